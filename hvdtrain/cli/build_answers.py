"""horovodrun's two questions about Horovod's build, answered once per build.

At every launch horovodrun asks whether Horovod was built with MPI and with Gloo. It answers each
question by importing horovod.torch, and with it torch, in a forked process: about 3 s of a core
before any rank starts. The answers change only when Horovod's extension libraries or torch do, so
they are kept in hvdtrain's cache (HVDTRAIN_CACHE, default ~/.cache/hvdtrain), keyed by those
libraries' paths, sizes and modification times and torch's version. An answer Horovod could not give
(None: no extension imported) is not kept, `horovodrun --verbose 2` still sees Horovod's own check
run, and a cache that cannot be read or written only means the check runs.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

QUESTIONS = ("mpi_built", "gloo_built")
KEPT_BUILDS = 8  # virtual environments that share one cache each keep their answers


def cache_file() -> Path:
    folder = os.environ.get("HVDTRAIN_CACHE") or Path.home() / ".cache" / "hvdtrain"
    return Path(folder) / "horovod-build.json"


def remember_answers(launch: Any) -> None:
    """Puts remembering versions of `mpi_built` and `gloo_built` in horovod.runner.launch (`launch`),
    where its run_controller looks them up."""
    for question in QUESTIONS:
        setattr(launch, question, _remembering(question, getattr(launch, question)))


def build_key() -> str | None:
    """Horovod's extension libraries and torch's version as they are now; None when no library is found."""
    from importlib import metadata

    import horovod

    libraries = sorted(Path(horovod.__file__).parent.glob("*/mpi_lib*.so"))
    stats = [f"{path} {path.stat().st_size} {path.stat().st_mtime_ns}" for path in libraries if path.is_file()]
    if not stats:
        return None
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "none"
    return "; ".join([*stats, f"torch {torch}"])


def _remembering(question: str, ask: Callable[..., Any]) -> Callable[..., Any]:
    def answer(verbose: bool = False) -> Any:
        if verbose:
            return ask(verbose=verbose)
        try:
            key = build_key()
            kept = _read() if key is not None else {}
        except Exception:  # noqa: BLE001 (no home folder, an unreadable library: the check runs)
            key, kept = None, {}
        if key is None:
            return ask()
        known = kept.get(key, {})
        if question in known:
            return known[question]
        found = ask()
        if found is not None:
            _write({**kept, key: {**known, question: bool(found)}}, key)
        return found

    return answer


def _read() -> dict[str, dict[str, bool]]:
    try:
        kept = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(kept, dict):
        return {}
    return {key: value for key, value in kept.items() if isinstance(value, dict)}


def _write(kept: dict[str, dict[str, bool]], newest: str) -> None:
    """Written whole and renamed, so a launch beside this one reads the old file or the new, never half
    of one; the newest KEPT_BUILDS builds are kept, this one last."""
    kept = {key: value for key, value in kept.items() if key != newest} | {newest: kept[newest]}
    written = None
    try:
        path = cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".horovod-build.", delete=False) as out:
            written = out.name
            json.dump(dict(list(kept.items())[-KEPT_BUILDS:]), out)
        os.chmod(written, 0o644)
        os.replace(written, path)
    except Exception:  # noqa: BLE001 (a read-only or missing folder: the answer is simply not kept)
        if written is not None:
            Path(written).unlink(missing_ok=True)
