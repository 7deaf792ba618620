"""Data sets too large for memory, read from files as batches need them (memory-mapped):

- a directory of `.npy` arrays, `x.npy` and `y.npy` (or `train/` and `val/` directories of them);
- a flat file of token ids, `.bin` (uint16 or uint32, as nanoGPT's `prepare.py` writes them, with
  `val.bin` beside `train.bin` when there is one), read as windows of `data.context` tokens.

Each process opens the files itself on first use (so data-loader workers do too) and reads only
the samples of its own batches: the pages are the operating system's file cache, shared by every
rank on a host, not memory of the process's own. Without a separate validation file, every k-th
sample is held out (k = round(1 / data.val_fraction)): no index list of the whole set is kept,
and data sorted by class still gets a validation part of every class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset

from hvdtrain.errors import UserError

TOKEN_SUFFIX = ".bin"
TOKEN_DTYPES = ("uint16", "uint32")


def is_array_directory(name: str) -> bool:
    return Path(name).is_dir()


def is_token_file(name: str) -> bool:
    return name.endswith(TOKEN_SUFFIX)


class HeldOut:
    """Which samples of `total` a part holds: all, or the train or validation side of a split that
    sends every `every`-th sample to validation."""

    def __init__(self, total: int, every: int = 0, val: bool = False):
        self.total, self.every, self.val = total, every, val

    def __len__(self) -> int:
        if not self.every:
            return self.total
        held = self.total // self.every
        return held if self.val else self.total - held

    def __call__(self, index: int) -> int:
        """The index in the file of the part's sample `index`."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        if not self.every:
            return index
        if self.val:
            return index * self.every + self.every - 1
        block, offset = divmod(index, self.every - 1)
        return block * self.every + offset


def split(total: int, val_fraction: float) -> tuple[HeldOut, HeldOut]:
    if val_fraction > 0.5:
        raise UserError(f"data.val_fraction {val_fraction} holds out more than every 2nd sample, which a file read "
                        "in place cannot: use at most 0.5, or give a separate validation part")
    every = max(2, round(1 / max(val_fraction, 1e-12)))
    if total // every == 0:
        raise UserError(f"the data set has {total} sample(s): too few to hold out every {every}th for "
                        "validation (data.val_fraction); give more data or a separate validation file")
    return HeldOut(total, every), HeldOut(total, every, val=True)


class MappedArrays(Dataset):
    """Samples (x[i], y[i]) of `.npy` files opened with mmap_mode="r"; x as float32, y as int64
    labels when integers, else float32."""

    def __init__(self, directory: Path, part: HeldOut, arrays: tuple[np.ndarray, np.ndarray] | None = None):
        """`arrays`: the directory's, when already open."""
        self.directory, self.part = directory, part
        self._arrays = arrays

    def __len__(self) -> int:
        return len(self.part)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            self._arrays = open_arrays(self.directory)
        return self._arrays

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One read per array for the whole batch, in the file's order (sequential where it can be)."""
        x, y = self.arrays()
        rows = np.fromiter((self.part(i) for i in indices), dtype=np.int64, count=len(indices))
        inputs = torch.from_numpy(np.asarray(x[rows], dtype=np.float32))
        targets = torch.from_numpy(_as_targets(np.asarray(y[rows])))
        return list(zip(inputs, targets))

    def __getstate__(self) -> dict[str, Any]:  # to a worker process: it maps the files itself
        return {**self.__dict__, "_arrays": None}


def open_arrays(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """x.npy and y.npy in `directory`, memory-mapped, checked against each other."""
    arrays = []
    for key in ("x", "y"):
        path = directory / f"{key}.npy"
        if not path.is_file():
            found = ", ".join(sorted(p.name for p in directory.glob("*.npy"))) or "no .npy file"
            raise UserError(f"data directory '{directory}' has no {key}.npy (it has {found}): save the inputs "
                            "with np.save(dir / 'x.npy', inputs) and the targets as y.npy")
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            raise UserError(f"data file '{path}' is not a readable .npy array of numbers ({err}): write one with "
                            "np.save") from err
        if not isinstance(array, np.ndarray) or array.ndim == 0:
            raise UserError(f"data file '{path}' is not an array with one row per sample: write one with np.save")
        arrays.append(array)
    x, y = arrays
    if len(x) != len(y):
        raise UserError(f"data directory '{directory}': x.npy has {len(x)} samples but y.npy has {len(y)}: "
                        "they must match")
    if not np.issubdtype(x.dtype, np.number):
        raise UserError(f"data file '{directory / 'x.npy'}': x must be numeric, got dtype {x.dtype}")
    if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
        raise UserError(f"data file '{directory / 'y.npy'}': y must hold class labels or numbers, got dtype {y.dtype}")
    if len(x) < 2:
        raise UserError(f"data directory '{directory}' holds {len(x)} sample(s): at least 2 are needed")
    return x, y


def _as_targets(y: np.ndarray) -> np.ndarray:
    return y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)


