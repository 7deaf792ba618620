"""How batches reach the loop: DataLoader or one gather per batch for tensors, the number of worker
processes, and collate functions (`pad` for variable-length sequences, or the user's own)."""

from __future__ import annotations

import functools
import multiprocessing.util
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset, default_collate

from hvdtrain.data.augment import prepared
from hvdtrain.data.batch import to_device
from hvdtrain.engine.environment import available_cores
from hvdtrain.errors import users_code
from hvdtrain.factory import resolve_factory


def first_batch(dataset: Dataset, batch_size: int, collate: Callable[[list[Any]], Any] | None, stage: str,
                device: torch.device, channels_last: bool = False) -> Any:
    """The first batch of `dataset`, read in this process and made what the model sees on `device`; a
    failure of the user's Dataset or collate is one line naming it and where in their code (`stage`:
    training, evaluation, prediction, export)."""
    size = min(batch_size, len(dataset))  # type: ignore[arg-type]
    batch = users_code(f"the first {stage} batch (samples 0 to {size - 1}) could not be made",
                       lambda: next(iter(batches(dataset, [list(range(size))], 0, False, collate))), batching_hint)
    return prepared(dataset, to_device(batch, device, channels_last))


def batching_hint(err: BaseException) -> str:
    """`; what to do` where PyTorch's default collate could not make a batch of the samples; "" otherwise."""
    text = str(err)
    if "stack expects each tensor to be equal size" in text:
        return ("; samples of different shapes do not stack into a batch: pad sequences with --set data.collate=pad, "
                "or make batches with a function of yours (--set data.collate=package.module:function)")
    if "default_collate: batch must contain" in text:
        return ("; return tensors, arrays or numbers from your Dataset (an image: torchvision's PILToTensor, or "
                "torch.from_numpy(np.asarray(image)))")
    return ""


