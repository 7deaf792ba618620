"""`hvdtrain fit` in one process (the local engine): files, resume, accumulation."""

import os
import platform
import re
import select
import socket
import subprocess
import sys
import time

import pytest
import torch
import yaml

from conftest import ROOT, assert_ok, assert_same_weights, epoch_records, final_weights, launch_env, run_summary
from hvdtrain.cli import main

RANDOM = ["--data", "random", "--set", "data.samples=512", "--set", "data.features=16",
          "--progress", "off", "--engine", "local", "--threads", "1"]


def fit(*args):
    main(["fit", *RANDOM, *args])


def test_a_lazy_model_on_half_precision_inputs_gets_its_weights_under_training_s_autocast(tmp_path):
    """Lazy layers are made by a forward that runs as training's does: under --precision bf16, float16
    inputs meet the layers in bf16 (without autocast, as the first build did, float16 met float32)."""
    main(["fit", "--progress", "off", "--data", "user_code:half_inputs", "--model", "user_code:lazy_net",
          "--precision", "bf16", "--epochs", "1", "--run-dir", str(tmp_path / "run")])
    assert final_weights(tmp_path / "run")["0.weight"].shape == (16, 6)


def test_run_directory_holds_what_the_readme_says(tmp_path, capsys):
    run_dir = tmp_path / "run"
    fit("--epochs", "3", "--run-dir", str(run_dir))
    out = capsys.readouterr().out
    assert "epoch 3/3" in out and f"results in {run_dir}/summary.json" in out
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["data"]["name"] == "random" and config["train"]["epochs"] == 3
    records = epoch_records(run_dir)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    summary = run_summary(run_dir)
    for key in ("world_size", "epochs", "steps", "val_acc", "val_loss", "train_samples_per_s", "wall_s"):
        assert summary[key] is not None, key
    assert summary["world_size"] == 1 and summary["steps"] == 3 * (410 // 64)
    assert summary["val_acc"] > 0.5  # learnable synthetic data, well above 0.1 chance
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "epoch", "step", "config"} <= state.keys() and state["epoch"] == 3
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "best.pt", "epoch-0001.pt", "epoch-0002.pt", "epoch-0003.pt", "last.pt", "manifest.json"]


def test_a_path_given_as_tilde_after_an_equals_sign_is_the_home_directory_s(tmp_path, monkeypatch):
    """`--run-dir=~/run` and `--output=~/p.npy`: a shell expands `~` only at a word's start, so these came
    unexpanded, and fit made a folder named `~` in the working directory (one `rm -rf ~` from disaster)."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    fit("--epochs", "1", "--run-dir=~/run")
    main(["predict", "~/run", "--output=~/p.npy"])
    assert (home / "run" / "summary.json").is_file() and (home / "p.npy").is_file()
    assert list(elsewhere.iterdir()) == []


def test_resume_ends_with_the_same_weights(tmp_path):
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    fit("--epochs", "4", "--run-dir", str(whole))
    fit("--epochs", "2", "--run-dir", str(halves))
    fit("--epochs", "4", "--run-dir", str(halves), "--resume")
    assert_same_weights(final_weights(whole), final_weights(halves), atol=0.0)
    epochs = [r["epoch"] for r in epoch_records(halves)]
    assert epochs == [1, 2, 3, 4]
    # Its config.yaml is the run's recipe: given to fit again, it trains the same run afresh elsewhere, not
    # resuming this one (it said resume: true), and with --overwrite over it, not refused as a clash.
    again = tmp_path / "again"
    main(["fit", "--config", str(halves / "config.yaml"), "--run-dir", str(again)])
    assert_same_weights(final_weights(whole), final_weights(again), atol=0.0)
    main(["fit", "--config", str(halves / "config.yaml"), "--run-dir", str(again), "--overwrite", "--epochs", "1"])
    assert [r["epoch"] for r in epoch_records(again)] == [1]


def test_accumulation_equals_a_larger_batch(tmp_path):
    fit("--epochs", "2", "--batch-size", "8", "--accumulate", "4", "--no-scale-lr", "--run-dir", str(tmp_path / "a"))
    fit("--epochs", "2", "--batch-size", "32", "--run-dir", str(tmp_path / "b"))
    assert_same_weights(final_weights(tmp_path / "a"), final_weights(tmp_path / "b"), atol=1e-5)


def test_adamw_clipping_and_cosine_train(tmp_path):
    fit("--epochs", "2", "--optimizer", "adamw", "--lr", "0.01", "--clip-grad-norm", "0.5",
        "--set", "optim.schedule=cosine", "--run-dir", str(tmp_path / "r"))
    summary = run_summary(tmp_path / "r")
    assert summary["val_acc"] > 0.5


def test_same_seed_same_run(tmp_path):
    fit("--epochs", "2", "--seed", "7", "--run-dir", str(tmp_path / "a"))
    fit("--epochs", "2", "--seed", "7", "--run-dir", str(tmp_path / "b"))
    fit("--epochs", "2", "--seed", "8", "--run-dir", str(tmp_path / "c"))
    assert_same_weights(final_weights(tmp_path / "a"), final_weights(tmp_path / "b"), atol=0.0)
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(tmp_path / "a"), final_weights(tmp_path / "c"), atol=0.0)


def test_user_factories_train(tmp_path):
    main(["fit", "--data", "user_code:blobs", "--model", "user_code:tiny_net", "--epochs", "3",
          "--batch-size", "16", "--progress", "off", "--engine", "local", "--run-dir", str(tmp_path / "r")])
    assert run_summary(tmp_path / "r")["val_acc"] > 0.8


def test_python_dash_m_and_config_command():
    done = subprocess.run([sys.executable, "-m", "hvdtrain", "config"], capture_output=True, text=True, cwd=ROOT)
    assert "batch_size: 64" in assert_ok(done).stdout
    assert yaml.safe_load(done.stdout)["data"]["name"] == "digits"


_SCRIPT_FIT = """
import hvdtrain
hvdtrain.fit(data="random", epochs=1, run_dir={run!r}, progress="off", engine="local", threads=1,
             overrides={{"data.samples": 256, "data.features": 8}})
