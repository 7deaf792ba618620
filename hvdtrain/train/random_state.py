"""Each rank's random states: seeded per epoch and rank, captured in a checkpoint written inside an
epoch and put back on resume, so that dropout and augmentation in the rank's own process (torch's,
numpy's or Python's) draw after a resume exactly what they would have drawn."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from hvdtrain.data.loading import seed_generators


def seed_epoch(seed: int, epoch: int, rank: int) -> None:
    # Per epoch and rank, so dropout and augmentation (torch's, numpy's or Python's, in this process)
    # replay exactly after a resume.
    seed_generators(seed * 1_000_003 + epoch * 1_009 + rank)  # dist: each rank draws its own


def rng_state() -> dict[str, Any]:
    """This process's random states (torch, CUDA, numpy, Python), as tensors and numbers only, so a
    checkpoint holding them still loads with weights_only=True."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["position"],
                         saved["has_gauss"], saved["gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
