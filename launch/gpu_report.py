"""The GPU check's report (launch/gpu-check.sh): OUT/gpu-report.json, a readable OUT/gpu-report.md and
the steps' logs as OUT/gpu-logs.tar.gz, all rewritten after every step, so that a check cut short
still leaves what it saw. Standard library only: it runs under the machine's own Python.

    python launch/gpu_report.py OUT/gpu-report.json     # the table again, from the JSON
"""

from __future__ import annotations

import datetime
import json
import sys
import tarfile
from pathlib import Path

TAIL_LINES = 25  # of a failed step's output, in the report


class Report:
    """Steps as they end, and what the machine is."""

    def __init__(self, out: Path, logs: Path):
        self.out, self.logs = out, logs
        out.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        self.data: dict = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "seconds": 0.0,
                           "machine": {}, "steps": [], "throughput": None}

    def add(self, name: str, status: str, seconds: float, note: str, command: str = "", output: str = "") -> None:
        """One step: `status` pass, fail or skip; `note` one line of what was seen."""
        tail = output.strip().splitlines()[-TAIL_LINES:] if status == "fail" else []
        self.data["steps"].append({"name": name, "status": status, "seconds": round(seconds, 1), "note": note,
                                   "command": command, "tail": tail})

    def save(self, seconds: float) -> None:
        self.data["seconds"] = round(seconds, 1)
        counts = {status: sum(step["status"] == status for step in self.data["steps"]) for status in ("pass", "fail", "skip")}
        self.data["summary"] = counts
        (self.out / "gpu-report.json").write_text(json.dumps(self.data, indent=2) + "\n")
        (self.out / "gpu-report.md").write_text(render(self.data))
        with tarfile.open(self.out / "gpu-logs.tar.gz", "w:gz") as archive:
            archive.add(self.logs, arcname="gpu-logs")


def render(data: dict) -> str:
    machine, summary = data["machine"], data.get("summary", {})
    lines = ["# hvdtrain GPU check", ""]
    if machine:
        gpus = "; ".join(machine.get("gpus") or []) or "no GPU visible"
        lines += [f"Machine: {gpus}. Python {machine.get('python')}, torch {machine.get('torch')} "
                  f"(CUDA {machine.get('torch_cuda') or 'none'}, NCCL {machine.get('nccl') or 'none'}), "
                  f"{machine.get('nvcc') or 'no nvcc'}, {machine.get('cmake') or 'no cmake'}, "
                  f"{machine.get('cores')} cores.", ""]
    lines += [f"Started {data['started']}, {data['seconds']:.0f} s: {summary.get('pass', 0)} passed, "
              f"{summary.get('fail', 0)} failed, {summary.get('skip', 0)} skipped.", "",
              "| step | result | s | what was seen |", "| --- | --- | ---: | --- |"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | {_cell(s['note'])} |" for s in data["steps"]]
    if data.get("throughput"):
        lines += ["", *throughput_table(data["throughput"])]
    failed = [s for s in data["steps"] if s["status"] == "fail"]
    if failed:
        lines += ["", "## Failures"]
        for step in failed:
            lines += ["", f"### {step['name']}", "", f"    {step['command']}", "", "```", *step["tail"], "```"]
    return "\n".join(lines) + "\n"


def throughput_table(result: dict) -> list[str]:
    """hvdtrain fit against the plain loop (benchmarks/gpu_throughput.py's result)."""
    flops = result.get("flops_per_sample") or 0
    lines = [f"## Throughput: {result['model']}, batch {result['batch']}, {result['image_size']}x{result['image_size']}, "
             "channels-last, one process", "",
             f"{result.get('device_name')}; {flops / 1e9:.1f} GFLOP per sample (forward and backward); "
             f"cudnn.allow_tf32 {result.get('cudnn_allow_tf32')}, float32 matmul precision {result.get('matmul_precision')}.",
             "", "| precision | hvdtrain fit | plain loop | ratio | plain, batch on the GPU | MFU fit | MFU plain "
             "| MFU on the GPU | peak TFLOP/s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        lines.append(f"| {row['precision']} | {_rate(row['hvdtrain_samples_per_s'])} | {_rate(row['plain_samples_per_s'])} "
                     f"| {_number(row['ratio'], '.2f')} | {_rate(row['resident_samples_per_s'])} "
                     f"| {_percent(row['mfu_hvdtrain'])} | {_percent(row['mfu_plain'])} | {_percent(row['mfu_resident'])} "
                     f"| {_number(row['peak_tflops'], '.0f')} |")
    return lines


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}/s"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1]).read_text())), end="")
