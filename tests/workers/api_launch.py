"""hvdtrain.launch from a plain Python process (as a notebook would call it).

    python tests/workers/api_launch.py ENGINE RUN_DIR      # trains, prints rank 0's summary as JSON
    python tests/workers/api_launch.py ENGINE fail         # rank 1 fails: prints the exception caught
"""

import json
import sys

import hvdtrain
from user_code import api_training, fails_on_rank_one

engine, what = sys.argv[1], sys.argv[2]
if what == "fail":
    try:
        hvdtrain.launch(fails_on_rank_one, np=2, engine=engine)
    except hvdtrain.LaunchFailed as err:
        print(f"caught: rank={err.rank} {err}")
else:
    summary = hvdtrain.launch(api_training, np=2, engine=engine, args=(what,))
    print("summary: " + json.dumps({"world_size": summary["world_size"], "engine": summary["engine"]}))
