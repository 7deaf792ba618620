"""After `fit`: evaluate, predict, export, TensorBoard, the timeline, plot, runs and plan, for real
under horovodrun and mpirun on one shared run directory, and on the run directories of every task."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (LAUNCHERS, assert_ok, assert_same_weights, epoch_records, final_weights, free_port,
                      requires_launchers, run, run_summary)
from hvdtrain.cli import main

LOCAL = ["--progress", "off", "--engine", "local", "--threads", "1"]
HVD2 = LAUNCHERS["horovodrun-mpi"][:1] + ["-np", "2"]  # plain horovodrun, as users type it
MPIRUN = LAUNCHERS["mpirun"]


@pytest.fixture(scope="module")
def trained(digits_np2) -> Path:
    """conftest's digits run of 3 epochs under `horovodrun -np 2`, with step logging and the timeline."""
    return digits_np2[0]


# --- TensorBoard and the timeline ---------------------------------------------------


@pytest.mark.multiprocess
@requires_launchers
def test_tensorboard_events_read_back_with_tensorboard_s_own_reader(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained))
    events.Reload()
    records = epoch_records(trained)
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "val/loss", "val/acc", "val/top5_acc", "lr", "train/samples_per_s",
            "steps/train_loss", "steps/lr", "steps/samples_per_s"} <= tags
    for tag, key in (("val/acc", "val_acc"), ("train/loss", "train_loss"), ("lr", "lr")):
        points = events.Scalars(tag)
        assert [p.step for p in points] == [r["step"] for r in records]
        assert [p.value for p in points] == pytest.approx([r[key] for r in records], rel=1e-6)
    steps = events.Scalars("steps/train_loss")
    assert [p.step for p in steps] == list(range(4, records[-1]["step"] + 1, 4))
    assert steps[-1].value < steps[0].value  # it learns


