"""Data sets read from files as batches need them: a directory of `.npy` arrays and a token file,
memory-mapped (hvdtrain.data.mapped), and Hugging Face datasets (hvdtrain.data.huggingface). In-process: the split, what each source says of itself, bad
input. Under the launchers: 2 ranks x batch B, stopped inside an epoch and resumed, end with the
weights of 1 process x 2B; and a 2 GB file of each kind trains in under 1 GB of each rank's own memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (assert_ok, assert_same_weights, epoch_records, final_weights, fit_under, requires_launchers,
                      run, run_summary)
from hvdtrain.config import DataConfig
from hvdtrain.data import mapped
from hvdtrain.data.sources import build_data, build_part
from hvdtrain.errors import UserError


def write_arrays(directory: Path, samples: int = 1200, features: int = 12, classes: int = 4) -> Path:
    """Gaussian inputs labelled by a random linear teacher, as x.npy and y.npy."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(5)
    x = generator.standard_normal((samples, features), dtype=np.float32)
    np.save(directory / "x.npy", x)
    np.save(directory / "y.npy", (x @ generator.standard_normal((features, classes))).argmax(axis=1))
    return directory


def write_tokens(path: Path, tokens: int = 40_000, dtype: str = "uint16") -> Path:
    """Runs of the rule t+1 = 3t + 1 (mod 16) from random starts: a bigram model can learn it."""
    generator = np.random.default_rng(7)
    ids = np.empty(tokens, dtype=np.int64)
    ids[0] = 0
    for start in range(0, tokens, 50):
        ids[start] = generator.integers(16)
        for i in range(start + 1, min(start + 50, tokens)):
            ids[i] = (3 * ids[i - 1] + 1) % 16
    path.parent.mkdir(parents=True, exist_ok=True)
    ids.astype(dtype).tofile(path)
    return path


@pytest.mark.parametrize("total, fraction", [(10, 0.2), (11, 0.2), (1000, 0.1), (7, 0.5), (100, 0.33)])
def test_the_split_sends_every_kth_sample_to_validation_and_the_rest_to_training(total, fraction):
    train, val = mapped.split(total, fraction)
    every = max(2, round(1 / fraction))
    taken = [train(i) for i in range(len(train))] + [val(i) for i in range(len(val))]
    assert sorted(taken) == list(range(total))  # each sample in exactly one part
    assert [val(i) for i in range(len(val))] == list(range(every - 1, total - total % every, every))
    with pytest.raises(IndexError):
        train(len(train))


def test_an_npy_directory_is_memory_mapped_and_says_what_it_holds(tmp_path):
    directory = write_arrays(tmp_path / "arrays")
    split = build_data(DataConfig(name=str(directory)), seed=0)
    assert isinstance(split.train, mapped.MappedArrays) and len(split.train) + len(split.val) == 1200
    assert split.input_shape == (12,) and split.num_classes == 4 and split.target_shape == ()
    x, y = np.load(directory / "x.npy"), np.load(directory / "y.npy")
    batch = split.val.__getitems__([0, 3, 1])
    assert torch.equal(torch.stack([b[0] for b in batch]), torch.from_numpy(x[[4, 19, 9]]))
    assert [int(b[1]) for b in batch] == y[[4, 19, 9]].tolist() and batch[0][1].dtype == torch.int64
    assert isinstance(split.train.arrays()[0], np.memmap)
    whole = build_part(DataConfig(name=str(directory)), 0, "labels", "all")
    assert len(whole) == 1200 and torch.equal(whole[7][0], torch.from_numpy(x[7]))


def test_train_and_val_directories_are_the_two_parts(tmp_path):
    write_arrays(tmp_path / "arrays" / "train", samples=300)
    write_arrays(tmp_path / "arrays" / "val", samples=40)
    split = build_data(DataConfig(name=str(tmp_path / "arrays")), seed=0)
    assert (len(split.train), len(split.val)) == (300, 40) and split.held_targets.shape == (340,)
    assert len(build_part(DataConfig(name=str(tmp_path / "arrays")), 0, "labels", "all")) == 340


def test_a_token_file_is_read_as_windows_of_the_context(tmp_path):
    path = write_tokens(tmp_path / "corpus.bin", tokens=1000)
    split = build_data(DataConfig(name=str(path), context=16), seed=0)
    assert (len(split.train), len(split.val)) == (50, 12) and split.num_classes == 16
    assert split.input_shape == (16,)
    tokens = np.fromfile(path, dtype=np.uint16)
    (window,) = split.val[1]  # window 9 of the file
    assert window.dtype == torch.int64 and window.tolist() == tokens[9 * 16:10 * 16].tolist()


