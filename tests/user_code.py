"""A user's own data set and model, as `tests.user_code:...` factories would be written."""

import torch
from torch import nn
from torch.utils.data import Dataset


class Blobs(Dataset):
    """A plain map-style Dataset, not a TensorDataset: it goes through a DataLoader."""

    classes = ["a", "b", "c"]

    def __init__(self, n: int = 300):
        generator = torch.Generator().manual_seed(0)
        self.y = torch.randint(0, 3, (n,), generator=generator)
        self.x = torch.randn(n, 5, generator=generator) * 0.3 + self.y[:, None].float()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def _say_stuck() -> None:
    """Creates the file HVDTRAIN_TEST_STUCK_FILE names, if any: a test learns when a rank got stuck."""
    import os

    if os.environ.get("HVDTRAIN_TEST_STUCK_FILE"):
        open(os.environ["HVDTRAIN_TEST_STUCK_FILE"], "w").close()


def _rank() -> int:
    """This process's rank as its launcher set it (horovodrun, mpirun or torchrun), 0 alone."""
    from hvdtrain.engine import launcher_rank

    return launcher_rank() or 0


def blobs():
    return Blobs()


def blobs_split():
    return Blobs(240), Blobs(60)


def downloaded_digits(root):
    """The digits as a torchvision data set with download=True gets its data: fetched into `root` unless
    an intact copy is there, in chunks straight into the file (as torchvision writes it), then checked,
    and "corrupted" where it is not intact. Each fetch adds a line to root/fetches.log, and each call its
    start and end times to root/calls.log."""
    import hashlib
    import io
    import os
    import time
    from pathlib import Path

    import numpy as np
    from sklearn.datasets import load_digits

    began = time.time()
    digits = load_digits()
    payload = io.BytesIO()
    np.savez(payload, x=digits.data.astype(np.float32) / 16, y=digits.target)
    payload = payload.getvalue()
    archive = Path(root) / "digits.npz"

    def intact() -> bool:
        return archive.is_file() and hashlib.sha256(archive.read_bytes()).digest() == hashlib.sha256(payload).digest()

    if not intact():
        archive.parent.mkdir(parents=True, exist_ok=True)
        with open(archive.parent / "fetches.log", "a") as log:
            log.write(f"{os.getpid()}\n")
        with open(archive, "wb") as out:
            for start in range(0, len(payload), 1 << 16):  # a slow network
                out.write(payload[start:start + (1 << 16)])
                out.flush()
                time.sleep(0.2)
    if not intact():
        raise RuntimeError("Dataset not found or corrupted. You can use download=True to download it")
    with open(archive.parent / "calls.log", "a") as log:
        log.write(f"{began} {time.time()}\n")
    arrays = np.load(archive)
    order = torch.randperm(len(arrays["y"]), generator=torch.Generator().manual_seed(0))
    x, y = torch.from_numpy(arrays["x"])[order], torch.from_numpy(arrays["y"])[order]
    split = len(y) * 4 // 5
    x = (x - x[:split].mean(0)) / (x[:split].std(0) + 1e-3)
    return torch.utils.data.TensorDataset(x[:split], y[:split]), torch.utils.data.TensorDataset(x[split:], y[split:])


def tiny_net(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 16), nn.Tanh(), nn.Linear(16, num_classes))


def net_sized_by_rank(input_shape, num_classes):
    """A mistake: a model sized from what each rank reads itself (a vocabulary from its own files),
    here wider on rank 1."""
    width = 16 + 8 * _rank()
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], width), nn.Tanh(), nn.Linear(width, num_classes))


def not_a_model():
    return 42


def raises_on_import_of_missing():
    import not_installed_anywhere  # noqa: F401


def fails_on_one_rank():
    """Like a data file present on one host but not another: only rank 1 fails."""
    rank = _rank()
    if rank == 1:
        raise FileNotFoundError("/data/shard-1 is missing on this host")
    return Blobs()


def split_by_the_global_generators():
    """A split as scikit-learn's train_test_split without random_state draws it (numpy's generator),
    shuffled again by torch's and Python's: the same wherever those are seeded alike."""
    import random

    import numpy as np
    from torch.utils.data import Subset

    data = Blobs()
    order = np.random.permutation(len(data))[torch.randperm(len(data))].tolist()
    random.shuffle(order)
    train, val = Subset(data, order[:240]), Subset(data, order[240:])
    train.classes = val.classes = data.classes
    return train, val


def shuffled_by_a_generator_of_its_own(digits=False):
    """Samples in an order drawn from a generator seeded by the operating system: another on each rank.
    Blobs, or with `digits` scikit-learn's digits as the built-in `digits` holds them (for its model)."""
    import numpy as np
    from torch.utils.data import Subset

    data = Blobs()
    if digits:
        from hvdtrain.config import DataConfig
        from hvdtrain.data.sources import build_part

        data = build_part(DataConfig(name="digits"), 0, "labels", "all")
        data.classes = [str(digit) for digit in range(10)]
    shuffled = Subset(data, np.random.default_rng().permutation(len(data)).tolist())
    shuffled.classes = data.classes
    return shuffled


