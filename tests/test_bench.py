"""The bench commands' output, run for real (small sizes)."""

import json
import sys

import pytest

from conftest import LAUNCHERS, ROOT, assert_ok, requires_launchers, run
from hvdtrain.tools.bench.allreduce import sizes
from hvdtrain.tools.bench.stats import mean_ci95


def test_sizes_sweep_by_four():
    assert sizes(4 << 10, 256 << 20) == [4 << 10 << (2 * i) for i in range(9)]


def test_mean_ci95_is_student_s_interval_for_few_repeats():
    # Tables: t(0.975) is 4.303 for 2 degrees of freedom, 2.045 for 29; the sample deviation of 10, 12, 14 is 2.
    mean, half = mean_ci95([10.0, 12.0, 14.0])
    assert mean == 12.0 and half == pytest.approx(4.303 * 2.0 / 3 ** 0.5, rel=1e-3)
    assert mean_ci95([10.0, 14.0] * 15)[1] == pytest.approx(2.045 * 2.0342 / 30 ** 0.5, rel=1e-3)
    assert mean_ci95([7.0]) == (7.0, 0.0)


def test_bench_sampler_reports_both_samplers(tmp_path):
    done = run(["hvdtrain", "bench", "sampler", "--size", "100000", "--world-size", "4", "--json", str(tmp_path / "s.json")])
    assert_ok(done)
    assert "hvdtrain.data.sampler.ShardedBatchSampler" in done.stdout and "torch.utils.data.DistributedSampler" in done.stdout
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [r["sampler"] for r in rows] == ["hvdtrain", "torch"]
    assert all(r["first_index_ms"] >= 0 and "extra_peak_MB" in r for r in rows)


def test_bench_train_alone(tmp_path):
    done = run(["hvdtrain", "bench", "train", "--model", "mlp", "--input-shape", "32", "--batch-size", "16",
                "--warmup", "1", "--steps", "3", "--repeats", "3", "--json", str(tmp_path / "t.json")])
    assert_ok(done)
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["world_size"] == 1 and result["samples_per_s_total"] > 0 and result["ci95"] >= 0
    assert "samples/s (95% CI)" in done.stdout


@pytest.mark.serial
def test_bench_data_finds_a_slow_data_set_input_bound_and_more_workers_faster(tmp_path):
    """A data set that takes 5 ms per sample gives at most 200 samples/s without workers, far below the
    small model's step: input-bound, and 2 workers read faster than none. Fast in-memory data with
    the same model is compute-bound."""
    done = run(["hvdtrain", "bench", "data", "--data", "user_code:slow_to_read", "--batch-size", "16",
                "--workers", "0,2", "--batches", "3", "--steps", "5", "--json", str(tmp_path / "d.json")])
    assert_ok(done)
    result = json.loads((tmp_path / "d.json").read_text())
    by_workers = {row["workers"]: row["samples_per_s"] for row in result["rows"]}
    assert sorted(by_workers) == [0, 2] and by_workers[0] <= 200 < result["step_samples_per_s"]
    assert by_workers[2] > 1.3 * by_workers[0], by_workers
    assert result["verdict"].startswith("input-bound") and "--num-workers" in result["verdict"]
    assert done.stdout.splitlines()[-1] == result["verdict"] and "training step:" in done.stdout
    fast = run(["hvdtrain", "bench", "data", "--data", "user_code:blobs", "--batch-size", "16", "--workers", "0",
                "--batches", "3", "--steps", "5"])
    assert assert_ok(fast).stdout.splitlines()[-1].startswith("compute-bound: data.num_workers=0")


def test_bench_rejects_bad_input():
    done = run(["hvdtrain", "bench", "train", "--input-shape", "3,x"])
    assert done.returncode == 2 and done.stderr.strip() == (
        "hvdtrain: error: --input-shape must be integers separated by commas, e.g. 3,32,32; got '3,x'")


@pytest.mark.multiprocess
@requires_launchers
def test_bench_allreduce_under_horovodrun(tmp_path):
    done = run([*LAUNCHERS["horovodrun-gloo"], "hvdtrain", "bench", "allreduce", "--max-bytes", str(1 << 20),
                "--json", str(tmp_path / "a.json"), "--plot", str(tmp_path / "a.png")])
    assert_ok(done)
    result = json.loads((tmp_path / "a.json").read_text())
    assert result["world_size"] == 2 and [r["bytes"] for r in result["rows"]] == sizes(4 << 10, 1 << 20)
    for row in result["rows"]:  # bus bandwidth = algorithm bandwidth x 2(n-1)/n, n = 2
        assert row["time_us"] > 0 and row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert done.stdout.count("busbw (GB/s)") == 1  # rank 0 only


