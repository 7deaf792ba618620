"""hvdtrain from Python: `hvdtrain.fit` with objects ends where `hvdtrain fit` with factories does,
alone and under horovodrun, mpirun and torchrun; what it refuses, it refuses in one clear error."""

from __future__ import annotations

import json
import re
import sys
import time

import pytest
import torch
from torch.utils.data import TensorDataset

import hvdtrain
from conftest import (ROOT, assert_ok, assert_same_weights, final_weights, fit_under, python_under,
                      requires_launchers, run)
from hvdtrain import UserError

SCRIPT = ROOT / "tests" / "workers" / "api_script.py"
LAUNCH = ROOT / "tests" / "workers" / "api_launch.py"
OWN_HOROVOD = ROOT / "tests" / "workers" / "own_horovod.py"
SWEEP = ROOT / "tests" / "workers" / "api_sweep.py"
# The script's pieces as the command names them (tests/user_code.py).
AS_FACTORIES = ["--data", "user_code:blobs_split", "--model", "user_code:tiny_net", "--task", "torch.nn:CrossEntropyLoss",
                "--epochs", "3", "--batch-size", "16", "--set", "optim.momentum=0.5"]


@pytest.fixture(scope="module")
def command_run(tmp_path_factory):
    """`hvdtrain fit` under horovodrun -np 2 with the script's pieces as factories."""
    run_dir = tmp_path_factory.mktemp("command") / "run"
    done = fit_under("horovodrun-gloo", *AS_FACTORIES, "--run-dir", str(run_dir))
    assert_ok(done)
    return run_dir


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "mpirun", "torchrun"])
def test_a_script_with_objects_ends_with_the_command_s_weights(launcher, command_run, tmp_path):
    """The script's objects train to the command's weights, and every rank gets the same summary back
    (rank 0's, its best epoch too). The script then trains again and evaluates in the same process:
    the same weights again, and the evaluation gives the run's last validation loss.

    Last, rank 1's data set fails in a data-loader worker. Its fit raises FailedAt naming it; rank 0's raises
    AnotherRankFailed (not the engine's own error, which reads as a failure of rank 0); the script catches
    both and ends. Before, the failed fit's workers (kept alive by the exception's frames, and ignoring
    SIGTERM) kept the interpreter from exiting: the job hung.

    Under mpirun and torchrun the script starts Horovod (hvd.init()) or its process group itself first, as
    scripts written for them do: fit joins it, and leaves it running for the script's own use after (before,
    fit shut down the script's Horovod, and refused the script's process group as a failed fit's)."""
    import psutil

    own = ["own-library"] if launcher in ("mpirun", "torchrun") else []
    done = run([*python_under(launcher), str(SCRIPT), str(tmp_path / "run"), *own], cwd=tmp_path, timeout=180)
    assert_ok(done)
    if own:
        for rank in (0, 1):
            assert f"rank {rank} own library after the fits: sum of ranks 1" in done.stdout, done.stdout[-2000:]
    if launcher == "torchrun":
        assert "rendezvous (the script's own process group)" in done.stderr, done.stderr[-2000:]
        assert "rendezvous env://" not in done.stderr, done.stderr[-2000:]  # every fit joined it
    for rank in (0, 1):
        assert f"rank {rank} summary epochs 3 world size 2" in done.stdout, done.stdout[-2000:]
    summaries = {rank: json.JSONDecoder().raw_decode(done.stdout.split(f"rank {rank} whole summary ", 1)[1])[0]
                 for rank in (0, 1)}
    assert summaries[0] == summaries[1] and summaries[0]["best_epoch"] is not None, summaries
    assert_same_weights(final_weights(command_run), final_weights(tmp_path / "run"), atol=1e-6)
    assert_same_weights(final_weights(command_run), final_weights(tmp_path / "run-again"), atol=1e-6)
    # A launcher can join two ranks' lines into one: the numbers are found wherever they are.
    again = re.findall(r"rank (\d) again val_loss ([0-9.eE+-]+) evaluated ([0-9.eE+-]+)", done.stdout)
    assert sorted(rank for rank, *_ in again) == ["0", "1"], done.stdout[-2000:]
    assert all(float(trained) == pytest.approx(float(evaluated), rel=1e-6) for _, trained, evaluated in again), again
    assert re.search(r"rank 1 fit raised hvdtrain\.errors\.FailedAt: rank 1 failed at epoch \d+, step \d+: "
                     r"OSError: corrupt record", done.stdout), done.stdout[-3000:]
    assert re.search(r"rank 0 fit raised hvdtrain\.errors\.AnotherRankFailed: the job stopped in a collective "
                     r"\(epoch \d+, step \d+\), as another rank failed or left", done.stdout), done.stdout[-3000:]
    ends = re.findall(r"rank (\d) script ends ([0-9.]+) s after the failing fit started", done.stdout)
    assert sorted(rank for rank, _ in ends) == ["0", "1"] and all(float(s) < 40 for _, s in ends), done.stdout[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    time.sleep(1)
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]


