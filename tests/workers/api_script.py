"""A user's training script on hvdtrain's Python API: objects built in code, no factories; then, as a
sweep would, the same training again, its evaluation, and (on 2 processes) a fit that fails on rank 1.
With `own-library` it starts the engine's library itself first, as a script written for Horovod
(`hvd.init()`) or DDP (`init_process_group()`) does, and uses it again after its fits.

    python tests/workers/api_script.py RUN_DIR [rank0-callback | own-library]
    horovodrun -np 2 python tests/workers/api_script.py RUN_DIR
    torchrun --nproc-per-node 2 tests/workers/api_script.py RUN_DIR

The same pieces as `hvdtrain fit --data user_code:blobs_split --model user_code:tiny_net`: the data
first, then the model after seeding with train.seed (0), as the command builds them. Ranks other
than 0 build their model from another seed: hvdtrain starts every rank from rank 0's weights.
"""

import json
import os
import sys
import time

import torch

import hvdtrain
from user_code import StopAtEpochTwo, blobs_split, corrupt_on_rank_one, tiny_net

rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0"))))
mode = "".join(sys.argv[2:])
if mode == "own-library" and "RANK" in os.environ:  # torchrun's: the torch engine's library
    import torch.distributed as dist

    dist.init_process_group()  # as DDP's tutorial has it: the backend left to torch
    own_allreduce = lambda t: dist.all_reduce(t) or t  # noqa: E731 - the library's sum, for after the fits
elif mode == "own-library":
    import horovod.torch as hvd

    hvd.init()
    own_allreduce = lambda t: hvd.allreduce(t, op=hvd.Sum)  # noqa: E731
data = blobs_split()
torch.manual_seed(0 if rank == 0 else 1234)
model = tiny_net((5,), 3)
# With `rank0-callback`, rank 0 alone has a callback (one that stops after epoch 2), as a script that
# logs from rank 0 only would: every rank must still stop with it.
callbacks = [StopAtEpochTwo()] if mode == "rank0-callback" and rank == 0 else []
summary = hvdtrain.fit(model=model, data=data, task=torch.nn.CrossEntropyLoss(), epochs=3, batch_size=16,
                       run_dir=sys.argv[1], progress="off", overrides={"optim.momentum": 0.5}, callbacks=callbacks)
print(f"rank {rank} summary epochs {summary['epochs']} world size {summary['world_size']}", flush=True)
print(f"rank {rank} whole summary {json.dumps(summary, sort_keys=True)}", flush=True)  # the same on every rank

if mode != "rank0-callback":
    # The same training again in this process, then its evaluation, as a sweep in one job would: the
    # engine starts a second and a third time (under MPI, and on torch.distributed's store).
    torch.manual_seed(0 if rank == 0 else 1234)
    again = hvdtrain.fit(model=tiny_net((5,), 3), data=data, task=torch.nn.CrossEntropyLoss(), epochs=3,
                         batch_size=16, run_dir=sys.argv[1] + "-again", progress="off",
                         overrides={"optim.momentum": 0.5})
    metrics = hvdtrain.evaluate(sys.argv[1] + "-again", checkpoint="last", model=tiny_net((5,), 3), data=data[1],
                                task=torch.nn.CrossEntropyLoss())
    print(f"rank {rank} again val_loss {again['val_loss']} evaluated {metrics['loss']}", flush=True)
if mode == "own-library":  # the script's own Horovod or process group outlives its fits
    print(f"rank {rank} own library after the fits: sum of ranks {own_allreduce(torch.tensor([rank])).item()}",
          flush=True)
if mode != "rank0-callback" and summary["world_size"] > 1:
    # Last, a fit whose data fails on rank 1 in a data-loader worker: the script catches what each rank's
    # fit raises and ends (the failed fit's workers must not keep the process from exiting).
    started = time.monotonic()
    try:
        hvdtrain.fit(model=tiny_net((5,), 3), data=corrupt_on_rank_one(), task=torch.nn.CrossEntropyLoss(),
                     epochs=3, batch_size=16, run_dir=sys.argv[1] + "-failing", progress="off",
                     overrides={"data.num_workers": 2})
    except Exception as failed:  # noqa: BLE001 - what each rank's fit raises is the test's finding
        print(f"rank {rank} fit raised {type(failed).__module__}.{type(failed).__name__}: {failed}", flush=True)
    print(f"rank {rank} script ends {time.monotonic() - started:.1f} s after the failing fit started", flush=True)
