"""Training batches on the device, the next one loaded while the current step computes.

On a GPU the loop would otherwise load batch k+1 only after step k's optimizer step, which waits on
the device (the finite-gradient check, the allreduce): the GPU idles while the host gathers the
batch. Here the loop calls `stage()` once its backward pass is queued: the next batch is gathered
and its copy to the GPU queued then, while the GPU still runs the backward pass.

Loading ahead is done only where it cannot change what the run computes: in-memory tensors (a
gather) and DataLoader workers (each batch seeded by its own position). A data set loaded in the
training process may draw from the random state that dropout draws from, and a checkpoint keeps
that state as of its step; those batches load when the loop asks for them, as before. A batch that
fails to load early fails when the loop asks for it, so the step before it ends as it would have.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader

from hvdtrain.data.batch import to_device
from hvdtrain.data.loading import gathers_only
from hvdtrain.engine.activity import DATA_LOADING

_END = object()
TO_DEVICE = "batch to device"


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class DeviceBatches:
    """(batch as loaded, batch on the device) pairs, in order; `stage()` loads the next one early.
    `doing` hears of each phase (engine.doing): a batch's wait is `data loading`, and the work on it
    until its forward pass is `batch to device`, whether it was loaded early or not."""

    def __init__(self, batches: Iterable, device: torch.device, channels_last: bool,
                 doing: Callable[[str], Any] = lambda phase: None, ahead: bool | None = None):
        self.batches, self.device, self.channels_last, self.doing = batches, device, channels_last, doing
        # On a CPU the step and the loading share the cores: nothing to overlap.
        self.ahead = (device.type == "cuda" and loads_apart_from_training(batches)) if ahead is None else ahead
        self._source: Iterator[Any] | None = None
        self._staged: Any = None

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        self._source, self._staged = iter(self.batches), None
        while True:
            if self._staged is None:
                self._load()
            else:  # loaded ahead: the phases are those of a batch loaded now
                self.doing(DATA_LOADING if self._staged is _END else TO_DEVICE)
            staged, self._staged = self._staged, None
            if staged is _END:
                return
            if isinstance(staged, _Failed):
                raise staged.error
            yield staged

    def stage(self) -> None:
        """Loads the next batch now, if loading ahead is safe and it is not loaded yet."""
        if self.ahead and self._staged is None and self._source is not None:
            left = self.doing(DATA_LOADING)
            try:
                self._load()
            except Exception as error:  # raised when the loop asks for this batch
                self._staged = _Failed(error)
            self.doing(left)

    def _load(self) -> None:
        self.doing(DATA_LOADING)
        loaded = next(self._source, _END)  # type: ignore[arg-type]
        if loaded is _END:
            self._staged = _END
            return
        self.doing(TO_DEVICE)
        self._staged = (loaded, to_device(loaded, self.device, self.channels_last))


def loads_apart_from_training(batches: Iterable) -> bool:
    """Whether loading a batch draws nothing from the training process's random state."""
    return gathers_only(batches) or (isinstance(batches, DataLoader) and batches.num_workers > 0)
