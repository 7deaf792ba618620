"""WebDataset-style tar shards as hvdtrain data: `--data 'shards/train-{000000..000099}.tar'`, a glob
(`'shards/*.tar'`), or a directory of `.tar` files (with `train/` and `val/` directories of them
when the validation part is apart).

A sample is the run of consecutive tar members that share a key, the member's name up to the first
dot of its file name (`000017.png` and `000017.cls` are the inputs and the label of sample
`000017`); each member is a column named by its extension and decoded as WebDataset decodes it
(images to float tensors in [0, 1], `.npy` arrays, `.cls` integers, `.json`, `.txt`). Columns are
chosen as for Hugging Face data: `data.target_column` (default `cls`, else `label`, `labels`, `y`)
and `data.input_columns` (default every other column).

The shards are read front to back (hvdtrain.data.streams); this module lists them, has them counted
(hvdtrain.data.shard_index), and reads one shard from a given sample on.
"""

from __future__ import annotations

import glob
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hvdtrain.data.huggingface import column_tensor
from hvdtrain.data.mapped import HeldOut, split as strided_split
from hvdtrain.data.shard_index import ShardIndex, index_of, key_of, members, open_shard
from hvdtrain.errors import UserError, message_lines

SUFFIX = ".tar"
TARGETS = ("cls", "label", "labels", "y")
LABEL_COLUMNS = ("cls", "cls2", "class", "index", "label", "labels", "y")
"""Columns WebDataset decodes as one integer: read while counting, for the label checks."""
HELD_LABELS_LIMIT = 128 << 20  # bytes of int64 labels held for the label checks


def is_shards(name: str) -> bool:
    """A tar file, a pattern of them, or a directory holding them (not a directory of .npy arrays)."""
    if name.endswith(SUFFIX) or (("{" in name or "*" in name) and SUFFIX in name):
        return True
    path = Path(name)
    return path.is_dir() and (any(path.glob("*" + SUFFIX)) or any((path / "train").glob("*" + SUFFIX)))


def require_webdataset(name: str) -> None:
    try:
        import braceexpand  # noqa: F401
        import webdataset  # noqa: F401
    except ImportError:
        raise UserError(f"data '{name}' is tar shards, which need the webdataset package: "
                        "pip install 'hvdtrain[shards]'") from None


def shard_paths(name: str) -> list[Path]:
    """The shards `name` names, in its order (a pattern's expansion; a directory's sorted)."""
    path = Path(name)
    if path.is_dir():
        found = sorted(path.glob("*" + SUFFIX))
    else:
        from braceexpand import braceexpand

        found = [Path(p) for expanded in braceexpand(name) for p in (sorted(glob.glob(expanded)) or [expanded])]
        if any("*" in str(p) or "?" in str(p) for p in found):
            raise UserError(f"data '{name}' matches no file: check the pattern (quote it, so that the shell leaves it "
                            "to hvdtrain)")
    if not found:
        raise UserError(f"data '{name}' names no tar shards: give a directory of .tar files, a pattern such as "
                        "'shards/train-{000000..000009}.tar', or 'shards/*.tar'")
    missing = [str(p) for p in found if not p.is_file()]
    if missing:
        raise UserError(f"shard '{missing[0]}' does not exist ({len(missing)} of {len(found)} named shards are "
                        "missing): check data.name (--data)")
    return found


