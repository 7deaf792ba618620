"""Hugging Face `datasets` as hvdtrain data: a `save_to_disk` directory (a Dataset, or a
DatasetDict whose `train` and `validation`/`val`/`test` splits are the two parts), an `.arrow`
file, or Parquet files. Arrow files are memory-mapped by `datasets` itself, so every rank reads
the same pages of the file cache and none holds a copy (Parquet is converted to Arrow once, in
the `datasets` cache, by whichever rank gets there first).

Columns are chosen by name: `data.target_column` (default `label`, else `labels`, else none)
and `data.input_columns` (default every other column; one column is the input tensor, several a dict of
named inputs). A batch is read in one call, as numpy arrays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset

from hvdtrain.data.mapped import HeldOut, split as strided_split
from hvdtrain.errors import UserError

SUFFIXES = (".arrow", ".parquet")
VAL_SPLITS = ("validation", "val", "test")


def is_hugging_face(name: str) -> bool:
    path = Path(name)
    return name.endswith(SUFFIXES) or (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


class Columns(Dataset):
    """Samples of a `datasets.Dataset`: (inputs, target) with inputs a tensor or a dict of them."""

    def __init__(self, table: Any, inputs: list[str], target: str | None, part: HeldOut):
        """`table` as `formatted` returns it."""
        self.table, self.inputs, self.target, self.part = table, inputs, target, part

    def __len__(self) -> int:
        return len(self.part)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        rows = self.table[[self.part(i) for i in indices]]
        columns = {name: column_tensor(rows[name], name) for name in [*self.inputs, *([self.target] if self.target else [])]}
        samples = []
        for i in range(len(indices)):
            inputs = columns[self.inputs[0]][i] if len(self.inputs) == 1 else {n: columns[n][i] for n in self.inputs}
            samples.append((inputs, columns[self.target][i]) if self.target else (inputs,))
        return samples


def formatted(table: Any, inputs: list[str], target: str | None) -> Any:
    """The table reading the chosen columns as numpy arrays, a batch of rows at a time."""
    return table.with_format("numpy", columns=[*inputs, *([target] if target else [])])


def column_tensor(values: Any, name: str) -> torch.Tensor | list[torch.Tensor]:
    """A column of a batch: one tensor, or one per row where rows differ in length (data.collate=pad
    pads them)."""
    array = np.asarray(values)
    if array.dtype == object:
        return [column_tensor(row, name) for row in values]
    if np.issubdtype(array.dtype, np.floating):
        return torch.from_numpy(array.astype(np.float32))
    if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        return torch.from_numpy(array.astype(np.int64))
    raise UserError(f"column '{name}' has dtype {array.dtype}, not numbers: choose numeric columns with data.input_columns")


def parts(name: str, inputs: str | None, target: str | None, val_fraction: float) -> tuple[Columns, Columns, int | None]:
    """(train, val, number of classes when the target is a ClassLabel)."""
    train_table, val_table = _tables(name)
    chosen_inputs, chosen_target = _columns(name, train_table.column_names, inputs, target)
    classes = getattr(train_table.features.get(chosen_target), "num_classes", None) if chosen_target else None
    train_rows = formatted(train_table, chosen_inputs, chosen_target)
    if val_table is None:
        train_part, val_part = strided_split(len(train_table), val_fraction)
        val_rows = train_rows
    else:
        _columns(name + " (validation)", val_table.column_names, ",".join(chosen_inputs), chosen_target)
        train_part, val_part = HeldOut(len(train_table)), HeldOut(len(val_table))
        val_rows = formatted(val_table, chosen_inputs, chosen_target)
    return (Columns(train_rows, chosen_inputs, chosen_target, train_part),
            Columns(val_rows, chosen_inputs, chosen_target, val_part), classes)


def whole(name: str, inputs: str | None, target: str | None) -> Dataset:
    """Every row in the data's own order (train before validation where they are apart)."""
    tables = [table for table in _tables(name) if table is not None]
    chosen_inputs, chosen_target = _columns(name, tables[0].column_names, inputs, target)
    parts = [Columns(formatted(table, chosen_inputs, chosen_target), chosen_inputs, chosen_target,
                     HeldOut(len(table))) for table in tables]
    return parts[0] if len(parts) == 1 else ConcatDataset(parts)


def _tables(name: str) -> tuple[Any, Any | None]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"data '{name}' is a Hugging Face data set, which needs the datasets package: "
                        "pip install 'hvdtrain[hf]'") from None
    if not Path(name).exists():
        raise UserError(f"data '{name}' does not exist: check data.name (--data)")
    try:
        if name.endswith(".arrow"):
            return datasets.Dataset.from_file(name), None
        if name.endswith(".parquet"):
            return datasets.Dataset.from_parquet(name), None
        loaded = datasets.load_from_disk(name)
    except Exception as err:  # noqa: BLE001 - OSError, ValueError, pyarrow's and datasets' own errors alike
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"data '{name}' could not be read by datasets ({first}): check that it was written by "
                        "save_to_disk, or is an .arrow or .parquet file") from err
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise UserError(f"data '{name}' has splits {', '.join(loaded)} but no 'train': save the training split "
                            "as 'train'")
        val = next((split for split in VAL_SPLITS if split in loaded), None)
        return loaded["train"], loaded[val] if val else None
    return loaded, None


def _columns(name: str, available: list[str], inputs: str | None, target: str | None) -> tuple[list[str], str | None]:
    if target is None:
        target = next((column for column in ("label", "labels") if column in available), None)
    chosen = [column.strip() for column in inputs.split(",")] if inputs else [c for c in available if c != target]
    for column in [*chosen, *([target] if target else [])]:
        if column not in available:
            raise UserError(f"data '{name}' has no column '{column}' (it has {', '.join(available)}): "
                            "choose with data.input_columns and data.target_column")
    if not chosen:
        raise UserError(f"data '{name}' has no input column besides its target '{target}': set data.input_columns")
    return chosen, target
