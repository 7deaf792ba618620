"""PowerSGD (`train.compression powersgd`; Vogels, Karimireddy and Jaggi, NeurIPS 2019): each gradient
matrix M (n x m; a convolution's weight as out x in·k·k) is sent as two thin factors of rank r,
P = M Q (n x r) and Q = Mᵀ P̂ (m x r), instead of n·m values. Per step and matrix:

    M  = this rank's gradient + its error E   (error feedback: what compression left out before)
    P  = average over ranks of M Q;  P̂ = P orthonormalised
    Q  = average over ranks of Mᵀ P̂           (kept: the next step starts from it, the "warm start")
    gradient = P̂ Qᵀ;  E = M - P̂ Qᵀ            (E is this rank's own)

Tensors that a low rank would not shrink (biases, norms, small matrices) are averaged as they are,
in the same sum as the P factors. Both sums are `segments.sum_in_rank_order`: the two engines
make the same ones and end with the same weights.

The error buffers (each rank's own) and the factors (the same on every rank) are training state:
`state_dict` for a checkpoint, `load_state_dict` on resume on as many processes. With a gradient
scaler the errors are kept unscaled (the scale changes between steps), and a step whose sums are
not finite (an overflow) changes neither: its gradients are not finite either, so it is skipped.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hvdtrain.engine.buckets import as_gradient, grads_with_flags
from hvdtrain.engine.segments import SegmentCollectives, sum_in_rank_order

# Factors start as random matrices drawn from this (and train.seed): the same on every rank.
_FACTOR_SEED = 7919


def compressed_rank(param: torch.Tensor, rank: int) -> int:
    """The rank at which `param`'s gradient is sent as factors; 0: sent whole (a vector, or a matrix
    whose factors would be no smaller)."""
    if param.dim() < 2:
        return 0
    n, m = param.shape[0], param[0].numel()
    r = min(rank, n, m)
    return r if (n + m) * r < n * m else 0


def sent_values(params: list[torch.Tensor], rank: int) -> int:
    """Values summed over ranks per step: each compressed matrix's two factors, every other tensor whole."""
    total = 0
    for param in params:
        r = compressed_rank(param, rank)
        total += (param.shape[0] + param[0].numel()) * r if r else param.numel()
    return total


