"""horovodrun's questions about Horovod's build, answered once per build (hvdtrain.cli.build_answers)."""

import json
from types import SimpleNamespace

import pytest

from conftest import BIN, requires_launchers, run
from hvdtrain.cli import build_answers

pytest.importorskip("horovod")


def _asked(answers: dict):
    """A stand-in for Horovod's check, counting its calls."""
    calls = []

    def ask(question):
        def check(verbose=False):
            calls.append((question, verbose))
            return answers[question]
        return check

    return SimpleNamespace(**{q: ask(q) for q in build_answers.QUESTIONS}), calls


def test_an_answer_is_asked_once_per_build_and_kept_across_launches(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDTRAIN_CACHE", str(tmp_path))
    launch, calls = _asked({"mpi_built": False, "gloo_built": True})
    build_answers.remember_answers(launch)
    assert (launch.mpi_built(), launch.gloo_built(), launch.gloo_built()) == (False, True, True)
    later, later_calls = _asked({"mpi_built": True, "gloo_built": False})  # a later launch of the same build
    build_answers.remember_answers(later)
    assert (later.mpi_built(), later.gloo_built()) == (False, True) and later_calls == []
    assert calls == [("mpi_built", False), ("gloo_built", False)]
    later.gloo_built(verbose=True)  # horovodrun --verbose 2: Horovod's own check, shown
    assert later_calls == [("gloo_built", True)]
    monkeypatch.setattr(build_answers, "build_key", lambda: "another build")
    assert later.mpi_built() is True and later_calls[-1] == ("mpi_built", False)


def test_no_answer_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDTRAIN_CACHE", str(tmp_path))
    launch, calls = _asked({"mpi_built": None, "gloo_built": None})
    build_answers.remember_answers(launch)
    assert launch.mpi_built() is None and launch.mpi_built() is None and len(calls) == 2
    assert not build_answers.cache_file().exists()


def test_a_cache_that_cannot_be_read_or_written_only_means_the_check_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDTRAIN_CACHE", str(tmp_path))
    build_answers.cache_file().write_text("{not json")
    launch, calls = _asked({"mpi_built": True, "gloo_built": True})
    build_answers.remember_answers(launch)
    assert launch.mpi_built() is True and len(calls) == 1
    assert launch.mpi_built() is True and len(calls) == 1  # the corrupt file was replaced
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HVDTRAIN_CACHE", str(tmp_path / "file" / "below"))  # cannot be made
    assert launch.gloo_built() is True and launch.gloo_built() is True and len(calls) == 3
    monkeypatch.delenv("HVDTRAIN_CACHE")
    monkeypatch.setattr(build_answers.Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("no home")))
    assert launch.gloo_built() is True and len(calls) == 4
    assert [name for name in tmp_path.iterdir() if name.name.startswith(".horovod-build.")] == []


def test_builds_sharing_a_cache_keep_their_own_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDTRAIN_CACHE", str(tmp_path))
    for build in ("one venv", "another venv", "one venv"):
        monkeypatch.setattr(build_answers, "build_key", lambda build=build: build)
        launch, calls = _asked({"mpi_built": build == "one venv", "gloo_built": True})
        build_answers.remember_answers(launch)
        assert launch.mpi_built() is (build == "one venv")
    assert json.loads(build_answers.cache_file().read_text()) == {
        "another venv": {"mpi_built": False}, "one venv": {"mpi_built": True}}
    assert calls == []  # the third launch: "one venv" answered from the cache


@pytest.mark.multiprocess
@requires_launchers
def test_horovodrun_takes_the_kept_answer(tmp_path):
    # The kept answer says this build has no Gloo: horovodrun --gloo must refuse without asking Horovod.
    key = run([str(BIN / "python"), "-c", "from hvdtrain.cli.build_answers import build_key; print(build_key())"])
    (tmp_path / "horovod-build.json").write_text(json.dumps({key.stdout.strip(): {"gloo_built": False}}))
    refused = run(["horovodrun", "--gloo", "-np", "1", "true"], env={"HVDTRAIN_CACHE": str(tmp_path)}, timeout=60)
    assert refused.returncode != 0 and "Gloo support has not been built" in refused.stderr + refused.stdout
    ran = run(["horovodrun", "--gloo", "-np", "1", "true"], env={"HVDTRAIN_CACHE": str(tmp_path / "new")}, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert json.loads((tmp_path / "new" / "horovod-build.json").read_text()) == {key.stdout.strip(): {"gloo_built": True}}
