"""What Horovod's collectives accept: contiguous tensors of a few dtypes. A model may hold others: a
bool mask or a bf16 buffer (Horovod broadcasts neither), a complex weight (a spectral layer), a
channels-last 4-D weight. Here each goes on the wire as something Horovod takes, and comes back as
it was; torch.distributed takes them all as they are, and the two engines end with the same weights.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# What Horovod 0.28 broadcasts and sums (its allreduce refuses the 8- and 16-bit integers too).
_BROADCAST = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
              torch.float64}
_SUMMED = {torch.int32, torch.int64, torch.float16, torch.float32, torch.float64}
# A broadcast is a copy of bits: any dtype goes as the integers of its width.
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def broadcastable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a view of its memory as a dtype Horovod broadcasts (complex as its real pairs, others
    as integers of the same width): a broadcast into the view is one into `tensor`."""
    if tensor.dtype in _BROADCAST:
        return tensor
    if tensor.is_complex():
        return torch.view_as_real(tensor)
    return tensor.view(_SAME_WIDTH[tensor.element_size()])


def summable(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """What Horovod sums for `tensor` (complex: a view of its real pairs; bf16 and others: an fp32 copy),
    and what makes the sum `tensor`'s dtype again."""
    if tensor.is_complex():
        return torch.view_as_real(tensor), torch.view_as_complex
    if tensor.dtype not in _SUMMED:
        dtype = tensor.dtype
        return tensor.float(), lambda result: result.to(dtype)
    return tensor, _as_it_is


def copyable(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """What Horovod gathers or exchanges for `tensor` (its bits, as `broadcastable` has them), and what
    makes the result `tensor`'s dtype again."""
    sent = broadcastable(tensor)
    if sent is tensor:
        return tensor, _as_it_is
    if tensor.is_complex():
        return sent, torch.view_as_complex
    dtype = tensor.dtype
    return sent, lambda result: result.view(dtype)


def _as_it_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class OnTheWire:
    """A Horovod compression around another (none, fp16) that sends a gradient Horovod would refuse as one
    it sums: a complex one as a view of its real pairs (summed in place, as Horovod sums any gradient),
    a bf16 (or other) one as an fp32 copy, a non-contiguous one (channels-last) as a contiguous copy. The
    result comes back in the gradient's own dtype and memory layout, which Horovod then makes the
    gradient's: a fused optimizer needs it to match the parameter's."""

    def __init__(self, compression: Any):
        self.compression = compression

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        sent, back = summable(tensor)
        if not sent.is_contiguous():
            sent = sent.contiguous()
        compressed, ctx = self.compression.compress(sent)
        if sent is tensor:  # Horovod's in-place allreduce, as without this wrapper
            return compressed, (ctx, None, None)
        return compressed, (ctx, back, tensor)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        inner, back, original = ctx
        result = self.compression.decompress(tensor, inner)
        return result if original is None else torch.empty_like(original).copy_(back(result))
