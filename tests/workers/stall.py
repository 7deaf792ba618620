"""Rank 0 goes on to evaluation after 3 steps while rank 1 trains a 4th: a stall by design.

    mpirun -np 2 python tests/workers/stall.py STALL_TIMEOUT
"""

import sys

import torch

from hvdtrain.cli import _report_and_exit
from hvdtrain.engine import start_engine

engine = start_engine("horovod", "cpu", stall_timeout=int(sys.argv[1]))
try:
    for _ in range(3 if engine.rank == 0 else 4):
        engine.allreduce_sum(torch.ones(3), "train_step")
    engine.allreduce_sum(torch.ones(3), "evaluate")
except Exception as err:
    _report_and_exit(err, debug=False)
    raise