def tensors():
    """A factory returning plain TensorDatasets: the class count comes from the labels."""
    from torch.utils.data import TensorDataset

    x = torch.randn(100, 4)
    return TensorDataset(x[:80], (x[:80, 0] > 0).long()), TensorDataset(x[80:], (x[80:, 0] > 0).long())


def uneven_by_rank():
    """Rank 1 sees more data than rank 0 (a per-host shard of another size): batch counts differ."""
    rank = _rank()
    return Blobs(200 + 200 * rank), Blobs(40)


class NaNOnRankOne(nn.Module):
    """Its output turns NaN on rank 1 at the 7th training forward pass."""

    def __init__(self, input_shape, num_classes):
        import math
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))
        self.rank = _rank()
        self.calls = 0

    def forward(self, x):
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.rank == 1 and self.calls == 7:
                out = out * float("nan")
        return out


def nan_on_rank_one(input_shape, num_classes):
    return NaNOnRankOne(input_shape, num_classes)


class _Paced(nn.Module):
    """Waits a little in each training forward pass, as a larger model would compute.

    With HVDTRAIN_TEST_HOLD=HOST:N in its environment, the worker on that host (Horovod's
    HOROVOD_HOSTNAME) stops in its Nth training forward pass until it is killed, after
    creating the file HVDTRAIN_TEST_HOLD_FILE: a test can then kill it at a known step
    instead of guessing from the clock.
    """

    def __init__(self, inner: nn.Module, seconds: float):
        import os

        super().__init__()
        self.inner, self.seconds, self.forwards = inner, seconds, 0
        host, _, count = os.environ.get("HVDTRAIN_TEST_HOLD", "").partition(":")
        held_here = host and host == os.environ.get("HOROVOD_HOSTNAME")
        self.hold_at = int(count) if held_here else None

    def forward(self, x):
        if self.training:
            import os
            import time

            self.forwards += 1
            if self.forwards == self.hold_at:
                open(os.environ["HVDTRAIN_TEST_HOLD_FILE"], "w").close()
                while True:
                    time.sleep(1)
            time.sleep(self.seconds)
        return self.inner(x)


def paced_mlp(input_shape, num_classes):
    """The built-in MLP at about 20 steps/s, so that a test can act while it trains."""
    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    return _Paced(build_model(ModelConfig(name="mlp"), input_shape, num_classes), 0.05)


class _StuckOnRank(nn.Module):
    """One rank never finishes its fifth training forward pass (step 5), as a deadlocked model would."""

    def __init__(self, inner: nn.Module, rank: int):
        super().__init__()
        self.inner, self.rank, self.calls = inner, rank, 0

    def forward(self, x):
        import time

        if self.training and _rank() == self.rank:
            self.calls += 1
            if self.calls == 5:
                _say_stuck()
            while self.calls >= 5:
                time.sleep(1)  # a rank stuck in its forward
        return self.inner(x)


def stuck_on_rank_1(input_shape, num_classes):
    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    return _StuckOnRank(build_model(ModelConfig(name="mlp"), input_shape, num_classes), 1)


def stuck_on_rank_0(input_shape, num_classes):
    """Rank 0 itself stuck: the stall is reported by rank 0's report thread, asked by rank 1."""
    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    return _StuckOnRank(build_model(ModelConfig(name="mlp"), input_shape, num_classes), 0)


def stream():
    """A pair of IterableDatasets without a length."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            for _ in range(100):
                yield torch.randn(4), torch.tensor(0)

    return Stream(), Stream()


# --- tasks ------------------------------------------------------------------------


def _tensor_split(x, y, val=60):
    from torch.utils.data import TensorDataset

    return TensorDataset(x[val:], y[val:]), TensorDataset(x[:val], y[:val])


def regression_data():
    """Two float targets per sample, a noisy linear function of six features."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(300, 6, generator=generator)
    y = x @ torch.randn(6, 2, generator=generator) + 0.1 * torch.randn(300, 2, generator=generator) + 3.0
    return _tensor_split(x, y)


def multilabel_data():
    """Four 0/1 labels per sample."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(300, 6, generator=generator)
    return _tensor_split(x, (x @ torch.randn(6, 4, generator=generator) > 0).float())


def sequences():
    """Token sequences of a simple rule (t+1 = 3t + 1 mod 16) from random starts, alone in each sample."""
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 16, (320,), generator=generator)]
    for _ in range(11):
        tokens.append((tokens[-1] * 3 + 1) % 16)
    ids = torch.stack(tokens, dim=1)
    return TensorDataset(ids[60:]), TensorDataset(ids[:60])


def bigram_lm():
    return nn.Sequential(nn.Embedding(16, 16), nn.Linear(16, 16))


def three_logits(input_shape, num_classes):
    """A model with fewer outputs than the labels reach (digits has 10 classes)."""
    import math

    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 3))


class _BlobsReshaped(Dataset):
    """Blobs' samples in another form (`sample(x, y)`), without Blobs' attributes."""

    def __init__(self):
        self.inner = Blobs()

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.sample(*self.inner[index])


class IntLabels(_BlobsReshaped):
    """Plain int labels and no `classes` attribute: the class count cannot be read off."""

    def sample(self, x, y):
        return x, int(y)


def int_labels():
    return IntLabels()


class Weighted(_BlobsReshaped):
    """(input, label, weight): the last item, the weight, is taken as the target."""

    classes = Blobs.classes

    def sample(self, x, y):
        return x, y, torch.tensor(1.0)


def weighted():
    return Weighted()


def generators():
    """(train, val) as generators of samples: they can be read once, not every epoch."""
    blobs = Blobs()
    return (blobs[i] for i in range(240)), (blobs[i] for i in range(240, 300))


def _x_and_y(samples: int = 64) -> tuple:
    """Numpy arrays, as a user loads them."""
    x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(0))
    return x.numpy(), (x[:, 0] > 0).long().numpy()


def keras_arrays():
    """(x, y) as Keras' fit takes them: not a (train, val) pair of data sets."""
    return _x_and_y()


