"""The order in which `make test`'s two workers take the test files: the longest first.

pytest-xdist (`--dist loadfile --no-loadscope-reorder`) hands a worker one whole file at a time, in
the order collected, and the next file once the worker's current one is nearly done. With the long
files first, the short in-process ones are left to fill the end and both workers finish together.
xdist's own order (the files with the most tests first) left the files of a few long tests (the
elastic jobs, the examples, the container image) to the end, where one worker ran them alone.
"""

from __future__ import annotations

# About how many seconds each long file takes alone on this 2-core machine (its tests' durations,
# summed). Only the order matters: a file that gains or loses a minute is moved here.
SECONDS = {
    "test_multiprocess.py": 500,
    "test_preemption.py": 420,
    "test_large_data.py": 140,
    "test_slurm.py": 140,
    "test_elastic.py": 120,
    "test_api.py": 100,
    "test_after_fit.py": 90,
    "test_streams.py": 80,
    "test_bench.py": 60,
    "test_torch_engine.py": 50,
    "test_sharded_optimizer.py": 80,
    "test_examples.py": 40,
    "test_whereabouts.py": 150,
}

# A file not named above: each system test (an install, a cluster, an image) takes a while, each
# multi-process test seconds, the others little.
SYSTEM_TEST_SECONDS = 30
LAUNCHED_TEST_SECONDS = 10
IN_PROCESS_TEST_SECONDS = 0.5

# The container image's tests wait for its build, which the session starts in the background: they
# come after the long files (the image is ready by then) and before the short ones.
IMAGE_TESTS = "test_docker.py"
LONG_SECONDS = 60


def _estimate(items) -> float:
    return sum(SYSTEM_TEST_SECONDS if "system" in item.keywords else
               LAUNCHED_TEST_SECONDS if "multiprocess" in item.keywords else IN_PROCESS_TEST_SECONDS
               for item in items)


def longest_first(items: list) -> None:
    """Sorts the collected items file by file, the longest file first; each file keeps its own order."""
    by_file: dict = {}
    for item in items:
        by_file.setdefault(item.path.name, []).append(item)
    seconds = {name: SECONDS.get(name) or _estimate(tests) for name, tests in by_file.items()}

    def place(item) -> tuple[int, float]:
        name = item.path.name
        tier = 1 if name == IMAGE_TESTS else 0 if seconds[name] >= LONG_SECONDS else 2
        return tier, -seconds[name]

    items.sort(key=place)  # a stable sort: each file's tests keep their order