@pytest.mark.multiprocess
@requires_launchers
def test_a_script_s_own_horovod_without_mpi4py_outlives_its_fits(tmp_path):
    """hvd.init() by the script, no mpi4py: Horovod started MPI, and hvdtrain must neither shut it down nor take
    its second fit for one after MPI ended; a timeline, which the script's start did not allow, is one error."""
    done = assert_ok(run(["mpirun", "-np", "1", sys.executable, str(OWN_HOROVOD), str(tmp_path / "run")], cwd=tmp_path,
                         timeout=120))
    assert "fit 1: world size 1" in done.stdout and "fit 2: world size 1" in done.stdout, done.stdout[-2000:]
    assert "refused: --horovod-timeline needs HOROVOD_TIMELINE=DYNAMIC when Horovod starts, and this script " \
           "started Horovod itself (hvd.init()) without it" in done.stdout
    assert "after the fits: Horovod of 1, allreduce 1.0" in done.stdout


@pytest.mark.multiprocess
@requires_launchers
def test_a_sweep_that_fails_between_fits_ends_instead_of_hanging(tmp_path):
    """Under mpirun, rank 0's script raises after a fit while rank 1 waits for it in the next one: the
    job ends (MPI_Abort; rank 0 would otherwise wait in MPI_Finalize for rank 1) with the script's own
    error. Under torchrun, a fit that failed leaves its process group: the next fit says so in one line.
    Under horovodrun, rank 1's fit fails and no rank catches what fit raises: rank 1's error (a traceback: the
    script's own) is the job's; rank 0 notes where the job stood in one line and leaves as the command's
    survivor does. Its AnotherRankFailed traceback and exit status 1 read as a second failure, and horovodrun
    named worker 0, whose exit came first. Under torchrun, bad input on rank 1 not caught is rank 0's one line
    naming rank 1 and status 2, as from the command, not a traceback from every rank."""
    import psutil

    started = time.monotonic()
    done = run([*python_under("mpirun"), str(SWEEP), str(tmp_path / "mpi"), "raise-between"], timeout=120)
    assert done.returncode != 0 and time.monotonic() - started < 90, done.stderr[-2000:]
    assert "PermissionError: results.csv is not writable" in done.stdout + done.stderr
    time.sleep(1)
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    again = assert_ok(run([*python_under("torchrun"), str(SWEEP), str(tmp_path / "torch"), "after-a-failed-fit"],
                          timeout=120))
    for rank in (0, 1):
        assert f"rank {rank} second fit refused: rank {rank}: an earlier fit or evaluate in this process failed " \
               "and left its process group: start the next one in a launch of its own" in again.stdout, again.stdout
    uncaught = run([*python_under("horovodrun-gloo"), str(SWEEP), str(tmp_path / "gloo"), "uncaught"], timeout=120)
    output = uncaught.stdout + uncaught.stderr
    assert uncaught.returncode == 1, output[-3000:]
    assert output.rstrip().splitlines()[-1] == "horovodrun: worker 1 exited with status 1; the other workers were " \
                                               "stopped", output[-3000:]
    assert "[1]<stderr>:RuntimeError: the callback of rank 1 broke" in output, output[-3000:]
    assert "[0]<stderr>:hvdtrain: the job stopped in a collective (the end of epoch 1), as another rank failed or " \
           "left" in output and "[0]<stderr>:Traceback" not in output, output[-3000:]
    bad = run([*python_under("torchrun"), str(SWEEP), str(tmp_path / "bad"), "bad-input"], timeout=120)
    assert bad.returncode == 2, bad.stderr[-3000:]
    said = [line for line in bad.stderr.splitlines() if line.startswith("hvdtrain: error: ")]
    assert len(said) == 1 and said[0].startswith("hvdtrain: error: rank 1 failed: data set factory 'user_code:"
                                                 "missing_on_rank_one' raised FileNotFoundError: /data/train.npy "
                                                 "(missing on this host) ("), bad.stderr[-3000:]
    assert "Traceback" not in bad.stderr, bad.stderr[-3000:]


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.parametrize("engine", ["horovod", "torch"])
def test_launch_from_a_plain_process_trains_as_the_command_and_names_a_failing_rank(engine, command_run, tmp_path):
    """hvdtrain.launch(np=2) from `python`, not under a launcher: the script's training as a function ends
    with the command's weights, rank 0's summary comes back; a rank that fails is named in the exception."""
    done = run([sys.executable, str(LAUNCH), engine, str(tmp_path / "run")], cwd=tmp_path, timeout=180)
    assert_ok(done)
    assert f'summary: {{"world_size": 2, "engine": "{engine}"}}' in done.stdout
    assert_same_weights(final_weights(command_run), final_weights(tmp_path / "run"), atol=1e-6)
    assert "caught: rank=1 rank 1 failed: ValueError: rank one's shard is corrupt" in done.stdout