def data_workers(requested: int, dataset: Dataset, device_type: str, local_size: int) -> tuple[int, int]:
    """DataLoader workers per process, (training, validation): as asked, or a choice that keeps
    the cores for compute (`device_type`: the training's, 'cuda' or 'cpu'; `local_size`: processes on
    this host). Both loaders keep their workers alive across epochs, so they share one budget:
    validation (no backward, a fraction of the data) gets a quarter of it."""
    if requested >= 0:
        total = requested
    elif isinstance(dataset, TensorDataset) or device_type != "cuda" or getattr(dataset, "iterates", bool)():
        # In memory or CPU training: workers would only take cores from the compute; a user's
        # IterableDataset: each worker would iterate through the others' samples to reach its own.
        total = 0
    else:
        # dist: the host's cores are shared by its local processes; leave one for the main thread.
        total = max(0, min(4, available_cores() // local_size - 1))
    return total - total // 4, total // 4


def batches(dataset: Dataset, sampler: Sampler[list[int]] | list[list[int]], num_workers: int, pin_memory: bool,
            collate: Callable[[list[Any]], Any] | None = None, stop_signals: tuple[int, ...] = ()) -> Iterable:
    """Batches in the order `sampler` gives (an iterable that can be re-iterated each epoch).
    `stop_signals`: what the workers leave to their rank (run.stop_signals)."""
    if isinstance(dataset, TensorDataset) and num_workers == 0 and collate is None:
        return _TensorBatches(dataset.tensors, sampler, pin_memory)
    if num_workers > 0:
        dataset = _SeededInWorkers(dataset)
        # Each worker that sends a batch's storage makes a temporary directory for it, which a worker
        # killed on purpose (a stop, a failure: end_workers) leaves in /tmp. Made here, before the
        # workers start, it is theirs too, and this process removes it as it exits.
        multiprocessing.util.get_temp_dir()
    # A generator of its own: each new iterator draws a base seed for its workers, which from the
    # training's random state would shift dropout's draws by one after a resume inside an epoch.
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0, collate_fn=collate, generator=torch.Generator(),
                      worker_init_fn=functools.partial(_leave_to_the_rank, stop_signals) if stop_signals else None)


def end_workers(batches: Iterable, at_once: bool = False) -> None:
    """Ends the worker processes of a loader that `batches` made (they persist across epochs) now, as
    the loader's end would: a failed fit's loaders outlive its exception (in reference cycles with its
    frames), and their workers, which ignore the stop signals, kept the interpreter from exiting.
    `at_once` (a failure, a stop): killed, not waited for (a hung worker cost torch's shutdown 10 s)."""
    iterator = getattr(batches, "_iterator", None) if isinstance(batches, DataLoader) else None
    if iterator is None:
        return
    batches._iterator = None
    workers = list(getattr(iterator, "_workers", ()))
    try:
        if at_once:
            _forget_workers(iterator)
        else:  # torch's own shutdown: idle workers leave at once, a busy one after its batch
            iterator._shutdown_workers()
    finally:  # also where a second Ctrl-C cut the shutdown short: a worker left would hold the exit
        for worker in workers:
            if worker.is_alive():
                worker.kill()  # SIGTERM, torch's last word, is ignored by hvdtrain's workers
        for worker in workers:
            worker.join(5)


def _forget_workers(iterator: Any) -> None:
    """What torch's shutdown does for a loader's workers, without waiting for them: they are killed
    next. Taken off torch's SIGCHLD watch first, which would raise for a worker killed on purpose."""
    from torch.utils.data._utils import signal_handling

    iterator._shutdown = True  # the loader's own end does nothing more
    if getattr(iterator, "_worker_pids_set", False):
        signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False
    done = getattr(iterator, "_pin_memory_thread_done_event", None)
    if done is not None:
        done.set()  # the pin-memory thread (CUDA) ends at its next poll
    for queue in getattr(iterator, "_index_queues", ()):
        queue.cancel_join_thread()  # nothing will read what is left in them
        queue.close()


def _leave_to_the_rank(numbers: tuple[int, ...], worker_id: int) -> None:
    """A data-loader worker ignores the stop signals: Slurm sends one to every process of a step and a
    terminal to the whole group, and a worker dying of it would fail the run its rank is stopping with
    a checkpoint. The rank ends its workers itself."""
    import signal

    for number in numbers:
        signal.signal(number, signal.SIG_IGN)


def seed_generators(seed: int) -> None:
    """Seeds the random generators a data set or a model may draw from: torch's, numpy's, Python's."""
    import random

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def seeded_for_data(seed: int) -> None:
    """Before a data set is made, for fit, evaluate and predict alike: a factory that splits or shuffles
    with torch's, numpy's or Python's own generator (scikit-learn's train_test_split without random_state
    draws from numpy's) makes the same samples on every rank, and evaluate's `val` is fit's."""
    seed_generators(seed)


class _SeededInWorkers(Dataset):
    """The data set, as a data-loader worker loads it: seeded with the batch's own seed first
    (`sampler.SeededBatch`). The main process keeps its own random state, which a checkpoint
    saves and restores per rank."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        seed = getattr(indices, "seed", None)
        if seed is not None:
            seed_generators(seed)
        own = getattr(self.dataset, "__getitems__", None)
        return own(indices) if own is not None else [self.dataset[i] for i in indices]  # a StreamBatch kept whole


def collate_function(name: str | None, ignore_index: int, target_key: str) -> Callable[[list[Any]], Any] | None:
    """data.collate: None (PyTorch's default), `pad`, or the user's `package.module:function`."""
    if name is None:
        return None
    if name == "pad":
        return functools.partial(pad_collate, ignore_index=ignore_index, target_key=target_key)
    return resolve_factory(name, "collate")


def pad_collate(samples: list[Any], ignore_index: int = -100, target_key: str = "labels") -> Any:
    """A batch of variable-length sequences, each field padded to the longest in the batch.

    Targets (the last element of a tuple sample, the target key of a dict sample) are
    padded with `ignore_index`, so padding is never scored; inputs with 0. A sample that
    is one sequence becomes (input padded with 0, target padded with ignore_index), the
    form the language-model task reads.
    """
    first = samples[0]
    if isinstance(first, dict):
        return {key: _padded([s[key] for s in samples], ignore_index if key == target_key else 0) for key in first}
    if isinstance(first, (tuple, list)):
        last = len(first) - 1
        return tuple(_padded([s[i] for s in samples], ignore_index if i == last and last > 0 else 0)
                     for i in range(len(first)))
    return _padded(samples, 0), _padded(samples, ignore_index)


def _padded(values: list[Any], pad_value: int) -> Any:
    if not all(isinstance(v, (torch.Tensor, np.ndarray)) for v in values):
        return default_collate(values)
    tensors = [torch.as_tensor(v) for v in values]
    if all(t.shape == tensors[0].shape for t in tensors):
        return torch.stack(tensors)
    return pad_sequence(tensors, batch_first=True, padding_value=pad_value)


def gathers_only(batches: Iterable) -> bool:
    """Whether `batches` are gathered from tensors in memory (nothing random drawn, nothing read)."""
    return isinstance(batches, _TensorBatches)


class _TensorBatches:
    """One gather per batch instead of one `__getitem__` call and a collate per sample; with
    `pin_memory`, into pinned host memory, from which the copy to the GPU does not wait for it."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], sampler: Sampler[list[int]], pin_memory: bool = False):
        self.tensors, self.sampler, self.pin_memory = tensors, sampler, pin_memory

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for indices in self.sampler:
            index = torch.as_tensor(indices)
            yield tuple(self._gathered(t, index) for t in self.tensors)

    def _gathered(self, tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if not self.pin_memory or tensor.device.type != "cpu" or tensor.requires_grad:
            return tensor[index]  # a data set already on the GPU, or one index_select(out=) cannot write
        # Pageable memory would make the copy wait for the GPU's queue and go through a staging buffer;
        # torch's pinned-memory cache reuses the buffer once the copy from it has ended.
        out = torch.empty((len(index), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=True)
        return torch.index_select(tensor, 0, index, out=out)