class PowerSGD:
    """`wait` (after the last backward pass of a step) replaces each gradient by its compressed average."""

    def __init__(self, params: list[torch.nn.Parameter], collectives: SegmentCollectives, rank: int, seed: int,
                 loss_scale: Callable[[], float]):
        self.comm, self.size, self.loss_scale = collectives, collectives.size, loss_scale
        self.params = params
        self.ranks = [compressed_rank(p, rank) for p in params]
        self.matrices = [i for i, r in enumerate(self.ranks) if r]
        self.whole = [i for i, r in enumerate(self.ranks) if not r]
        generator = torch.Generator().manual_seed((seed * 1_000_003 + _FACTOR_SEED) % 2**63)
        # Each Q is kept as the transpose of a row-major r x m matrix: M Q is then 3 times faster on a
        # CPU than with a row-major m x r one, and P̂ Qᵀ reads Qᵀ row by row
        self.factors = {i: _row_major_transpose(torch.randn(params[i][0].numel(), self.ranks[i], generator=generator)
                                                .to(params[i].device)) for i in self.matrices}
        self.errors = {i: torch.zeros(params[i].shape[0], params[i][0].numel(), device=params[i].device)
                       for i in self.matrices}
        # M's buffer, which becomes the error (the old error's buffer then holds the next M), and the
        # approximation goes into the gradient's own memory: no new gradient-sized tensors a step (on the
        # CPU, 3 fewer such matrices at the peak and 10-15 % less time a step for a 17 M-parameter MLP).
        self._spare = {i: torch.empty_like(self.errors[i]) for i in self.matrices}

    def wait(self) -> None:
        params, scale = self.params, self.loss_scale()
        grads, used = grads_with_flags(params)  # flattened
        # dist: errors are kept unscaled; the gradients carry this step's loss scale
        full = {i: torch.add(grads[i].view(params[i].shape[0], -1).float(), self.errors[i], alpha=scale,
                             out=self._spare[i]) for i in self.matrices}
        first = torch.cat([*((full[i] @ self.factors[i]).reshape(-1) for i in self.matrices),
                           *(grads[i].float() for i in self.whole), used.float()])
        summed = sum_in_rank_order(self.comm, first, "hvdtrain.powersgd.p") / self.size  # dist
        offset, left = 0, {}
        for i in self.matrices:
            n, r = full[i].shape[0], self.ranks[i]
            left[i] = torch.linalg.qr(summed[offset:offset + n * r].view(n, r)).Q  # P̂: orthonormal columns
            offset += n * r
        averaged = {}
        for i in self.whole:
            averaged[i] = summed[offset:offset + params[i].numel()]
            offset += params[i].numel()
        users = (summed[offset:] * self.size).round().tolist()
        right = summed.new_zeros(0)
        if self.matrices:  # the same on every rank: the model's
            # Mᵀ P̂ as (P̂ᵀ M)ᵀ: a row-major product, 15 times faster than the transposed one on a CPU; sent
            # as the r x m matrix P̂ᵀ M (the sums are elementwise: the order of the values changes none)
            second = torch.cat([(left[i].T @ full[i]).reshape(-1) for i in self.matrices])
            right = sum_in_rank_order(self.comm, second, "hvdtrain.powersgd.q") / self.size  # dist
        finite = bool(summed.isfinite().all()) and bool(right.isfinite().all())  # dist: the same on every rank
        offset = 0
        for i in self.matrices:
            m, r = full[i].shape[1], self.ranks[i]
            factor = right[offset:offset + m * r].view(r, m).T
            offset += m * r
            approximation = torch.mm(left[i], factor.T, out=_writable_gradient(grads[i], params[i], full[i]))
            if finite and users[i]:  # a skipped step (an overflow), or a tensor no rank used, changes no state
                error = full[i].sub_(approximation)
                if scale != 1.0:
                    error.div_(scale)
                self._spare[i], self.errors[i] = self.errors[i], error
                self.factors[i] = factor
            averaged[i] = approximation
        for i, param in enumerate(params):
            param.grad = None if users[i] == 0 else as_gradient(averaged[i].to(param.dtype), param)

    def state_dict(self) -> dict[str, Any]:
        """This rank's errors and the factors (the same on every rank), on the host, by parameter index."""
        # copies: the error buffers are written in place in later steps (on the CPU .cpu() would not copy)
        return {"world_size": self.size, "factors": {i: t.to("cpu", copy=True) for i, t in self.factors.items()},
                "errors": {i: t.to("cpu", copy=True) for i, t in self.errors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Factors and this rank's errors as saved by a run of as many processes and the same model."""
        for name, held in (("factors", self.factors), ("errors", self.errors)):
            for i in held:
                # a copy (ours alone: errors are written in place later), in the layout this class keeps
                loaded = state[name][i].to(held[i].device, copy=True)
                held[i] = _row_major_transpose(loaded) if name == "factors" else loaded

    def fits(self, state: dict[str, Any]) -> bool:
        """Whether saved state is this run's to load: as many processes, the same matrices and ranks."""
        return state.get("world_size") == self.size and \
            {i: tuple(t.shape) for i, t in state.get("factors", {}).items()} == \
            {i: tuple(t.shape) for i, t in self.factors.items()}


def _row_major_transpose(factor: torch.Tensor) -> torch.Tensor:
    """The m x r factor's values, as the transpose of a row-major r x m matrix."""
    return factor.T.contiguous().T


def _writable_gradient(grad: torch.Tensor, param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor | None:
    """Where the approximation can be written: the gradient's own memory (backward allocated it, M
    holds its values by now), as an n x m matrix; None (a new tensor) where it is not float32 and in
    place, or is a stand-in of zeros for a gradient this rank did not compute."""
    if param.grad is None or grad.dtype != full.dtype or grad.data_ptr() != param.grad.data_ptr():
        return None
    return grad.view(full.shape)
