"""Prints the value Open MPI itself holds for each MCA variable named, read through the MPI
tool interface (MPI_T) of the library Horovod loaded, after hvdtrain started its engine, and the
transports (btl components) Open MPI loaded.

    horovodrun --mpi -np 2 python tests/workers/mpi_settings.py mpi_yield_when_idle
"""

import ctypes
import json
import sys
from pathlib import Path

from hvdtrain.engine import start_engine

engine = start_engine("horovod", "cpu")
maps = Path("/proc/self/maps").read_text().splitlines()
path = next(line.split()[-1] for line in maps if "/libmpi.so" in line)
transports = sorted({line.split("mca_btl_")[-1].removesuffix(".so") for line in maps if "/mca_btl_" in line})
mpi = ctypes.CDLL(path)
provided = ctypes.c_int()
assert mpi.MPI_T_init_thread(0, ctypes.byref(provided)) == 0
held = {}
for name in sys.argv[1:]:
    index, handle, count, value = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int(0)
    assert mpi.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) == 0, name
    assert mpi.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) == 0
    assert mpi.MPI_T_cvar_read(handle, ctypes.byref(value)) == 0
    held[name] = value.value
print(json.dumps({"rank": engine.rank, "held": held, "transports": transports}), flush=True)
engine.shutdown()
