"""Rank 0 has 3 batches and rank 1 has 5: rank 0 goes on to evaluation while rank 1
waits for a 4th gradient allreduce. A stall by design, as uneven data would make one.

    mpirun -np 2 python tests/workers/stall.py STALL_TIMEOUT
    horovodrun --gloo -np 2 python tests/workers/stall.py STALL_TIMEOUT
"""

import sys

import torch

from hvdtrain.cli.common import report_and_exit as _report_and_exit
from hvdtrain.engine import start_engine

engine = start_engine("horovod", "cpu", stall_timeout=int(sys.argv[1]))
try:
    for batch in range(3 if engine.rank == 0 else 5):
        engine.at(f"batch {batch + 1}")
        engine.allreduce_sum(torch.ones(3), "train_step")
    engine.at("evaluation")
    engine.allreduce_sum(torch.ones(3), "evaluate")
except Exception as err:
    _report_and_exit(err, debug=False)
    raise