class Shards:
    """A part of a list of shards: every sample, or the training or validation side of a split that
    holds out every k-th sample of each shard. `counts[i]`: the part's samples in shard i."""

    def __init__(self, indexes: list[ShardIndex], inputs: list[str], target: str | None, every: int = 0,
                 val: bool = False):
        self.paths = [index.path for index in indexes]
        self.inputs, self.target = inputs, target
        self.parts = [HeldOut(index.count, every, val) for index in indexes]
        self.counts = [len(part) for part in self.parts]
        self.labels = [index.labels for index in indexes]
        self._decoder: Any = None

    def names(self) -> list[str]:
        return [str(path) for path in self.paths]

    def open(self, shard: int) -> "ShardCursor":
        return ShardCursor(self, shard)

    def decode(self, raw: dict[str, bytes]) -> tuple[Any, ...]:
        """(inputs, target) or (inputs,) of one sample's members, decoded by their extensions."""
        if self._decoder is None:
            from webdataset.autodecode import Decoder, imagehandler

            self._decoder = Decoder([imagehandler("torchrgb")])
        try:
            decoded = self._decoder(dict(raw))
        except Exception as err:  # noqa: BLE001 - PIL's, numpy's and json's errors alike
            raise UserError(f"shard '{raw['__url__']}': sample '{raw['__key__']}' does not decode "
                            f"({message_lines(err.__cause__ or err, 1)}): write it again, or leave its column out") from err
        inputs = [_tensor(decoded[column], column) for column in self.inputs]
        value = inputs[0] if len(inputs) == 1 else dict(zip(self.inputs, inputs))
        return (value, _tensor(decoded[self.target], self.target)) if self.target else (value,)


    def __getstate__(self) -> dict[str, Any]:  # to a worker process: it makes its own decoder
        return {**self.__dict__, "_decoder": None}


def _tensor(value: Any, column: str) -> Any:
    """A decoded column as a float32 or int64 tensor (an image is one already)."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value.long()
    return column_tensor(value, column)


class ShardCursor:
    """Reads one shard's samples of a part front to back."""

    def __init__(self, shards: Shards, shard: int):
        self.shards, self.shard, self.part = shards, shard, shards.parts[shard]
        self.path = shards.paths[shard]
        self.tar = open_shard(self.path)
        self.members = members(self.tar)
        self.pending: tarfile.TarInfo | None = None
        self.next_sample = 0  # in the shard, not the part
        self.position = 0  # the part's next sample
        self.columns = set(shards.inputs) | ({shards.target} if shards.target else set())

    def read(self, index: int) -> dict[str, bytes]:
        """The part's sample `index` (at or after the cursor's position): its chosen columns' bytes."""
        wanted = self.part(index)
        while self.next_sample < wanted:
            self._sample(keep=False)
        self.position = index + 1
        raw = self._sample(keep=True)
        missing = self.columns - set(raw) - {"__key__", "__url__"}
        if missing:
            raise UserError(f"shard '{self.path}': sample '{raw['__key__']}' has no column "
                            f"{', '.join(sorted(missing))}: every sample needs the chosen columns")
        return raw

    def _sample(self, keep: bool) -> dict[str, bytes]:
        """The next sample's members: their bytes when `keep`, else only passed over."""
        raw: dict[str, Any] = {"__url__": str(self.path)}
        key = None
        try:
            while True:
                member = self.pending or next(self.members, None)
                self.pending = None
                if member is None:
                    break
                sample, column = key_of(member.name)
                if key is not None and sample != key:
                    self.pending = member
                    break
                key = sample
                if keep and column in self.columns:
                    raw[column] = self.tar.extractfile(member).read()  # type: ignore[union-attr]
        except (tarfile.TarError, OSError) as err:
            raise UserError(f"shard '{self.path}' could not be read at sample {self.next_sample} ({err})") from err
        if key is None:
            raise UserError(f"shard '{self.path}' ended before sample {self.next_sample}: it changed since it was "
                            "counted; do not rewrite shards while a run reads them")
        self.next_sample += 1
        raw["__key__"] = key
        return raw

    def close(self) -> None:
        self.tar.close()