def arrays_pair():
    """A (train, val) pair of (x, y) arrays each."""
    return _x_and_y(64), _x_and_y(16)


class NamedLabels(torch.utils.data.Dataset):
    """Samples whose targets are class names, as a CSV's label column reads."""

    def __init__(self):
        x, y = _x_and_y()
        self.samples = [(torch.as_tensor(row), ("cat", "dog")[label]) for row, label in zip(x, y)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


class Pictures(torch.utils.data.Dataset):
    """torchvision's ImageFolder without a transform: PIL images."""

    classes = ["a", "b"]

    def __len__(self):
        return 32

    def __getitem__(self, index):
        from PIL import Image

        return Image.new("RGB", (8, 8), (index, 0, 0)), index % 2


def names_to_indices(samples):
    """A collate that makes NamedLabels' class names numbers itself."""
    inputs, names = zip(*samples)
    return torch.stack(inputs), torch.tensor([("cat", "dog").index(name) for name in names])


def split_dict():
    """Splits by name, as Hugging Face's load_dataset gives them: not a (train, val) pair."""
    return {name: torch.utils.data.TensorDataset(*map(torch.as_tensor, _x_and_y(n)))
            for name, n in (("train", 64), ("test", 16), ("validation", 16))}


def three_splits():
    """train, val and test: one too many."""
    return tuple(split_dict().values())


def loaders_pair():
    """A (train, val) pair of DataLoaders: hvdtrain makes the loaders itself."""
    train, val = (torch.utils.data.TensorDataset(*map(torch.as_tensor, _x_and_y(n))) for n in (64, 16))
    return torch.utils.data.DataLoader(train, batch_size=8), torch.utils.data.DataLoader(val, batch_size=8)


def ddp_mlp(input_shape, num_classes):
    """The built-in mlp in DistributedDataParallel, as a script written for DDP builds it: hvdtrain takes it off."""
    from hvdtrain.models import mlp

    return nn.parallel.DistributedDataParallel(mlp(input_shape, num_classes))


def data_parallel_net(input_shape, num_classes):
    """tiny_net in DataParallel, as a script written for one process and several GPUs builds it."""
    return nn.DataParallel(tiny_net(input_shape, num_classes))


def wrapped_optimizer(model, lr):
    """SGD in the distributed optimizer of the library that is started, as a script written for it has it:
    Horovod's DistributedOptimizer (also where neither is, as a Horovod script has it), or torch's
    ZeroRedundancyOptimizer."""
    import torch.distributed

    if torch.distributed.is_initialized():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=lr)
    import horovod.torch as hvd

    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), named_parameters=model.named_parameters())


def compiled_data_parallel(input_shape, num_classes):
    """torch.compile around DataParallel, as torch's documentation has it for DDP."""
    return torch.compile(data_parallel_net(input_shape, num_classes), backend="eager")


def compiled_net(input_shape, num_classes):
    """A factory that compiles its model itself (the eager backend: no compiler needed)."""
    return torch.compile(tiny_net(input_shape, num_classes), backend="eager")


class VocabularyNet(nn.Module):
    """A model with extra state in its state dict (get_extra_state), as a vocabulary or a version is kept;
    HVDTRAIN_TEST_EXTRA_STATE=object: one that is not JSON; =empty: built without one, which its forward
    refuses (only extra state set from a file makes it work)."""

    def __init__(self, input_shape, num_classes):
        import os

        super().__init__()
        self.net = tiny_net(input_shape, num_classes)
        built = os.environ.get("HVDTRAIN_TEST_EXTRA_STATE")
        self.vocabulary = {"words": {"a", "b"} if built == "object" else [] if built == "empty" else ["a", "b"]}

    def get_extra_state(self):
        return self.vocabulary

    def set_extra_state(self, state):
        self.vocabulary = state

    def forward(self, x):
        if not self.vocabulary["words"]:
            raise ValueError("no vocabulary: the extra state was not set")
        return self.net(x)


def half_net(input_shape, num_classes):
    """Built in float16, as `.half()` makes it, for float32 data."""
    return tiny_net(input_shape, num_classes).half()


def double_net(input_shape, num_classes):
    """Built in float64, as `.double()` makes it, for float32 data."""
    return tiny_net(input_shape, num_classes).double()


def meta_net(input_shape, num_classes):
    """Built on the meta device (shapes without values), as for a large model's deferred initialisation."""
    with torch.device("meta"):
        return tiny_net(input_shape, num_classes)


def needs_num_classes(input_shape, num_classes):
    return tiny_net(input_shape, num_classes)


