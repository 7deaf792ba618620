"""`fit`: builds the run from a config and drives the loop on a given engine.

    horovodrun -np 2 hvdtrain fit             # two processes, Gloo or MPI
    mpirun -np 2 hvdtrain fit                 # the same through plain MPI
    hvdtrain fit                              # one process, no launcher needed

From Python: `fit(Config(), start_engine())`. The engine is an argument so the same
code runs on Horovod, on one local process, and in tests. Sits above both kinds of fit:
plain (`plain`) and elastic (`elastic`), which drive one `trainer.Trainer`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from hvdtrain.config import Config
from hvdtrain.data.sources import located
from hvdtrain.engine import Engine
from hvdtrain.train import early_signals
from hvdtrain.train.elastic import fit_elastic
from hvdtrain.train.plain import fit_plain


def fit(config: Config, engine: Engine) -> dict[str, Any]:
    """Trains as the config says; returns the summary (also in summary.json)."""
    started = time.perf_counter()
    config.data.name = located(config.data.name)  # the run's config and checkpoints hold where the data is
    sys.stderr.write(f"hvdtrain: {engine.describe()}\n")  # every rank, once; one write keeps it whole
    sys.stderr.flush()
    if config.train.elastic:
        # No stop signals: Horovod's elastic driver replaces a worker that dies.
        _, originals = early_signals.take_over(set())
        summary = fit_elastic(config, engine, started)
        early_signals.ignore_after_training(originals)  # as a plain run's end: nothing left to stop
        return summary
    return fit_plain(config, engine, started)
