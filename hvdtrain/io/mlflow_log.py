"""MLflow tracking (`--mlflow`), written by rank 0 beside TensorBoard's event files.

    hvdtrain fit --mlflow                                   # ./mlflow.db, or $MLFLOW_TRACKING_URI
    MLFLOW_TRACKING_URI=http://mlflow:5000 horovodrun -np 8 hvdtrain fit --mlflow
    mlflow ui --backend-store-uri sqlite:///mlflow.db       # (the full mlflow package)

The config as parameters (`section.key`), each epoch's record as metrics at the run's optimizer
step (and `steps/...` every run.log_every steps), the summary and the best checkpoint as
artifacts. The MLflow run's id is kept in the run directory, so a resumed run goes on in the same
MLflow run. A tracking server that cannot be reached is said once; training goes on without it.

Without $MLFLOW_TRACKING_URI the store is the one MLflow's own client picks in the same directory
(`sqlite:///mlflow.db` since MLflow 3's file store went into maintenance), so that `MlflowClient()` or
`mlflow.search_runs()` there reads the runs with no setting at all.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

from hvdtrain.errors import UserError

RUN_ID_FILE = "mlflow_run_id"
# Record keys that are counts or clocks, not metrics.
_NOT_METRICS = {"epoch", "epochs", "step", "world_size"}


def require_mlflow() -> None:
    """Every rank, while setting up: --mlflow without the package, or without the database packages its
    store needs, is one line, before anything is written."""
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        raise UserError("--mlflow needs MLflow: pip install 'hvdtrain[mlflow]' (mlflow-skinny), or drop --mlflow")
    missing = [name for name in ("sqlalchemy", "alembic") if importlib.util.find_spec(name) is None]
    if missing and _is_database(uri := tracking_uri()):  # mlflow is imported only on this rare path
        raise UserError(f"--mlflow writes to {uri}, and MLflow's database store needs {' and '.join(missing)}: "
                        "pip install 'hvdtrain[mlflow]', or set MLFLOW_TRACKING_URI to a tracking server")


def tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else the store MLflow's own client would open in this directory."""
    import mlflow

    return os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()


def _is_database(uri: str) -> bool:
    return uri.split(":", 1)[0].split("+", 1)[0] in ("sqlite", "postgresql", "mysql", "mssql")


class MLflowLog:
    """Rank 0's MLflow run; every call after a failure to reach the tracking store is skipped."""

    def __init__(self, run_dir: Path, config: dict[str, Any], warn: Callable[[str], None]):
        require_mlflow()
        import mlflow

        self.mlflow, self.warn, self.run_dir = mlflow, warn, run_dir
        self.uri = tracking_uri()
        # Its two lines of INFO while it creates a new database, between hvdtrain's own.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        if self.uri.startswith("file:") or "://" not in self.uri:
            # MLflow 3 keeps its file store (asked for, or an ./mlruns of earlier runs) behind this switch.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # A server that does not answer must not hold training for MLflow's default minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.client: Any = None
        self.run_id: str | None = None
        self._try(lambda: self._start(config))

    def _start(self, config: dict[str, Any]) -> None:
        client = self.mlflow.tracking.MlflowClient(tracking_uri=self.uri)
        kept = self.run_dir / RUN_ID_FILE
        if kept.exists():  # a resume: the same MLflow run goes on
            self.run_id = kept.read_text().strip()
            client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = client.get_experiment_by_name("hvdtrain")
            experiment_id = experiment.experiment_id if experiment else client.create_experiment("hvdtrain")
            self.run_id = client.create_run(experiment_id, run_name=self.run_dir.name,
                                            tags={"hvdtrain.run_dir": str(self.run_dir.resolve())}).info.run_id
            params = [self.mlflow.entities.Param(key, str(value)[:6000]) for key, value in _flat(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
                client.log_batch(self.run_id, params=params[start:start + 100])
            kept.write_text(self.run_id + "\n")
        self.client = client

    def epoch(self, record: dict[str, Any]) -> None:
        metrics = {key: value for key, value in record.items()
                   if key not in _NOT_METRICS and isinstance(value, (int, float))}
        self._metrics(metrics, int(record["step"]))

    def steps(self, step: int, values: dict[str, float]) -> None:
        self._metrics({f"steps/{key}": value for key, value in values.items()}, step)

    def finish(self, summary_path: Path, best: Path | None) -> None:
        def upload() -> None:
            self.client.log_artifact(self.run_id, str(summary_path))
            if best is not None and best.exists():
                self.client.log_artifact(self.run_id, str(best), artifact_path="checkpoints")
            self.client.set_terminated(self.run_id, status="FINISHED")

        self._try(upload)

    def close(self) -> None:
        pass  # each call is complete when it returns; a run that stops early stays RUNNING until resumed

    def _metrics(self, values: dict[str, float], step: int) -> None:
        import time

        stamp = int(time.time() * 1000)
        metrics = [self.mlflow.entities.Metric(key, float(value), stamp, step) for key, value in values.items()]
        self._try(lambda: self.client.log_batch(self.run_id, metrics=metrics))

    def _try(self, call: Callable[[], None]) -> None:
        if self.uri is None:  # unreachable before: said once, skipped since
            return
        try:
            call()
        except Exception as err:  # noqa: BLE001 - tracking is never worth a failed run
            self.warn(f"MLflow at {self.uri} cannot be reached ({type(err).__name__}: {str(err)[:200]}); "
                      "training goes on without it")
            self.uri = None


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
