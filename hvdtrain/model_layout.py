"""Whether every rank built the same model: its tensors' names, shapes and types, in order.

Each rank builds the model itself, and a factory can build another one on some rank: a vocabulary
counted from the files each host reads, a size from a host's own config, an architecture drawn
without a seed. Rank 0's weights are then broadcast, and the gradients averaged, into tensors that do
not match: the collectives fail (Horovod: "Mismatched BROADCAST tensor shapes" on some rank, Gloo: an
abort), or worse, agree in size and train nonsense. Checked once, before the first of them."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from torch import nn

from hvdtrain.alike import unlike_rank_0
from hvdtrain.engine.base import is_extra_state
from hvdtrain.errors import UserError

if TYPE_CHECKING:
    from hvdtrain.engine import Engine


class Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str
    trained: bool | None
    """requires_grad of a parameter (a frozen one has no gradient to average); None for a buffer."""


def layout(model: nn.Module) -> list[Tensor]:
    """The model's state, tensor by tensor, in the order the engines broadcast it."""
    trained = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    # Extra state by its name alone: rank 0's is broadcast over it, whatever each rank built
    return [Tensor(name, (), "extra state", None) if is_extra_state(name) else
            Tensor(name, tuple(value.shape), str(value.dtype).removeprefix("torch."), trained.get(name))
            for name, value in model.state_dict().items()]


def check_same_model(model: nn.Module, engine: Engine) -> None:
    """Raises UserError on every rank where some rank built another model than rank 0's (a collective:
    every rank calls it, with the module itself, not a compiled wrapper)."""
    unlike = unlike_rank_0(layout(model), engine, "model_layout")
    if unlike is None:
        return
    other, root, theirs = unlike
    raise UserError(f"rank {other} built another model than rank 0: {difference(root, theirs)}; "
                    "every rank must build the same model: seed what your factory draws at random, and size the "
                    "model from what every rank reads alike (the whole data set, not a rank's or host's own files)")


def difference(root: list[Tensor], other: list[Tensor]) -> str:
    """The first way `other` differs from rank 0's `root`, in rank 0's order, in words."""
    others = {tensor.name: tensor for tensor in other}
    counts = f" ({len(other)} tensors there, {len(root)} on rank 0)" if len(other) != len(root) else ""
    for mine in root:
        theirs = others.get(mine.name)
        if theirs is None:
            return f"it lacks rank 0's '{mine.name}'{counts}"
        if theirs.shape != mine.shape:
            return f"'{mine.name}' is {_shape(theirs.shape)} there, {_shape(mine.shape)} on rank 0{counts}"
        if theirs.dtype != mine.dtype:
            return f"'{mine.name}' is {theirs.dtype} there, {mine.dtype} on rank 0{counts}"
        if theirs.trained != mine.trained:
            return f"'{mine.name}' is {_trained(theirs.trained)} there, {_trained(mine.trained)} on rank 0{counts}"
    names = {tensor.name for tensor in root}
    extra = next((tensor.name for tensor in other if tensor.name not in names), None)
    if extra is not None:
        return f"it has '{extra}', which rank 0's has not{counts}"
    return "the same tensors, in another order"


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape)) if shape else "a scalar"


def _trained(trained: bool | None) -> str:
    return "frozen (requires_grad False)" if trained is False else "trained" if trained else "a buffer"