class _Ragged(_BlobsReshaped):
    """Inputs of two lengths, and no collate to pad them."""
    classes = Blobs.classes

    def sample(self, x, y):
        return x[: 4 + int(y) % 2], y


def ragged():
    return _Ragged()


class _Float64(_BlobsReshaped):
    """Inputs as NumPy makes them by default."""
    classes = Blobs.classes

    def sample(self, x, y):
        return x.double().numpy(), y


def float64_blobs():
    return _Float64()


class Picture:
    """Not a tensor, an array or a number: what an image library's image is to PyTorch's collate."""


class _Pictures(_BlobsReshaped):
    classes = Blobs.classes

    def sample(self, x, y):
        return Picture(), y


def pictures():
    return _Pictures()


class _FirstSampleFails(_BlobsReshaped):
    classes = Blobs.classes

    def sample(self, x, y):
        return {"image": x}["pixels"], y


def first_sample_fails():
    return _FirstSampleFails()


class _CorruptLate(Dataset):
    """Digits-shaped samples whose record 150 is corrupt: met in the third batch of 64."""
    classes = list(range(10))

    def __len__(self):
        return 200

    def __getitem__(self, index):
        if index == 150:
            raise ValueError(f"corrupt record {index}")
        return torch.zeros(1, 8, 8), index % 10


def corrupt_late():
    return _CorruptLate()


class CorruptOnRankOne(Blobs):
    """Rank 1 finds a corrupt record partway into the first epoch: the 30th read of this copy, the
    process's or a data-loader worker's (2 workers read about 56 samples each in an epoch of batches of 16)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        if _rank() == 1 and self.reads == 30:
            raise OSError(f"corrupt record {index} in /data/part-1.bin")
        return super().__getitem__(index)


class WorkerKilledOnRankOne(Blobs):
    """Rank 1's data-loader worker is killed (SIGKILL, as the out-of-memory killer sends it) at its 40th read,
    in the third batch, which it loads while rank 1 waits in the gradient allreduce for a slow rank 0."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __getitem__(self, index):
        import os
        import signal
        import time

        self.reads += 1
        if _rank() == 1 and self.reads == 40 and torch.utils.data.get_worker_info() is not None:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


def worker_killed_on_rank_one():
    return WorkerKilledOnRankOne()


