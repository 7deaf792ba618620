"""Data sources behind one interface (`base.Source`): each kind of data set is a module here that
says which names it claims and builds its parts. `SOURCES` asks them in order; the first that
claims `data.name` builds the train/val split for `fit` (`build_data`) and a part for evaluate and
predict (`build_part`).

Kinds: user.py (a factory's Dataset or IterableDataset), builtin.py (digits, random),
image_folder.py (class folders of images), hugging_face.py, tar_shards.py, arrays.py (memory-mapped .npy), tokens.py (.bin token files) and
npz.py; tensors.py holds what the in-memory kinds share.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from torch.utils.data import Dataset

from hvdtrain.config import DataConfig
from hvdtrain.data.sources.arrays import ArrayDirectory
from hvdtrain.data.sources.base import DataSplit, Source
from hvdtrain.data.sources.builtin import BUILT_IN, Digits, RandomTeacher
from hvdtrain.data.sources.hugging_face import HuggingFace
from hvdtrain.data.sources.image_folder import ImageFolder
from hvdtrain.data.sources.npz import NpzFile
from hvdtrain.data.sources.tar_shards import TarShards
from hvdtrain.data.sources.tokens import TokenFile
from hvdtrain.data.sources.user import UserFactory
from hvdtrain.errors import UserError, users_code
from hvdtrain.factory import colon_hint

__all__ = ["BUILT_IN", "PARTS", "SOURCES", "DataSplit", "Source", "build_data", "build_part", "located", "source_of"]

SOURCES: tuple[Source, ...] = (
    UserFactory(),  # package.module:function, before any file: a factory's name may look like one
    Digits(),  # the built-ins by exact name, before a file or directory of that name
    RandomTeacher(),
    ImageFolder(),  # class folders of images, before the directory kinds below (it leaves them their files)
    HuggingFace(),  # before the directories below: a save_to_disk directory holds other files too
    TarShards(),  # a directory of .tar files, before a directory of arrays
    ArrayDirectory(),
    TokenFile(),
    NpzFile(),
)
"""Every kind of data source, in the order they are asked which claims a name."""

PARTS = ("val", "train", "all")
NOT_FILES = (UserFactory, Digits, RandomTeacher)
"""The sources whose names are not paths."""


def build_data(cfg: DataConfig, seed: int, target_key: str = "labels") -> DataSplit:
    """The train and validation sets the config names; the same on every rank."""
    split = _reading(cfg.name, lambda source: source.split(cfg, seed, target_key))
    if cfg.num_classes is not None:  # the user's word wins over what the data suggests
        split.num_classes = cfg.num_classes
    return split


def build_part(cfg: DataConfig, seed: int, target_key: str, part: str, need_targets: bool = True) -> Dataset:
    """One part of a data set for evaluation or prediction: the `train` or `val` split as `fit`
    made it, or `all` of it in the source's own order (a factory's (train, val) pair: train first).
    Without `need_targets`, an .npz file may hold only `x`."""
    if part not in PARTS:
        raise UserError(f"unknown data part '{part}': use one of {', '.join(PARTS)}")
    if part != "all":
        return getattr(build_data(cfg, seed, target_key), part)
    return _reading(cfg.name, lambda source: source.whole(cfg, seed, need_targets))


def _reading(name: str, call: Callable[[Source], Any]) -> Any:
    """`call(source)` for the source of `name`: a failure as the source opens the data (a user's Dataset
    asked for its first sample, to learn its shapes; a file that cannot be read) is one line naming it,
    and where in the user's code."""
    source = source_of(name)
    return users_code(f"data set '{name}' could not be read", lambda: call(source))


def located(name: str) -> str:
    """`name` as the run keeps it: a file or directory that exists (or a pattern of tar shards) as an
    absolute path, `~` expanded, so that evaluate, predict and a resume find it from any directory;
    other names as they are (a missing file's error names it as given)."""
    if isinstance(_claimant(name), NOT_FILES) or name.startswith("{"):  # a brace's choices may be absolute each
        return name
    expanded = os.path.expanduser(name)
    if os.path.isabs(expanded):
        return expanded
    if any(mark in expanded for mark in "{*?["):  # a pattern: joined as it is (normalising could fold a
        path = os.path.join(os.getcwd(), expanded)  # `..` after a brace into it)
    elif os.path.exists(expanded):
        path = os.path.abspath(expanded)
    else:
        return name
    return path if _claimant(path) is not None else name


def _claimant(name: str) -> Source | None:
    return next((source for source in SOURCES if source.claims(name)), None)


# A table's files: read by the user's own code, which knows its columns.
_TABLES = (".csv", ".tsv", ".parquet", ".json", ".jsonl", ".feather", ".arrow", ".xlsx")


# Files of torch.save or pickle: objects that only the user's code knows how to make a Dataset of.
_SAVED_OBJECTS = (".pt", ".pth", ".pkl", ".pickle")


def _file_hint(name: str) -> str:
    """For a file that none of the sources reads: what would read it."""
    suffix = Path(name).suffix
    if name.lower().endswith(_TABLES):
        return (f"; a table ({suffix}) needs a data factory of yours that reads its columns into a "
                "Dataset (--data mymodule:data), or its arrays saved as x and y in an .npz file")
    if name.lower().endswith(_SAVED_OBJECTS):
        return (f"; a saved object ({suffix}) needs a data factory of yours that loads it into a Dataset "
                "(TensorDataset(x, y), --data mymodule:data), or its arrays saved as x and y in an .npz file")
    if name.lower().endswith(".npy"):
        return "; an .npy file holds one array: save the inputs as x.npy and the targets as y.npy in one directory"
    return ""


def source_of(name: str) -> Source:
    """The first source in `SOURCES` that claims `name`; one line naming what would be when none does."""
    found = _claimant(name)
    if found is not None:
        return found
    if "/" in name or Path(name).exists():
        found_as = "is not one of these" if Path(name).exists() else "does not exist"
        raise UserError(f"data path '{name}' {found_as}: give a directory of x.npy and y.npy, an .npz file, "
                        f"a .bin token file, .tar shards or class folders of images{_file_hint(name)}")
    raise UserError(
        f"unknown data set '{name}': use one of {', '.join(BUILT_IN)}, a path to an .npz file, a directory "
        f"of .npy arrays, a .bin token file, or package.module:function{colon_hint(name)}"
    )