def shard_parts(name: str, inputs: str | None, target: str | None, val_fraction: float) -> tuple[Shards, Shards]:
    """(train, val): the `train/` and `val/` directories' shards when there are, else every shard's
    k-th samples held out."""
    require_webdataset(name)
    path = Path(name)
    if path.is_dir() and (path / "train").is_dir():
        if not (path / "val").is_dir():
            raise UserError(f"data directory '{name}' has a train/ directory but no val/: give both, or the shards "
                            "in the directory itself")
        train_indexes = _indexes(shard_paths(str(path / "train")), target)
        val_indexes = _indexes(shard_paths(str(path / "val")), target)
        chosen_inputs, chosen_target = _columns(name, train_indexes, inputs, target)
        _columns(name + "/val", val_indexes, ",".join(chosen_inputs), chosen_target)
        return Shards(train_indexes, chosen_inputs, chosen_target), Shards(val_indexes, chosen_inputs, chosen_target)
    indexes = _indexes(shard_paths(name), target)
    chosen_inputs, chosen_target = _columns(name, indexes, inputs, target)
    train, _ = strided_split(sum(index.count for index in indexes), val_fraction)  # checks the fraction and size
    val = Shards(indexes, chosen_inputs, chosen_target, train.every, val=True)
    if sum(val.counts) == 0:
        raise UserError(f"shards '{name}' hold fewer than {train.every} samples each, so holding out every "
                        f"{train.every}th sample of each (data.val_fraction) leaves none for validation: give train/ "
                        "and val/ directories of shards, or larger shards")
    return Shards(indexes, chosen_inputs, chosen_target, train.every), val


def whole(name: str, inputs: str | None, target: str | None) -> Shards:
    """Every sample in the shards' own order (train before val where they are apart)."""
    require_webdataset(name)
    path = Path(name)
    paths = (shard_paths(str(path / "train")) + shard_paths(str(path / "val"))
             if path.is_dir() and (path / "train").is_dir() else shard_paths(name))
    indexes = _indexes(paths, target)
    return Shards(indexes, *_columns(name, indexes, inputs, target))


def _indexes(paths: list[Path], target: str | None) -> list[ShardIndex]:
    if target is None:  # the default target, from the first sample's columns, to read its labels while counting
        first = next((columns for columns in map(_first_columns, paths) if columns), [])
        target = next((column for column in TARGETS if column in first), None)
    label = target if target in LABEL_COLUMNS else None
    indexes = [index_of(path, label) for path in paths]
    if sum(index.count for index in indexes) == 0:
        raise UserError(f"the shards from '{paths[0]}' on hold no samples: check that they are tar files of samples")
    return indexes


def _first_columns(path: Path) -> list[str]:
    tar, columns, key = open_shard(path), [], None
    try:
        for member in members(tar):
            sample, column = key_of(member.name)
            if key is not None and sample != key:
                break
            key = sample
            columns.append(column)
    except (tarfile.TarError, OSError) as err:
        raise UserError(f"shard '{path}' is damaged ({err}): write it again") from err
    finally:
        tar.close()
    return columns


def _columns(name: str, indexes: list[ShardIndex], inputs: str | None,
             target: str | None) -> tuple[list[str], str | None]:
    available = next(index.columns for index in indexes if index.count)
    if target is None:
        target = next((column for column in TARGETS if column in available), None)
    chosen = [c.strip().lower() for c in inputs.split(",")] if inputs else [c for c in available if c != target]
    for column in [*chosen, *([target] if target else [])]:
        if column not in available:
            raise UserError(f"shards '{name}' have no column '{column}' (the first sample has "
                            f"{', '.join(available)}): choose with data.input_columns and data.target_column")
    if not chosen:
        raise UserError(f"shards '{name}' have no input column besides the target '{target}': set data.input_columns")
    return chosen, target


def held_labels(*parts: Shards) -> torch.Tensor | None:
    """Every integer label of the parts' shards (each shard once), when they have a label column and
    not too many to hold."""
    labels = {path: held for part in parts for path, held in zip(part.paths, part.labels)}
    if not labels or any(held is None for held in labels.values()) or \
            sum(len(held) for held in labels.values()) * 8 > HELD_LABELS_LIMIT:
        return None
    return torch.from_numpy(np.concatenate(list(labels.values())))