def test_val_bin_beside_train_bin_is_the_validation_part(tmp_path):
    write_tokens(tmp_path / "train.bin", tokens=800, dtype="uint32")
    write_tokens(tmp_path / "val.bin", tokens=160, dtype="uint32")
    config = DataConfig(name=str(tmp_path / "train.bin"), context=16, token_dtype="uint32", num_classes=20)
    split = build_data(config, seed=0)
    assert (len(split.train), len(split.val)) == (50, 10) and split.num_classes == 20
    assert len(build_part(config, 0, "labels", "all")) == 60


def _bad(tmp_path: Path, case: str) -> DataConfig:
    if case == "missing directory":
        return DataConfig(name=str(tmp_path / "nowhere/"))
    if case == "no x.npy":
        (tmp_path / "d").mkdir()
        np.save(tmp_path / "d" / "inputs.npy", np.zeros((4, 2)))
        return DataConfig(name=str(tmp_path / "d"))
    if case == "lengths differ":
        write_arrays(tmp_path / "d", samples=20)
        np.save(tmp_path / "d" / "y.npy", np.zeros(19, dtype=np.int64))
        return DataConfig(name=str(tmp_path / "d"))
    if case == "not an array":
        write_arrays(tmp_path / "d", samples=20)
        (tmp_path / "d" / "x.npy").write_text("not numpy")
        return DataConfig(name=str(tmp_path / "d"))
    if case == "odd size":
        (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02")
        return DataConfig(name=str(tmp_path / "t.bin"))
    if case == "context too long":
        write_tokens(tmp_path / "t.bin", tokens=100)
        return DataConfig(name=str(tmp_path / "t.bin"), context=128)
    if case == "missing token file":
        return DataConfig(name=str(tmp_path / "t.bin"))
    if case == "empty x.npy":
        write_arrays(tmp_path / "d", samples=20)
        (tmp_path / "d" / "x.npy").write_bytes(b"")
        return DataConfig(name=str(tmp_path / "d"))
    if case == "one number":
        write_arrays(tmp_path / "d", samples=20)
        np.save(tmp_path / "d" / "x.npy", np.float32(3))
        return DataConfig(name=str(tmp_path / "d"))
    if case == "train without val":
        write_arrays(tmp_path / "d" / "train", samples=20)
        return DataConfig(name=str(tmp_path / "d"))
    if case == "parts differ":
        write_arrays(tmp_path / "d" / "train", samples=20)
        write_arrays(tmp_path / "d" / "val", samples=20, features=5)
        return DataConfig(name=str(tmp_path / "d"))
    if case == "most held out":
        write_arrays(tmp_path / "d", samples=20)
        return DataConfig(name=str(tmp_path / "d"), val_fraction=0.6)
    if case == "uint16 read as uint32":
        (np.arange(4000) % 1000).astype(np.uint16).tofile(tmp_path / "t.bin")
        return DataConfig(name=str(tmp_path / "t.bin"), token_dtype="uint32", context=8)
    raise AssertionError(case)


@pytest.mark.parametrize("case, message", [
    ("missing directory", r"data path '.*nowhere' does not exist: give a directory of x.npy and y.npy"),
    ("no x.npy", r"has no x.npy \(it has inputs.npy\): save the inputs with np.save"),
    ("lengths differ", r"x.npy has 20 samples but y.npy has 19: they must match"),
    ("not an array", r"x.npy' is not a readable .npy array of numbers"),
    ("odd size", r"has 3 bytes, not a multiple of 2 \(uint16\): check data.token_dtype"),
    ("context too long", r"holds 100 tokens, fewer than one window of data.context=128: lower data.context"),
    ("missing token file", r"token file '.*t.bin' does not exist"),
    ("empty x.npy", r"x.npy' is not a readable .npy array of numbers"),
    ("one number", r"x.npy' is not an array with one row per sample"),
    ("train without val", r"has a train/ directory but not the other: give both train/ and val/"),
    ("parts differ", r"train/x.npy holds float32 samples of shape \(12,\) but val/x.npy float32 of shape \(5,\)"),
    ("most held out", r"data.val_fraction 0.6 holds out more than every 2nd sample"),
    ("uint16 read as uint32", r"holds ids up to [\d,]+ as uint32: check data.token_dtype"),
])
def test_bad_files_are_one_line_each(tmp_path, case, message):
    with pytest.raises(UserError, match=message) as caught:
        build_data(_bad(tmp_path, case), seed=0)
    assert "\n" not in str(caught.value)


def test_a_token_dtype_other_than_uint16_or_uint32_is_refused():
    with pytest.raises(UserError, match="config key 'data.token_dtype' must be uint16 or uint32, got 'int8'"):
        DataConfig(name="x.bin", token_dtype="int8")


def write_hugging_face(directory: Path, samples: int = 1200) -> Path:
    """The arrays of write_arrays as a Hugging Face Dataset (x a sequence of floats, label a ClassLabel)."""
    import datasets

    arrays = write_arrays(directory.with_name(directory.name + "-arrays"), samples)
    features = datasets.Features({"x": datasets.Sequence(datasets.Value("float32"), length=12),
                                  "label": datasets.ClassLabel(num_classes=4)})
    datasets.Dataset.from_dict({"x": np.load(arrays / "x.npy"), "label": np.load(arrays / "y.npy")},
                               features=features).save_to_disk(str(directory))
    return directory


def test_a_hugging_face_dataset_is_read_by_columns(tmp_path):
    import datasets

    directory = write_hugging_face(tmp_path / "hf")
    split = build_data(DataConfig(name=str(directory)), seed=0)
    assert (len(split.train), len(split.val)) == (960, 240) and split.num_classes == 4 and split.input_shape == (12,)
    x, y = np.load(tmp_path / "hf-arrays" / "x.npy"), np.load(tmp_path / "hf-arrays" / "y.npy")
    batch = split.val.__getitems__([0, 3])
    assert torch.equal(torch.stack([b[0] for b in batch]), torch.from_numpy(x[[4, 19]]))
    assert [int(b[1]) for b in batch] == y[[4, 19]].tolist()
    # A DatasetDict's splits, named inputs, and a Parquet file.
    table = datasets.load_from_disk(str(directory)).add_column("w", list(range(1200)))
    datasets.DatasetDict({"train": table.select(range(1000)), "test": table.select(range(1000, 1200))}).save_to_disk(
        str(tmp_path / "dict"))
    named = build_data(DataConfig(name=str(tmp_path / "dict"), input_columns="x,w"), seed=0)
    assert (len(named.train), len(named.val)) == (1000, 200)
    inputs, label = named.val[5]
    assert sorted(inputs) == ["w", "x"] and int(inputs["w"]) == 1005 and int(label) == y[1005]
    table.to_parquet(str(tmp_path / "rows.parquet"))
    assert len(build_part(DataConfig(name=str(tmp_path / "rows.parquet")), 0, "labels", "all")) == 1200


@pytest.mark.parametrize("case, message", [
    ("no such target", r"has no column 'kind' \(it has x, label\): choose with data.input_columns"),
    ("no such input", r"has no column 'z'"),
    ("validation without it", r"hf-dict \(validation\)' has no column 'x'"),
    ("not parquet", r"could not be read by datasets \(.*\): check that it was written by save_to_disk"),
    ("text input", r"column 'text' has dtype <U\d+, not numbers: choose numeric columns with data.input_columns"),
])
def test_bad_hugging_face_data_is_one_line(tmp_path, case, message):
    import datasets

    directory = write_hugging_face(tmp_path / "hf", samples=20)
    config = {"no such target": {"target_column": "kind"}, "no such input": {"input_columns": "x,z"}}.get(case, {})
    name = str(directory)
    if case == "validation without it":
        table = datasets.load_from_disk(name)
        datasets.DatasetDict({"train": table, "validation": table.remove_columns("x").add_column("y", [0] * 20)}) \
            .save_to_disk(str(tmp_path / "hf-dict"))
        name = str(tmp_path / "hf-dict")
    if case == "not parquet":
        (tmp_path / "rows.parquet").write_text("not parquet")
        name = str(tmp_path / "rows.parquet")
    if case == "text input":
        datasets.Dataset.from_dict({"text": ["ab", "cd"] * 10, "label": [0, 1] * 10}).save_to_disk(str(tmp_path / "t"))
        name = str(tmp_path / "t")
    with pytest.raises(UserError, match=message) as caught:
        build_data(DataConfig(name=name, **config), seed=0)
    assert "\n" not in str(caught.value)


def test_a_column_of_sequences_of_different_lengths_is_padded_by_the_pad_collate(tmp_path):
    import datasets

    from hvdtrain.data.loading import pad_collate

    rows = [list(range(n % 5 + 1)) for n in range(20)]
    datasets.Dataset.from_dict({"input_ids": rows, "labels": rows}).save_to_disk(str(tmp_path / "lm"))
    split = build_data(DataConfig(name=str(tmp_path / "lm"), target_column="labels"), seed=0)
    samples = split.train.__getitems__([0, 1, 2])
    assert [len(inputs) for inputs, _ in samples] == [1, 2, 3]
    inputs, targets = pad_collate(samples)
    assert inputs.shape == (3, 3) and targets[0].tolist() == [0, -100, -100]


def test_fit_evaluate_and_predict_take_an_npy_directory_and_a_token_file_gets_the_right_task(tmp_path):
    """One process, as a user types it: fit on an .npy directory, then evaluate its validation part
    (equal to fit's record) and predict all of it in the file's order; a token file with the default
    task, or with a built-in model, is one line that says what to add."""
    directory = write_arrays(tmp_path / "arrays")
    done = run(["hvdtrain", "fit", "--data", str(directory), "--epochs", "2", "--progress", "off",
                "--run-dir", str(tmp_path / "run")])
    assert_ok(done)
    record = epoch_records(tmp_path / "run")[-1]
    evaluated = run(["hvdtrain", "evaluate", str(tmp_path / "run"), "--checkpoint", "last",
                     "--output", str(tmp_path / "eval.json")])
    assert_ok(evaluated)
    assert json.loads((tmp_path / "eval.json").read_text())["loss"] == pytest.approx(record["val_loss"])
    predicted = run(["hvdtrain", "predict", str(tmp_path / "run"), "--split", "all", "--output", str(tmp_path / "p.npy")])
    assert_ok(predicted)
    assert np.load(tmp_path / "p.npy").shape == (1200,)
    tokens = write_tokens(tmp_path / "corpus.bin", tokens=2000)
    for args, message in (([], "is a token file, windows of token ids for --task language-model, not "
                                "classification: add --task language-model"),
                          (["--task", "language-model"], "the built-in model 'mlp' takes features, not token ids")):
        refused = run(["hvdtrain", "fit", "--data", str(tokens), *args, "--run-dir", str(tmp_path / "never")])
        errors = [line for line in refused.stderr.splitlines() if line.startswith("hvdtrain: error:")]
        assert refused.returncode == 2 and len(errors) == 1 and message in errors[0], refused.stderr[-2000:]
        assert "Traceback" not in refused.stderr and not (tmp_path / "never").exists()


# --- under the launchers -------------------------------------------------------------------------

SOURCES = {  # source -> (launcher of the 2-rank run, arguments beyond the data)
    "npy": ("horovodrun-gloo", ["--model", "user_code:signals_itself", "--set", "data.num_workers=2"]),
    "hugging-face": ("torchrun", ["--model", "user_code:signals_itself"]),
    "tokens": ("torchrun", ["--model", "user_code:signals_itself_lm", "--task", "language-model",
                            "--set", "data.context=16", "--optimizer", "adamw", "--lr", "0.01"]),
}


def _fit(launcher: str | None, data: Path, run_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return fit_under(launcher, "--data", str(data), "--epochs", "2", "--threads", "1",
                     "--set", "run.stop_check_seconds=0", "--set", "optim.lr_batch=64", *args, "--run-dir", str(run_dir),
                     env={"HVDTRAIN_TEST_DROPOUT": "0", **env}, timeout=240)


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", SOURCES)
def test_two_ranks_stopped_inside_an_epoch_and_resumed_end_with_one_process_s_weights(source, tmp_path):
    """2 ranks x batch 32 (the Horovod engine with 2 data-loader workers per rank for the arrays, the
    torch engine for the Hugging Face data and the token file), stopped by SIGTERM in the middle of epoch 2 and resumed, against
    one process x batch 64 never stopped: the same samples in the same global batches, so the same
    weights (to 1e-5: the sum over ranks rounds differently)."""
    launcher, args = SOURCES[source]
    data = {"npy": lambda: write_arrays(tmp_path / "arrays"), "hugging-face": lambda: write_hugging_face(tmp_path / "hf"),
            "tokens": lambda: write_tokens(tmp_path / "corpus.bin")}[source]()
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    done = _fit(None, data, whole, *args, "--batch-size", "64")
    assert_ok(done)
    steps = epoch_records(whole)[0]["step"]
    stopped = _fit(launcher, data, cut, *args, "--batch-size", "32",
                   HVDTRAIN_TEST_SIGNAL=f"1:{steps + steps // 2}:SIGTERM")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "stopped by SIGTERM at epoch 2" in stopped.stdout + stopped.stderr
    resumed = _fit(launcher, data, cut, *args, "--batch-size", "32", "--resume")
    assert_ok(resumed)
    assert "samples into epoch 2" in resumed.stdout
    assert_same_weights(final_weights(whole), final_weights(cut), atol=1e-5)
    summary = run_summary(cut)
    assert summary["world_size"] == 2 and summary["epochs"] == 2


@pytest.mark.system
@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.timeout(600)
def test_two_gigabyte_files_train_in_under_a_gigabyte_of_each_rank_s_own_memory(tmp_path):
    """A 2 GB x.npy (2M samples of 256 float32 features) and a 2 GB token file (1G uint16 ids), each
    under horovodrun -np 2 for 20 steps of a full-size epoch (then every rank signals itself and the
    run stops with a checkpoint): the most anonymous memory (RssAnon: not the file pages it maps) any
    rank held from its start to its end, read from /proc every 0.1 s, stays under 1 GB, while the files
    are twice that."""
    runs = {"npy": (_two_gigabytes_of_arrays, ["--model", "user_code:signals_itself", "--batch-size", "256"]),
            "tokens": (_two_gigabytes_of_tokens, ["--model", "user_code:signals_itself_lm", "--task", "language-model",
                                                  "--set", "data.context=256", "--batch-size", "16"])}
    for name, (write, args) in runs.items():
        data = write(tmp_path)
        size = sum(path.stat().st_size for path in ([data] if data.is_file() else data.iterdir()))
        assert size >= 2 << 30
        run_dir = tmp_path / f"run-{name}"
        peaks: dict[int, int] = {}
        done_watching = threading.Event()
        watcher = threading.Thread(target=_watch_ranks, args=(run_dir, peaks, done_watching), daemon=True)
        watcher.start()
        try:
            done = _fit("horovodrun-gloo", data, run_dir, *args, HVDTRAIN_TEST_SIGNAL="all:20:SIGTERM")
        finally:  # pytest keeps the last runs' directories: not 2 GB files
            done_watching.set()
            watcher.join()
            shutil.rmtree(data) if data.is_dir() else data.unlink()
        assert done.returncode == 75, done.stderr[-3000:]
        most = {pid: kb / 1024 for pid, kb in peaks.items()}
        assert len(most) == 2 and max(most.values()) < 1024, (name, most)
        print(f"{name}: {size / 2**30:.2f} GB, most RssAnon per rank (MB): {sorted(most.values())}")


def _watch_ranks(run_dir: Path, peaks: dict[int, int], done: threading.Event) -> None:
    """RssAnon of the ranks (Python processes running fit in `run_dir`, not the launcher), every 0.1 s."""
    import psutil

    while not done.is_set():
        for process in psutil.process_iter(["cmdline"]):
            line = process.info["cmdline"] or []
            if not line or "python" not in Path(line[0]).name or "fit" not in line or str(run_dir) not in line or \
                    any(Path(arg).name == "horovodrun" for arg in line):
                continue
            try:
                status = Path(f"/proc/{process.pid}/status").read_text()
            except OSError:  # gone meanwhile
                continue
            anon = next((int(row.split()[1]) for row in status.splitlines() if row.startswith("RssAnon:")), 0)
            peaks[process.pid] = max(peaks.get(process.pid, 0), anon)
        time.sleep(0.1)


def _two_gigabytes_of_arrays(parent: Path) -> Path:
    """2M samples of 256 float32 features (2 GiB) and their labels: one random slice written 32 times."""
    samples, features, piece = 2 << 20, 256, 1 << 16
    directory = parent / "arrays"
    directory.mkdir()
    block = np.random.default_rng(0).standard_normal((piece, features), dtype=np.float32)
    with open(directory / "x.npy", "wb") as handle:
        np.lib.format.write_array_header_1_0(handle, {"descr": "<f4", "fortran_order": False,
                                                      "shape": (samples, features)})
        for _ in range(samples // piece):
            handle.write(block.tobytes())
    np.save(directory / "y.npy", np.arange(samples) % 10)
    return directory


def _two_gigabytes_of_tokens(parent: Path) -> Path:
    """1G uint16 token ids (2 GiB) of a vocabulary of 64."""
    path = parent / "tokens.bin"
    with open(path, "wb") as handle:
        for start in range(16):
            handle.write(((np.arange(1 << 26, dtype=np.uint16) * 3 + start) % 64).tobytes())
    return path