def array_parts(directory: Path, val_fraction: float) -> tuple[MappedArrays, MappedArrays]:
    """(train, val): `train/` and `val/` directories when there are, else one directory split."""
    if not directory.is_dir():
        raise UserError(f"data directory '{directory}' does not exist: check data.name (--data)")
    if (directory / "train").is_dir() != (directory / "val").is_dir():
        raise UserError(f"data directory '{directory}' has a {'train' if (directory / 'train').is_dir() else 'val'}/ "
                        "directory but not the other: give both train/ and val/, or x.npy and y.npy in the directory")
    if (directory / "train").is_dir():
        train_dir, val_dir = directory / "train", directory / "val"
        (train_x, train_y), (val_x, val_y) = open_arrays(train_dir), open_arrays(val_dir)
        for name, a, b in (("x", train_x, val_x), ("y", train_y, val_y)):
            if a.shape[1:] != b.shape[1:] or a.dtype.kind != b.dtype.kind:
                raise UserError(f"data directory '{directory}': train/{name}.npy holds {a.dtype} samples of shape "
                                f"{a.shape[1:]} but val/{name}.npy {b.dtype} of shape {b.shape[1:]}: they must match")
        return (MappedArrays(train_dir, HeldOut(len(train_x)), (train_x, train_y)),
                MappedArrays(val_dir, HeldOut(len(val_x)), (val_x, val_y)))
    arrays = open_arrays(directory)
    train, val = split(len(arrays[0]), val_fraction)
    return MappedArrays(directory, train, arrays), MappedArrays(directory, val, arrays)


def target_files(*datasets: MappedArrays) -> list[np.ndarray]:
    """The y.npy of each directory the parts read, once each."""
    return [d.arrays()[1] for d in {d.directory: d for d in datasets}.values()]


def largest_label(targets: list[np.ndarray], chunk: int = 1 << 24) -> int | None:
    """The largest integer label of the target files, read in chunks; None for float targets."""
    largest = -1
    for y in targets:
        if not np.issubdtype(y.dtype, np.integer):
            return None
        for start in range(0, len(y), chunk):
            largest = max(largest, int(y[start:start + chunk].max()))
    return largest


class TokenWindows(Dataset):
    """Windows of `context` token ids of a flat binary file: sample i is tokens [i*context, (i+1)*context),
    as int64 (the language-model task predicts each token from the ones before it)."""

    def __init__(self, path: Path, dtype: str, context: int, part: HeldOut | None = None):
        self.path, self.dtype, self.context = path, dtype, context
        self.part = part or HeldOut(windows(path, dtype, context))
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.part)

    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        start = self.part(index) * self.context
        return (torch.from_numpy(self.tokens()[start:start + self.context].astype(np.int64)),)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}


def windows(path: Path, dtype: str, context: int) -> int:
    """How many whole windows of `context` tokens the file holds; refuses files that are not token files."""
    if not path.is_file():
        raise UserError(f"token file '{path}' does not exist: check data.name (--data)")
    size, width = path.stat().st_size, np.dtype(dtype).itemsize
    if size % width:
        raise UserError(f"token file '{path}' has {size} bytes, not a multiple of {width} ({dtype}): "
                        "check data.token_dtype (uint16 for vocabularies up to 65536, else uint32)")
    count = size // width // context
    if count < 1:
        raise UserError(f"token file '{path}' holds {size // width} tokens, fewer than one window of "
                        f"data.context={context}: lower data.context or give a longer file")
    return count


def token_parts(path: Path, dtype: str, context: int, val_fraction: float) -> tuple[TokenWindows, TokenWindows]:
    """(train, val): `val.bin` beside a `train.bin` when there is one, else one file split."""
    val_path = path.with_name("val" + TOKEN_SUFFIX)
    if path.name == "train" + TOKEN_SUFFIX and val_path.is_file():
        return TokenWindows(path, dtype, context), TokenWindows(val_path, dtype, context)
    train, val = split(windows(path, dtype, context), val_fraction)
    return TokenWindows(path, dtype, context, train), TokenWindows(path, dtype, context, val)


def check_token_run(data: str, task: str, model: str) -> None:
    """A token file with a built-in task other than the language model's, or a built-in model: the
    first batch would fail with a dtype error that names neither."""
    if task in ("classification", "regression", "multilabel"):
        raise UserError(f"data '{data}' is a token file, windows of token ids for --task language-model, "
                        f"not {task}: add --task language-model")
    if model in ("mlp", "cnn"):
        raise UserError(f"the built-in model '{model}' takes features, not token ids: give a language model with "
                        "--model package.module:function (it takes (batch, data.context) token ids and returns "
                        "(batch, data.context, vocabulary) logits)")


def whole(path: Path, token_dtype: str, context: int) -> Dataset:
    """Every sample in the files' own order (train before val where they are apart), for evaluate and predict."""
    if is_token_file(path.name):
        parts = [path, path.with_name("val" + TOKEN_SUFFIX)] if path.name == "train" + TOKEN_SUFFIX else [path]
        return ConcatDataset([TokenWindows(p, token_dtype, context) for p in parts if p.is_file()])
    directories = [path / "train", path / "val"] if (path / "train").is_dir() and (path / "val").is_dir() else [path]
    parts = []
    for directory in directories:
        arrays = open_arrays(directory)
        parts.append(MappedArrays(directory, HeldOut(len(arrays[0])), arrays))
    return ConcatDataset(parts)


def vocabulary(*datasets: TokenWindows, chunk: int = 1 << 26) -> int:
    """The largest token id of the files, plus one (read in chunks: set data.num_classes to skip it)."""
    largest = 0
    for path in dict.fromkeys(d.path for d in datasets):
        tokens = np.memmap(path, dtype=datasets[0].dtype, mode="r")
        for start in range(0, len(tokens), chunk):
            largest = max(largest, int(tokens[start:start + chunk].max()))
    if largest >= 1 << 22:  # no tokenizer in use has 4 M tokens: uint16 ids read two at a time as uint32
        raise UserError(f"token file '{datasets[0].path}' holds ids up to {largest:,} as {datasets[0].dtype}: check "
                        "data.token_dtype (uint16 for vocabularies up to 65536), or set data.num_classes")
    return largest + 1
