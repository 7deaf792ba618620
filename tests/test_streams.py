"""Data read as a stream: WebDataset-style tar shards (hvdtrain.data.shards) and a user's
IterableDataset with a length (hvdtrain.data.streams), sharded by rank into contiguous ranges of
each epoch's stream (hvdtrain.data.stream_sampler). In-process: every sample of an epoch served once
across ranks and data-loader workers, the order by (seed, epoch), a resume inside an epoch, what the
shards say of themselves, bad input. Under the launchers: stopped inside an epoch and resumed, the
weights of a run never stopped, on both engines."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_ok, assert_same_weights, epoch_records, final_weights, fit_under, requires_launchers
from hvdtrain.config import DataConfig
from hvdtrain.data.loading import batches
from hvdtrain.data.sources import build_data, build_part
from hvdtrain.data.stream_sampler import StreamBatchSampler
from hvdtrain.data.streams import StreamDataset
from hvdtrain.errors import UserError

COUNTS = (50, 37, 61, 12, 40)  # five shards of unequal sizes: not divisible by ranks x workers


def write_shards(directory: Path, counts: tuple[int, ...] = COUNTS, features: int = 11, classes: int = 4,
                 prefix: str = "part") -> Path:
    """Shards of samples `NNNNNN.npy` (features, then the sample's number as the last column) and
    `NNNNNN.cls` (a label a linear teacher gives the features)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(3)
    teacher = generator.standard_normal((features, classes))
    number = 0
    for shard, count in enumerate(counts):
        with tarfile.open(directory / f"{prefix}-{shard:04d}.tar", "w") as tar:
            for _ in range(count):
                x = generator.standard_normal(features).astype(np.float32)
                buffer = io.BytesIO()
                np.save(buffer, np.append(x, np.float32(number)))
                _add(tar, f"{number:06d}.npy", buffer.getvalue())
                _add(tar, f"{number:06d}.cls", str(int((x @ teacher).argmax())).encode())
                number += 1
    return directory


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _served(dataset: StreamDataset, sampler: StreamBatchSampler, workers: int) -> list[int]:
    """The sample numbers one rank's loader serves, in order, through real data-loader workers."""
    return [int(n) for x, _ in batches(dataset, sampler, workers, False) for n in x[:, -1].tolist()]


def test_every_sample_of_an_epoch_is_served_once_across_ranks_and_workers_in_an_order_of_seed_and_epoch(tmp_path):
    """Five shards of 200 samples (160 for training), 2 or 3 ranks, 0 or 3 data-loader workers each:
    every training sample of an epoch served once, but for fewer than a global batch at the end of the
    epoch's stream; the same order for the same seed and any number of workers, another each epoch."""
    split = build_data(DataConfig(name=str(write_shards(tmp_path / "shards")), val_fraction=0.2), seed=1)
    train = split.train
    assert isinstance(train, StreamDataset) and len(train) == 161 and len(split.val) == 39
    orders = {}
    for world, workers in ((2, 0), (2, 3), (3, 2)):
        for epoch in (1, 2):
            per_rank = []
            for rank in range(world):
                sampler = StreamBatchSampler(len(train), 5, rank, world, seed=1, buffer=16, workers=workers)
                sampler.set_epoch(epoch)
                per_rank.append(_served(train, sampler, workers))
            served = [n for numbers in per_rank for n in numbers]
            assert len(set(served)) == len(served) == len(train) - sampler.dropped  # once each
            assert sampler.dropped == 161 - sampler.per_rank * 5 * world and len(set(map(len, per_rank))) == 1
            orders[(world, workers, epoch)] = per_rank
    assert orders[(2, 0, 1)] == orders[(2, 3, 1)] and orders[(2, 0, 2)] == orders[(2, 3, 2)]  # workers change nothing
    assert orders[(2, 0, 1)] != orders[(2, 0, 2)]  # another order each epoch
    # A resume inside the epoch (after 7 of a rank's batches) serves the rest, with other workers too.
    sampler = StreamBatchSampler(len(train), 5, 1, 2, seed=1, buffer=16, workers=2)
    sampler.set_epoch(2, start=7 * 10)
    assert _served(train, sampler, 2) == orders[(2, 0, 2)][1][35:]
    again = build_data(DataConfig(name=str(tmp_path / "shards"), val_fraction=0.2), seed=2).train
    other = StreamBatchSampler(len(again), 5, 0, 2, seed=2, buffer=16)
    other.set_epoch(1)
    assert _served(again, other, 0) != orders[(2, 0, 1)][0]  # another seed, another order


STAGES = {  # (world size, batch, accumulate, shuffle buffer, share of its batches served) of each stage
    "processes 2, 3, 1": [(2, 5, 1, 16, 0.5), (3, 5, 1, 16, 0.5), (1, 5, 1, 16, 1)],
    "processes 3, 2, 4 with accumulate": [(3, 4, 2, 7, 0.5), (2, 4, 2, 7, 0.5), (4, 4, 2, 7, 1)],
    "buffer smaller than the batch": [(2, 16, 1, 5, 0.5), (1, 16, 1, 5, 0.5), (2, 16, 1, 5, 1)],
    "batch, accumulate and buffer changed": [(2, 8, 1, 64, 0.5), (2, 12, 1, 64, 0.5), (2, 12, 2, 30, 1)],
    "a change at the epoch's end, ranges not whole blocks": [(2, 16, 1, 100, 1), (3, 16, 1, 100, 1)],
    "a change at the epoch's end, a buffer longer than a range": [(4, 16, 1, 1000, 1), (3, 16, 1, 1000, 1)],
}


@pytest.mark.parametrize("stages", STAGES.values(), ids=STAGES.keys())
def test_a_change_inside_an_epoch_serves_what_no_rank_had_served_each_once(stages):
    """An epoch of 1003 positions begun with one number of processes (batch size, accumulate, buffer),
    checkpointed halfway, gone on with from each checkpoint's plan as a resume or an elastic reset would:
    every position served at most once, and all but fewer than the last global batch x accumulate."""
    served, state, start = [], None, 0
    for world, batch, accumulate, buffer, share in stages:
        samplers = [StreamBatchSampler(1003, batch, rank, world, seed=3, multiple=accumulate, buffer=buffer)
                    for rank in range(world)]
        for sampler in samplers:
            if state is not None:
                sampler.resume_plan(2, state)
            sampler.set_epoch(2, start)
        steps = int(samplers[0].num_batches * share) // accumulate * accumulate
        served += [p for sampler in samplers for b in list(sampler)[:steps] for p in b]
        start += steps * batch * world
        state = samplers[0].state_at(start)
    assert len(set(served)) == len(served) and 1003 - len(served) < world * batch * accumulate
    assert min(served) >= 0 and max(served) < 1003 and state["runs"] is not None  # a plan of what was left


@pytest.mark.parametrize("done", [0, 2, 4, 10, 24, 26], ids=lambda d: f"after {d} batches")
def test_a_resume_on_the_same_processes_serves_the_rest_of_the_uninterrupted_order(done):
    """Batches of 6 from blocks of 24 (4 batches a block, the last one half), accumulate 2, 26 batches per
    rank: a resume at the start, inside a block, at a block's edge, at the last block and at the end, with
    other data-loader workers than before, serves what the uninterrupted epoch would have served."""
    whole = StreamBatchSampler(330, 6, 1, 2, seed=5, multiple=2, buffer=24, workers=0)
    whole.set_epoch(3)
    order = [list(b) for b in whole]
    assert len(order) == 26 and whole.dropped == 330 - 26 * 12
    resumed = StreamBatchSampler(330, 6, 1, 2, seed=5, multiple=2, buffer=24, workers=3)
    resumed.resume_plan(3, whole.state_at(done * 12))
    resumed.set_epoch(3, done * 12)
    assert [list(b) for b in resumed] == order[done:]
    fewer = StreamBatchSampler(300, 6, 1, 2, seed=5, multiple=2, buffer=24)  # shards removed since
    with pytest.raises(UserError, match="a stream of 330 training samples, and the data now has 300: resume with"):
        fewer.resume_plan(3, whole.state_at(done * 12))


def test_a_shard_is_counted_once_per_version_of_its_file(tmp_path, monkeypatch):
    """The second start reads the count and labels from the cache (counting would fail here); a
    rewritten shard is counted again."""
    from hvdtrain.data import shard_index as shards

    monkeypatch.setattr(shards, "INDEX_CACHE", tmp_path / "cache")
    directory = write_shards(tmp_path / "shards", (30, 20))
    first = build_data(DataConfig(name=str(directory)), seed=0)
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2
    counting = shards.ShardIndex.__init__

    def refuse(self, path, label_column, known=None):
        assert known is not None, f"{path} counted again"
        counting(self, path, label_column, known)

    monkeypatch.setattr(shards.ShardIndex, "__init__", refuse)
    again = build_data(DataConfig(name=str(directory)), seed=0)
    assert len(again.train) == len(first.train) and torch.equal(again.held_targets, first.held_targets)
    write_shards(directory, (30, 21))
    with pytest.raises(UserError, match="part-0000.tar counted again"):  # rewritten, if the same
        build_data(DataConfig(name=str(directory)), seed=0)
    monkeypatch.setattr(shards.ShardIndex, "__init__", counting)
    for entry in (tmp_path / "cache").glob("*.npz"):
        entry.write_bytes(entry.read_bytes()[:100])  # damaged: counted again, and written anew
    assert len(build_data(DataConfig(name=str(directory)), seed=0).train) == len(first.train) + 1
    assert sum(len(entry.read_bytes()) > 100 for entry in (tmp_path / "cache").glob("*.npz")) == 2  # the shards now


def test_fit_evaluate_and_predict_take_shards(tmp_path):
    """One process, from Python: fit on shards, then evaluate its last checkpoint (fit's last record) and
    predict every sample in the shards' own order."""
    import hvdtrain

    directory = write_shards(tmp_path / "shards", (60, 40))
    summary = hvdtrain.fit(data=str(directory), epochs=2, batch_size=16, run_dir=str(tmp_path / "run"),
                           progress="off", engine="local")
    evaluated = hvdtrain.evaluate(tmp_path / "run", checkpoint="last")
    assert evaluated["samples"] == 20 and evaluated["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    predicted = hvdtrain.predict(tmp_path / "run", checkpoint="last", split="all")
    assert predicted.shape == (100,)


def _bad(tmp_path: Path, case: str) -> DataConfig:
    shards = write_shards(tmp_path / "shards", (6, 6))
    if case == "not a tar file":
        (shards / "part-0001.tar").write_text("not a tar file")
    if case == "missing shard":
        return DataConfig(name=str(shards / "part-{0000..0002}.tar"))
    if case == "no such column":
        return DataConfig(name=str(shards), input_columns="jpg")
    if case == "image that does not decode":
        with tarfile.open(shards / "part-0000.tar", "w") as tar:
            for number in range(6):
                _add(tar, f"{number:06d}.png", b"\x89PNG but not really")
                _add(tar, f"{number:06d}.cls", b"1")
    if case == "cut off":
        data = (shards / "part-0001.tar").read_bytes()
        (shards / "part-0001.tar").write_bytes(data[:len(data) // 2])
    if case == "a later sample without its label":
        with tarfile.open(shards / "part-0001.tar", "a") as tar:
            buffer = io.BytesIO()
            np.save(buffer, np.zeros(12, dtype=np.float32))
            _add(tar, "000099.npy", buffer.getvalue())
    if case == "too small to hold out":
        return DataConfig(name=str(write_shards(tmp_path / "small", (3, 3, 3))), val_fraction=0.2)
    if case == "a glob that matches nothing":
        return DataConfig(name=str(shards / "train-*.tar"))
    if case == "text label":
        with tarfile.open(shards / "part-0001.tar", "a") as tar:
            buffer = io.BytesIO()
            np.save(buffer, np.zeros(12, dtype=np.float32))
            _add(tar, "000099.npy", buffer.getvalue())
            _add(tar, "000099.cls", b"cat")
    return DataConfig(name=str(shards), val_fraction=0.5)


@pytest.mark.parametrize("case, message", [
    ("not a tar file", r"shard '.*part-0001.tar' is not a readable tar file"),
    ("missing shard", r"shard '.*part-0002.tar' does not exist \(1 of 3 named shards are missing\)"),
    ("no such column", r"have no column 'jpg' \(the first sample has npy, cls\): choose with data.input_columns"),
    ("image that does not decode", r"shard '.*part-0000.tar': sample '000000' does not decode \(.*\): write it again"),
    ("text label", r"member '000099.cls' holds 'cat', not an integer label"),
    ("cut off", r"shard '.*part-0001.tar' is (cut off|damaged) .*: write it again"),
    ("a later sample without its label", r"part-0001.tar': sample '000099' has no column cls: every sample needs"),
    ("too small to hold out", r"hold fewer than 5 samples each, so holding out every 5th .* leaves none"),
    ("a glob that matches nothing", r"train-\*.tar' matches no file: check the pattern"),
])
def test_bad_shards_are_one_line_each(tmp_path, case, message):
    with pytest.raises(UserError, match=message) as caught:
        build_data(_bad(tmp_path, case), seed=0)
    assert "\n" not in str(caught.value)


def test_an_iterable_dataset_with_a_length_is_a_stream_and_one_without_is_refused():
    split = build_data(DataConfig(name="user_code:indexed_stream"), seed=0)
    assert isinstance(split.train, StreamDataset) and (len(split.train), len(split.val)) == (1600, 400)
    assert split.num_classes == 4 and split.input_shape == (12,)
    served = []
    for rank, workers in ((0, 0), (1, 2)):
        sampler = StreamBatchSampler(1600, 32, rank, 2, seed=0, buffer=100, workers=workers)
        sampler.set_epoch(1)
        served.append(_served(split.train, sampler, workers))
    assert len(served[1]) == 800 and sorted(served[0] + served[1]) == list(range(1600))  # each rank half, once
    with pytest.raises(UserError, match="returned an IterableDataset without a length: hvdtrain needs len()"):
        build_data(DataConfig(name="user_code:stream"), seed=0)
    short = build_data(DataConfig(name="user_code:short_stream"), seed=0).train
    with pytest.raises(UserError, match="its IterableDataset ended after 1600 samples, but its len\\(\\) says 1700"):
        short.__getitems__([len(short) - 1])


# --- under the launchers -------------------------------------------------------------------------


def _fit(launcher: str | None, data: str, run_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return fit_under(launcher, "--data", data, "--epochs", "2", "--threads", "1", "--batch-size", "16",
                     "--model", "user_code:records_indices", "--set", "run.stop_check_seconds=0",
                     "--set", "data.shuffle_buffer=64", *args, "--run-dir", str(run_dir), env=env, timeout=240)


STREAMS = {  # stream -> (launcher, arguments beyond the data)
    "shards": ("horovodrun-gloo", ["--set", "data.num_workers=2"]),
    "iterable": ("torchrun", []),
}


def _records(folder: Path) -> list[list[int]]:
    """What each process trained on, in order (user_code:records_indices writes a file per process)."""
    return [[int(n) for n in path.read_text().split()] for path in sorted(folder.iterdir())]


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stream", STREAMS)
def test_a_stream_stopped_inside_an_epoch_resumes_exactly_on_as_many_processes_and_on_fewer_serves_the_rest(
        stream, tmp_path):
    """2 ranks (the Horovod engine with 2 data-loader workers per rank on tar shards, the torch engine on
    a user's IterableDataset): a run never stopped trains on every sample of each epoch once (what the
    model records), in another order each epoch. The same run stopped by SIGTERM in the middle of epoch 2
    and resumed on 2 processes ends with the weights of the run never stopped; the shards' run resumed on
    1 process instead trains on the samples of epoch 2 that no rank had reached, each once."""
    launcher, args = STREAMS[stream]
    data = str(write_shards(tmp_path / "shards", (400, 300, 500, 300, 505))) if stream == "shards" \
        else "user_code:indexed_stream"
    whole, cut, alone = tmp_path / "whole", tmp_path / "cut", tmp_path / "alone"
    for folder in ("whole-record", "cut-record", "alone-record"):
        (tmp_path / folder).mkdir()
    done = _fit(launcher, data, whole, *args, HVDTRAIN_TEST_RECORD=str(tmp_path / "whole-record"))
    assert_ok(done)
    assert stream == "iterable" or "streamed data: each rank reads its own range of each epoch's stream; the last 4 " \
        "of its 1,604 samples are left out (the end of the epoch's stream" in done.stdout
    per_rank = _records(tmp_path / "whole-record")
    steps = epoch_records(whole)[0]["step"]
    epoch = steps * 16  # samples per rank per epoch
    assert len(per_rank) == 2 and all(len(numbers) == 2 * epoch for numbers in per_rank)
    for e in (0, 1):
        served = [n for numbers in per_rank for n in numbers[e * epoch:(e + 1) * epoch]]
        assert len(set(served)) == len(served) == 2 * epoch
    assert [numbers[:16] for numbers in per_rank] != [numbers[epoch:epoch + 16] for numbers in per_rank]
    stopped = _fit(launcher, data, cut, *args, HVDTRAIN_TEST_SIGNAL=f"1:{steps + steps // 2}:SIGTERM",
                   HVDTRAIN_TEST_RECORD=str(tmp_path / "cut-record"))
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    shutil.copytree(cut, alone)
    resumed = _fit(launcher, data, cut, *args, "--resume")
    assert_ok(resumed)
    assert "samples into epoch 2" in resumed.stdout
    assert_same_weights(final_weights(whole), final_weights(cut), atol=0)
    if stream == "iterable":  # the same plan of what is left as for shards (and elastic training)
        return
    fewer = _fit(None, data, alone, *args, "--resume", HVDTRAIN_TEST_RECORD=str(tmp_path / "alone-record"))
    assert_ok(fewer)
    before = [n for numbers in _records(tmp_path / "cut-record") for n in numbers[epoch:]]
    (after,) = _records(tmp_path / "alone-record")
    assert 0 < len(before) < 2 * epoch and len(set(before + after)) == len(before + after)
    assert 1604 - 16 < len(before + after) <= 1604  # all but fewer than one batch of one process


@pytest.mark.multiprocess
@requires_launchers
def test_a_sample_that_does_not_decode_mid_run_is_named_by_the_rank_that_read_it(tmp_path):
    """Rank 1's first sample of epoch 1, read by a data-loader worker, is not a .npy: rank 1 says which
    shard and sample, once and without a traceback (at the step whose batch its worker was reading
    the block for), and every rank stops."""
    directory = write_shards(tmp_path / "shards", (400, 300))
    config = DataConfig(name=str(directory), batch_size=16, shuffle_buffer=64)
    train = build_data(config, seed=0).train
    sampler = StreamBatchSampler(len(train), 16, 1, 2, seed=0, buffer=64)
    sampler.set_epoch(1)
    first = next(iter(sampler))[0]
    number = int(train[first][0][-1])  # the sample's own number, written as its last feature
    shard = directory / f"part-{0 if number < 400 else 1:04d}.tar"
    with tarfile.open(shard) as tar:
        members = [(member, tar.extractfile(member).read()) for member in tar.getmembers()]
    with tarfile.open(shard, "w") as tar:
        for member, data in members:
            _add(tar, member.name, b"not a numpy array" if member.name == f"{number:06d}.npy" else data)
    done = _fit("horovodrun-gloo", str(directory), tmp_path / "run", "--set", "data.num_workers=2", "--epochs", "1")
    output = done.stdout + done.stderr
    named = [line for line in output.splitlines() if "does not decode" in line]
    assert done.returncode != 0 and "Traceback" not in output, output[-3000:]
    assert len(named) == 1 and re.search(rf"rank 1 failed at epoch 1, step \d+: shard '{shard}': sample '{number:06d}' "
                                         "does not decode", named[0]), output[-3000:]
