"""Optimizer state sharded across ranks (`train.shard_optimizer`): each rank steps, and keeps the
optimizer state of, a 1/N share of the parameters.

    backward    each bucket's gradients reduce-scattered as soon as they are final (overlapped, as the
                allreduce is): every rank receives the average of its own share only
    step        each rank steps its own parameters; the optimizer holds state only for parameters
                that have a gradient, so it never makes any for the others
    after step  the updated parameters all-gathered, bucket by bucket

Whole parameters are owned (never a slice), so any optimizer whose update is per parameter (SGD,
AdamW, LAMB-like norms of a parameter) steps as it would unsharded. The partition depends only on
the parameters' sizes, their order and the world size: both engines make the same one, and a
checkpoint (which holds the optimizer state in the unsharded format, written in pieces) loads into
any partition. Each bucket's collective is one equal segment per rank (`segments.py`): a rank's
parameters of the bucket, then one flag per parameter, then padding to the longest segment.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from hvdtrain.engine.buckets import (BUCKET_BYTES, FIRST_BUCKET_BYTES, BucketHooks, as_gradient, buckets,
                                     flat_grads, host_values)
from hvdtrain.engine.segments import SegmentCollectives, finish_reduce_scatter, start_reduce_scatter


@dataclass(frozen=True)
class BucketShares:
    """One bucket's parameters and who owns each; `segment`: elements per rank on the wire."""

    params: list[torch.nn.Parameter]
    owners: list[int]
    segment: int

    def owned_by(self, rank: int) -> list[int]:
        return [index for index, owner in enumerate(self.owners) if owner == rank]


def deal(params: list[torch.nn.Parameter], size: int) -> list[BucketShares]:
    """The buckets (in backward order, N times the allreduce's bucket size: each rank's share of one is
    about an allreduce bucket) and who owns each parameter in them."""
    return partition(buckets(list(reversed(params)), FIRST_BUCKET_BYTES * size, BUCKET_BYTES * size), size)


def held_bytes(params: list[torch.nn.Parameter], size: int, state_bytes: dict[torch.nn.Parameter, int],
               sharded: bool) -> list[dict[str, int]]:
    """What each rank holds, in bytes: all parameters; the gradients and optimizer state (`state_bytes`
    per parameter) of its share when sharded, else of all of them. During backward a bucket's full
    gradients exist until its reduce-scatter starts."""
    def nbytes(param: torch.nn.Parameter) -> int:
        return param.numel() * param.element_size()

    shares = deal(params, size) if sharded else []
    owned = [{share.params[i] for share in shares for i in share.owned_by(rank)} if sharded else set(params)
             for rank in range(size)]
    return [{"parameters": sum(nbytes(p) for p in params), "gradients": sum(nbytes(p) for p in mine),
             "optimizer_state": sum(state_bytes.get(p, 0) for p in mine)} for mine in owned]


def partition(grouped: list[list[torch.nn.Parameter]], size: int) -> list[BucketShares]:
    """Each bucket's parameters dealt out to the ranks, largest first, each to the rank with the least
    of this bucket so far (then of all buckets, then the lowest rank): balanced segments, little padding."""
    totals = [0] * size
    shares = []
    for bucket in grouped:
        load = [0] * size
        owners = [0] * len(bucket)
        for index in sorted(range(len(bucket)), key=lambda i: (-bucket[i].numel(), i)):
            rank = min(range(size), key=lambda r: (load[r], totals[r], r))
            owners[index] = rank
            load[rank] += bucket[index].numel() + 1  # and its flag
            totals[rank] += bucket[index].numel()
        shares.append(BucketShares(bucket, owners, max(load)))
    return shares


