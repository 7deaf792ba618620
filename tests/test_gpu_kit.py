"""The GPU kit (`make gpu-kit`) needs nothing from outside: built here (its downloads kept in
~/.cache/hvdtrain/gpu-kit), it installs with pip's index and the network cut off into a venv over this
environment's torch, and that venv trains. The GPU check itself (launch/gpu-check.sh) needs a GPU
machine; its pieces that run anywhere are checked here: the throughput benchmark on the CPU, the
report, and the time bound that stops a command and all it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, launch_env

sys.path.insert(0, str(ROOT / "launch"))
from gpu_report import Report  # noqa: E402
from gpu_runner import Check  # noqa: E402

KIT_LIMIT = 64 << 20  # what travels to the GPU machine beside the working tree
CUT_OFF = "http://127.0.0.1:9"  # a proxy nothing listens on: any download fails at once


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-kit")
    done = subprocess.run(["bash", str(ROOT / "launch" / "gpu-kit.sh"), "--out", str(out)],
                          env={**launch_env(), "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return out


def offline_env() -> dict[str, str]:
    """pip without an index, a config or the network; Python without this repository on its path."""
    env = {name: value for name, value in launch_env().items() if name != "PYTHONPATH" and not name.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", http_proxy=CUT_OFF, https_proxy=CUT_OFF,
               HTTP_PROXY=CUT_OFF, HTTPS_PROXY=CUT_OFF, no_proxy="", NO_PROXY="")
    return env


@pytest.mark.system
def test_the_kit_holds_horovod_s_source_and_pinned_wheels_within_what_can_travel(kit):
    files = [path for path in kit.rglob("*") if path.is_file()]
    assert sum(path.stat().st_size for path in files) < KIT_LIMIT
    assert (kit / "sdist" / "horovod-0.28.1.tar.gz").exists()
    requirements = (kit / "requirements.txt").read_text().split()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"hvdtrain=={version}" in requirements and all("==" in line for line in requirements)
    assert {"setuptools", "cffi", "pycparser", "pytest", "pytest_timeout"} <= {line.split("==")[0] for line in requirements}
    # < 81: Horovod's build needs distutils; >= 70: older ones call pkgutil.ImpImporter, gone in Python 3.12
    assert 70 <= int((kit / "requirements.txt").read_text().split("setuptools==")[1].split(".")[0]) < 81
    # Horovod's build needs cffi, a binary wheel: one for the GPU image's Python 3.12, one for this Python.
    tags = {f"cp{sys.version_info[0]}{sys.version_info[1]}", "cp312"}
    assert {path.name.split("-")[2] for path in (kit / "wheels").glob("cffi-*.whl")} == tags


@pytest.mark.system
@pytest.mark.timeout(300)
def test_hvdtrain_installs_from_the_kit_offline_over_this_torch_and_trains(kit, tmp_path):
    venv, env = tmp_path / "venv", offline_env()
    done = subprocess.run(["bash", str(ROOT / "launch" / "gpu-kit-install.sh"), str(venv), "--kit", str(kit)],
                          env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import hvdtrain, torch; print(hvdtrain.__file__); "
                            "print(torch.__file__)"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    hvdtrain_file, torch_file = where.stdout.split()
    assert hvdtrain_file.startswith(str(venv)) and not torch_file.startswith(str(venv))  # the kit's, over the base's
    assert (venv / "bin" / "torchrun").exists()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    fit = subprocess.run(["hvdtrain", "fit", "--epochs", "1", "--progress", "off", "--run-dir", str(tmp_path / "run")],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert fit.returncode == 0, fit.stdout[-2000:] + fit.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["epochs"] == 1


@pytest.mark.system
@pytest.mark.timeout(300)
def test_the_throughput_benchmark_runs_on_the_cpu(tmp_path):
    out = tmp_path / "throughput.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), "--device", "cpu",
                           "--image-size", "32", "--batch", "4", "--steps", "2", "--precisions", "32", "--json", str(out)],
                          env=launch_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    # ResNet-50 trains at about 24.6 GFLOP per 224x224 image; 32x32 has 49 times fewer pixels.
    assert 0.4e9 < result["flops_per_sample"] < 0.6e9
    row = result["rows"][0]
    assert min(row["hvdtrain_samples_per_s"], row["plain_samples_per_s"], row["resident_samples_per_s"]) > 0
    assert row["ratio"] > 0 and row["mfu_hvdtrain"] is None  # no peak known for a CPU


def test_a_command_past_its_bound_is_stopped_with_what_it_started(tmp_path):
    check = Check(tmp_path / "out", tmp_path / "kit", sys.executable, tmp_path / "work", budget=60)
    ran = check.run("sleeper", ["bash", "-c", "sleep 297 & echo started; wait"], bound=1)
    assert ran.rc is None and "started" in ran.output and ran.seconds < 30
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "297"]]  # its child too
    check.do("needs-a-gpu", lambda: ("pass", "never run", None), needs=("gpu",))
    assert check.report.data["steps"][-1]["status"] == "skip"
    assert "no GPU is visible" in (tmp_path / "out" / "gpu-report.md").read_text()


def test_the_report_keeps_a_failed_step_s_tail_and_counts(tmp_path):
    report = Report(tmp_path / "out", tmp_path / "logs")
    report.add("install", "pass", 3.0, "installed")
    report.add("fit-bf16", "fail", 9.0, "exit 1: boom", "hvdtrain fit", "\n".join(f"line {i}" for i in range(40)))
    report.save(12.0)
    data = json.loads((tmp_path / "out" / "gpu-report.json").read_text())
    assert data["summary"] == {"pass": 1, "fail": 1, "skip": 0}
    text = (tmp_path / "out" / "gpu-report.md").read_text()
    assert "| fit-bf16 | fail | 9 | exit 1: boom |" in text and "line 39" in text and "line 10" not in text
    assert (tmp_path / "out" / "gpu-logs.tar.gz").exists()
