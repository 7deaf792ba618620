"""Gradients combined in buckets while backward still runs, as DDP and Horovod do: what the torch
engine's averaged gradients and the sharded optimizer's reduce-scattered ones share.

Parameters are grouped into buckets in reverse order (the order backward produces their
gradients). When a parameter's gradient is final (after `accumulate` backward passes) a hook marks
it; a bucket whose gradients are all final is started (one asynchronous collective), and buckets
start strictly in order, so every rank issues the same collectives in the same order even when a
parameter gets no gradient on some rank.
"""

from __future__ import annotations

from typing import Callable

import torch

# One collective per bucket of about this many bytes (DDP's sizes: a small first bucket starts
# communication early in backward).
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


def buckets(params: list[torch.nn.Parameter], first_bytes: int = FIRST_BUCKET_BYTES,
            bytes_each: int = BUCKET_BYTES) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype and device: the first bucket closes after `first_bytes`
    (so communication starts early in backward), the others after `bytes_each`."""
    made: list[list[torch.nn.Parameter]] = []
    size = 0
    for param in params:
        last = made[-1] if made else None
        limit = first_bytes if len(made) == 1 else bytes_each
        if last is None or size >= limit or param.dtype != last[0].dtype or param.device != last[0].device:
            made.append([param])
            size = 0
        else:
            last.append(param)
        size += param.numel() * param.element_size()
    return made


class BucketHooks:
    """Calls `start(index)` for each bucket, in order, as soon as its gradients are final."""

    def __init__(self, grouped: list[list[torch.nn.Parameter]], accumulate: int, start: Callable[[int], None]):
        self.buckets, self.accumulate, self._start = grouped, accumulate, start
        self.bucket_of = {param: index for index, bucket in enumerate(grouped) for param in bucket}
        self.passes_left = {param: accumulate for bucket in grouped for param in bucket}
        self.final = [0] * len(grouped)  # gradients final, per bucket
        self.started = 0
        for param in self.passes_left:
            param.register_post_accumulate_grad_hook(self._on_gradient)

    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        self.passes_left[param] -= 1
        if self.passes_left[param] == 0:
            self.final[self.bucket_of[param]] += 1
            while self.started < len(self.buckets) and self.final[self.started] == len(self.buckets[self.started]):
                self._next()

    def _next(self) -> None:
        self.started += 1
        self._start(self.started - 1)

    def start_rest(self) -> None:
        """Starts the buckets not started yet (parameters without a gradient this step)."""
        while self.started < len(self.buckets):
            self._next()

    def reset(self) -> None:
        """After the step: the next one counts its backward passes afresh."""
        self.started = 0
        self.final = [0] * len(self.buckets)
        self.passes_left = dict.fromkeys(self.passes_left, self.accumulate)


def grads_with_flags(bucket: list[torch.nn.Parameter]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each parameter's gradient flattened (zeros where this rank computed none), and one flag per
    parameter: whether it did. dist: the flags ride along in the same collective, so a parameter that
    no rank computed keeps no gradient (as with DDP) and momentum and weight decay leave it alone."""
    grads = flat_grads(bucket)
    return grads, host_values([float(p.grad is not None) for p in bucket], grads[0].dtype, grads[0].device)


def flat_grads(bucket: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient flattened, zeros where this rank computed none."""
    return [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket]


def host_values(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, without waiting for it: `torch.tensor(..., device="cuda")` copies
    from pageable memory, which waits until the GPU has run everything queued. In a gradient hook that
    made backward itself wait for the GPU, and the next batch was then loaded with the GPU idle."""
    on_host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return on_host.to(device)
    return on_host.pin_memory().to(device, non_blocking=True)  # torch keeps the pinned buffer until copied


def set_gradient(param: torch.nn.Parameter, combined: torch.Tensor, users: float) -> None:
    """`param`'s gradient as combined over ranks; none when no rank computed it (`users` 0)."""
    if users == 0:
        param.grad = None
    elif param.grad is None:
        param.grad = torch.empty_like(param).copy_(combined.view(param.shape))  # in param's layout, as below
    else:
        param.grad.copy_(combined.view(param.shape))


def as_gradient(values: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """`values` (`param`'s elements in logical order) as `param`'s gradient, in `param`'s memory layout: a
    channels-last weight's fused optimizer step needs its gradient channels-last too, and goes wrong
    without a word otherwise. Where `param` is contiguous, `values` itself, reshaped (no copy)."""
    shaped = values.reshape(param.shape)
    return shaped if param.is_contiguous() else torch.empty_like(param).copy_(shaped)


def write_back(bucket: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Each parameter's combined gradient from a bucket's `flat` (the gradients, then one flag each)."""
    used = flat[len(flat) - len(bucket):].tolist()
    offset = 0
    for param, users in zip(bucket, used):
        set_gradient(param, flat[offset:offset + param.numel()], users)
        offset += param.numel()
