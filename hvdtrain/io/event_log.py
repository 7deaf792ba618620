"""TensorBoard event files in the run directory, written by rank 0 with TensorBoard's own writer.

    tensorboard --logdir runs          # every run, named by its directory

Per epoch: the training loss, every validation metric, the learning rate and samples/s,
at the run's optimizer step (so per-epoch and per-step points share one x axis). With
run.log_every N, also every N steps: what the training's step log reduced over ranks (the
training loss, the learning rate and samples/s since the last point).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from hvdtrain.io.atomic import WriteFailed

# Record keys that are counts or clocks, not curves worth a chart.
_NOT_CURVES = {"epoch", "epochs", "step", "world_size", "val_samples", "train_samples", "elapsed_s"}


class EventLog:
    """Rank 0's TensorBoard writer; on a resume, events past the checkpoint's step are purged."""

    def __init__(self, run_dir: Path, resumed_at_step: int):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: rank 0 only

        self.run_dir = run_dir
        _quiet_writer_thread()
        # Events after the checkpoint's step are replayed, so TensorBoard drops the old ones.
        with self._writing():
            self.writer = SummaryWriter(str(run_dir), purge_step=resumed_at_step + 1 if resumed_at_step else None,
                                        flush_secs=10)

    def epoch(self, record: dict[str, Any]) -> None:
        with self._writing():
            for key, value in record.items():
                if key not in _NOT_CURVES and isinstance(value, (int, float)):
                    self.writer.add_scalar(_tag(key), value, record["step"])
            self.writer.add_scalar("epoch", record["epoch"], record["step"])
            self.writer.flush()

    def steps(self, step: int, values: dict[str, float]) -> None:
        with self._writing():
            for key, value in values.items():
                self.writer.add_scalar(f"steps/{key}", value, step)

    def close(self) -> None:
        with self._writing():
            self.writer.close()

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """TensorBoard's writer thread's failed write (a full disk), raised again here: one line."""
        try:
            yield
        except OSError as err:
            raise WriteFailed.of(self.run_dir / "events.out.tfevents.*", err) from err


def _quiet_writer_thread() -> None:
    """TensorBoard's writer thread's failed write is raised again in the thread that writes next (one
    line, above): its own traceback, printed as the thread ends, is left out."""
    import threading

    before = threading.excepthook
    if getattr(before, "hvdtrain_quiet", False):
        return

    def hook(args: Any) -> None:
        if not (issubclass(args.exc_type, OSError) and type(args.thread).__module__.startswith("tensorboard.")):
            before(args)

    hook.hvdtrain_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _tag(key: str) -> str:
    """`val_acc` -> `val/acc`: TensorBoard groups the charts by what comes before the slash."""
    head, _, tail = key.partition("_")
    return f"{head}/{tail}" if head in ("train", "val") and tail else key
