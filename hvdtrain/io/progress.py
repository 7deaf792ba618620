"""What rank 0 shows a person: a progress bar per epoch and one line per epoch."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

import torch
from tqdm import tqdm


def bar_stream(mode: str) -> TextIO | None:
    """Where rank 0's bar goes, or None for no bar.

    `auto` shows it only where a person watches. Launchers pipe a rank's output, so
    a terminal shows up elsewhere: mpirun gives rank 0 a pty as stdout, and
    horovodrun leaves the user's terminal on stdin. Logs and CI get no bar.
    """
    if mode == "off":
        return None
    if mode == "bar" or sys.stderr.isatty() or _is_tty(0):
        return sys.stderr
    return sys.stdout if sys.stdout.isatty() else None


def _is_tty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


class EpochProgress:
    """Rank 0's bar for one epoch; a no-op elsewhere or when switched off."""

    # Reading the loss waits for the device; do it at most this often (in steps).
    LOSS_EVERY = 10

    def __init__(self, stream: TextIO | None, epoch: int, epochs: int, steps: int, first_step: int):
        self.first_step = first_step
        self.bar = tqdm(total=steps, desc=f"epoch {epoch}/{epochs}", unit="step", leave=False,
                        dynamic_ncols=True, file=stream) if stream is not None else None

    def step(self, step: int, loss: torch.Tensor) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        if (step - self.first_step) % self.LOSS_EVERY == 1:
            self.bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def epoch_line(record: dict[str, Any]) -> str:
    """Rank 0's line per epoch: the training loss and every validation metric."""
    metrics = "  ".join(f"{key} {value:.4f}" for key, value in record.items()
                        if key == "train_loss" or (key.startswith("val_") and key != "val_samples"))
    slow = f"  slow: {record['stragglers']}" if record.get("stragglers") else ""
    return (f"epoch {record['epoch']}/{record['epochs']}  {metrics}  "
            f"{record['train_samples_per_s']:,.0f} samples/s  {record['elapsed_s']:.1f}s{slow}")


def mib(nbytes: int) -> str:
    """Bytes in the unit that reads best (KiB, MiB, GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def say(message: str, err: bool = False) -> None:
    """A line for the user on stdout (`err`: stderr), flushed so launchers forward it at once, and in one
    write: a launcher tags each piece it reads, and print's text and newline are two writes where the
    stream writes through (PYTHONUNBUFFERED, which horovodrun sets; a script's own streams are left so)."""
    stream = sys.stderr if err else sys.stdout
    stream.write(f"{message}\n")
    stream.flush()
