"""Sparse gradients (nn.Embedding or nn.EmbeddingBag with sparse=True) made dense as backward produces
them, before any engine's hook sees them: the finite check, clipping, accumulation and every way of
exchanging gradients (both engines, sharded, compressed) then work as with sparse=False, and the
update is the same. Horovod's `sparse_as_dense`, for both engines: an allreduce of the dense gradient
costs the embedding's size, as with sparse=False, where an allgather of the sparse rows would grow
with the number of ranks."""

from __future__ import annotations

import torch
from torch import nn


def densify_sparse_gradients(model: nn.Module) -> None:
    """Registers the hook on each weight of a sparse embedding (once for a weight two modules share).
    Before the engine's own hooks, which run in the order registered."""
    weights = {id(module.weight): module.weight for module in model.modules()
               if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
               and module.weight.requires_grad}
    for weight in weights.values():
        weight.register_post_accumulate_grad_hook(_dense)


def _dense(param: torch.Tensor) -> None:
    if param.grad is not None and param.grad.is_sparse:
        param.grad = param.grad.to_dense()
