"""Whether every rank holds what rank 0 holds of something each makes itself: its settings (its own
command line, config file and environment) and its model.

A rank started otherwise (a config file edited on one host, a shell variable set on some) or a
factory that builds another model on some rank leaves the ranks in collectives that do not match:
Horovod waits for a missing gradient until its stall timeout (300 s) and then names the rank as
stuck, Gloo aborts, or, where the sizes happen to agree, each rank trains something else without a
word. Checked once at the start, before the first of them."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from hvdtrain.errors import UserError

if TYPE_CHECKING:
    from hvdtrain.config import Config
    from hvdtrain.engine import Engine

PER_HOST_KEYS = frozenset({"train.threads", "train.keep_freed_memory", "data.num_workers", "data.name",
                           "train.callbacks", "run.dir", "run.progress", "run.tensorboard"})
"""Settings each rank may hold its own of: what suits its host (threads, loader workers, its memory), a
path to the data on its host's own disk (the data sets' sizes are checked alike), callbacks (a logger on
rank 0 alone), and what only rank 0 uses."""


def unlike_rank_0(value: Any, engine: Engine, name: str) -> tuple[int, Any, Any] | None:
    """(the first rank whose `value` differs from rank 0's, rank 0's value, that rank's), or None where
    every rank's equals rank 0's. A collective: a digest of each rank's; the values only where some differ."""
    digests = engine.allgather_object(digest(value), name)  # dist
    if len(set(digests)) == 1:
        return None
    # dist: every rank got here (the digests are the same everywhere). A value may equal rank 0's though
    # written otherwise (a dict's keys in another order, 1 and 1.0): compared, not only digested.
    values = engine.allgather_object(value, f"{name}.values")
    other = next((rank for rank, theirs in enumerate(values) if theirs != values[0]), None)
    return None if other is None else (other, values[0], values[other])


def digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def settings(config: Config) -> dict[str, Any]:
    """`section.key`: value, for every setting the ranks must agree on."""
    return {f"{section}.{name}": value for section, values in config.to_dict().items()
            for name, value in values.items() if f"{section}.{name}" not in PER_HOST_KEYS}


def check_same_settings(started_with: dict[str, Any], engine: Engine) -> None:
    """Raises UserError on every rank where some rank was started with other `settings` than rank 0's
    (a collective), naming the first few that differ."""
    unlike = unlike_rank_0(started_with, engine, "settings")
    if unlike is None:
        return
    other, root, theirs = unlike
    differ = [f"{key} is {_value(theirs, key)} there, {_value(root, key)} on rank 0" for key in {**root, **theirs}
              if root.get(key, _UNSET) != theirs.get(key, _UNSET)]
    more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
    raise UserError(f"rank {other} was started with other settings than rank 0: {'; '.join(differ[:3])}{more}: start "
                    "every rank with the same command line and config file (from Python: the same arguments); only "
                    "threads, data loader workers, the data's path and callbacks may differ")


_UNSET = object()


def _value(held: dict[str, Any], key: str) -> str:
    """A setting's value as written, or that the rank's hvdtrain has no such setting (another version)."""
    value = held.get(key, _UNSET)
    return "not known (another hvdtrain version?)" if value is _UNSET else repr(value)