class _SlowOnRankZero(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if self.training and _rank() == 0:
            import time

            time.sleep(1.5)
        return self.inner(x)


def slow_on_rank_zero(input_shape, num_classes):
    """Rank 0 takes 1.5 s over each training step: the other ranks wait for it in the allreduce."""
    return _SlowOnRankZero(tiny_net(input_shape, num_classes))


def corrupt_on_rank_one():
    return CorruptOnRankOne()


class DictBlobs(_BlobsReshaped):
    """Dict samples whose target is under 'y', not the default 'labels'."""

    classes = Blobs.classes

    def sample(self, x, y):
        return {"x": x, "y": y}


def dict_blobs():
    return DictBlobs()


class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = tiny_net((5,), 3)

    def forward(self, x):
        return self.net(x)


def dict_net():
    return DictNet()


class OwnLoss(nn.Module):
    """Computes its own loss when given labels, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.net = tiny_net((5,), 3)

    def forward(self, x, y=None):
        logits = self.net(x)
        if y is None:
            return logits
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "logits": logits}


def own_loss():
    return OwnLoss()


class OnlyLoss(OwnLoss):
    """Returns nothing but its loss, a scalar tensor."""

    def forward(self, x, y=None):
        return torch.nn.functional.cross_entropy(self.net(x), y)


def only_loss():
    return OnlyLoss()


def per_sample_loss(output, target):
    """A loss that forgot to reduce."""
    return torch.nn.functional.cross_entropy(output, target, reduction="none")


def log_of_zero_loss(output, target):
    return torch.log(torch.zeros(())) * output.sum()


def in_place_loss(output, target):
    """Trains: the output is no leaf in training, and an in-place operation on it is allowed."""
    return torch.nn.functional.cross_entropy(output.div_(2.0), target)


def nested_output_loss(output, target):
    """For a model returning ((logits, aux), hidden)."""
    (logits, _aux), _hidden = output
    return torch.nn.functional.cross_entropy(logits, target)


def detached_loss(output, target):
    """A loss taken off the graph, as `.detach()` or a tensor made from `.item()` leaves it."""
    return torch.nn.functional.cross_entropy(output, target).detach()


class _CrossEntropy:
    def loss(self, output, target):
        return torch.nn.functional.cross_entropy(output, target)


class CrossEntropyOfMyOwn(_CrossEntropy):
    """A user's own task with a loss only: the same shapes as classification, another task."""


class MeanMetrics(_CrossEntropy):
    """Reports a mean instead of (sum, count): cannot be summed exactly across ranks."""

    def metrics(self, output, target):
        return {"acc": (output.argmax(1) == target).float().mean()}


class OnlyMetrics:
    """No loss, and the model gives none either."""

    def metrics(self, output, target):
        return {"acc": ((output.argmax(1) == target).sum(), len(target))}


class F1WithoutDirection(_CrossEntropy):
    """A metric whose direction hvdtrain cannot know (no `maximize`)."""

    def metrics(self, output, target):
        return {"hits": ((output.argmax(1) == target).sum(), len(target))}


class _BlowUpGradient(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by 1e6, so that in fp16 it overflows
    (inf) and the gradient scaler skips the step and halves its scale."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e6


class _SignalsItself(nn.Module):
    """The built-in MLP (with dropout, so that a resume is exact only with the random states restored)
    that, given HVDTRAIN_TEST_SIGNAL=RANK:N:SIGNAL, sends SIGNAL to its own process in its Nth training
    forward pass on that rank (RANK `all`: every rank; N `vK`: its Kth evaluation forward pass), as a
    scheduler would at that moment (RANK:N:SIGNAL:workers: to its data-loader workers first; RANK:N:SIGNAL:terminal:
    instead to the process group whose id is in the file HVDTRAIN_TEST_TERMINAL, as a terminal's Ctrl-C reaches
    the launcher in front of it). HVDTRAIN_TEST_OVERFLOW=N: rank 1's gradient overflows in fp16 in its
    Nth training forward pass.
    HVDTRAIN_TEST_DROPOUT sets the dropout (0: none, for runs compared across world sizes);
    HVDTRAIN_TEST_EXIT_SIGNAL as `_signal_at_exit`."""

    def __init__(self, inner: nn.Module):
        import os

        super().__init__()
        _signal_at_exit()
        self.inner, self.dropout, self.forwards = inner, nn.Dropout(float(os.environ.get("HVDTRAIN_TEST_DROPOUT", 0.2))), 0
        rank, count, name, *also = (os.environ.get("HVDTRAIN_TEST_SIGNAL", "") or "-1:0:SIGTERM").split(":")
        self.to_workers = also == ["workers"]  # its data-loader workers get it first, as Slurm signals them all
        self.to_terminal = also == ["terminal"]
        # A worker torchrun started again (--max-restarts) after this signal ended the first: not again.
        mine = rank in ("all", str(_rank())) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        # N counts training forward passes; vN evaluation ones.
        self.signal_at = int(count) if mine and not count.startswith("v") else None
        self.signal_in_evaluation = int(count[1:]) if mine and count.startswith("v") else None
        self.signal_name, self.evaluations, self.slowed = name, 0, False

    def forward(self, x):
        import os
        import signal

        if self.training:
            self.forwards += 1
            if self.forwards == self.signal_at:
                if self.to_workers:
                    import psutil

                    for child in psutil.Process().children():
                        os.kill(child.pid, getattr(signal, self.signal_name))
                if self.to_terminal:
                    with open(os.environ["HVDTRAIN_TEST_TERMINAL"]) as group:
                        os.killpg(int(group.read()), getattr(signal, self.signal_name))
                else:
                    os.kill(os.getpid(), getattr(signal, self.signal_name))
            if str(self.forwards) == os.environ.get("HVDTRAIN_TEST_OVERFLOW") and _rank() == 1:
                return _BlowUpGradient.apply(self.inner(self.dropout(x)))
        else:
            self.evaluations += 1
            if self.evaluations == self.signal_in_evaluation:
                os.kill(os.getpid(), getattr(signal, self.signal_name))
        return self.inner(self.dropout(x) if x.is_floating_point() else x)

    def state_dict(self, *args, **kwargs):
        """With HVDTRAIN_TEST_SLOW_SAVE=SECONDS:PATH, rank 0's first checkpoint takes SECONDS longer
        (a slow file system); PATH appears when it begins."""
        import os
        import time

        slow = os.environ.get("HVDTRAIN_TEST_SLOW_SAVE")
        if slow and self.forwards and _rank() == 0 and not self.slowed:
            seconds, path = slow.split(":", 1)
            self.slowed = True
            open(path, "w").close()
            time.sleep(float(seconds))
        return super().state_dict(*args, **kwargs)


def signals_itself(input_shape, num_classes):
    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    return _SignalsItself(build_model(ModelConfig(name="mlp"), input_shape, num_classes))


def signals_itself_cnn(input_shape, num_classes):
    """signals_itself around the built-in CNN of 16 channels, for images."""
    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    return _SignalsItself(build_model(ModelConfig(name="cnn", hidden=16), input_shape, num_classes))


def signals_itself_lm(input_shape, num_classes):
    """A bigram language model over `num_classes` token ids (dropout after the embedding) that
    signals itself as signals_itself does."""
    import os

    dropout = float(os.environ.get("HVDTRAIN_TEST_DROPOUT", 0.2))
    return _SignalsItself(nn.Sequential(nn.Embedding(num_classes, 16), nn.Dropout(dropout), nn.Linear(16, num_classes)))


class _Augmented(Dataset):
    """Four classes of 12 features, with a random augmentation drawn from torch, numpy and Python's
    `random` in `__getitem__`, as a user's transforms would (in data-loader workers with
    data.num_workers > 0)."""

    classes = ["a", "b", "c", "d"]

    def __init__(self, n: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 4, (n,), generator=generator)
        self.x = torch.randn(n, 12, generator=generator) * 0.8 + self.y[:, None].float()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        import random

        import numpy as np

        noise = torch.randn(12) * 0.2 + float(np.random.normal()) * 0.1 + random.random() * 0.1
        return self.x[index] + noise, self.y[index]


def augmented():
    return _Augmented(1600, 0), _Augmented(400, 1)


def indexed():
    """1600 training and 400 validation samples of 11 features, 4 classes, and a 12th column that
    holds the sample's index in its split (for `records_indices`). HVDTRAIN_TEST_TRAIN_SAMPLES=N: the
    first N training samples alone (a data set that changed)."""
    import os

    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(2)
    y = torch.randint(0, 4, (2000,), generator=generator)
    x = torch.randn(2000, 11, generator=generator) + y[:, None].float()
    index = torch.cat([torch.arange(1600), torch.arange(400)]).float()[:, None]
    x = torch.cat([x, index], dim=1)
    kept = int(os.environ.get("HVDTRAIN_TEST_TRAIN_SAMPLES", 1600))
    return TensorDataset(x[:kept], y[:kept]), TensorDataset(x[1600:], y[1600:])


class _RecordsIndices(_SignalsItself):
    """`signals_itself` on `indexed` data: the index column is not a feature; each training forward
    pass appends the indices it trained on to HVDTRAIN_TEST_RECORD/<pid>.txt."""

    def forward(self, x):
        import os

        folder = os.environ.get("HVDTRAIN_TEST_RECORD")
        if self.training and folder:
            with open(os.path.join(folder, f"{os.getpid()}.txt"), "a") as record:
                record.write("".join(f"{int(i)}\n" for i in x[:, -1].tolist()))
        return super().forward(x[:, :-1])


def records_indices(input_shape, num_classes):
    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    return _RecordsIndices(build_model(ModelConfig(name="mlp"), (input_shape[0] - 1,), num_classes))


def paced_in_first_allocation(input_shape, num_classes):
    """The built-in MLP at 0.6 s a step in a Slurm job's first allocation (so that its time limit
    comes in the middle of training), at full speed after a requeue and outside Slurm: the same
    weights either way."""
    import os

    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    first = os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    return _Paced(build_model(ModelConfig(name="mlp"), input_shape, num_classes), 0.6 if first else 0.0)


def nan_in_one_sample():
    """Blobs whose training sample 200 holds a NaN, in a data set of the user's own (not a checked file),
    past the first batch that is checked before training."""
    train, val = Blobs(240), Blobs(60)
    train.x[200, 2] = float("nan")
    return train, val


def batch_norm_net(input_shape, num_classes):
    """A small net with BatchNorm, whose running statistics differ per rank unless shared."""
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 32), nn.BatchNorm1d(32), nn.ReLU(),
                         nn.Linear(32, num_classes))