def test_launch_refuses_what_it_cannot_run():
    with pytest.raises(UserError, match="engine must be one of horovod, torch, got 'mpi'"):
        hvdtrain.launch(print, np=2, engine="mpi")
    with pytest.raises(UserError, match="np must be a whole number of processes, at least 1, got 0"):
        hvdtrain.launch(print, np=0)
    with pytest.raises(UserError, match="launch takes a function or fit's settings as a dict, got int"):
        hvdtrain.launch(42)


def test_one_process_script_equals_the_command_alone(tmp_path):
    """The script without a launcher against the command without one (both on the local engine)."""
    done = run([sys.executable, str(SCRIPT), str(tmp_path / "script")], cwd=tmp_path, timeout=120)
    assert_ok(done)
    command = fit_under(None, *AS_FACTORIES, "--run-dir", str(tmp_path / "command"))
    assert_ok(command)
    assert_same_weights(final_weights(tmp_path / "command"), final_weights(tmp_path / "script"), atol=0)
    assert_same_weights(final_weights(tmp_path / "command"), final_weights(tmp_path / "script-again"), atol=0)


def _blobs():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (120,), generator=g)
    return TensorDataset(torch.randn(120, 5, generator=g) + y[:, None], y)


@pytest.mark.parametrize("call, message", [
    (dict(model="user_code:tiny_net", data=(torch.zeros(4, 5), torch.zeros(4))), "data takes Datasets, not tensors"),
    (dict(model="user_code:tiny_net", data=42), "data must be a map-style Dataset"),
    (dict(model="user_code:tiny_net", data={"train": _blobs(), "test": _blobs()}),
     "data got a dict of 'train', 'test': pass a (train, val) pair of its data sets, (splits['train'], "
     "splits['test']) say"),
    (dict(model="user_code:tiny_net", data=(_blobs(), _blobs(), _blobs())),
     "data got 3 data sets: pass a (train, val) pair, and evaluate another set after fit with "
     "hvdtrain.evaluate(run_dir, data=test_set)"),
    (dict(model="user_code:tiny_net", data=torch.utils.data.DataLoader(_blobs())),
     "data got a DataLoader: pass its data set (loader.dataset)"),
    (dict(model="user_code:tiny_net", data=(torch.utils.data.DataLoader(_blobs()), _blobs())),
     "data got a pair whose train set is a DataLoader: pass its data set (loader.dataset)"),
    (dict(model=42, data=_blobs()), "model must be an nn.Module, a function that builds one, or a name; got int"),
    (dict(data=_blobs(), batch_sise=4), "unknown setting 'batch_sise': did you mean batch_size=...?"),
    # habits of other trainers: a third positional data set, Trainer's split arguments, a built optimizer
    (dict(model="user_code:tiny_net", data=_blobs(), task=_blobs()), "task got a data set (TensorDataset): give the "
     "training and validation sets as one pair, hvdtrain.fit(model, (train_set, val_set))"),
    (dict(model="user_code:tiny_net", train_dataset=_blobs(), eval_dataset=_blobs()), "fit takes its data as one "
     "argument, not eval_dataset, train_dataset: hvdtrain.fit(model, data=(train_set, val_set))"),
    (dict(model="user_code:tiny_net", data=_blobs(), optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)],
                                                                               lr=0.1)),
     "optimizer got an optimizer already built (SGD): give its class (optimizer=torch.optim.SGD, options in "
     "overrides={'optim.args': {...}}) or a function of (params, lr) that builds it"),
    # other tools' names, and a config key without a flag, point at ours
    (dict(data=_blobs(), learning_rate=0.1), "unknown setting 'learning_rate': did you mean lr=...?"),
    (dict(data=_blobs(), output_dir="runs/x"), "unknown setting 'output_dir': did you mean run_dir=...?"),
    (dict(data=_blobs(), val_fraction=0.1),
     "unknown setting 'val_fraction': did you mean overrides={'data.val_fraction': ...}? (it has no flag)"),
    (dict(data=_blobs(), overrides={"batch_size": 4}),
     "override 'batch_size' must be section.key, did you mean 'data.batch_size'?"),
    (dict(data=_blobs(), epochs=0), "config key 'train.epochs' must be at least 1"),
])
def test_what_fit_refuses_it_refuses_in_one_error(call, message, tmp_path):
    with pytest.raises(UserError, match=re.escape(message)):
        hvdtrain.fit(**call, run_dir=str(tmp_path / "run"), progress="off", engine="local")
    assert not (tmp_path / "run").exists()


