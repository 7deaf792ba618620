"""Run under a launcher: each rank gathers its own object to rank 0 and reports what it got.

    horovodrun --gloo -np 2 python tests/workers/gather.py
    torchrun --nproc-per-node 2 tests/workers/gather.py
"""

from hvdtrain.engine import start_engine

engine = start_engine("auto", "cpu", threads=1)
got = engine.gather_object({"rank": engine.rank, "payload": list(range(engine.rank * 3))}, "test")
print(f"rank {engine.rank} got {got}", flush=True)
engine.shutdown(finished=True)
