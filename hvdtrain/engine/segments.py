"""Collectives over equal segments, one per rank (the shape reduce-scatter, all-gather and all-to-all take
on Horovod, Gloo and NCCL alike), and the sums made of them that both engines add up alike.

bf16 on the wire (`train.compression bf16`) is an all-to-all of each rank's bf16 values, summed in fp32
on the rank that owns the segment, not an allreduce in bf16: Horovod 0.28 has no bfloat16 collective,
and a ring sum in bf16 would round at every hop. The values travel as bytes (a bf16 tensor viewed as
uint8), which every transport passes on bit for bit, so both engines sum the same numbers in the same
order and end with the same weights. PowerSGD's factors are summed the same way, in fp32.
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


def start_reduce_scatter(comm: SegmentCollectives, flat: torch.Tensor, name: str, wire: torch.dtype) -> Any:
    """Starts summing `flat` (size x segment) over ranks with each value in `wire` on the wire."""
    return comm.all_to_all(flat.to(wire).view(torch.uint8), name)


def finish_reduce_scatter(comm: SegmentCollectives, handle: Any, wire: torch.dtype) -> torch.Tensor:
    """This rank's segment of the sum (fp32), added up in rank order on every engine alike."""
    received = comm.wait(handle).view(wire).view(comm.size, -1)
    total = received[0].float()
    for part in received[1:]:  # dist: the sum over ranks, one rank after another: the same for every
        total += part          # element wherever it sits (a tensor's sum(0) is not, from 5 ranks on)
    return total


def start_all_gather(comm: SegmentCollectives, segment: torch.Tensor, name: str, wire: torch.dtype) -> Any:
    """Starts gathering every rank's `segment`, in `wire` on the wire."""
    return comm.all_gather(segment.to(wire).view(torch.uint8), name)


def finish_all_gather(comm: SegmentCollectives, handle: Any, wire: torch.dtype) -> torch.Tensor:
    return comm.wait(handle).view(wire)


def padded(values: torch.Tensor, size: int) -> torch.Tensor:
    """`values` (1-d) with zeros after them up to `size` equal segments, in fp32."""
    flat = values.new_zeros(-(-values.numel() // size) * size, dtype=torch.float32)
    flat[:values.numel()] = values
    return flat


def sum_in_rank_order(comm: SegmentCollectives, values: torch.Tensor, name: str) -> torch.Tensor:
    """The fp32 sum of `values` (1-d) over ranks, at once, the same to the last bit on either engine:
    a reduce-scatter and an all-gather (an allreduce's bytes) whose sums are this module's."""
    summed = finish_reduce_scatter(comm, start_reduce_scatter(comm, padded(values, comm.size), name, torch.float32),
                                   torch.float32)
    gathered = finish_all_gather(comm, start_all_gather(comm, summed, f"{name}.gather", torch.float32), torch.float32)
    return gathered[:values.numel()]