def test_an_optimizer_class_or_function_is_the_optimizer_factory(tmp_path):
    """`optimizer=torch.optim.Adam` as `--optimizer torch.optim:Adam` (its options in optim.args), and a function."""
    hvdtrain.fit(model="user_code:tiny_net", data=_blobs(), optimizer=torch.optim.Adam, epochs=1, batch_size=16,
                 overrides={"optim.args": {"betas": [0.8, 0.9]}}, run_dir=str(tmp_path / "class"), progress="off",
                 engine="local")
    saved = torch.load(tmp_path / "class" / "checkpoints" / "last.pt", weights_only=True)
    assert saved["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9) and "exp_avg" in saved["optimizer"]["state"][0]
    hvdtrain.fit(model="user_code:tiny_net", data=_blobs(), optimizer=lambda params, lr: torch.optim.SGD(params, lr, 0.5),
                 epochs=1, batch_size=16, run_dir=str(tmp_path / "function"), progress="off", engine="local")
    saved = torch.load(tmp_path / "function" / "checkpoints" / "last.pt", weights_only=True)
    assert saved["optimizer"]["param_groups"][0]["momentum"] == 0.5


def test_a_list_of_two_data_sets_is_the_train_val_pair_and_a_data_set_that_is_a_list_is_one(tmp_path):
    train, val = _blobs(), TensorDataset(*_blobs()[:30])
    summary = hvdtrain.fit(model="user_code:tiny_net", data=[train, val], epochs=1, batch_size=16,
                           run_dir=str(tmp_path / "run"), progress="off", engine="local")
    assert summary["val_samples"] == 30

    class Samples(list, torch.utils.data.Dataset):  # a list of (x, y) samples: not train, val and test sets
        pass

    summary = hvdtrain.fit(model="user_code:tiny_net", data=Samples(zip(*_blobs()[:])), epochs=1, batch_size=16,
                           run_dir=str(tmp_path / "samples"), progress="off", engine="local",
                           overrides={"data.num_classes": 3})
    assert summary["val_samples"] == 24  # data.val_fraction (0.2) of its 120 samples


def test_evaluating_a_run_of_objects_from_the_command_says_why_it_cannot(tmp_path):
    hvdtrain.fit(model=torch.nn.Sequential(torch.nn.Linear(5, 3)), data=_blobs(), epochs=1, batch_size=16,
                 run_dir=str(tmp_path / "run"), progress="off", engine="local")
    done = run(["hvdtrain", "evaluate", str(tmp_path / "run")])
    assert done.returncode == 2 and done.stderr.strip() == (
        "hvdtrain: error: the model of this run was a Python object given to hvdtrain.fit: it cannot be rebuilt "
        "here; give it again from Python, or use a package.module:function")


def test_callback_objects_are_called_and_can_stop_the_run(tmp_path):
    class StopAfterTwo:
        def __init__(self):
            self.epochs = []

        def on_epoch_end(self, state):
            self.epochs.append(state.epoch)
            if state.epoch == 2:
                state.stop("two are enough")

    callback = StopAfterTwo()
    summary = hvdtrain.fit(data=_blobs(), model="user_code:tiny_net", epochs=5, batch_size=16, callbacks=[callback],
                           run_dir=str(tmp_path / "run"), progress="off", engine="local")
    assert callback.epochs == [1, 2] and summary["stopped"] == "two are enough" and summary["epochs"] == 2


@pytest.mark.parametrize("callbacks", ["user_code:Recorder", ["user_code:Recorder"], iter(["user_code:Recorder"])],
                         ids=["alone", "listed", "any iterable"])
def test_callbacks_named_as_on_the_command_line(callbacks, tmp_path, monkeypatch):
    """`callbacks=["mymodule:MyCallback"]`, as --callback names it (a name alone, as a list of one): before,
    its letters were taken for callbacks."""
    monkeypatch.setenv("HVDTRAIN_TEST_RECORD", str(tmp_path / "record"))
    hvdtrain.fit(data=_blobs(), model="user_code:tiny_net", epochs=1, batch_size=16, callbacks=callbacks,
                 run_dir=str(tmp_path / "run"), progress="off", engine="local")
    hooks = [json.loads(line)["hook"] for line in (tmp_path / "record.0").read_text().splitlines()]
    assert hooks[0] == "on_fit_start" and hooks.count("on_epoch_end") == 1 and hooks[-1] == "on_fit_end"


def test_evaluate_predict_and_export_take_the_run_s_objects_again(tmp_path):
    """A run trained from objects is opened from Python with those objects: evaluate equals fit's last
    record, predict gives one answer per sample in order, export loads back."""
    train, val = _blobs(), _blobs()
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    summary = hvdtrain.fit(model=net, data=(train, val), epochs=2, batch_size=16, run_dir=str(tmp_path / "run"),
                           progress="off", engine="local")
    fresh = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    evaluated = hvdtrain.evaluate(tmp_path / "run", model=fresh, data=(train, val), split="val")
    assert evaluated["samples"] == 120 and evaluated["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    assert evaluated["acc"] == pytest.approx(summary["val_acc"])
    predicted = hvdtrain.predict(tmp_path / "run", model=fresh, data=val)
    assert predicted.shape == (120,)
    assert (predicted == val.tensors[1]).float().mean().item() == pytest.approx(summary["val_acc"])
    path = hvdtrain.export(tmp_path / "run", model=fresh, data=val, format="pt2")
    assert path == tmp_path / "run" / "export" / "model.pt2" and path.exists()


def test_a_model_object_named_on_the_command_line_is_one_line(tmp_path):
    done = fit_under(None, "--data", "user_code:blobs", "--model", "user_code:MODEL_OBJECT", "--run-dir",
                     str(tmp_path / "run"))
    assert done.returncode == 2 and not (tmp_path / "run").exists()
    assert done.stderr.strip().splitlines()[-1] == (
        "hvdtrain: error: model 'user_code:MODEL_OBJECT' is an nn.Module object, not a function that builds one: "
        "name a function (def model(): return Net()), or pass the object to hvdtrain.fit(model=...)")


@pytest.mark.multiprocess
@requires_launchers
def test_a_callback_on_rank_0_alone_still_stops_every_rank(tmp_path):
    done = run([*python_under("horovodrun-gloo"), str(SCRIPT), str(tmp_path / "run"), "rank0-callback"], cwd=tmp_path,
               timeout=180)
    assert_ok(done)
    for rank in (0, 1):
        assert f"rank {rank} summary epochs 2 world size 2" in done.stdout, done.stdout[-2000:]
    assert "hvdtrain: stopped: epoch two is enough (rank 0); at epoch 2, step" in done.stdout
