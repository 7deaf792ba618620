"""hvdtrain.launch from a plain Python process (as a notebook would call it).

    python tests/workers/api_launch.py ENGINE RUN_DIR

Trains, prints rank 0's summary as JSON; then launches a function that fails on rank 1, and prints the
exception caught.
"""

import json
import sys

import hvdtrain
from user_code import api_training, fails_on_rank_one

engine, run_dir = sys.argv[1], sys.argv[2]
summary = hvdtrain.launch(api_training, np=2, engine=engine, args=(run_dir,))
print("summary: " + json.dumps({"world_size": summary["world_size"], "engine": summary["engine"]}), flush=True)
try:
    hvdtrain.launch(fails_on_rank_one, np=2, engine=engine)
except hvdtrain.LaunchFailed as err:
    print(f"caught: rank={err.rank} {err}", flush=True)
