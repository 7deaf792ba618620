"""Step arithmetic, in one place: samples per optimizer step, steps per epoch, the step number of a place
in the run and the place of a step.

dist: steps count steps of the current global batch (every rank's batch x train.accumulate). On
another number of processes a resumed run's step number, and with it the learning-rate schedule, goes
on from where the run is in samples, not from the old step count.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvdtrain.data.sampler import TrainingSampler


@dataclass(frozen=True)
class StepCount:
    per_epoch: int
    """Optimizer steps in a whole epoch."""
    samples: int
    """dist: samples of all ranks in one optimizer step."""
    accumulate: int
    """Batches of each rank in one optimizer step (train.accumulate)."""

    @classmethod
    def of(cls, sampler: TrainingSampler, accumulate: int) -> "StepCount":
        """Of a sampler at an epoch's start, whole."""
        return cls(len(sampler) // accumulate, sampler.global_batch * accumulate, accumulate)

    def left(self, sampler: TrainingSampler) -> int:
        """Optimizer steps left in the epoch the sampler has begun."""
        return len(sampler) // self.accumulate

    def at(self, epoch: int, position: int) -> int:
        """The step number after `epoch` whole epochs and `position` samples of the next one's order."""
        return epoch * self.per_epoch + position // self.samples

    def position(self, start: int, steps: int) -> int:
        """The place in an epoch's order `steps` optimizer steps after global position `start`."""
        return start + steps * self.samples
