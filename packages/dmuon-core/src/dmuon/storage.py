"""Buffers whose memory comes and goes while the tensors built over them live on.

A segment or expert-stack buffer is freed between forward/backward uses by resizing its storage
to 0 and allocated again (same size, same storage object) before the next broadcast, so the
unsharded parameters bound to it with ``set_`` stay valid autograd leaves, as FSDP2 does with its
unsharded parameters.
"""

from __future__ import annotations

import torch


def tensor_over(buffer: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` over ``buffer``'s storage from element ``offset``, built with
    ``set_`` rather than as a view so that it has its own version counter: refilling the buffer
    (Z3's second broadcast) must not trip autograd's check on tensors saved in forward."""
    tensor = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    tensor.set_(buffer.untyped_storage(), offset, shape)
    return tensor


def allocate_storage(buffer: torch.Tensor) -> None:
    nbytes = buffer.numel() * buffer.element_size()
    if buffer.untyped_storage().size() != nbytes:
        buffer.untyped_storage().resize_(nbytes)


def free_storage(buffer: torch.Tensor) -> None:
    if buffer.untyped_storage().size() != 0:
        buffer.untyped_storage().resize_(0)