def signals_while_loading():
    """Blobs; with HVDTRAIN_TEST_SETUP_SIGNAL=NAME each rank sends itself that signal while its data
    set is built, before training (a scheduler's signal soon after the start)."""
    import os
    import signal

    name = os.environ.get("HVDTRAIN_TEST_SETUP_SIGNAL")
    if name:
        os.kill(os.getpid(), getattr(signal, name))
    return Blobs(240), Blobs(60)


def _signal_at_exit() -> None:
    """With HVDTRAIN_TEST_EXIT_SIGNAL=NAME, this process sends itself that signal as it exits, after fit
    (Slurm's --signal can come while a finished job's ranks shut down)."""
    import atexit
    import os
    import signal
    import time

    name = os.environ.get("HVDTRAIN_TEST_EXIT_SIGNAL")
    if name:
        atexit.register(lambda: (os.kill(os.getpid(), getattr(signal, name)), time.sleep(0.2)))


class _WithUnusedBranch(nn.Module):
    """The built-in MLP and a layer no rank ever calls."""

    def __init__(self, inner: nn.Module, width: int):
        super().__init__()
        self.inner, self.unused = inner, nn.Linear(width, width)

    def forward(self, x):
        return self.inner(x)


def with_unused_branch(input_shape, num_classes):
    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    return _WithUnusedBranch(build_model(ModelConfig(name="mlp"), input_shape, num_classes), input_shape[0])


class _SlowToRead(Dataset):
    """Blobs that take 5 ms to read each sample, as from slow storage."""

    classes = Blobs.classes

    def __init__(self):
        self.blobs = Blobs()

    def __len__(self):
        return len(self.blobs)

    def __getitem__(self, index):
        import time

        time.sleep(0.005)
        return self.blobs[index]


def slow_to_read():
    return _SlowToRead()


def val_disagrees():
    """Validation labels are the opposite of the training rule: the validation loss rises from the first
    epoch on, the same way every time (for early stopping)."""
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(400, 4, generator=generator)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x[:320], y[:320]), TensorDataset(x[320:], 1 - y[320:])


class Recorder:
    """A callback that writes each call it gets, with the state it saw, to $HVDTRAIN_TEST_RECORD.<rank>."""

    def _record(self, hook, state, **extra):
        import json
        import os

        line = {"hook": hook, "epoch": state.epoch, "step": state.step, "metrics": sorted(state.metrics),
                "rank": state.rank, "local_rank": state.local_rank, "world_size": state.world_size,
                "run_dir": str(state.run_dir), "model": type(state.model).__name__, **extra}
        with open(f"{os.environ['HVDTRAIN_TEST_RECORD']}.{state.rank}", "a") as out:
            out.write(json.dumps(line) + "\n")

    def on_fit_start(self, state):
        self._record("on_fit_start", state)

    def on_step_end(self, state):
        self._record("on_step_end", state)

    def on_epoch_end(self, state):
        self._record("on_epoch_end", state, val_loss=state.metrics["val_loss"])

    def on_checkpoint(self, state, path):
        self._record("on_checkpoint", state, path=str(path))

    def on_fit_end(self, state, summary):
        self._record("on_fit_end", state, stopped=summary.get("stopped"))


