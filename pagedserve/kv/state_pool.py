"""Per-sequence recurrent-state slots for the Gated DeltaNet (linear-attention) layers.

Every live sequence owns one slot. A slot holds, for every linear-attention layer, the
causal-conv state (the last ``kernel - 1`` inputs of each conv channel) and the gated
delta-rule recurrent state. All slots live in two preallocated tensors, indexed by slot id,
the form batched kernels take:

    conv_state      [num_linear_layers, num_slots + 1, conv_dim, conv_kernel - 1]  model dtype
    recurrent_state [num_linear_layers, num_slots + 1, Hv, Dk, Dv]                 float32

Slot ``num_slots`` (``null_slot``) is reserved: padding rows of a captured batch point at
it, so a padded kernel launch never writes a live sequence's state. Slots follow the same
handle / generation / stale-detection rules as sequences and are zeroed when assigned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kv.handles import Handle, HandleTable


@dataclass(frozen=True)
class StateShapes:
    """Per-slot, per-layer shapes and dtypes of the two states (``ModelConfig.state_shapes``)."""

    num_layers: int
    conv: tuple[int, int]  # (conv_dim, conv_kernel - 1)
    recurrent: tuple[int, int, int]  # (Hv, Dk, Dv)
    conv_dtype: torch.dtype
    recurrent_dtype: torch.dtype = torch.float32

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one sequence's state over all linear-attention layers."""
        conv = self.conv[0] * self.conv[1] * _itemsize(self.conv_dtype)
        rec = self.recurrent[0] * self.recurrent[1] * self.recurrent[2]
        return self.num_layers * (conv + rec * _itemsize(self.recurrent_dtype))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class StatePool:
    """``num_slots`` state slots (plus the null slot) on ``device``."""

    def __init__(self, shapes: StateShapes, num_slots: int, device: str | torch.device) -> None:
        self.shapes = shapes
        self.num_slots = num_slots
        self._handles = HandleTable(num_slots, "state slot")
        n = num_slots + 1
        # [num_linear_layers, num_slots + 1, conv_dim, conv_kernel - 1]
        self.conv_state = torch.zeros(
            (shapes.num_layers, n, *shapes.conv), dtype=shapes.conv_dtype, device=device
        )
        # [num_linear_layers, num_slots + 1, Hv, Dk, Dv]
        self.recurrent_state = torch.zeros(
            (shapes.num_layers, n, *shapes.recurrent),
            dtype=shapes.recurrent_dtype,
            device=device,
        )

    @property
    def null_slot(self) -> int:
        return self.num_slots

    @property
    def num_free_slots(self) -> int:
        return self._handles.num_free

    @property
    def num_used_slots(self) -> int:
        return self._handles.num_live

    def acquire(self) -> Handle:
        """Assign a zeroed slot. Raises ``OutOfCapacityError`` when none is free."""
        handle = self._handles.acquire()
        self.conv_state[:, handle.index].zero_()
        self.recurrent_state[:, handle.index].zero_()
        return handle

    def release(self, handle: Handle) -> None:
        self._handles.release(handle)

    def slot(self, handle: Handle) -> int:
        """The slot index of a live handle; raises ``StaleHandleError`` otherwise."""
        return self._handles.validate(handle)

    def check_invariants(self) -> None:
        self._handles.check_invariants()
