"""The GPU check that `launch/gpu-check.sh OUT_DIR` runs, offline, on a GPU machine. Each step puts a
claim of the README's "GPUs and precision" section to the machine: what the machine is; hvdtrain
installed from the kit; Horovod built with NCCL (in the background, while the steps that do not need
it run); the `gpu` tests; `hvdtrain fit` on the GPU in each precision, channels-last and compiled;
both engines on NCCL under their launchers; two processes on the one GPU under each; a SIGTERM
inside an epoch and an exact resume; `hvdtrain doctor`; the throughput of `fit` against a plain
loop. Without a GPU each GPU step is skipped with a line, so the check itself is proven on a CPU
machine too. The machinery (time bounds, the budget, skips) is launch/gpu_runner.py's.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_runner import ROOT, Check, Outcome, Ran  # noqa: E402  (beside this file)

# The machine as the report's header shows it, read by its own Python before anything is installed.
FACTS = r"""
import json, os, platform, shutil, subprocess
import torch

def first(command, having=""):
    try:
        lines = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((line for line in lines if having in line), None)

cuda = torch.cuda.is_available()
gpus = []
for i in range(torch.cuda.device_count() if cuda else 0):
    p = torch.cuda.get_device_properties(i)
    gpus.append(f"{p.name} (capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB)")
nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
print(json.dumps({
    "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None, "gpus": gpus,
    "driver": first(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
    "nvcc": first([nvcc, "--version"], having="release"), "cmake": first(["cmake", "--version"]),
    "cxx": first(["g++", "--version"]), "make": shutil.which("make"), "ninja": shutil.which("ninja"),
    "cores": os.cpu_count()}))
"""

GPU_FIT = ["--device", "cuda", "--model", "cnn", "--epochs", "5", "--no-tensorboard"]
FITS = {  # the README's GPU flags, one run each, alone (the local engine)
    "fit-fp32": ["--precision", "32"],
    "fit-bf16": ["--precision", "bf16"],
    "fit-fp16": ["--precision", "fp16"],
    "fit-channels-last": ["--precision", "bf16", "--channels-last"],
    "fit-compile": ["--precision", "bf16", "--compile"],
}
# Under a launcher: channels-last too (Horovod's collectives once refused its non-contiguous tensors).
LAUNCHED_FIT = [*GPU_FIT, "--precision", "bf16", "--channels-last"]
TORCHRUN, HOROVODRUN = ["torchrun", "--nproc-per-node"], ["horovodrun", "--gloo", "-np"]
# tests/user_code.py's model that sends itself SIGTERM in its 30th training step (epoch 2 of 3, 25 steps each).
RESUME = ["--data", "random", "--set", "data.samples=2000", "--set", "data.features=12", "--epochs", "3",
          "--model", "user_code:signals_itself", "--set", "run.stop_check_seconds=0", "--device", "cuda",
          "--no-tensorboard"]
SAME_WEIGHTS = ("import sys, torch; a, b = (torch.load(p, map_location='cpu', weights_only=True)['model'] "
                "for p in sys.argv[1:]); print(max((a[k].double() - b[k].double()).abs().max().item() for k in a) "
                "if a.keys() == b.keys() else 'different keys')")


def steps(check: Check) -> list[tuple[str, tuple[str, ...], Callable[[], Outcome]]]:
    """(name, what it needs, what it does), in the order they run. Horovod builds in the background from
    the end of `install` to `horovod-build`; the throughput is measured once the build is done."""
    gpu, horovod = ("install", "gpu"), ("install", "gpu", "horovod")
    return [
        ("environment", (), lambda: environment(check)),
        ("install", (), lambda: install(check)),
        ("gpu-tests", gpu, lambda: gpu_tests(check)),
        *[(name, gpu, lambda name=name, args=args: fitted(check, name, [*GPU_FIT, *args])) for name, args in FITS.items()],
        ("torchrun-np1", gpu, lambda: fitted(check, "torchrun-np1", LAUNCHED_FIT, [*TORCHRUN, "1"],
                                             controller="nccl")),
        ("torchrun-np1-sharded", gpu, lambda: sharded(check, "torchrun-np1-sharded", "torchrun-np1", [*TORCHRUN, "1"],
                                                      "nccl")),
        ("torchrun-np2-one-gpu", gpu, lambda: two_on_one(check, "torchrun-np2-one-gpu", [*TORCHRUN, "2"])),
        ("resume", gpu, lambda: resume(check)),
        ("horovod-build", ("install",), lambda: horovod_build(check)),
        ("doctor", ("install",), lambda: doctor(check, "doctor", [])),
        ("horovodrun-doctor", ("install", "horovod"), lambda: doctor(check, "horovodrun-doctor", [*HOROVODRUN, "1"])),
        ("horovodrun-np1", horovod, lambda: horovod_fit(check)),
        ("horovodrun-np1-sharded", horovod, lambda: sharded(check, "horovodrun-np1-sharded", "horovodrun-np1",
                                                               [*HOROVODRUN, "1"], "gloo")),
        ("throughput", gpu, lambda: throughput(check)),
        ("horovodrun-np2-one-gpu", horovod, lambda: two_on_one(check, "horovodrun-np2-one-gpu", [*HOROVODRUN, "2"])),
        ("throughput-launched", gpu, lambda: throughput_launched(check)),
        ("powersgd-arithmetic", gpu, lambda: powersgd_arithmetic(check)),
    ]


def run_all(check: Check, only: set[str]) -> None:
    """Every step, or those in `only` (with the machine's description, the install, and Horovod's build
    when one of them needs it)."""
    chosen = steps(check)
    if only:
        only = only | {"environment", "install"}
        only |= {"horovod-build"} if any("horovod" in needs for name, needs, _ in chosen if name in only) else set()
        chosen = [step for step in chosen if step[0] in only]
    for name, needs, action in chosen:
        check.do(name, action, needs)
        if name == "install" and check.installed and any(step[0] == "horovod-build" for step in chosen):
            check.start_build()


def environment(check: Check) -> Outcome:
    ran = check.run("environment", [check.python, "-c", FACTS], 120)
    if ran.rc != 0:
        return "fail", f"{check.python} cannot describe the machine (has it torch?): {error_line(ran.output)}", ran
    facts = json.loads(ran.output.strip().splitlines()[-1])
    check.report.data["machine"] = facts
    check.gpu = bool(facts["gpus"])
    return "pass", (f"{'; '.join(facts['gpus']) or 'no GPU'}; torch {facts['torch']}, CUDA {facts['torch_cuda']}, "
                    f"NCCL {facts['nccl']}; {facts['nvcc'] or 'no nvcc'}; {facts['cmake'] or 'no cmake'}"), ran


def install(check: Check) -> Outcome:
    ran = check.run("install", ["bash", str(ROOT / "launch" / "gpu-kit-install.sh"), str(check.venv), "--kit",
                                str(check.kit)], 240, env={"PYTHON": check.python})
    check.installed = ran.rc == 0
    return ("pass" if check.installed else "fail"), error_line(ran.output), ran


def gpu_tests(check: Check) -> Outcome:
    files = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in path.read_text())
    # Only the kit's plugin: the machine's own (its pytest's) need not suit the kit's pytest.
    ran = check.run("gpu-tests", [str(check.venv / "bin" / "python"), "-m", "pytest", "-m", "gpu", "-q", "-p",
                                  "pytest_timeout", "-p", "no:cacheprovider", *files], 240, cwd=ROOT,
                    env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    result = last_line(ran.output)  # pytest's count
    passed = ran.rc == 0 and re.search(r"\d+ passed", result) and "skipped" not in result
    return ("pass" if passed else "fail"), f"{result} ({', '.join(files)})", ran


def fit(check: Check, name: str, args: list[str], launcher: list[str] | None = None, bound: float = 150,
        env: dict[str, str] | None = None, run_dir: Path | None = None) -> Ran:
    run_dir = run_dir or check.runs / name
    return check.run(name, [*(launcher or []), "hvdtrain", "fit", "--progress", "off", *args, "--run-dir", str(run_dir)],
                     bound, env=env)


def fitted(check: Check, name: str, args: list[str], launcher: list[str] | None = None,
           controller: str | None = None) -> Outcome:
    """A fit that must end well: on the GPU, above 0.9 validation accuracy, on `controller` if given."""
    ran = fit(check, name, args, launcher, bound=240 if "--compile" in args else 150)
    if ran.rc != 0:
        return "fail", ended(ran), ran
    summary = json.loads((check.runs / name / "summary.json").read_text())
    wrong = [what for what, bad in (
        (f"on {summary['device']}, not the GPU", not str(summary["device"]).startswith("cuda")),
        ("val_acc under 0.9", summary["val_acc"] < 0.9),
        (f"controller {summary['controller']}, not {controller}", controller and summary["controller"] != controller),
    ) if bad]
    seen = (f"val_acc {summary['val_acc']:.4f} after {summary['epochs']} epochs on {summary['device']}, "
            f"{summary['engine']} engine, controller {summary['controller']}, "
            f"{summary['train_samples_per_s']:,.0f} samples/s, {ran.seconds:.0f} s in all")
    return ("fail" if wrong else "pass"), "; ".join([*wrong, seen]), ran


def sharded(check: Check, name: str, unsharded: str, launcher: list[str], controller: str) -> Outcome:
    """`--shard-optimizer` on the GPU: its reduce-scatter and all-gather run even at one process (on NCCL
    for either engine), and it must end with the weights of the unsharded run `unsharded`."""
    status, seen, ran = fitted(check, name, [*LAUNCHED_FIT, "--shard-optimizer"], launcher,
                               controller=controller)
    baseline = check.runs / unsharded / "checkpoints" / "last.pt"
    if status != "pass":
        return status, seen, ran
    if not baseline.exists():
        return "fail", f"no {unsharded} run to compare with; {seen}", ran
    diff = check.run(name, [str(check.venv / "bin" / "python"), "-c", SAME_WEIGHTS, str(baseline),
                            str(check.runs / name / "checkpoints" / "last.pt")], 60)
    same = last_line(diff.output)
    try:
        ok = diff.rc == 0 and float(same) <= 1e-6
    except ValueError:  # "different keys", or an error
        ok = False
    return ("pass" if ok else "fail"), f"max |weight difference| from {unsharded}: {same}; {seen}", joined([ran, diff])


def two_on_one(check: Check, name: str, launcher: list[str]) -> Outcome:
    """Two processes, one GPU: NCCL refuses two ranks on one device, so hvdtrain must either train another
    way or stop at once with one line that says why and what to do: no hang, no traceback."""
    ran = fit(check, name, ["--device", "cuda", "--epochs", "1", "--no-tensorboard"], launcher, bound=90)
    if ran.rc is None:
        return "fail", f"hung: no end after {ran.seconds:.0f} s", ran
    if ran.rc == 0:
        return "pass", f"trained two processes on one GPU ({ran.seconds:.0f} s)", ran
    errors = [line for line in ran.output.splitlines() if "hvdtrain: error" in line]
    if "Traceback" in ran.output or not errors:
        return "fail", f"exit {ran.rc} with {'a traceback' if 'Traceback' in ran.output else 'no hvdtrain error'}: " \
                       f"{error_line(ran.output)}", ran
    return "pass", f"refused in {ran.seconds:.0f} s, exit {ran.rc}, {len(errors)} line(s): {errors[0].strip()}", ran


def resume(check: Check) -> Outcome:
    whole, cut = check.runs / "resume-whole", check.runs / "resume-cut"
    env = {"PYTHONPATH": str(ROOT / "tests"), "HVDTRAIN_TEST_SIGNAL": ""}
    runs = [fit(check, "resume", RESUME, env=env, run_dir=whole),
            fit(check, "resume", RESUME, env={**env, "HVDTRAIN_TEST_SIGNAL": "0:30:SIGTERM"}, run_dir=cut),
            fit(check, "resume", [*RESUME, "--resume"], env=env, run_dir=cut)]
    expected = [0, 75, 0]
    if [r.rc for r in runs] != expected:
        bad = next(r for r, rc in zip(runs, expected) if r.rc != rc)
        return "fail", f"exits {[r.rc for r in runs]}, not {expected}: {ended(bad)}", joined(runs)
    diff = check.run("resume", [str(check.venv / "bin" / "python"), "-c", SAME_WEIGHTS,
                                str(whole / "checkpoints" / "last.pt"), str(cut / "checkpoints" / "last.pt")], 60)
    runs.append(diff)
    stopped = re.search(r"stopped by SIGTERM at [^:]*", runs[1].output)
    seen = f"{stopped.group(0) if stopped else 'stopped'} (exit 75), resumed; max |weight difference| {last_line(diff.output)}"
    return ("pass" if last_line(diff.output) == "0.0" else "fail"), seen, joined(runs)


def horovod_build(check: Check) -> Outcome:
    # 2 to 3 minutes on 16 cores; a slower build still leaves the throughput its 2 minutes.
    ran = check.finish_build(bound=min(max(480.0, 0.8 * (check.deadline - check.started)),
                                       check.deadline - check.build_started - 120))
    check.horovod = ran.rc == 0
    lines = [line for line in ran.output.splitlines() if line.startswith("[horovod-build]")]
    seen = "; ".join(line.removeprefix("[horovod-build] ") for line in lines[1:])
    return ("pass", seen, ran) if check.horovod else ("fail", ended(ran), ran)


def doctor(check: Check, name: str, launcher: list[str]) -> Outcome:
    """`hvdtrain doctor`: on a GPU machine both engines must show NCCL, Horovod's once it is built."""
    report = check.runs / f"{name}.json"
    ran = check.run(name, [*launcher, "hvdtrain", "doctor", "--json", str(report)], 90)
    if not report.exists():
        return "fail", ended(ran), ran
    facts = json.loads(report.read_text())[0]
    horovod, backends = facts["horovod"], facts["torch_distributed"]["backends"]
    wrong = []
    if check.gpu:
        wrong += ["torch has no NCCL backend"] if "nccl" not in backends else []
        wrong += ["Horovod has no NCCL operations"] if check.horovod and "nccl" not in horovod.get("operations", []) else []
    seen = (f"horovod {horovod.get('version', 'absent')}: operations {', '.join(horovod.get('operations', [])) or 'none'}; "
            f"torch backends {', '.join(backends)}; {facts['gpus']['count']} GPU(s); engine {facts['engine'] or 'none'}; "
            f"doctor exit {ran.rc}" + (f", its problems: {'; '.join(facts['problems'])}" if facts["problems"] else ""))
    return ("fail" if wrong else "pass"), "; ".join([*wrong, seen]), ran


def horovod_fit(check: Check) -> Outcome:
    """horovodrun --gloo -np 1 on the GPU: Horovod's timeline must show its NCCL allreduce."""
    status, seen, ran = fitted(check, "horovodrun-np1", [*LAUNCHED_FIT, "--horovod-timeline"],
                               [*HOROVODRUN, "1"], controller="gloo")
    timeline = check.runs / "horovodrun-np1" / "horovod-timeline.json"
    nccl = timeline.exists() and "NCCL_ALLREDUCE" in timeline.read_text()
    if status == "pass" and not nccl:
        return "fail", f"no NCCL_ALLREDUCE in Horovod's timeline; {seen}", ran
    return status, (f"NCCL_ALLREDUCE in Horovod's timeline; {seen}" if nccl else seen), ran


def throughput(check: Check) -> Outcome:
    result = check.runs / "throughput.json"
    ran = check.run("throughput", [str(check.venv / "bin" / "python"), str(ROOT / "benchmarks" / "gpu_throughput.py"),
                                   "--json", str(result)], 300, cwd=ROOT)
    if ran.rc != 0 or not result.exists():
        return "fail", ended(ran), ran
    measured = json.loads(result.read_text())
    check.report.data["throughput"] = measured
    return "pass", "; ".join(
        f"{row['precision']}: fit {row['hvdtrain_samples_per_s']:,.0f}/s, plain {row['plain_samples_per_s']:,.0f}/s "
        f"(ratio {row['ratio']:.2f})" for row in measured["rows"]), ran


def throughput_launched(check: Check) -> Outcome:
    """The ResNet-50 layout in bf16 under each engine's launcher at one process, each beside its own plain
    loop: what the engine's step (its allreduce hook, Horovod's background thread) costs on the GPU."""
    rows, runs = [], []
    launchers = [("torch", "torchrun --nproc-per-node 1")] + ([("horovod", "horovodrun --gloo -np 1")] if check.horovod else [])
    for engine, launcher in launchers:  # the torch engine's even where Horovod did not build
        result = check.runs / f"throughput-{engine}.json"
        ran = check.run("throughput-launched", [str(check.venv / "bin" / "python"),
                                                str(ROOT / "benchmarks" / "gpu_throughput.py"), "--precisions", "bf16",
                                                "--launcher", launcher, "--json", str(result)], 200, cwd=ROOT)
        runs.append(ran)
        if ran.rc != 0 or not result.exists():
            return "fail", f"{launcher}: {ended(ran)}", joined(runs)
        row = json.loads(result.read_text())["rows"][0]
        rows.append({"engine": engine, "launcher": launcher, **row})
    check.report.data["throughput_launched"] = rows
    return "pass", "; ".join(f"{row['launcher']} ({row['engine']} engine), bf16: fit {row['hvdtrain_samples_per_s']:,.0f}/s, "
                             f"plain {row['plain_samples_per_s']:,.0f}/s (ratio {row['ratio']:.2f})" for row in rows), \
        joined(runs)


def powersgd_arithmetic(check: Check) -> Outcome:
    """PowerSGD's own arithmetic per step on the GPU beside the host's, for the two-hosts job's model."""
    result = check.runs / "powersgd.json"
    ran = check.run("powersgd-arithmetic", [str(check.venv / "bin" / "python"),
                                            str(ROOT / "benchmarks" / "powersgd_arithmetic.py"), "--devices", "cpu,cuda",
                                            "--json", str(result)], 120, cwd=ROOT)
    if ran.rc != 0 or not result.exists():
        return "fail", ended(ran), ran
    measured = json.loads(result.read_text())
    check.report.data["powersgd_arithmetic"] = measured
    return "pass", "; ".join(f"{row['device']}: PowerSGD {row['powersgd_ms']:.1f} ms a step, forward and backward "
                             f"{row['step_ms']:.1f} ms" for row in measured["rows"]), ran


def ended(ran: Ran) -> str:
    if ran.rc is None:
        return f"no end after {ran.seconds:.0f} s: stopped"
    return f"exit {ran.rc}: {error_line(ran.output)}"


def error_line(output: str) -> str:
    """The line that says the most: hvdtrain's or a script's error, else the last one."""
    lines = _lines(output)
    for marker in ("hvdtrain: error", "gpu-kit-install.sh:", "gpu-horovod-build.sh:", "Error"):
        found = [line for line in lines if marker in line]
        if found:
            return found[-1]
    return last_line(output)


def last_line(output: str) -> str:
    lines = _lines(output)
    return lines[-1] if lines else "no output"


def _lines(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if line.strip() and not line.startswith("[gpu-check]")]


def joined(runs: list[Ran]) -> Ran:
    """Several commands of one step, as one for the report."""
    return Ran(" && ".join(r.command for r in runs), runs[-1].rc, "".join(r.output for r in runs),
               sum(r.seconds for r in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description="The GPU check (launch/gpu-check.sh).")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kit", type=Path, default=ROOT / ".gpu-kit")
    parser.add_argument("--python", default=sys.executable, help="The interpreter that holds the machine's torch.")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hvdtrain-gpu-check"))
    parser.add_argument("--seconds", type=float, default=560.0, help="The whole check's budget.")
    parser.add_argument("--only", default="", help="Comma-separated steps to run (default: all).")
    args = parser.parse_args()
    if not (args.kit / "requirements.txt").exists():
        refuse(f"no kit at {args.kit}: run `make gpu-kit` where there is a network, and bring .gpu-kit/ along")
    # Found before the check puts its venv first on PATH; absolute, since steps run in other folders.
    python = str(Path(shutil.which(args.python) or args.python).absolute())
    check = Check(args.out.resolve(), args.kit.resolve(), python, args.work.resolve(), args.seconds)
    only, known = {name for name in args.only.split(",") if name}, [name for name, _, _ in steps(check)]
    if only - set(known):
        refuse(f"no step {', '.join(sorted(only - set(known)))}; the steps: {', '.join(known)}")
    run_all(check, only)
    summary = check.report.data["summary"]
    print(f"[gpu-check] {summary['pass']} passed, {summary['fail']} failed, {summary['skip']} skipped: "
          f"{args.out / 'gpu-report.md'}")
    sys.exit(1 if summary["fail"] else 0)


def refuse(why: str) -> None:
    """Bad input: one line, exit 2."""
    print(f"gpu-check: {why}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
