"""`hvdtrain doctor` reports the facts of this build, alone and under a launcher."""

import json
import os
import sys

import pytest

from conftest import LAUNCHERS, assert_ok, launch_env, requires_launchers, run
from hvdtrain.tools.doctor import problems, report


@requires_launchers
def test_doctor_alone_finds_this_build(tmp_path):
    done = run(["hvdtrain", "doctor", "--np", "2", "--json", str(tmp_path / "d.json")])
    assert_ok(done)
    [facts] = json.loads((tmp_path / "d.json").read_text())
    assert facts["horovod"]["version"] == "0.28.1"
    assert set(facts["horovod"]["controllers"]) == {"mpi", "gloo"}
    assert {"mpi", "gloo"} <= set(facts["horovod"]["operations"])
    assert facts["mpi"]["library"].startswith("Open MPI")
    assert facts["launchers"]["horovodrun"] and facts["launchers"]["mpirun"] and facts["launchers"]["torchrun"]
    assert "gloo" in facts["torch_distributed"]["backends"]
    assert "engine horovod: ready" in done.stdout and "engine torch: ready" in done.stdout
    assert facts["threads_per_rank"] == max(1, len(os.sched_getaffinity(0)) // 2)
    assert list(facts["gpus"]["local_rank_gpu"]) == ["0", "1"]
    assert facts["problems"] == [] and "ok: ready to launch" in done.stdout


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "mpirun", "torchrun"])
def test_doctor_reports_per_rank_under_a_launcher(launcher, tmp_path):
    done = run([*LAUNCHERS[launcher], "hvdtrain", "doctor", "--json", str(tmp_path / "d.json")])
    assert_ok(done)
    reports = json.loads((tmp_path / "d.json").read_text())
    assert [r["rank"] for r in reports] == [0, 1] and {r["local_size"] for r in reports} == {2}
    engine = "torch" if launcher == "torchrun" else "horovod"
    assert {r["engine"] for r in reports} == {engine} and f"engine {engine} (running this report): ready" in done.stdout
    assert [list(r["gpus"]["local_rank_gpu"]) for r in reports] == [["0"], ["1"]]
    assert done.stdout.count("rank 1/2  local rank 1/2") == 1  # printed once, by rank 0


def test_doctor_names_what_is_missing_with_the_fix():
    env = launch_env()
    env["PATH"] = "/usr/bin:/bin"  # no .venv/bin: no horovodrun
    import subprocess

    done = subprocess.run([sys.executable, "-m", "hvdtrain", "doctor"], env=env, capture_output=True, text=True)
    assert done.returncode == 1
    assert "PROBLEM: horovodrun is not on PATH: source .venv/bin/activate" in done.stdout


@requires_launchers
def test_doctor_is_content_with_the_torch_engine_alone(tmp_path):
    """As after `launch/install.sh --engine torch`: torchrun there, no horovodrun."""
    import subprocess

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "torchrun").symlink_to(launch_env()["PATH"].split(os.pathsep)[0] + "/torchrun")
    env = {**launch_env(), "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    doctor = [sys.executable, "-m", "hvdtrain", "doctor"]
    done = subprocess.run(doctor, env=env, capture_output=True, text=True)
    assert_ok(done)
    assert "engine horovod: not ready: horovodrun is not on PATH" in done.stdout and "engine torch: ready" in done.stdout
    asked = subprocess.run([*doctor, "--engine", "horovod"], env=env, capture_output=True, text=True)
    assert asked.returncode == 1 and "PROBLEM: horovodrun is not on PATH" in asked.stdout


def test_more_local_processes_than_gpus_is_a_problem():
    facts = report(0, 0, 4, 4, launched=False)
    facts["gpus"]["count"] = 2
    assert any("4 local processes but 2 visible GPU(s)" in p for p in problems(facts, "cuda"))
    assert not any("visible GPU" in p for p in problems(facts, "cpu"))
