"""horovodrun's two questions about Horovod's build, answered once per build.

At every launch horovodrun asks whether Horovod was built with MPI and with Gloo. It answers each
question by importing horovod.torch, and with it torch, in a forked process: about 3 s of a core
before any rank starts. The answers change only when Horovod's extension libraries do, so they are
kept in hvdtrain's cache (HVDTRAIN_CACHE, default ~/.cache/hvdtrain), keyed by those libraries'
paths, sizes and modification times. An answer Horovod could not give (None: no extension
imported) is not kept, and `horovodrun --verbose 2` still sees Horovod's own check run.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

QUESTIONS = ("mpi_built", "gloo_built")


def cache_file() -> Path:
    return Path(os.environ.get("HVDTRAIN_CACHE", Path.home() / ".cache" / "hvdtrain")) / "horovod-build.json"


def remember_answers(launch: Any) -> None:
    """Puts remembering versions of `mpi_built` and `gloo_built` in horovod.runner.launch (`launch`),
    where its run_controller looks them up."""
    for question in QUESTIONS:
        setattr(launch, question, _remembering(question, getattr(launch, question)))


def build_key() -> str | None:
    """Horovod's extension libraries as they are now, or None when none is found."""
    import horovod

    libraries = sorted(Path(horovod.__file__).parent.glob("*/mpi_lib*.so"))
    stats = [(str(path), path.stat()) for path in libraries if path.is_file()]
    return "; ".join(f"{path} {stat.st_size} {stat.st_mtime_ns}" for path, stat in stats) or None


def _remembering(question: str, ask: Callable[..., Any]) -> Callable[..., Any]:
    def answer(verbose: bool = False) -> Any:
        key = build_key()
        if verbose or key is None:
            return ask(verbose=verbose)
        known = _read().get(key, {})
        if question in known:
            return known[question]
        found = ask(verbose=verbose)
        if found is not None:
            _write(key, {**known, question: bool(found)})
        return found

    return answer


def _read() -> dict[str, dict[str, bool]]:
    try:
        kept = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def _write(key: str, answers: dict[str, bool]) -> None:
    """Keeps only this build's answers; written whole and renamed, so a launch beside this one reads
    the old file or the new, never half of one. A cache that cannot be written is no error."""
    path = cache_file()
    written = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".horovod-build.", delete=False) as out:
            written = out.name
            json.dump({key: answers}, out)
        os.replace(written, path)
    except OSError:
        if written is not None:
            Path(written).unlink(missing_ok=True)
