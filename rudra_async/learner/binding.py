"""A module's trainable parameters bound to a flat float32 weights buffer, so pulled
weights land in the model as one buffer, and the gradients go out as they are.

On the CPU the model's parameter memory *is* the flat weights buffer, and the gradient is
pushed as the tensors' own ``.grad`` (one wire segment each, docs/wire.md): backward
writes each gradient once and nothing is zeroed, accumulated into or gathered (but for a
small model, below :data:`GATHER_BELOW` values, whose gradient is gathered into one reused
buffer: one segment costs both ends less than one per tensor). (Binding
``.grad`` to a flat buffer instead makes every backward add into it: at 25M values a
third more backward time on one thread, ``benchmarks/peers`` workload (a).) On another
device the flat buffers live on the device; :meth:`FlatParameters.gradients` copies the
gradient into a reused host buffer (pinned, on a side stream, for CUDA) and
:meth:`FlatParameters.load` copies received weights back the same way. Nothing is
allocated per step but the gradients backward creates.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import torch
from torch import nn

from ..errors import LearnerError
from ..layout import Layout

#: models of fewer values send their gradient as one gathered segment (a copy of at most
#: 256 KiB, a few µs) rather than one segment per tensor: each segment costs both ends a few
#: µs and a shm notification more than that copy
GATHER_BELOW = 1 << 16


def sparse_gradients(name: str) -> LearnerError:
    """The error for a parameter whose gradient is sparse."""
    return LearnerError(
        f"parameter {name!r} gets sparse gradients, which rudra-async does not support "
        "(build its layer with sparse=False)"
    )


class FlatParameters:
    """``named`` parameters (in this order; all float32, on one device) bound to flat buffers.

    ``host_weights`` receives pulled weights (on the CPU, the model's own memory);
    :meth:`gradients` gives what to push. Every parameter must get a dense gradient from
    each backward pass; one that did not is reported by name (an unused layer: freeze it).
    :meth:`close` removes the hooks put on the parameters (they never hold this object).
    """

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]]) -> None:
        if not named:
            raise LearnerError("the model has no trainable parameters")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.device = self.params[0].device
        for name, p in named:
            if p.dtype != torch.float32:
                raise LearnerError(f"parameter {name!r} is {p.dtype}; rudra-async trains float32 parameters")
            if p.device != self.device:
                raise LearnerError(f"parameter {name!r} is on {p.device}, others on {self.device}: use one device")
        self.layout = Layout.from_shapes((n, tuple(p.shape)) for n, p in named)
        self.weights = torch.empty(self.layout.size, dtype=torch.float32, device=self.device)
        for p, t in zip(self.params, self.layout.tensors):
            self.weights[t.offset : t.offset + t.size].copy_(p.detach().reshape(-1))
        #: a small model's gradient is sent gathered in one reused buffer (see :data:`GATHER_BELOW`)
        self._gathered = np.empty(self.layout.size, np.float32) if self.layout.size < GATHER_BELOW else None
        self._device: _DeviceGradients | None = None
        if self.device.type != "cpu":
            self._device = _DeviceGradients(self.params, self.layout, self.weights)
        self.bind(self.weights)
        self._touched = [False] * len(self.params)  # set by the hooks, which hold only this list
        self._hooks = [
            p.register_post_accumulate_grad_hook(partial(_touch, self._touched, i)) for i, p in enumerate(self.params)
        ]

    @property
    def on_cpu(self) -> bool:
        return self._device is None

    @property
    def host_weights(self) -> np.ndarray:
        return self._device.copier.host_weights if self._device else self.weights.numpy()

    def bind(self, weights: torch.Tensor) -> None:
        """Make ``weights`` (flat, on the parameters' device) the parameters' memory."""
        for p, t in zip(self.params, self.layout.tensors):
            p.data = weights[t.offset : t.offset + t.size].view(t.shape)
        self.weights = weights

    def zero_grad(self) -> None:
        """Clear the gradients for the next backward (on the CPU: ``.grad = None``, as
        torch's ``zero_grad`` does; on a device: zero the bound flat gradient)."""
        self._untouch()
        if self._device:
            self._device.zero_grad()
            return
        for p in self.params:
            p.grad = None

    def gradients(self) -> list[np.ndarray]:
        """The gradient of the last backward pass in host memory, as its parts in layout
        order (on the CPU each tensor's ``.grad``, flattened; on a device one host buffer),
        valid until the next backward. Raises :class:`LearnerError` naming parameters that
        got no gradient."""
        missing = [n for n, touched in zip(self.names, self._touched) if not touched]
        if missing:
            raise LearnerError(
                f"no gradient for parameter(s) {', '.join(missing)} in this step: a layer the loss does not "
                "depend on (freeze it with requires_grad_(False)), or backward() was not called"
            )
        self._untouch()
        if self._device:
            return [self._device.to_host()]
        parts = [_host_part(n, p.grad) for n, p in zip(self.names, self.params)]
        if self._gathered is None or len(parts) == 1:
            return parts
        np.concatenate(parts, out=self._gathered)  # a small model: one segment costs less than many
        return [self._gathered]

    def release_gradients(self) -> None:
        """Let go of the gradients just taken, so the next backward starts from none: on the
        CPU ``.grad = None`` (the next backward writes new tensors and cannot change the ones
        still being sent); on a device the bound gradient is zeroed (what is sent is in host
        staging already)."""
        if self._device:
            self._device.zero_grad()
            return
        for p in self.params:
            p.grad = None

    def load(self, wait: bool = False) -> None:
        """Move what arrived in :attr:`host_weights` into the model (nothing to do on the CPU).
        ``wait``: return only once :attr:`host_weights` may be overwritten."""
        if self._device:
            self._device.copier.to_device(self.weights, wait)

    def close(self) -> None:
        """Remove the hooks put on the parameters. Idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _untouch(self) -> None:
        self._touched[:] = [False] * len(self.params)  # in place: the hooks hold this list


def _touch(touched: list[bool], index: int, _: nn.Parameter) -> None:
    touched[index] = True


def _host_part(name: str, grad: torch.Tensor | None) -> np.ndarray:
    """A CPU parameter's gradient as a flat float32 array (a view unless it is not contiguous)."""
    assert grad is not None  # the post-accumulate hook saw it
    try:
        return grad.detach().contiguous().reshape(-1).numpy()
    except RuntimeError:
        if grad.layout != torch.strided:  # asked only here: nothing on the common path
            raise sparse_gradients(name) from None
        raise


class _DeviceGradients:
    """A model on a device: its ``.grad`` bound to one flat device buffer, copied to host
    staging (:class:`_DeviceCopier`) to be pushed."""

    def __init__(self, params: list[nn.Parameter], layout: Layout, weights: torch.Tensor) -> None:
        self.params = params
        self.grads = torch.zeros(layout.size, dtype=torch.float32, device=weights.device)
        self.views = [self.grads[t.offset : t.offset + t.size].view(t.shape) for t in layout.tensors]
        for p, view in zip(params, self.views):
            p.grad = view
        self.copier = _DeviceCopier(weights, self.grads)

    def zero_grad(self) -> None:
        self.grads.zero_()
        self._rebind_foreign_grads(copy=False)

    def to_host(self) -> np.ndarray:
        self._rebind_foreign_grads(copy=True)
        self.copier.to_host(self.grads)
        return self.copier.host_grads

    def _rebind_foreign_grads(self, copy: bool) -> None:
        """A parameter whose ``.grad`` is not a view of the flat buffer (``set_to_none`` by a
        torch optimizer's zero_grad): move its gradient in and bind it again."""
        for p, part in zip(self.params, self.views):
            grad = p.grad
            if grad is part:
                continue
            if grad is None or grad.data_ptr() != part.data_ptr():
                if copy and grad is not None:
                    part.copy_(grad)
                p.grad = part


class _DeviceCopier:
    """Host staging for a model on a device: reused host buffers (pinned for CUDA) and, on
    CUDA, a side stream for non-blocking copies that the compute stream waits for. The host
    weights start as a copy of ``weights``: they are what the learner offers a new server."""

    def __init__(self, weights: torch.Tensor, grads: torch.Tensor) -> None:
        cuda = weights.device.type == "cuda"
        self._weights = torch.empty(weights.numel(), dtype=torch.float32, pin_memory=cuda)
        self._weights.copy_(weights)
        self._grads = torch.empty(grads.numel(), dtype=torch.float32, pin_memory=cuda)
        self.host_weights, self.host_grads = self._weights.numpy(), self._grads.numpy()
        self._stream = torch.cuda.Stream(weights.device) if cuda else None

    def to_host(self, grads: torch.Tensor) -> None:
        """Copy the device gradient into the host buffer; returns when it is there."""
        if self._stream is None:
            self._grads.copy_(grads)
            return
        ready = torch.cuda.current_stream(grads.device).record_event()  # backward's work is queued before
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            self._grads.copy_(grads, non_blocking=True)
        self._stream.synchronize()

    def to_device(self, weights: torch.Tensor, wait: bool) -> None:
        """Copy the host weights into the device buffer; the compute stream waits for it, and
        so does the caller when ``wait``."""
        if self._stream is None:
            weights.copy_(self._weights)
            return
        with torch.cuda.stream(self._stream):
            weights.copy_(self._weights, non_blocking=True)
            done = self._stream.record_event()
        torch.cuda.current_stream(weights.device).wait_event(done)
        if wait:
            done.synchronize()