class ShardedGradients:
    """The gradients and updates of a sharded optimizer, over an engine's `SegmentCollectives`;
    `watch(what)` is the engine's context for a collective the stall report should name."""

    def __init__(self, params: list[torch.nn.Parameter], collectives: SegmentCollectives, accumulate: int,
                 compression: str, watch: Callable[[str], ContextManager] = lambda what: contextlib.nullcontext()):
        self.comm, self.watch = collectives, watch
        self.fp16, self.bf16 = compression == "fp16", compression == "bf16"
        self.rank, self.size = collectives.rank, collectives.size
        self.shares = deal(params, self.size)
        self.hooks = BucketHooks([share.params for share in self.shares], accumulate, self._start)
        self.owned = {param for share in self.shares for i in share.owned_by(self.rank) for param in [share.params[i]]}
        self.pending: list[Any] = []
        self._norms: torch.Tensor | None = None

    def _start(self, index: int) -> None:
        share = self.shares[index]
        grads = flat_grads(share.params)
        owned = [share.owned_by(rank) for rank in range(self.size)]
        # every rank's flags in one copy from the host, not indexed on the device: a list index waits for the GPU
        flags = host_values([float(share.params[i].grad is not None) for mine in owned for i in mine],
                            grads[0].dtype, grads[0].device)
        pieces, taken = [], 0
        for mine in owned:
            pieces += [grads[i] for i in mine] + [flags[taken:taken + len(mine)]]
            taken += len(mine)
            filled = sum(grads[i].numel() for i in mine) + len(mine)
            pieces.append(grads[0].new_zeros(share.segment - filled))
        flat = torch.cat(pieces)
        for param in share.params:  # the flat copy is what travels: each rank keeps only its share's
            param.grad = None
        name = f"hvdtrain.shard.grads.{index}"
        if self.bf16:  # dist: the sum, in fp32 on the rank that owns each segment (segments.py)
            self.pending.append(start_reduce_scatter(self.comm, flat, name, torch.bfloat16))
            return
        # dist: fp16 on the wire divides before the sum (as the allreduce does): a sum of gradients
        # each below fp16's limit can overflow where their average would not.
        wire = flat.div(self.size).half() if self.fp16 else flat
        self.pending.append(self.comm.reduce_scatter(wire, name))  # dist: the sum

    def wait(self) -> None:
        """Every bucket's share received: this rank's parameters hold the averaged gradients, the others none."""
        self.hooks.start_rest()
        for share, handle in zip(self.shares, self.pending):
            mine = share.owned_by(self.rank)
            if self.bf16:
                # rounded to bf16 as the unsharded average is (it is all-gathered in bf16): sharding the
                # optimizer does not change the weights
                averaged = finish_reduce_scatter(self.comm, handle, torch.bfloat16).div_(self.size).bfloat16()
                averaged = averaged.to(share.params[0].dtype)
            else:
                received = self.comm.wait(handle)
                averaged = received.to(share.params[0].dtype) if self.fp16 else received.div_(self.size)
            offset = sum(share.params[i].numel() for i in mine)
            flags = averaged[offset:offset + len(mine)].tolist()
            offset = 0
            for i, users in zip(mine, flags):
                param = share.params[i]
                param.grad = None if users == 0 else as_gradient(averaged[offset:offset + param.numel()], param)
                offset += param.numel()
        self.pending.clear()
        self.hooks.reset()
        self._norms = None

    def norms(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The norm of each gradient of `params` (the model's order; those that have one on the rank that
        owns them), on every rank: as `torch._foreach_norm` gives them unsharded, so a clip and a finite
        check decide as they would. Summed over ranks with zeros for the others' (exact)."""
        if self._norms is None:
            device = params[0].device
            local = torch.zeros(2, len(params), dtype=torch.float32, device=device)
            here = [i for i, p in enumerate(params) if p in self.owned and p.grad is not None]
            if here:
                local[0, here] = torch.stack(torch._foreach_norm([params[i].grad for i in here])).float().to(device)
                local[1, here] = 1.0
            combined = self.comm.allreduce_sum(local, "gradient_norms").to(device)  # dist
            self._norms = combined[0][combined[1] > 0]
        return self._norms

    def clip(self, params: list[torch.nn.Parameter], max_norm: float) -> None:
        """Clips every gradient by the global norm of all of them, as `clip_grad_norm_` unsharded."""
        total = torch.linalg.vector_norm(self.norms(params))
        mine = [p for p in params if p in self.owned and p.grad is not None]
        if mine:
            torch.nn.utils.clip_grads_with_norm_(mine, max_norm, total)

    def gather_parameters(self) -> None:
        """After this rank stepped its share: every rank gets every rank's updated parameters. Two buckets
        in flight at most: the next one travels while this one is copied, and the gathered buffers (a whole
        bucket each) never add up to a second copy of the model."""
        with torch.no_grad(), self.watch("the parameter all-gather"):
            started = self._gather_bucket(0) if self.shares else None
            for index, share in enumerate(self.shares):
                following = self._gather_bucket(index + 1) if index + 1 < len(self.shares) else None
                gathered = self.comm.wait(started)
                for rank in range(self.size):
                    if rank == self.rank:
                        continue
                    offset = rank * share.segment
                    for i in share.owned_by(rank):
                        param = share.params[i]
                        param.copy_(gathered[offset:offset + param.numel()].view_as(param))
                        offset += param.numel()
                del gathered
                started = following

    def _gather_bucket(self, index: int) -> Any:
        share = self.shares[index]
        mine = [share.params[i].detach().reshape(-1) for i in share.owned_by(self.rank)]
        filled = sum(t.numel() for t in mine)
        segment = torch.cat([*mine, share.params[0].new_zeros(share.segment - filled)])
        return self.comm.all_gather(segment, f"hvdtrain.shard.params.{index}")

    def owned_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                    rank: int | None = None) -> dict[str, Any]:
        """An optimizer state dict (any world size, sharded or not) cut to the parameters of `rank` (this one's)."""
        owned = self.owned if rank is None else \
            {share.params[i] for share in self.shares for i in share.owned_by(rank)}
        order = [p for group in optimizer.param_groups for p in group["params"]]
        keep = {index for index, param in enumerate(order) if param in owned}
        return {**state, "state": {k: v for k, v in state.get("state", {}).items() if int(k) in keep}}

