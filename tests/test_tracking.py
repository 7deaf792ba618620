"""Experiment tracking: MLflow read back with MLflow's own client (parameters, metrics at the run's
steps, artifacts, one MLflow run for a run stopped and resumed), written by rank 0 alone; a tracking
server that cannot be reached is said once and the run goes on."""

from __future__ import annotations

import json

import pytest

from conftest import assert_ok, epoch_records, fit_under, requires_launchers, run_summary
from hvdtrain.cli import main

DIGITS = ["--progress", "off", "--log-every", "5", "--mlflow"]


@pytest.fixture
def mlflow_env(monkeypatch, tmp_path):
    """MLflow's settings for this test only (hvdtrain sets defaults for them in its process)."""
    uri = (tmp_path / "mlruns").as_uri()
    for name, value in {"MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true",
                        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}.items():
        monkeypatch.setenv(name, value)
    return uri


@pytest.mark.multiprocess
@requires_launchers
def test_mlflow_holds_the_run_s_params_metrics_and_artifacts_in_one_run_across_a_resume(mlflow_env, tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    first = fit_under("horovodrun-gloo", *DIGITS, "--epochs", "2", "--run-dir", str(run_dir))
    assert_ok(first)
    main(["fit", *DIGITS, "--epochs", "3", "--engine", "local", "--resume", "--run-dir", str(run_dir)])

    client = MlflowClient(mlflow_env)
    runs = client.search_runs([client.get_experiment_by_name("hvdtrain").experiment_id])
    assert len(runs) == 1, "rank 0 alone logs, and the resume went on in the same MLflow run"
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["train.epochs"] == "2" and run.data.params["optim.lr"] == "0.05"
    records = epoch_records(run_dir)
    history = client.get_metric_history(run.info.run_id, "val_acc")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["val_acc"])) for r in records]
    steps = client.get_metric_history(run.info.run_id, "steps/train_loss")
    # 2 epochs of 11 steps on 2 processes, then on one process, whose steps count its own global batch
    # (epoch 3 is steps 45-66 of 22 an epoch): a point every 5 steps
    assert sorted({m.step for m in steps}) == [5, 10, 15, 20, 45, 50, 55, 60, 65]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "summary.json" in artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == ["checkpoints/best.pt"]


# What a user types in a fresh Python, in the directory of the run, with no MLflow variable set.
READ_BACK = """
import json, mlflow
client = mlflow.MlflowClient()
experiment = client.get_experiment_by_name("hvdtrain").experiment_id
runs = mlflow.search_runs(experiment_ids=[experiment], output_format="list")
print(json.dumps([[r.info.run_name, r.info.status, r.data.params["train.epochs"], r.data.metrics["val_acc"]]
                  for r in runs] + [mlflow.get_tracking_uri()]))
"""


def test_the_default_store_is_one_mlflow_s_own_client_reads_with_no_setting(monkeypatch, tmp_path):
    """Without MLFLOW_TRACKING_URI the runs went to ./mlruns, MLflow's file store, which its client
    refuses (maintenance mode) unless MLFLOW_ALLOW_FILE_STORE is set: now MLflow's own default store."""
    import os
    import subprocess
    import sys

    for name in [name for name in os.environ if name.startswith("MLFLOW_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    main(["fit", *DIGITS, "--epochs", "1", "--engine", "local", "--run-dir", "run"])
    summary = run_summary(tmp_path / "run")
    fresh = {name: value for name, value in os.environ.items() if not name.startswith("MLFLOW_")}
    done = subprocess.run([sys.executable, "-c", READ_BACK], cwd=tmp_path, env=fresh, capture_output=True,
                          text=True, timeout=120)
    assert_ok(done)
    *runs, uri = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs == [["run", "FINISHED", "1", pytest.approx(summary["val_acc"])]]
    assert uri == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_the_default_store_without_its_database_packages_is_one_line_at_set_up(monkeypatch, tmp_path):
    import importlib.util

    from hvdtrain.errors import UserError
    from hvdtrain.io.mlflow_log import require_mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "alembic" else find_spec(name, *a))
    with pytest.raises(UserError, match=r"^--mlflow writes to sqlite:///\S+/mlflow.db, and MLflow's database store "
                                        r"needs alembic: pip install 'hvdtrain\[mlflow\]', or set MLFLOW_TRACKING_URI"):
        require_mlflow()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    require_mlflow()  # a server needs neither


def test_a_tracking_server_that_cannot_be_reached_is_said_once_and_the_run_goes_on(mlflow_env, monkeypatch,
                                                                                       tmp_path, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on the discard port
    main(["fit", *DIGITS, "--epochs", "2", "--engine", "local", "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "MLflow" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        "hvdtrain: warning: MLflow at http://127.0.0.1:9 cannot be reached (")
    assert warnings[0].endswith("; training goes on without it")
    assert run_summary(tmp_path / "run")["epochs"] == 2


def test_tensorboard_s_failed_write_is_one_line_and_its_thread_prints_nothing(tmp_path, capfd):
    """TensorBoard writes in a thread of its own; on a full disk that thread died with a traceback and the
    next write raised a bare OSError. Now the next write is one line naming the files and the free space."""
    from hvdtrain.io.atomic import WriteFailed
    from hvdtrain.io.event_log import EventLog

    record = {"epoch": 1, "step": 1, "train_loss": 0.5, "val_acc": 0.9}
    log = EventLog(tmp_path, 0)
    log.epoch(record)
    events = next(tmp_path.glob("events.out.tfevents.*"))
    events.unlink()
    events.symlink_to("/dev/full")  # its writes fail with ENOSPC from here on
    with pytest.raises(WriteFailed, match=r"events\.out\.tfevents\.\*: No space left on device \(.* free there\)"):
        for step in range(2, 50):  # the thread's failure surfaces at a write after it
            log.epoch({**record, "step": step})
    assert "Traceback" not in capfd.readouterr().err
