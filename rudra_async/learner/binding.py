"""A module's trainable parameters bound to flat float32 buffers, so the model moves to and
from the wire as one buffer each way.

On the CPU the model's parameter memory *is* the flat weights buffer and backward
accumulates straight into the flat gradient buffer: pushing and pulling copy nothing on the
learner. On another device the flat buffers live on the device; :meth:`FlatParameters.gradients`
copies the gradient into a reused host buffer (pinned, on a side stream, for CUDA) and
:meth:`FlatParameters.load` copies received weights back the same way. Nothing is
allocated per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from ..errors import LearnerError
from ..layout import Layout


class FlatParameters:
    """``named`` parameters (in this order; all float32, on one device) bound to flat buffers.

    ``host_weights`` receives pulled weights and ``host_grads`` holds the gradient to push
    (on the CPU, views of the model's own memory). Every parameter must get a gradient from
    each backward pass; one that did not is reported by name (an unused layer: freeze it).
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
        self.grads = torch.zeros(self.layout.size, dtype=torch.float32, device=self.device)
        for p, t in zip(self.params, self.layout.tensors):
            self.weights[t.offset : t.offset + t.size].copy_(p.detach().reshape(-1))
        self._touched = [False] * len(self.params)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _, i=i: self._touch(i))
        self._copier = _DeviceCopier(self.weights, self.grads) if self.device.type != "cpu" else None
        self.bind(self.weights, self.grads)

    @property
    def on_cpu(self) -> bool:
        return self._copier is None

    @property
    def host_weights(self) -> np.ndarray:
        return self._copier.host_weights if self._copier else self.weights.numpy()

    @property
    def host_grads(self) -> np.ndarray:
        return self._copier.host_grads if self._copier else self.grads.numpy()

    def bind(self, weights: torch.Tensor, grads: torch.Tensor) -> None:
        """Make ``weights``/``grads`` (flat, on the parameters' device) the parameters' memory."""
        self._grad_views: list[torch.Tensor] = []  # the parameters' .grad, views of grads
        for p, t in zip(self.params, self.layout.tensors):
            part = slice(t.offset, t.offset + t.size)
            p.data = weights[part].view(t.shape)
            p.grad = grads[part].view(t.shape)
            self._grad_views.append(p.grad)
        self.weights, self.grads = weights, grads

    def zero_grad(self) -> None:
        """Zero the gradient buffer (the bound gradients), ready for the next backward."""
        self.grads.zero_()
        self._touched = [False] * len(self.params)
        self._rebind_foreign_grads(copy=False)

    def gradients(self) -> np.ndarray:
        """The flat gradient of the last backward pass, in host memory (valid until the next
        step). Raises :class:`LearnerError` naming parameters that got no gradient."""
        missing = [n for n, touched in zip(self.names, self._touched) if not touched]
        if missing:
            raise LearnerError(
                f"no gradient for parameter(s) {', '.join(missing)} in this step: a layer the loss does not "
                "depend on (freeze it with requires_grad_(False)), or backward() was not called"
            )
        self._rebind_foreign_grads(copy=True)
        self._touched = [False] * len(self.params)
        if self._copier:
            self._copier.to_host(self.grads)
        return self.host_grads

    def load(self, wait: bool = False) -> None:
        """Move what arrived in :attr:`host_weights` into the model (nothing to do on the CPU).
        ``wait``: return only once :attr:`host_weights` may be overwritten."""
        if self._copier:
            self._copier.to_device(self.weights, wait)

    def _touch(self, index: int) -> None:
        self._touched[index] = True

    def _rebind_foreign_grads(self, copy: bool) -> None:
        """A parameter whose ``.grad`` is not a view of the flat buffer (``set_to_none`` by a
        torch optimizer's zero_grad): move its gradient in and bind it again."""
        for p, part in zip(self.params, self._grad_views):
            grad = p.grad
            if grad is part:
                continue
            if grad is None or grad.data_ptr() != part.data_ptr():
                if copy and grad is not None:
                    part.copy_(grad)
                p.grad = part


class _DeviceCopier:
    """Host staging for a model on a device: reused host buffers (pinned for CUDA) and, on
    CUDA, a side stream for non-blocking copies that the compute stream waits for."""

    def __init__(self, weights: torch.Tensor, grads: torch.Tensor) -> None:
        cuda = weights.device.type == "cuda"
        self._weights = torch.empty(weights.numel(), dtype=torch.float32, pin_memory=cuda)
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