class StopOnRankOne(Recorder):
    """Records, and on rank 1 alone asks to stop after optimizer step 5."""

    def on_step_end(self, state):
        super().on_step_end(state)
        if state.rank == 1 and state.step == 5:
            state.stop("rank one had seen enough")


class NoHooks:
    def on_epoch_start(self, state):  # not a hook hvdtrain knows
        pass


class EndWithoutSummary:
    def on_fit_end(self, state):  # hvdtrain calls on_fit_end(state, summary)
        pass


class FailsOnEveryRank:
    """A callback looking up a metric that no rank has: it raises alike on every rank."""

    def on_epoch_end(self, state):
        print(state.metrics["val_f1"])


class KerasNames:
    """One hook hvdtrain calls, and one it never does (Keras' name for the end of training)."""

    def on_epoch_end(self, state):
        pass

    def on_train_end(self, logs=None):
        pass


def two_groups(model, lr):
    """A user's optimizer: the last layer at a tenth of the lr of the rest."""
    head = list(model.parameters())[-2:]
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    return torch.optim.SGD([{"params": body, "lr": lr}, {"params": head, "lr": lr / 10}], lr=lr, momentum=0.9)


def fused_adamw(model, lr):
    """AdamW's fused kernel: it needs each gradient in its parameter's memory layout (channels-last too)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)


def foreach_adamw(model, lr):
    """fused_adamw's arithmetic without its kernel: indifferent to a gradient's memory layout."""
    return torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)


def not_an_optimizer(model):
    return [model]


def optimizer_and_scheduler(model, lr):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1)


def optimizer_and_scheduler_dict(model, lr):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}}


def optimizer_of_another_model(model, lr):
    return torch.optim.SGD(torch.nn.Linear(5, 3).parameters(), lr=lr)


def api_training(run_dir):
    """tests/workers/api_script.py's training as a function, for hvdtrain.launch."""
    import os

    import hvdtrain

    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0")))
    data = blobs_split()
    torch.manual_seed(0 if rank == 0 else 1234)
    model = tiny_net((5,), 3)
    return hvdtrain.fit(model=model, data=data, task=torch.nn.CrossEntropyLoss(), epochs=3, batch_size=16,
                        run_dir=run_dir, progress="off", overrides={"optim.momentum": 0.5})


def fails_on_rank_one():
    import os

    if os.environ.get("HOROVOD_RANK", os.environ.get("RANK")) == "1":
        raise ValueError("rank one's shard is corrupt")
    import time

    time.sleep(30)  # rank 0 would go on: the launcher stops it once rank 1 failed
    return "rank 0 finished"


MODEL_OBJECT = nn.Identity()  # a model object where the command wants a function (no weights: no RNG drawn at import)


class StopAtStepTwo:
    """Asks to stop after optimizer step 2, before the first epoch has a record."""

    def on_step_end(self, state):
        if state.step == 2:
            state.stop("two steps are enough")


class ReportsCollector:
    """Says as fit starts whether Python's garbage collector runs, and how many objects it keeps frozen."""

    def on_fit_start(self, state):
        import gc

        print(f"collector enabled {gc.isenabled()} frozen {gc.get_freeze_count()}", flush=True)


class StopAtEpochTwo:
    """Asks to stop at the end of epoch 2 (given to one rank only by tests/workers/api_script.py)."""

    def on_epoch_end(self, state):
        if state.epoch == 2:
            state.stop("epoch two is enough")


class _IndexedStream(torch.utils.data.IterableDataset):
    """A user's IterableDataset with a length: `indexed` data, one sample after another."""

    classes = ["a", "b", "c", "d"]

    def __init__(self, part):
        self.part = part

    def __len__(self):
        return len(self.part)

    def __iter__(self):
        for index in range(len(self.part)):
            yield self.part[index]


def indexed_stream():
    train, val = indexed()
    return _IndexedStream(train), _IndexedStream(val)


class _ShortStream(_IndexedStream):
    """An IterableDataset whose len() says more than one pass yields."""

    def __len__(self):
        return len(self.part) + 100


def short_stream():
    return _ShortStream(indexed()[0])


def paced_records(input_shape, num_classes):
    """`records_indices` paced as `paced_mlp` (and held as it is), for elastic training on `indexed` data."""
    return _Paced(records_indices(input_shape, num_classes), 0.05)


class _HeldOnRank1(Dataset):
    """Blobs whose reads on rank 1 hold: for ever from the `stuck_at`-th sample on (a hung file system),
    or `slow` seconds each (a slow disk)."""

    classes = Blobs.classes

    def __init__(self, n: int, stuck_at: float = float("inf"), slow: float = 0.0):
        self.blobs, self.stuck_at, self.slow, self.reads = Blobs(n), stuck_at, slow, 0

    def __len__(self):
        return len(self.blobs)

    def __getitem__(self, index):
        import time

        if _rank() == 1:
            self.reads += 1
            if self.reads == self.stuck_at:
                _say_stuck()
            while self.reads >= self.stuck_at:
                time.sleep(1)  # rank 1 stuck reading its data
            time.sleep(self.slow)
        return self.blobs[index]


