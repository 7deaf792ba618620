"""Learning-rate schedules and optimizers: each schedule equals its formula after the same warm-up and
world-size scaling, on one process and on two for real; a user's optimizer keeps its parameter groups;
AdamW leaves biases and norm scales undecayed."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_ok, epoch_records, fit_under, requires_launchers
from hvdtrain.cli import main
from hvdtrain.config import OptimConfig
from hvdtrain.train.schedule import LearningRate

BASE = 0.1  # per batch of 32; 10 steps an epoch, 5 epochs


def rate(schedule: str, processes: int, warmup_epochs: float = 1.0, **extra) -> LearningRate:
    cfg = OptimConfig(lr=BASE, schedule=schedule, warmup_epochs=warmup_epochs, **extra)
    return LearningRate.from_config(cfg, global_batch=32 * processes, batch_size=32, adasum=False,
                                    steps_per_epoch=10, epochs=5)


@pytest.mark.parametrize("processes", [1, 2])
def test_each_schedule_is_its_formula_after_the_same_warm_up_and_scaling(processes):
    peak = BASE * processes  # dist: the lr follows the global batch
    for schedule in ("constant", "cosine", "linear", "step"):
        lr = rate(schedule, processes, step_every_epochs=1, step_gamma=0.5)
        assert lr(0) == pytest.approx(BASE) and lr(5) == pytest.approx(BASE + (peak - BASE) / 2), schedule
    # After the 10 warm-up steps, 40 steps: progress = (step - 10) / 40.
    assert rate("constant", processes)(30) == pytest.approx(peak)
    assert rate("cosine", processes)(20) == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert rate("cosine", processes)(50) == pytest.approx(0, abs=1e-12)
    assert rate("linear", processes)(20) == pytest.approx(peak * 0.75)
    assert rate("linear", processes)(50) == pytest.approx(0, abs=1e-12)
    step = rate("step", processes, step_every_epochs=1, step_gamma=0.5)
    assert [step(s) for s in (10, 19, 20, 35, 49)] == pytest.approx([peak, peak, peak / 2, peak / 4, peak / 8])
    # OneCycle without a warm-up: 1/25 of the peak, the peak after 30% of the 50 steps, 1/250000 at the end.
    cycle = rate("onecycle", processes, warmup_epochs=0)
    assert cycle(0) == pytest.approx(peak / 25) and cycle(15) == pytest.approx(peak)
    assert cycle(50) == pytest.approx(peak / 250000)
    assert cycle(7.5) == pytest.approx(peak / 25 + (peak - peak / 25) * 0.5)  # halfway up the cosine
    assert cycle(32.5) == pytest.approx(peak / 250000 + (peak - peak / 250000) * 0.5)  # halfway down
    # Its rise is its warm-up: optim.warmup_epochs does not put a linear one (and a cliff) before it.
    assert [rate("onecycle", processes, warmup_epochs=1)(s) for s in range(51)] == [cycle(s) for s in range(51)]


def _logged_lr(run_dir) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {point.step: point.value for point in events.Scalars("steps/lr")}


ONECYCLE = ["--data", "random", "--set", "data.samples=1200", "--batch-size", "32", "--epochs", "3",
            "--schedule", "onecycle", "--warmup-epochs", "0", "--lr", "0.1", "--log-every", "1", "--progress", "off"]


def _expected(logged: dict[int, float], processes: int, steps_per_epoch: int) -> dict[int, float]:
    lr = LearningRate.from_config(OptimConfig(lr=0.1, schedule="onecycle", warmup_epochs=0),
                                  global_batch=32 * processes, batch_size=32, adasum=False,
                                  steps_per_epoch=steps_per_epoch, epochs=3)
    return {step: lr(step - 1) for step in logged}  # the lr that step `step` trained with


def test_a_run_trains_with_the_schedule_s_learning_rate_at_every_step(tmp_path):
    main(["fit", *ONECYCLE, "--engine", "local", "--run-dir", str(tmp_path / "run")])
    logged = _logged_lr(tmp_path / "run")
    assert len(logged) == 3 * 30  # 960 training samples / 32
    assert logged == pytest.approx(_expected(logged, 1, 30), rel=1e-6)


@pytest.mark.multiprocess
@requires_launchers
def test_two_processes_train_with_the_schedule_of_their_global_batch(tmp_path):
    done = fit_under("horovodrun-gloo", *ONECYCLE, "--run-dir", str(tmp_path / "run"))
    assert_ok(done)
    logged = _logged_lr(tmp_path / "run")
    assert len(logged) == 3 * 15 and max(logged.values()) == pytest.approx(0.2, rel=1e-3)
    assert logged == pytest.approx(_expected(logged, 2, 15), rel=1e-6)


def test_a_user_optimizer_keeps_its_groups_and_their_ratio(tmp_path):
    run_dir = tmp_path / "run"
    main(["fit", "--data", "user_code:blobs", "--model", "user_code:tiny_net", "--optimizer", "user_code:two_groups",
          "--lr", "0.05", "--epochs", "3", "--batch-size", "16", "--progress", "off", "--engine", "local",
          "--schedule", "cosine", "--run-dir", str(run_dir)])
    records = epoch_records(run_dir)
    assert records[-1]["val_acc"] > 0.9 and records[-1]["train_loss"] < records[0]["train_loss"]
    groups = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["param_groups"]
    assert len(groups) == 2 and groups[0]["lr"] == pytest.approx(10 * groups[1]["lr"]) and groups[1]["lr"] > 0


def test_adamw_decays_weights_but_not_biases(tmp_path):
    run_dir = tmp_path / "run"
    main(["fit", "--data", "random", "--set", "data.samples=256", "--optimizer", "adamw", "--set",
          "optim.weight_decay=0.1", "--epochs", "1", "--progress", "off", "--engine", "local", "--run-dir", str(run_dir)])
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    groups = saved["optimizer"]["param_groups"]
    shapes = [saved["model"][name].dim() for name in saved["model"]]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sorted(len(g["params"]) for g in groups) == sorted([sum(d >= 2 for d in shapes), sum(d < 2 for d in shapes)])


@pytest.mark.parametrize("factory, message", [
    ("not_an_optimizer", "returned list: return a torch.optim.Optimizer over the model's parameters"),
    # Lightning's configure_optimizers returns these; its optimizer and scheduler would be taken as nothing
    ("optimizer_and_scheduler", "returned a tuple holding the optimizer: return the optimizer alone; hvdtrain sets "
                                "the learning rate itself (--lr, --warmup-epochs, --schedule)"),
    ("optimizer_and_scheduler_dict", "returned a dict holding the optimizer: return the optimizer alone"),
    # the model would not train at all (the torch engine and one process went on, val_acc at chance)
    ("optimizer_of_another_model", "made an optimizer over 2 tensor(s) that are not the model's parameters (the first "
                                   "of shape (3, 5)): build it over the `params` (or `model`) it is given"),
])
def test_an_optimizer_factory_returning_something_else_is_one_line(factory, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as leaving:
        main(["fit", "--data", "user_code:blobs", "--model", "user_code:tiny_net", "--optimizer",
              f"user_code:{factory}", "--progress", "off", "--engine", "local", "--run-dir", str(tmp_path / "r")])
    assert leaving.value.code == 2 and not (tmp_path / "r").exists()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"hvdtrain: error: optimizer factory 'user_code:{factory}' {message}"), last


def test_an_adamw_checkpoint_of_one_parameter_group_resumes(tmp_path):
    """Checkpoints written before AdamW split off biases and norm scales hold one group of every
    parameter in the model's order: a resume splits it as the optimizer now groups them."""
    run_dir = tmp_path / "run"
    args = ["fit", "--data", "random", "--set", "data.samples=256", "--optimizer", "adamw", "--progress", "off",
            "--engine", "local", "--run-dir", str(run_dir)]
    main([*args, "--epochs", "1"])
    path = run_dir / "checkpoints" / "epoch-0001.pt"
    saved = torch.load(path, weights_only=True)
    dims = [tensor.dim() for tensor in saved["model"].values()]  # the model's parameters, in order
    order = [i for i, d in enumerate(dims) if d >= 2] + [i for i, d in enumerate(dims) if d < 2]
    groups = saved["optimizer"]["param_groups"]
    old_state = {order[new_id]: value for new_id, value in saved["optimizer"]["state"].items()}
    saved["optimizer"] = {"state": old_state, "param_groups": [{**groups[0], "params": list(range(len(dims)))}]}
    for name in ("epoch-0001.pt", "last.pt", "best.pt"):
        (run_dir / "checkpoints" / name).unlink()
    torch.save(saved, path)
    (run_dir / "checkpoints" / "manifest.json").unlink()  # as if written by the older version
    main([*args, "--epochs", "2", "--resume"])
    resumed = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert resumed["epoch"] == 2 and len(resumed["optimizer"]["param_groups"]) == 2
