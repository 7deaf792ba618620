"""Counting a tar shard's samples: the members' headers read once (tarfile passes over their data),
with the labels of its label column, and the archive checked whole; cached per version of the file
on a host, so a later start, and every other rank there, reads the count instead."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import tarfile
from pathlib import Path
from typing import Iterator

import numpy as np

from hvdtrain.errors import UserError

def open_shard(path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(path, "r:")
    except (tarfile.TarError, OSError) as err:
        raise UserError(f"shard '{path}' is not a readable tar file ({err}): write shards with tar or "
                        "webdataset's ShardWriter, uncompressed") from err


def members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The files of a shard, headers only (tarfile seeks past the data); directories and dot-files skipped."""
    while True:
        member = tar.next()
        if member is None:
            return
        if member.isfile() and not member.name.rpartition("/")[2].startswith("."):
            yield member


def key_of(member_name: str) -> tuple[str, str]:
    """(sample key, column) of a member: `dir/000017.seg.png` is sample `dir/000017`, column `seg.png`."""
    directory, _, base = member_name.rpartition("/")
    stem, _, column = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), column.lower()


CACHE_FORMAT = 2  # what an entry holds, and what counting checks, as of this version
INDEX_CACHE = Path(os.environ.get("HVDTRAIN_CACHE", Path.home() / ".cache" / "hvdtrain")) / "shard-index"


def index_of(path: Path, label_column: str | None) -> "ShardIndex":
    """A shard's index, counted once per version of the file on a host: a later start (and every other
    rank there) reads it from the cache, keyed by the file's identity, size and change time."""
    stat = path.stat()
    version = (f"{CACHE_FORMAT}\0{path.resolve()}\0{stat.st_dev}\0{stat.st_ino}\0{stat.st_size}\0{stat.st_mtime_ns}"
               f"\0{stat.st_ctime_ns}\0{label_column}")
    key = hashlib.sha1(version.encode()).hexdigest()
    cached = INDEX_CACHE / f"{key}.npz"
    try:
        with np.load(cached, allow_pickle=False) as saved:
            return ShardIndex(path, label_column, (int(saved["count"]), [str(c) for c in saved["columns"]],
                                                   saved["labels"] if bool(saved["has_labels"]) else None))
    except FileNotFoundError:
        pass
    except Exception:  # noqa: BLE001 - a damaged entry (zipfile's, numpy's errors alike): counted again
        with contextlib.suppress(OSError):
            cached.unlink()
    index = ShardIndex(path, label_column)
    partial = cached.with_name(f"{key}.{socket.gethostname()}.{os.getpid()}.tmp.npz")
    try:  # written whole or not at all: ranks on a host (or hosts sharing a home) may write it at once
        INDEX_CACHE.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as handle:
            np.savez(handle, count=index.count, columns=np.asarray(index.columns, dtype=str),
                     labels=index.labels if index.labels is not None else np.zeros(0, dtype=np.int64),
                     has_labels=index.labels is not None)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, cached)
    except OSError:  # a read-only home: counted again next time
        with contextlib.suppress(OSError):
            partial.unlink()
    return index


class ShardIndex:
    """What counting a shard's samples learnt: how many, the columns of its first sample, and its
    integer labels when it has a label column."""

    def __init__(self, path: Path, label_column: str | None,
                 known: tuple[int, list[str], np.ndarray | None] | None = None):
        """`known`: (count, columns, labels) from the cache, instead of counting."""
        if known is not None:
            self.path, (self.count, self.columns, self.labels) = path, known
            return
        self.path, self.count, self.columns = path, 0, []
        labels: list[int] = []
        tar, key, last = open_shard(path), None, None
        try:
            for member in members(tar):
                sample, column = key_of(member.name)
                if sample != key:
                    if label_column and len(labels) < self.count:
                        raise UserError(f"shard '{path}': sample '{key}' has no column {label_column}: every sample "
                                        "needs the target column (data.target_column)")
                    key, self.count = sample, self.count + 1
                if self.count == 1:
                    self.columns.append(column)
                if column == label_column:
                    labels.append(_label(tar, member, path))
                last = member
            _check_whole(tar, last, path, self.count)
            if label_column and len(labels) < self.count:
                raise UserError(f"shard '{path}': sample '{key}' has no column {label_column}: every sample needs "
                                "the target column (data.target_column)")
        except (tarfile.TarError, OSError) as err:
            raise UserError(f"shard '{path}' is damaged after {self.count} samples ({err}): write it again") from err
        finally:
            tar.close()
        self.labels = np.asarray(labels, dtype=np.int64) if label_column else None


def _check_whole(tar: tarfile.TarFile, last: tarfile.TarInfo | None, path: Path, count: int) -> None:
    """tarfile reads a cut-off archive as a shorter one: what follows its last member must be the
    archive's end, blocks of zeros (at least one), and its last member's data must be there."""
    size = path.stat().st_size
    if last is not None and last.offset_data + last.size > size:
        raise UserError(f"shard '{path}' is cut off in sample {count} ('{last.name}'): write it again")
    tar.fileobj.seek(tar.offset)
    rest = tar.fileobj.read(min(size - tar.offset, 1 << 16))
    if rest.strip(b"\0") or not 512 <= size - tar.offset <= 1 << 16:  # a tar ends with zero blocks
        raise UserError(f"shard '{path}' is cut off or damaged after {count} samples (no tar member or end at byte "
                        f"{tar.offset}): write it again")


def _label(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> int:
    text = tar.extractfile(member).read().decode("utf-8", "replace").strip()  # type: ignore[union-attr]
    try:
        return int(text)
    except ValueError:
        raise UserError(f"shard '{path}': member '{member.name}' holds '{text[:40]}', not an integer label: "
                        "a .cls member holds one integer as text") from None