def stuck_reading_on_rank_1():
    """Rank 1's training data hangs at its 5th batch (batch 16, samples of 240 over 2 ranks)."""
    return _HeldOnRank1(240, stuck_at=4 * 16 + 1), Blobs(60)


def stuck_before_evaluation_on_rank_1():
    """Rank 1's validation data hangs at its first sample in evaluation, after the samples set-up compares
    (hvdtrain.same_samples): rank 1 never reaches evaluation's allreduce."""
    from hvdtrain.same_samples import PROBES

    return Blobs(240), _HeldOnRank1(60, stuck_at=PROBES + 1)


def slow_reading_on_rank_1():
    """Rank 1 reads each training sample 8 ms slower than rank 0 (about 2 s an epoch): a straggler waiting
    for its data."""
    return _HeldOnRank1(480, slow=0.008), Blobs(60)


class _HeldUntilReleased(nn.Module):
    """Every rank waits in its third training forward until the file HVDTRAIN_TEST_RELEASE_FILE exists
    (60 s at most), saying so with the file HVDTRAIN_TEST_RELEASE_FILE.held-RANK: a test can ask a live job
    where it is, then let it finish. Weights as the inner model's."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.forwards = inner, 0

    def forward(self, x):
        if self.training:
            import os
            import time

            self.forwards += 1
            release = os.environ.get("HVDTRAIN_TEST_RELEASE_FILE", "")
            if self.forwards == 3 and release:
                open(f"{release}.held-{_rank()}", "w").close()  # the test asks once every rank is held
            deadline = time.monotonic() + 60
            while self.forwards == 3 and release and not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.1)  # held until the test has asked
        return self.inner(x)


def held_until_released(input_shape, num_classes):
    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    return _HeldUntilReleased(build_model(ModelConfig(name="mlp"), input_shape, num_classes))


class _TokenBag(nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        self.embedding = nn.EmbeddingBag(500, 8, mode="mean", sparse=sparse)
        self.head = nn.Linear(8, 4)

    def forward(self, tokens):
        return self.head(self.embedding(tokens))


def sparse_bag():
    """Its embedding's gradient is sparse."""
    return _TokenBag(sparse=True)


def dense_bag():
    return _TokenBag(sparse=False)


def token_bags():
    """Eight tokens of 500 a sample; the class is the first token's, mod 4."""
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 500, (360, 8), generator=generator)
    return _tensor_split(tokens, tokens[:, 0] % 4)


class OddLayers(nn.Module):
    """What Horovod's collectives refuse as they are, and lazy layers: a LazyLinear (no weights until the
    first forward), a bool mask buffer, a bf16 buffer, a layer kept in bf16 and a complex weight (a
    spectral layer, as a Fourier neural operator has)."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        features = input_shape[-1]
        self.register_buffer("mask", torch.arange(features) % 5 != 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, features).to(torch.bfloat16))
        self.spectrum = nn.Parameter(torch.randn(features, dtype=torch.cfloat) * 0.1 + 1)
        self.in_bf16 = nn.Linear(features, 16).to(torch.bfloat16)
        self.lazy = nn.LazyLinear(16)
        self.head = nn.Linear(32, num_classes)

    def get_extra_state(self):  # not a tensor: evaluate's ranks must pass it by
        return {"version": 2}

    def set_extra_state(self, state):
        self.version = state["version"]

    def forward(self, x):
        x = x * self.mask * self.scale.float()
        x = torch.fft.ifft(torch.fft.fft(x) * self.spectrum).real
        half = torch.relu(self.in_bf16(x.to(torch.bfloat16))).float()
        return self.head(torch.cat([half, torch.relu(self.lazy(x))], dim=1))


def odd_layers(input_shape, num_classes):
    return OddLayers(input_shape, num_classes)


def lazy_sized_wrong(input_shape, num_classes):
    """A LazyLinear's 32 outputs into a Linear that takes 30: its making forward fails."""
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(32), nn.ReLU(), nn.Linear(30, num_classes))


class _LazyInTrainingOnly(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.head = nn.LazyLinear(num_classes)
        self.auxiliary = nn.LazyLinear(1)

    def forward(self, x):
        out = self.head(x)
        return out + 0 * self.auxiliary(x).sum() if self.training else out


def lazy_in_training_only(input_shape, num_classes):
    """A lazy layer only training's forward uses: eval mode leaves it without weights."""
    return _LazyInTrainingOnly(num_classes)


def half_inputs():
    """Inputs kept in float16, as a memory-mapped array may be."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g)
    y = (x[:, 0] > 0).long()
    return (torch.utils.data.TensorDataset(x[:160].half(), y[:160]),
            torch.utils.data.TensorDataset(x[160:].half(), y[160:]))


def lazy_net(input_shape, num_classes):
    return nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(num_classes))


def missing_on_rank_one():
    """A data factory whose files are missing on rank 1's host alone."""
    if _rank() == 1:
        raise FileNotFoundError("/data/train.npy (missing on this host)")
    return blobs_split()