@pytest.mark.serial
@pytest.mark.multiprocess
@requires_launchers
def test_bench_train_scaling_under_horovodrun(tmp_path):
    """A model of known pace (paced_mlp waits 50 ms in each training forward pass): 16 samples per step
    is at most 320 samples/s per process, whatever the machine, and more than half of it here (the
    wait dominates the step). A total that is one process's figure (or twice the per-process one
    where that is the total), or an efficiency against the wrong single-process figure, falls outside."""
    done = run([*LAUNCHERS["horovodrun-gloo"], "hvdtrain", "bench", "train", "--model", "user_code:paced_mlp",
                "--input-shape", "32", "--batch-size", "16", "--warmup", "1", "--steps", "3", "--repeats", "2",
                "--scaling", "--json", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png")])
    assert_ok(done)
    result = json.loads((tmp_path / "t.json").read_text())
    pace = 16 / 0.05
    assert result["world_size"] == 2
    assert pace / 2 < result["samples_per_s_per_process"] <= pace, result
    assert pace < result["samples_per_s_total"] <= 2 * pace, result
    assert pace / 2 < result["single_process_samples_per_s"] <= pace, result
    assert 0.5 < result["scaling_efficiency"] <= 1.1, result  # both sides waited out by the same pace
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.timeout(600)
def test_make_bench_runs_every_contender_and_writes_the_ratios(tmp_path, monkeypatch):
    """benchmarks/run.py, one short repeat of one job (the other runs the same commands on another model): the
    tables, the ratios, each contender's share of the ceiling and results.json (not the figures)."""
    out = tmp_path / "results.json"
    monkeypatch.setenv("BENCH_STEPS", "3")  # 3 steps per epoch: the commands, not the speed
    done = run([sys.executable, "benchmarks/run.py", "--repeats", "1", "--epochs", "2", "--jobs", "linear",
                "--sampler-size", "100000", "--out", str(out)], timeout=540, cwd=ROOT)
    assert_ok(done)
    result = json.loads(out.read_text())
    assert list(result["samples_per_s"]) == ["linear"]
    assert result["machine"]["controller"] in ("mpi", "gloo")
    lines = done.stdout.splitlines()
    for job, contenders in result["samples_per_s"].items():
        assert len(contenders) == 6 and all(len(rates) == 1 and rates[0] > 0 for rates in contenders.values())
        printed = {}  # each contender's figure as its run line printed it, the ratios checked against those
        for name in contenders:
            run_lines = [line for line in lines if line.startswith(f"  run 1/1  {job:<6} {name}")]
            assert len(run_lines) == 1 and sum(line.startswith(name) for line in lines) == 1  # and its table row
            printed[name] = float(run_lines[0].split()[-2])
        ratios = result["ratios"][job]
        for label, (top, bottom) in {
                "torch engine / hand-written DDP (target >= 1.00)": ("torch engine", "hand-written DDP"),
                "Horovod engine / hand-written Horovod loop (target >= 1.00)": ("Horovod engine", "Horovod loop"),
                "Horovod engine / one process all cores (target >= 1.00)": ("Horovod engine", "one process")}.items():
            top_rate, = (rate for name, rate in printed.items() if top in name and "ceiling" not in name)
            bottom_rate, = (rate for name, rate in printed.items() if bottom in name and "ceiling" not in name)
            assert ratios[label] == pytest.approx(top_rate / bottom_rate, rel=0.01, abs=0.002), label
        ceiling = next(rate for name, rate in printed.items() if name.startswith("ceiling"))
        shares = {label: value for label, value in ratios.items() if label.startswith("share of the ceiling: ")}
        assert len(shares) == 5  # every contender but the ceiling, each its own figure over the ceiling's
        for name, rate in printed.items():
            if not name.startswith("ceiling"):
                share, = (value for label, value in shares.items() if name in label)
                assert share == pytest.approx(rate / ceiling, rel=0.01, abs=0.002), name
    assert [row["sampler"] for row in result["sampler"]["rows"]] == ["hvdtrain", "torch"]
