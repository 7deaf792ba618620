"""On PYTHONPATH for one test of tests/test_preemption.py only: a process's first `import torch` waits a
second, so that the test sees the moment between hvdtrain's signal handlers and torch's load even on a
busy machine (without it the test's poll could come after both, and the order could not be told)."""

import importlib.abc
import sys
import time


class _SlowTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            time.sleep(1.0)
        return None  # the usual finders import it


sys.meta_path.insert(0, _SlowTorch())