@pytest.mark.multiprocess
@requires_launchers
def test_the_horovod_timeline_holds_the_allreduces_of_the_run(trained):
    events = json.loads((trained / "horovod-timeline.json").read_text())  # whole: closed when fit ended
    names = {e.get("name") for e in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= names
    tensors = {e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e.get("args", {})}
    assert any(t.startswith("allreduce.") and t.endswith(".weight") for t in tensors), tensors
    assert sum(e.get("name") == "ALLREDUCE" for e in events) >= 3 * 11  # every step of 3 epochs


def test_the_timeline_needs_horovod(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["fit", *LOCAL, "--run-dir", str(tmp_path / "r"), "--horovod-timeline"])
    assert stop.value.code == 2 and "start it with horovodrun or mpirun" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# --- evaluate and predict under each launcher ------------------------------------------


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_evaluate_gives_fit_s_validation_metrics_under_a_launcher(trained, launcher, tmp_path):
    out = tmp_path / "eval.json"
    prefix = HVD2 if launcher == "horovodrun" else MPIRUN
    assert_ok(run([*prefix, "hvdtrain", "evaluate", str(trained), "--output", str(out)], cwd=tmp_path))
    result = json.loads(out.read_text())
    best = run_summary(trained)["best_epoch"]
    record = next(r for r in epoch_records(trained) if r["epoch"] == best)
    assert result["world_size"] == 2 and result["samples"] == record["val_samples"] == 359
    assert result["acc"] == record["val_acc"] and result["loss"] == pytest.approx(record["val_loss"], rel=1e-9)


@pytest.mark.multiprocess
@requires_launchers
def test_evaluate_on_data_each_rank_makes_otherwise_is_refused_in_one_line(trained, tmp_path):
    """Each rank would count its own samples as a share of one data set, and call the sum the metrics."""
    done = run([*MPIRUN, "hvdtrain", "evaluate", str(trained), "--data", "user_code:shuffled_by_a_generator_of_its_own",
                "--set", "data.args.digits=true", "--output", str(tmp_path / "eval.json")], cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert output.count("hvdtrain: error: rank 1 made other samples than rank 0: sample ") == 1, output[-3000:]
    assert not (tmp_path / "eval.json").exists()


@pytest.mark.multiprocess
@requires_launchers
def test_predict_writes_the_same_file_for_one_and_two_processes(trained, tmp_path):
    def predict(prefix: list[str], path: Path) -> str:
        args = ["predict", str(trained), "--data", "digits", "--output", str(path), "--batch-size", "50"]
        if prefix:
            assert_ok(run([*prefix, "hvdtrain", *args], cwd=tmp_path))
        else:
            main(args)  # one process, no launcher
        return hashlib.sha256(path.read_bytes()).hexdigest()

    assert predict([], tmp_path / "alone.npy") == predict(HVD2, tmp_path / "horovodrun.npy")
    assert predict([], tmp_path / "alone.jsonl") == predict(MPIRUN, tmp_path / "mpirun.jsonl")
    # In the input's order: the best checkpoint's classes of load_digits' images, one per image.
    from sklearn.datasets import load_digits

    predicted = np.load(tmp_path / "alone.npy")
    assert predicted.shape == (1797,) and (predicted == load_digits().target).mean() > 0.9
    lines = (tmp_path / "alone.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == list(range(1797))
    assert [json.loads(line)["prediction"] for line in lines] == predicted.tolist()


# --- export ---------------------------------------------------------------------------


@pytest.mark.multiprocess
@requires_launchers
def test_export_under_horovodrun_loads_back_and_matches(trained, tmp_path):
    out = assert_ok(run([*HVD2, "hvdtrain", "export", str(trained), "--format", "pt2", "--output",
                         str(tmp_path / "m.pt2")], cwd=tmp_path)).stdout
    assert "differ from the checkpoint's model by at most" in out
    program = torch.export.load(str(tmp_path / "m.pt2")).module()
    from hvdtrain.engine import LocalEngine
    from hvdtrain.after.saved_run import open_run

    saved = open_run(LocalEngine(torch.device("cpu")), trained)
    images = torch.randn(7, 1, 8, 8)  # another batch size than the export's
    assert torch.equal(program(images), saved.model(images).detach())


@pytest.mark.parametrize("fmt", ["safetensors", "torchscript", "onnx"])
def test_every_export_format_is_checked_by_loading_it_back(finished_digits, fmt, tmp_path, capsys):
    given = [] if fmt == "onnx" else ["--format", fmt]  # ONNX from the file's name alone
    main(["export", str(finished_digits), *given, "--output", str(tmp_path / f"model.{fmt}")])
    out = capsys.readouterr().out
    assert f"as {fmt} to" in out and "differ from the checkpoint's model by at most" in out
    assert float(out.rsplit("at most ", 1)[1]) <= 1e-4
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left
    if fmt == "safetensors":
        from safetensors import safe_open

        with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
            config = json.loads(handle.metadata()["hvdtrain.config"])
        assert config["model"]["name"] == "mlp" and handle is not None


@pytest.mark.parametrize("args, message", [
    (["--output", "model.pt"], "--output 'model.pt' does not say which format to write: give --format"),
    (["--format", "onnx", "--output", "out/model.safetensors"],
     "--format onnx and --output 'out/model.safetensors' disagree: its name says safetensors; name it out/model.onnx, "
     "or give --format safetensors"),
])
def test_an_export_whose_file_name_says_another_format_or_none_is_one_line(finished_digits, args, message, tmp_path,
                                                                           capsys, monkeypatch):
    """safetensors went into model.onnx when --format was left out; a .pt name says none of the formats."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(finished_digits), *args])
    assert exit_info.value.code == 2 and capsys.readouterr().err.startswith(f"hvdtrain: error: {message}")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def finished_digits(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("digits") / "run"
    main(["fit", *LOCAL, "--epochs", "2", "--run-dir", str(run_dir)])
    return run_dir


# --- every task's run directory ----------------------------------------------------------

TASKS = {
    "regression": ["--data", "user_code:regression_data", "--task", "regression", "--optimizer", "adamw",
                   "--lr", "0.01"],
    "multilabel": ["--data", "user_code:multilabel_data", "--task", "multilabel", "--batch-size", "16"],
    "language-model": ["--data", "user_code:sequences", "--model", "user_code:bigram_lm", "--task",
                       "language-model", "--batch-size", "16", "--optimizer", "adamw", "--lr", "0.05"],
    "own loss, dict batches": ["--data", "user_code:dict_blobs", "--model", "user_code:own_loss",
                               "--set", "task.target_key=y", "--batch-size", "16"],
    "user task": ["--data", "user_code:blobs", "--model", "user_code:tiny_net", "--task",
                  "torch.nn:CrossEntropyLoss", "--batch-size", "16"],
}
PREDICTION_SHAPES = {"regression": (300, 2), "multilabel": (300, 4), "language-model": (320, 12),
                     "own loss, dict batches": (300,), "user task": (300, 3)}


@pytest.mark.parametrize("task", TASKS)
def test_evaluate_predict_and_export_work_for_every_task(task, tmp_path, capsys):
    run_dir = tmp_path / "run"
    main(["fit", *LOCAL, "--epochs", "2", "--run-dir", str(run_dir), *TASKS[task]])
    last = epoch_records(run_dir)[-1]
    main(["evaluate", str(run_dir), "--checkpoint", "last", "--output", str(tmp_path / "e.json")])
    result = json.loads((tmp_path / "e.json").read_text())
    for key, value in last.items():
        if key.startswith("val_") and key != "val_samples":
            assert result[key.removeprefix("val_")] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    main(["predict", str(run_dir), "--split", "all", "--output", str(tmp_path / "p.npy")])
    assert np.load(tmp_path / "p.npy").shape == PREDICTION_SHAPES[task]
    main(["export", str(run_dir), "--format", "pt2", "--output", str(tmp_path / "m.pt2")])
    main(["export", str(run_dir), "--format", "safetensors", "--output", str(tmp_path / "m.safetensors")])
    assert capsys.readouterr().out.count("differ from the checkpoint's model by at most 0") == 2


def test_a_run_on_data_named_from_its_directory_is_evaluated_from_any_other(tmp_path, monkeypatch, capsys):
    """A relative --data path is kept as an absolute one: evaluate and predict from elsewhere find the data."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    generator = torch.Generator().manual_seed(0)
    np.savez(work / "blobs.npz", x=torch.randn(200, 5, generator=generator).numpy(),
             y=torch.randint(0, 3, (200,), generator=generator).numpy())
    monkeypatch.chdir(work)
    main(["fit", *LOCAL, "--data", "blobs.npz", "--epochs", "1", "--batch-size", "16", "--run-dir", "runs/a"])
    monkeypatch.chdir(elsewhere)
    main(["evaluate", str(work / "runs" / "a"), "--output", "e.json"])
    assert json.loads((elsewhere / "e.json").read_text())["samples"] == 40
    assert f"of {work / 'blobs.npz'} (val)" in capsys.readouterr().out


def test_a_model_its_factory_compiled_is_evaluated_predicted_and_exported(tmp_path, capsys):
    """fit saves a compiled model's plain weights; evaluate, predict and export loaded them into the factory's
    compiled wrapper, whose names all start `_orig_mod.`, and refused the checkpoint as not fitting."""
    run_dir = tmp_path / "run"
    main(["fit", *LOCAL, "--data", "user_code:blobs", "--model", "user_code:compiled_net", "--epochs", "1",
          "--batch-size", "16", "--run-dir", str(run_dir)])
    main(["evaluate", str(run_dir), "--output", str(tmp_path / "e.json")])
    assert json.loads((tmp_path / "e.json").read_text())["acc"] == run_summary(run_dir)["val_acc"]
    main(["predict", str(run_dir), "--output", str(tmp_path / "p.npy")])
    main(["export", str(run_dir), "--format", "safetensors", "--output", str(tmp_path / "m.safetensors")])
    assert np.load(tmp_path / "p.npy").shape[0] > 0 and (tmp_path / "m.safetensors").is_file()


def test_evaluate_s_val_is_fit_s_where_the_factory_splits_with_the_global_generators(tmp_path, capsys):
    """The random generators are seeded alike before the data is made, in fit and in evaluate: evaluate
    measured other samples than fit's `val`, and called them so (its model was built first)."""
    run_dir = tmp_path / "run"
    main(["fit", *LOCAL, "--data", "user_code:split_by_the_global_generators", "--model", "user_code:tiny_net",
          "--epochs", "1", "--batch-size", "16", "--run-dir", str(run_dir)])
    main(["evaluate", str(run_dir), "--checkpoint", "last", "--output", str(tmp_path / "e.json")])
    result, record = json.loads((tmp_path / "e.json").read_text()), epoch_records(run_dir)[-1]
    assert result["loss"] == pytest.approx(record["val_loss"], rel=1e-6) and result["acc"] == record["val_acc"]


def test_a_model_with_extra_state_trains_evaluates_and_exports_it(tmp_path, capsys, monkeypatch):
    """A state dict may hold objects (a module's get_extra_state; both engines' broadcast of it:
    tests/test_multiprocess.py): the safetensors export took it for a tensor and failed. It keeps JSON extra
    state in its metadata, and loads it back (the check compares the outputs of the model it rebuilt from
    the file; here its extra state too), and refuses other in one line."""
    run_dir = tmp_path / "run"
    main(["fit", *LOCAL, "--data", "user_code:blobs", "--model", "user_code:VocabularyNet", "--epochs", "1",
          "--batch-size", "16", "--run-dir", str(run_dir)])
    monkeypatch.setenv("HVDTRAIN_TEST_EXTRA_STATE", "empty")  # each model built from here on: the file's, or none
    main(["evaluate", str(run_dir), "--output", str(tmp_path / "e.json")])
    assert json.loads((tmp_path / "e.json").read_text())["acc"] == run_summary(run_dir)["val_acc"]
    main(["export", str(run_dir), "--output", str(tmp_path / "m.safetensors")])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m.safetensors"), "pt") as handle:
        assert json.loads(handle.metadata()["hvdtrain.extra_state"]) == {"_extra_state": {"words": ["a", "b"]}}
    monkeypatch.setenv("HVDTRAIN_TEST_EXTRA_STATE", "object")
    main(["fit", *LOCAL, "--data", "user_code:blobs", "--model", "user_code:VocabularyNet", "--epochs", "1",
          "--batch-size", "16", "--run-dir", str(tmp_path / "other")])
    with pytest.raises(SystemExit) as refused:
        main(["export", str(tmp_path / "other"), "--output", str(tmp_path / "other.safetensors")])
    assert refused.value.code == 2 and not (tmp_path / "other.safetensors").exists()
    assert "hvdtrain: error: the model's extra state '_extra_state' (its module's get_extra_state, a dict) does not " \
           "come back the same from JSON" in capsys.readouterr().err


def test_a_model_in_data_parallel_trains_as_the_module_inside_it(tmp_path, capsys):
    """DataParallel around a factory's model is taken off with one warning: the checkpoint holds the module's
    own names and weights, as a run of the plain model, and evaluate loads it."""
    runs = {}
    for model in ("data_parallel_net", "tiny_net"):
        runs[model] = tmp_path / model
        main(["fit", *LOCAL, "--data", "user_code:blobs", "--model", f"user_code:{model}", "--epochs", "1",
              "--batch-size", "16", "--run-dir", str(runs[model])])
    out = capsys.readouterr().out
    assert out.count("hvdtrain: warning: the model comes wrapped in DataParallel: hvdtrain trains the module inside "
                     "it") == 1
    assert out.count(" after 1 epoch (best ") == 2, out  # one epoch, not "1 epochs"
    assert_same_weights(final_weights(runs["data_parallel_net"]), final_weights(runs["tiny_net"]), atol=0)
    main(["evaluate", str(runs["data_parallel_net"]), "--output", str(tmp_path / "e.json")])
    assert json.loads((tmp_path / "e.json").read_text())["acc"] == run_summary(runs["data_parallel_net"])["val_acc"]


def test_weights_saved_with_data_parallel_s_names_load_into_the_module_itself():
    """A checkpoint of a DataParallel model written before hvdtrain took the wrapper off (every name `module.`)
    loads into the module; a model whose own names start with `module.` keeps them."""
    from torch import nn

    from hvdtrain.models import load_weights

    source, plain = nn.Linear(3, 2), nn.Linear(3, 2)
    load_weights(plain, nn.DataParallel(source).state_dict())
    assert torch.equal(plain.weight, source.weight)
    holder = nn.Sequential()
    holder.module = nn.Linear(3, 2)
    load_weights(holder, {f"module.{name}": value for name, value in source.state_dict().items()})
    assert torch.equal(holder.module.weight, source.weight)


# --- plot and runs -------------------------------------------------------------------------


@pytest.mark.multiprocess
@requires_launchers
def test_plot_overlays_runs_and_runs_lists_them(trained, finished_digits, tmp_path, capsys):
    import matplotlib.image

    out = assert_ok(run([*HVD2, "hvdtrain", "plot", str(finished_digits), str(trained), "--output",
                         str(tmp_path / "both.png")], cwd=tmp_path)).stdout
    assert out.count("val_acc, val_top5_acc, train_samples_per_s, rank seconds against epoch and wall time, 2 runs") == 1
    image = matplotlib.image.imread(tmp_path / "both.png")
    assert image.shape[0] > 800 and image.shape[1] > 1000 and image[..., :3].std() > 0.05  # drawn, not blank
    table = assert_ok(run([*HVD2, "hvdtrain", "runs", str(trained.parent), "--json", str(tmp_path / "runs.json")],
                          cwd=tmp_path)).stdout.splitlines()
    assert len(table) == 2  # the header and the one run, from rank 0 alone
    table = [line.split("<stdout>:", 1)[-1] for line in table]
    assert table[0].split() == ["run", "world", "size", "epochs", "best", "samples/s", "status"]
    listed = json.loads((tmp_path / "runs.json").read_text())
    summary = run_summary(trained)
    assert listed == [{"run": str(trained), "world_size": 2, "epochs_done": 3, "epochs": 3, "best_metric": "val_acc",
                       "best_value": summary["best_value"], "best_epoch": summary["best_epoch"],
                       "train_samples_per_s": summary["train_samples_per_s"], "status": "finished", "error": None}]


def test_runs_marks_an_unfinished_run(finished_digits, tmp_path, capsys):
    import shutil

    copy = tmp_path / "stopped"
    shutil.copytree(finished_digits, copy)
    (copy / "summary.json").unlink()
    (copy / "metrics.jsonl").write_text((copy / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    main(["runs", str(tmp_path)])
    line = capsys.readouterr().out.splitlines()[1]
    assert "1/2" in line and "stopped after epoch 1" in line and "val_acc" in line
    # A fit holding it now, here: running; killed outright (its lock's note left behind): stopped again.
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; from hvdtrain.io."
                               "run_lock import claim; claim(Path(sys.argv[1])); print('held', flush=True); "
                               "time.sleep(60)", str(copy)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        main(["runs", str(tmp_path)])
        assert capsys.readouterr().out.splitlines()[1].split()[-1] == "running"
    finally:
        holder.kill()
        holder.wait()
    assert (copy / ".hvdtrain.lock").read_text()  # the note of a process that has gone without letting go
    main(["runs", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[1].endswith("crashed in epoch 2")
    # Nor does a note naming a live Python process (its pid taken again, in a restarted container) say running.
    import json
    import os
    import socket

    (copy / ".hvdtrain.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    main(["runs", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[1].endswith("crashed in epoch 2")
    # `hvdtrain where` finds the where.json a killed job left, and no one answering there: it says so.
    (copy / "where.json").write_text(json.dumps({"host": socket.gethostname(), "port": free_port(), "token": "t",
                                                 "pid": os.getpid()}))
    with pytest.raises(SystemExit):
        main(["where", str(copy)])
    assert capsys.readouterr().err == f"hvdtrain: error: no job answers in {copy}: its last fit crashed in epoch 2 " \
                                      f"(hvdtrain runs {copy}); a fit started there since answers once it trains\n"
    # A run of an hvdtrain that kept no note, or whose lock file went: its epochs alone say where it stopped.
    (copy / ".hvdtrain.lock").unlink()
    main(["runs", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[1].endswith("stopped after epoch 1")
    # A finished run is finished, whatever an earlier fit's note says (a fit without the lock finished it).
    (copy / ".hvdtrain.lock").write_text(json.dumps({"ended": "failed", "error": "boom"}))
    shutil.copy(finished_digits / "summary.json", copy)
    shutil.copy(finished_digits / "metrics.jsonl", copy)
    main(["runs", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[1].endswith("finished")


# --- plan ------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@requires_launchers
def test_plan_under_horovodrun_is_what_fit_does(tmp_path):
    plan_file = tmp_path / "plan.json"
    out = assert_ok(run([*HVD2, "hvdtrain", "plan", "--batch-size", "100", "--json", str(plan_file)],
                        cwd=tmp_path)).stdout
    assert "global batch 200" in out
    plan = json.loads(plan_file.read_text())
    assert [r["rank"] for r in plan["ranks"]] == [0, 1] and [r["local_rank"] for r in plan["ranks"]] == [0, 1]
    assert all(r["device"] == "cpu" and r["threads"] >= 1 for r in plan["ranks"])
    assert plan["steps_per_epoch"] == 1438 // 200 and plan["dropped_per_epoch"] == 1438 - 7 * 200
    assert plan["lr"]["peak"] == pytest.approx(0.1) and plan["lr"]["first_step"] == pytest.approx(0.05)
    # The first global batch is the one fit's sampler gives each rank in epoch 1.
    from hvdtrain.data.sampler import ShardedBatchSampler

    for rank in (0, 1):
        sampler = ShardedBatchSampler(1438, 100, rank, 2, seed=0)
        sampler.set_epoch(1)
        assert plan["ranks"][rank]["first_batch"] == next(iter(sampler))
    assert not set(plan["ranks"][0]["first_batch"]) & set(plan["ranks"][1]["first_batch"])


def test_plan_alone_for_several_processes(capsys):
    main(["plan", "--np", "4", "--batch-size", "32", "--accumulate", "2", "--adasum"])
    out = capsys.readouterr().out
    assert "32 per rank x 4 ranks x accumulate 2 = global batch 256" in out
    assert "Adasum: not scaled" in out and out.count("  rank ") == 4


def test_plan_counts_lazy_layers_as_fit_makes_them(tmp_path):
    """A LazyLinear's weights exist after a first forward only: plan counted them with a traceback."""
    from user_code import OddLayers

    main(["plan", "--data", "random", "--set", "data.features=12", "--model", "user_code:odd_layers",
          "--json", str(tmp_path / "plan.json")])
    built = OddLayers((12,), 10)
    built(torch.zeros(2, 12))
    held = json.loads((tmp_path / "plan.json").read_text())["memory"][0]["parameters"]
    assert held == sum(p.numel() * p.element_size() for p in built.parameters()) == 2664


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.multiprocess
@requires_launchers
def test_a_corrupt_checkpoint_is_one_line_from_rank_0_and_nothing_is_written(trained, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    best = copy / "checkpoints" / "best.pt"
    best.write_bytes(best.read_bytes()[:1000])
    before = sorted(p.name for p in copy.iterdir())
    result = run([*HVD2, "hvdtrain", "evaluate", str(copy)], cwd=tmp_path)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "hvdtrain: error" in line]
    assert len(errors) == 1 and "is corrupt or truncated" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in copy.iterdir()) == before


BAD = {
    "no checkpoints": (["evaluate", "{empty}"], "has no checkpoints"),
    "no such run": (["predict", "{empty}/nope", "--output", "{tmp}/p.npy"], "does not exist"),
    "unknown format": (["export", "{run}", "--format", "tflite"], "'tflite' is not one of"),
    "unknown output type": (["predict", "{run}", "--output", "{tmp}/p.csv"], "must end in .npy, .pt, .jsonl"),
    "data that does not fit": (["evaluate", "{run}", "--data", "{tmp}/wide.npz"], "mat1 and mat2 shapes"),
    "labels beyond the classes": (["evaluate", "{run}", "--data", "{tmp}/many.npz"], "the labels reach 12"),
    "missing checkpoint file": (["export", "{run}", "--checkpoint", "{tmp}/x.pt"], "checkpoint '"),
    "an epoch the run has not": (["evaluate", "{run}", "--checkpoint", "epoch-0009"], "checkpoint 'epoch-0009' does "
                                 "not exist: pass best, last, the name of one in the run's checkpoints (the run's: "
                                 "best, epoch-0001, epoch-0002, last)"),
    "a model to stdout": (["export", "{run}", "--output", "-"], "--output '-' would be a file named '-': give the "
                          "model a file name"),
    "a folder of runs": (["evaluate", "{runs}"], "is no run directory but holds 1: run; pass one of them (`hvdtrain "
                         "runs "),
    "nothing to plot": (["plot", "{empty}"], "not a run directory"),
    "samples that do not stack": (["predict", "{run}", "--data", "user_code:ragged", "--output", "{tmp}/p.npy"],
                                  "the first prediction batch (samples 0 to "),
    "a corrupt sample mid-way": (["evaluate", "{run}", "--data", "user_code:corrupt_late"],
                                 "rank 0 failed at evaluation, batch 3 of its 4: ValueError: corrupt record 150 ("),
    "a corrupt sample mid-way, predicting": (["predict", "{run}", "--data", "user_code:corrupt_late", "--output",
                                              "{tmp}/p.npy"], "rank 0 failed at prediction, batch 3 of its 4"),
}
EXIT_1 = ("a corrupt sample mid-way", "a corrupt sample mid-way, predicting")  # the user's code failed mid-run


def test_a_checkpoint_of_the_run_is_named_as_its_file_is_and_json_goes_to_stdout_as_dash(finished_digits, capsys):
    """`--checkpoint epoch-0001`, and `--output -` / `--json -` as other tools take them: the JSON alone on
    stdout (it made a file named '-'), the command's line on stderr."""
    main(["evaluate", str(finished_digits), "--checkpoint", "epoch-0001", "--output", "-"])
    out, err = capsys.readouterr()
    assert json.loads(out)["epoch"] == 1 and "(epoch 1)" in err and err.rstrip().endswith("; written to stdout")
    main(["runs", str(finished_digits.parent), "--json", "-"])
    out, err = capsys.readouterr()
    assert [run["run"] for run in json.loads(out)] == [str(finished_digits)] and "run" in err
    assert not Path("-").exists()


@pytest.mark.parametrize("case", BAD)
def test_bad_input_after_fit_is_one_line(case, finished_digits, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    np.savez(tmp_path / "wide.npz", x=np.zeros((10, 20), np.float32), y=np.zeros(10, np.int64))
    np.savez(tmp_path / "many.npz", x=np.zeros((10, 1, 8, 8), np.float32), y=np.full(10, 12))
    args, expected = BAD[case]
    args = [a.format(empty=tmp_path / "empty", tmp=tmp_path, run=finished_digits, runs=finished_digits.parent)
            for a in args]
    before = sorted(str(p) for p in finished_digits.rglob("*"))
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == (1 if case in EXIT_1 else 2) and len(err) == 1 and expected in err[0], err
    assert sorted(str(p) for p in finished_digits.rglob("*")) == before
    assert not list(tmp_path.glob("p.*"))


# --- every flag passes through horovodrun ------------------------------------------------------

ECHO = "import json, sys; print('ARGV' + json.dumps(sys.argv[1:]))"


def _every_flag(command) -> list[str]:
    """Each option of a click command with a valid-looking value, secondary forms (--no-x) too."""
    import click

    argv = []
    for param in command.params:
        if not isinstance(param, click.Option):
            continue
        value = [] if param.is_flag else [param.type.choices[0] if isinstance(param.type, click.Choice) else "1"]
        for name in [*param.opts, *param.secondary_opts]:
            if name.startswith("--"):
                argv += [name, *value]
    return argv


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.parametrize("launcher", [["horovodrun", "--gloo", "-np", "1", "python"],
                                      ["torchrun", "--nproc-per-node", "1", "--no-python", "python"]],
                         ids=["horovodrun", "torchrun"])
def test_every_flag_of_every_command_passes_through_the_launcher_unchanged(launcher, tmp_path):
    from hvdtrain.cli import cli

    argv = []
    for name in ("fit", "plan", "evaluate", "predict", "export", "plot", "runs", "doctor"):
        argv += [name, *_every_flag(cli.commands[name])]
    assert {"--horovod-timeline", "--log-every", "--raw-outputs", "--no-tensorboard", "--split", "--np"} <= set(argv)
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    result = assert_ok(run([*launcher, str(script), *argv], cwd=tmp_path, timeout=120), tail=2000)
    out = result.stdout + result.stderr
    echoed = json.loads(next(line for line in out.splitlines() if "ARGV" in line).split("ARGV", 1)[1])
    assert echoed == argv


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "torch.distributed.launch"])
def test_evaluate_of_a_batch_norm_model_reproduces_fit_s_record(launcher, tmp_path):
    """BatchNorm running statistics are averaged over ranks before validation and checkpoints
    (train.dist_bn reduce), so `evaluate` of the checkpoint gives fit's validation metrics. The torch
    engine's case is started by torchrun's deprecated predecessor, as old scripts do: it puts
    `--local-rank=N` before the command."""
    from conftest import LAUNCHERS

    prefix = LAUNCHERS.get(launcher) or [sys.executable, "-m", launcher, "--nproc-per-node", "2", "-m"]
    run_dir = tmp_path / "run"
    args = ["--data", "random", "--set", "data.samples=1200", "--set", "data.features=12",
            "--model", "user_code:batch_norm_net", "--epochs", "2", "--threads", "1", "--progress", "off"]
    assert_ok(run([*prefix, "hvdtrain", "fit", *args, "--run-dir", str(run_dir)], cwd=tmp_path))
    out = tmp_path / "eval.json"
    assert_ok(run(["hvdtrain", "evaluate", str(run_dir), "--checkpoint", "last", "--output", str(out)], cwd=tmp_path))
    result, record = json.loads(out.read_text()), epoch_records(run_dir)[-1]
    assert result["loss"] == pytest.approx(record["val_loss"], rel=1e-5)
    assert result["acc"] == pytest.approx(record["val_acc"], abs=1e-9)


def test_predictions_are_held_by_rank_0_alone(finished_digits):
    """dist: each rank predicts its batches and sends them to rank 0 only, so the memory of the other
    ranks does not grow with the world size: rank 1 of 2 ends with nothing."""
    from hvdtrain.after.inference import predict_run
    from hvdtrain.after.saved_run import open_run
    from hvdtrain.engine.local import LocalEngine

    class RankOneOfTwo(LocalEngine):
        def __init__(self, device: torch.device):
            super().__init__(device)
            self.rank, self.size = 1, 2
            self.sent: list = []

        def gather_object(self, obj, name):
            self.sent.append(obj)
            return None

        def allgather_object(self, obj, name):
            return [obj, obj]

    saved = open_run(LocalEngine(torch.device("cpu")), finished_digits)
    engine = RankOneOfTwo(torch.device("cpu"))
    predict_run(saved, engine, "all", raw=False)
    assert len(engine.sent) == 1, "its predictions go to rank 0 once, by gather, not allgather"
    batches = [number for number, _ in engine.sent[0]]
    assert batches and all(number % 2 == 1 for number in batches)  # its own half, sent once
