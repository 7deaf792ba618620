"""An `.npz` file of arrays `x` (inputs) and `y` (targets), read whole into memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hvdtrain.config import DataConfig
from hvdtrain.data.sources.tensors import InMemory
from hvdtrain.errors import UserError


class NpzFile(InMemory):
    """Integer targets stay integers (classification); any others become float32 (regression,
    multilabel). Without `need_targets`, the file may hold only `x`."""

    def claims(self, name: str) -> bool:
        return name.endswith(".npz")

    def tensors(self, cfg: DataConfig, seed: int, need_targets: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        path = Path(cfg.name)
        if not path.is_file():
            raise UserError(f"data file '{path}' does not exist: check data.name (--data)")
        try:
            with np.load(path, allow_pickle=False) as arrays:
                missing = [k for k in ("x", "y") if k not in arrays.files and (need_targets or k == "x")]
                if missing:
                    raise UserError(
                        f"data file '{path}' has no array {' or '.join(repr(k) for k in missing)} "
                        f"(it has {', '.join(arrays.files) or 'none'}): save it with np.savez(path, x=inputs, y=labels)"
                    )
                x, y = arrays["x"], arrays["y"] if "y" in arrays.files else None
        except (OSError, ValueError) as err:
            raise UserError(f"data file '{path}' is not a readable .npz file ({err}): write it with np.savez") from err
        if not np.issubdtype(x.dtype, np.number):
            raise UserError(f"data file '{path}': x must be numeric, got dtype {x.dtype}")
        _require_finite(path, "x", x)
        inputs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        if y is None:
            return inputs, None
        if len(x) != len(y):
            raise UserError(f"data file '{path}': x has {len(x)} samples but y has {len(y)}: they must match")
        if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
            raise UserError(f"data file '{path}': y must hold class labels or numbers, got dtype {y.dtype}")
        _require_finite(path, "y", y)
        targets = y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else np.ascontiguousarray(y, dtype=np.float32)
        return inputs, torch.from_numpy(targets)


def _require_finite(path: Path, key: str, values: np.ndarray) -> None:
    """NaN or Inf in a data file would surface much later as a non-finite loss, blamed on the lr."""
    if not np.issubdtype(values.dtype, np.floating) or len(values) == 0:
        return
    bad = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    if bad.any():
        first = int(np.argmax(bad))
        raise UserError(f"data file '{path}': {key} holds NaN or Inf in {int(bad.sum())} of {len(values)} samples, "
                        f"the first at index {first}: clean or drop them (np.isfinite) before training")
