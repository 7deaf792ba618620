"""A Horovod script without mpi4py: it starts Horovod itself (hvd.init()), fits twice, asks for Horovod's
timeline, which its start did not allow, and uses Horovod after its fits.

    mpirun -np 1 python tests/workers/own_horovod.py RUN_DIR
"""

import sys

sys.modules["mpi4py"] = None  # not installed: Horovod's own MPI start is the process's only one

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import hvdtrain  # noqa: E402
from user_code import blobs_split, tiny_net  # noqa: E402

hvd.init()
for attempt in (1, 2):
    summary = hvdtrain.fit(model=tiny_net((5,), 3), data=blobs_split(), epochs=1, batch_size=16,
                           run_dir=f"{sys.argv[1]}-{attempt}", progress="off")
    print(f"fit {attempt}: world size {summary['world_size']}", flush=True)
try:
    hvdtrain.fit(model=tiny_net((5,), 3), data=blobs_split(), epochs=1, run_dir=f"{sys.argv[1]}-timeline",
                 progress="off", horovod_timeline=True)
except hvdtrain.UserError as refused:
    print(f"refused: {refused}", flush=True)
print(f"after the fits: Horovod of {hvd.size()}, allreduce {hvd.allreduce(torch.ones(1), op=hvd.Sum).item()}",
      flush=True)
