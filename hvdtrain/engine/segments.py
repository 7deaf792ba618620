"""Collectives over equal segments, one per rank (the shape reduce-scatter, all-gather and all-to-all take
on Horovod, Gloo and NCCL alike), and the bf16 reduce-scatter made of them.

bf16 on the wire (`train.compression bf16`) is an all-to-all of each rank's bf16 values, summed in fp32
on the rank that owns the segment, not an allreduce in bf16: Horovod 0.28 has no bfloat16 collective,
and a ring sum in bf16 would round at every hop. The values travel as bytes (a bf16 tensor viewed as
uint8), which every transport passes on bit for bit, so both engines sum the same numbers in the same
order and end with the same weights.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class SegmentCollectives(Protocol):
    """What the sharded optimizer and bf16 on the wire need of an engine: asynchronous collectives over
    `size` equal segments, in rank order."""

    rank: int
    size: int

    def reduce_scatter(self, flat: torch.Tensor, name: str) -> Any:
        """Starts summing `flat` (size x segment) over ranks; this rank receives segment `rank`."""

    def all_gather(self, segment: torch.Tensor, name: str) -> Any:
        """Starts gathering every rank's `segment` into one tensor, rank by rank."""

    def all_to_all(self, flat: torch.Tensor, name: str) -> Any:
        """Starts sending segment r of `flat` (size x segment) to rank r; this rank receives every
        rank's segment `rank`, rank by rank."""

    def wait(self, handle: Any) -> torch.Tensor:
        """The result of a started collective."""

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The element-wise sum over ranks, at once."""


def start_bf16_reduce_scatter(comm: SegmentCollectives, flat: torch.Tensor, name: str) -> Any:
    """Starts summing `flat` (size x segment) over ranks with each value rounded to bf16 on the wire."""
    return comm.all_to_all(flat.to(torch.bfloat16).view(torch.uint8), name)


def finish_bf16_reduce_scatter(comm: SegmentCollectives, handle: Any) -> torch.Tensor:
    """This rank's segment of the sum (fp32), added up in rank order."""
    received = comm.wait(handle).view(torch.bfloat16).view(comm.size, -1)
    return received.float().sum(0)  # dist: the sum over ranks


def start_bf16_all_gather(comm: SegmentCollectives, segment: torch.Tensor, name: str) -> Any:
    """Starts gathering every rank's `segment`, rounded to bf16 on the wire."""
    return comm.all_gather(segment.to(torch.bfloat16).view(torch.uint8), name)


def finish_bf16_all_gather(comm: SegmentCollectives, handle: Any) -> torch.Tensor:
    return comm.wait(handle).view(torch.bfloat16)
