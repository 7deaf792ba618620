"""Gradients averaged with bf16 on the wire (`train.compression bf16`), on both engines, while backward
still runs: each bucket's reduce-scatter starts as soon as its gradients are final (`buckets.BucketHooks`),
its average is all-gathered at the step. Each value is rounded to bf16 twice (sent, and its average)
whatever the world size; bf16 keeps fp32's range, so nothing is divided before the sum (as fp16 must)
and nothing overflows. Half of fp32's bytes either way, as fp16.
"""

from __future__ import annotations

from typing import Any

import torch

from hvdtrain.engine.buckets import BucketHooks, buckets, grads_with_flags, write_back
from hvdtrain.engine.segments import (SegmentCollectives, finish_all_gather, finish_reduce_scatter, padded,
                                      start_all_gather, start_reduce_scatter)

BF16 = torch.bfloat16


class Bf16Average:
    """`wait` starts whatever is left, finishes every bucket and writes the averages back."""

    def __init__(self, params: list[torch.nn.Parameter], collectives: SegmentCollectives, accumulate: int):
        self.comm, self.size = collectives, collectives.size
        self.hooks = BucketHooks(buckets(list(reversed(params))), accumulate, self._start)
        self.sent: list[tuple[Any, int]] = []  # (reduce-scatter, elements) per started bucket

    def _start(self, index: int) -> None:
        grads, used = grads_with_flags(self.hooks.buckets[index])
        values = torch.cat([*grads, used])
        self.sent.append((start_reduce_scatter(self.comm, padded(values, self.size), f"hvdtrain.bf16.grads.{index}",
                                               BF16), values.numel()))

    def wait(self) -> None:
        self.hooks.start_rest()
        gathers = [start_all_gather(self.comm, finish_reduce_scatter(self.comm, sent, BF16).div_(self.size),
                                    f"hvdtrain.bf16.average.{index}", BF16)  # dist: ... over the world size
                   for index, (sent, _) in enumerate(self.sent)]
        for bucket, gathered, (_, elements) in zip(self.hooks.buckets, gathers, self.sent):
            write_back(bucket, finish_all_gather(self.comm, gathered, BF16)[:elements].to(bucket[0].dtype))
        self.sent.clear()
        self.hooks.reset()
