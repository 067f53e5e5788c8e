"""A model's frozen parameters and buffers as the run's state tensors (docs/wire.md, STATE):
what the server keeps besides the trained weights, so that its checkpoint holds the whole
model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from ..errors import LearnerError
from ..model_state import StateLayout, StateTensor
from ..wire import ALLOWED_DTYPES


class ModelState:
    """The entries of ``model.state_dict()`` that are not ``trained``: frozen parameters
    (``requires_grad=False``) and persistent buffers, in ``state_dict`` order (a tensor that
    appears under several names once, under its first). Their dtypes must be ones the wire
    carries (bfloat16 is not)."""

    def __init__(self, model: nn.Module, trained: Sequence[nn.Parameter]) -> None:
        skip = {id(p) for p in trained}
        parameters = {id(p) for p in model.parameters()}
        entries: list[StateTensor] = []
        self.tensors: list[torch.Tensor] = []
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in skip:
                continue
            skip.add(id(tensor))
            dtype = _wire_dtype(name, tensor)
            entries.append(
                StateTensor(name, dtype, tuple(tensor.shape), "frozen" if id(tensor) in parameters else "buffer")
            )
            self.tensors.append(tensor)
        self.layout = StateLayout(tuple(entries))
        self._buffers = [t for t, e in zip(self.tensors, entries) if e.kind == "buffer"]

    def __bool__(self) -> bool:
        return bool(self.tensors)

    @property
    def has_buffers(self) -> bool:
        return bool(self._buffers)

    def values(self) -> list[np.ndarray]:
        """Every state tensor's value, in layout order (on the CPU, views of the tensors)."""
        return [_host(t) for t in self.tensors]

    def buffers(self) -> list[np.ndarray]:
        """The buffers' values, in layout order."""
        return [_host(t) for t in self._buffers]

    def load(self, values: Sequence[np.ndarray]) -> list[str]:
        """Copy the run's values into the model's tensors; returns the names of the frozen
        parameters whose values differed from the model's own."""
        self.layout.check_arrays(self.layout.tensors, values)
        differed = []
        with torch.no_grad():
            for entry, tensor, value in zip(self.layout.tensors, self.tensors, values):
                incoming = torch.from_numpy(np.require(value, requirements="C")).to(tensor.device)
                if entry.kind == "frozen" and not torch.equal(tensor.detach(), incoming):
                    differed.append(entry.name)
                tensor.data.copy_(incoming)
        return differed


def _wire_dtype(name: str, tensor: torch.Tensor) -> str:
    try:
        dtype = np.dtype(str(tensor.dtype).removeprefix("torch."))
    except TypeError:
        dtype = None
    if dtype is None or dtype.newbyteorder("<").str not in ALLOWED_DTYPES:
        raise LearnerError(
            f"{name!r} is a {tensor.dtype} tensor, which rudra-async cannot keep in the server's checkpoint "
            f"(frozen parameters and buffers may be float16/32/64, integers or bool)"
        )
    return str(dtype.newbyteorder("<").str)


def _host(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().contiguous().numpy()