"""


def _writes(command: list[str], cwd) -> tuple[int, dict[str, list[bytes]]]:
    """Runs `command` under PYTHONUNBUFFERED=1, as horovodrun runs its ranks; returns its exit status and
    each of stdout's and stderr's writes, one by one: a datagram socket keeps the boundaries a pipe loses
    (empty writes, such as click's probe of a stream, are left out)."""
    pairs = {name: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for name in ("stdout", "stderr")}
    process = subprocess.Popen(command, cwd=cwd, env={**launch_env(), "PYTHONUNBUFFERED": "1"},
                               stdout=pairs["stdout"][1], stderr=pairs["stderr"][1])
    writes: dict[str, list[bytes]] = {name: [] for name in pairs}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ended = process.poll() is not None  # read once more after the end: what it wrote last
        ready, _, _ = select.select([ours for ours, _ in pairs.values()], [], [], 0.1)
        for name, (ours, _) in pairs.items():
            if ours in ready:
                writes[name] += [write for write in [ours.recv(1 << 16)] if write]
        if ended and not ready:
            break
    process.kill()
    for ours, theirs in pairs.values():
        ours.close()
        theirs.close()
    return process.wait(), writes


@pytest.fixture(scope="module")
def command_writes(tmp_path_factory) -> tuple[int, dict[str, list[bytes]]]:
    """`hvdtrain fit` under PYTHONUNBUFFERED=1, with a callback that prints the garbage collector's state:
    its exit status and each of its writes."""
    folder = tmp_path_factory.mktemp("command")
    return _writes([sys.executable, "-m", "hvdtrain", "fit", *RANDOM, "--epochs", "1", "--run-dir",
                    str(folder / "run"), "--callback", "user_code:ReportsCollector"], folder)


def test_each_line_leaves_the_process_in_one_write_where_python_writes_through(command_writes, tmp_path):
    """horovodrun runs its ranks with PYTHONUNBUFFERED=1 and tags each piece of their output it reads: a line
    written as its text, then its newline, came out as `...7.3s[1,0]<stdout>:` and an empty tagged line.
    Each line of the command's process (a user's callback's print among them) and each of a script's fit's
    leaves whole: the run directory, the epoch, the end."""
    script = [sys.executable, "-c", _SCRIPT_FIT.format(run=str(tmp_path / "b"))]
    for (status, writes), count in ((command_writes, 4), (_writes(script, tmp_path), 3)):
        lines = writes["stdout"]
        assert status == 0 and len(lines) == count, writes
        assert all(write.endswith(b"\n") and write.count(b"\n") == 1 for write in lines), lines


def test_the_command_freezes_what_its_imports_made_and_runs_the_collector_again_a_script_s_is_its_own(
        command_writes, tmp_path, capsys):
    """`hvdtrain fit` holds the garbage collector while torch and Horovod load, then freezes what they made
    and turns it on again before the user's code runs; `hvdtrain.fit` in a script leaves it as it is."""
    import gc

    status, writes = command_writes
    output = b"".join(writes["stdout"]).decode()
    said = re.search(r"collector enabled (\w+) frozen (\d+)", output)
    assert status == 0 and said and said[1] == "True" and int(said[2]) > 100_000, writes
    assert gc.isenabled() and gc.get_freeze_count() == 0  # pytest's process, as any script's
    import hvdtrain
    from user_code import ReportsCollector

    hvdtrain.fit(data="random", epochs=1, run_dir=str(tmp_path / "b"), progress="off", engine="local",
                 callbacks=[ReportsCollector()], overrides={"data.samples": 256, "data.features": 8})
    assert "collector enabled True frozen 0" in capsys.readouterr().out


_COUNT_FAULTS = """
import resource, sys
from hvdtrain.cli import main
main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_training_steps_reuse_freed_host_memory_instead_of_faulting_it_back(tmp_path):
    """Once training runs, further steps add (almost) no page faults: freed gradients and
    activations stay in the heap. Without the setting, glibc's own threshold sometimes lets
    every step fault about 8 MB back (2,000+ faults a step, BENCHMARKS.md), sometimes not,
    so the test bounds the default's faults per step rather than comparing with that."""
    faults, steps = {}, {}
    for epochs in (1, 3):
        run_dir = tmp_path / str(epochs)
        done = subprocess.run(
            [sys.executable, "-c", _COUNT_FAULTS, "fit", "--engine", "local", "--threads", "1", "--epochs", str(epochs),
             "--data", "benchmarks.jobs:synthetic", "--model", "benchmarks.jobs:small_cnn", "--progress", "off",
             "--run-dir", str(run_dir)],
            capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
        assert_ok(done)
        faults[epochs] = int(done.stdout.split()[-1])
        steps[epochs] = run_summary(run_dir)["steps"]
    per_step = (faults[3] - faults[1]) / (steps[3] - steps[1])
    print(f"minor page faults: {faults} for steps {steps}: {per_step:.1f} per further step")
    assert per_step < 256, (faults, steps)  # under 1 MB of 4 KB pages a step


def test_host_memory_setting_takes_effect_and_yields_to_the_users_own(monkeypatch):
    from hvdtrain.engine import host_memory

    assert host_memory.keep_freed_memory() == (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1048576")
    assert host_memory.keep_freed_memory() is False


def test_a_non_finite_loss_from_non_finite_data_blames_the_data_not_the_learning_rate(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--engine", "local", "--progress", "off", "--data", "user_code:nan_in_one_sample",
              "--batch-size", "16", "--epochs", "1",
              "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert re.search(r"non-finite loss at step \d+ on rank 0 \(loss nan\): the data holds NaN or Inf \(rank 0's "
                     r"sample \d+ of its batch\)", err), err
    assert "lower --lr" not in err and "Traceback" not in err


def _fit_whose_reader_leaves(prefix: list[str], run_dir, stdout_ours, stdout_theirs) -> tuple[int, str]:
    """`hvdtrain fit` (3 epochs) writing into `stdout_theirs`; once its first line is read from
    `stdout_ours`, that end is closed: the lines that follow meet a reader that has gone."""
    with open(run_dir.parent / f"{run_dir.name}.err", "w+") as err:
        process = subprocess.Popen([*prefix, "hvdtrain", "fit", *RANDOM[:-4], "--epochs", "3",
                                    "--run-dir", str(run_dir)], env=launch_env(), stdout=stdout_theirs, stderr=err)
        os.close(stdout_theirs)
        first = os.read(stdout_ours, 4096)
        os.close(stdout_ours)
        status = process.wait(timeout=180)
        err.seek(0)
        return status, first.decode() + err.read()


@pytest.mark.multiprocess
def test_fit_goes_on_when_the_reader_of_its_output_goes_away(tmp_path):
    """`hvdtrain fit | head -1` under torchrun (EPIPE), and a job whose terminal closed under it (EIO): a
    worker ended with status 1 and not a word at its next line (click's way with EPIPE), before its next
    checkpoint; under mpirun, which keeps reading, the ranks went on. Now the run goes on to its end, and
    one line on stderr says where the lines went."""
    ours, theirs = os.pipe()
    status, output = _fit_whose_reader_leaves(["torchrun", "--nproc-per-node", "2"], tmp_path / "pipe", ours, theirs)
    assert status == 0 and "reader has gone (a closed pipe)" in output and "Traceback" not in output, output
    assert run_summary(tmp_path / "pipe")["epochs"] == 3
    ours, theirs = os.openpty()  # closing the terminal's side makes the job's writes fail with EIO
    status, output = _fit_whose_reader_leaves([], tmp_path / "terminal", ours, theirs)
    assert status == 0 and "reader has gone (a terminal that hung up)" in output, output
    assert run_summary(tmp_path / "terminal")["epochs"] == 3
