"""Tasks in one process: batches of any structure, exact sharded metrics, user tasks, the first-batch check."""

import json
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, f1_score, mean_absolute_error, mean_squared_error, r2_score
from torch import nn

from conftest import fit_here
from hvdtrain.data.batch import batch_size, call_model, split_batch, to_device
from hvdtrain.cli import main
from hvdtrain.config import TaskConfig
from hvdtrain.data.loading import pad_collate
from hvdtrain.errors import UserError
from hvdtrain.numerics.metrics import MetricSums
from hvdtrain.engine import LocalEngine
from hvdtrain.numerics.precision import Precision
from hvdtrain.tasks import build_task
from hvdtrain.tasks.check import best_metric, check_first_batch

CPU = torch.device("cpu")


def test_batches_of_any_structure_reach_the_device_whole():
    batch = {"a": torch.ones(2, 3), "b": (torch.zeros(2), [torch.arange(2)]), "name": "kept"}
    moved = to_device(batch, CPU, channels_last=True)
    assert moved["name"] == "kept" and isinstance(moved["b"], tuple) and isinstance(moved["b"][1], list)
    image = to_device((torch.randn(2, 3, 4, 4), torch.tensor([1, 0])), CPU, channels_last=True)[0]
    assert image.is_contiguous(memory_format=torch.channels_last)
    assert batch_size(batch) == 2 and batch_size(torch.zeros(7, 3)) == 7


def test_the_batch_decides_how_the_model_is_called():
    seen = {}

    class Net(nn.Module):
        def forward(self, a, b=None, labels=None):
            seen.update(a=a, b=b, labels=labels)
            return a

    class NoLabels(nn.Module):
        def forward(self, a, b):
            seen.update(a=a, b=b)
            return a

    one, two, y = torch.ones(2), torch.zeros(2), torch.tensor([1, 0])
    assert split_batch((one, y), "labels") == (one, y)
    assert split_batch((one, two, y), "labels")[0] == (one, two)
    assert split_batch(one, "labels") == (one, None)
    call_model(Net(), {"a": one, "b": two, "labels": y}, "labels")
    assert seen["labels"] is y  # forward takes the target: the model may compute its own loss
    call_model(NoLabels(), {"a": one, "b": two, "labels": y}, "labels")  # it does not: left out
    call_model(NoLabels(), (one, two), "labels")
    assert seen["b"] is two


def test_pad_collate_pads_inputs_with_zero_and_targets_with_the_ignore_index():
    short, long = torch.tensor([5, 6]), torch.tensor([1, 2, 3])
    ids, targets = pad_collate([short, long])
    assert ids.tolist() == [[5, 6, 0], [1, 2, 3]] and targets.tolist() == [[5, 6, -100], [1, 2, 3]]
    batch = pad_collate([{"input_ids": short, "labels": short}, {"input_ids": long, "labels": long}])
    assert batch["labels"][0].tolist() == [5, 6, -100] and batch["input_ids"][0].tolist() == [5, 6, 0]
    x, y = pad_collate([(torch.ones(2), torch.tensor(1)), (torch.ones(2), torch.tensor(0))])
    assert x.shape == (2, 2) and y.tolist() == [1, 0]  # equal lengths are simply stacked


def _shards(task, output, target, cuts):
    """Metrics summed over uneven batches (as ranks and batches cut them) against one batch."""
    template = {name: (torch.as_tensor(s).shape, torch.as_tensor(c).shape)
                for name, (s, c) in task.metrics(output, target).items()}
    whole, parts = MetricSums(CPU, template), MetricSums(CPU, template)
    whole.add(task.metrics(output, target))
    for start, end in zip(cuts, cuts[1:]):
        parts.add(task.metrics(output[start:end], target[start:end]))
    return task.summarize(whole.sums), task.summarize(parts.sums)


CUTS = [0, 7, 8, 30, 64, 100]  # five shards of different sizes


def test_classification_metrics_are_exact_over_shards():
    generator = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(100, 7, generator=generator), torch.randint(0, 7, (100,), generator=generator)
    labels[3] = -100  # not scored
    whole, sharded = _shards(build_task(TaskConfig()), logits, labels, CUTS)
    assert whole == pytest.approx(sharded, rel=1e-6)  # float32 sums within a batch
    kept = labels != -100
    assert whole["acc"] == pytest.approx(accuracy_score(labels[kept], logits[kept].argmax(1)))
    assert whole["loss"] == pytest.approx(float(nn.functional.cross_entropy(logits, labels)), rel=1e-6)
    top5 = (logits[kept].topk(5, dim=1).indices == labels[kept, None]).any(1).float().mean()
    assert whole["top5_acc"] == pytest.approx(float(top5))


@pytest.mark.parametrize("loss", ["mse", "l1", "huber"])
def test_regression_metrics_are_exact_over_shards_and_match_scikit_learn(loss):
    generator = torch.Generator().manual_seed(1)
    target = torch.randn(100, 3, generator=generator) * 5 + 40
    output = target + torch.randn(100, 3, generator=generator) * 2
    task = build_task(TaskConfig(name="regression", regression_loss=loss))
    whole, sharded = _shards(task, output, target, CUTS)
    assert whole == pytest.approx(sharded, rel=1e-6)  # float32 sums within a batch
    assert whole["r2"] == pytest.approx(r2_score(target.double().numpy(), output.double().numpy()), rel=1e-9)
    assert whole["mse"] == pytest.approx(mean_squared_error(target.numpy(), output.numpy()), rel=1e-6)
    assert whole["mae"] == pytest.approx(mean_absolute_error(target.numpy(), output.numpy()), rel=1e-6)
    assert whole["loss"] == pytest.approx(float(task.loss(output, target)), rel=1e-6)


def test_regression_takes_one_output_per_sample_for_a_flat_target():
    task = build_task(TaskConfig(name="regression"))
    output, target = torch.randn(10, 1), torch.randn(10)
    assert task.loss(output, target) == pytest.approx(float(((output[:, 0] - target) ** 2).mean()))


def test_multilabel_metrics_are_exact_over_shards_and_match_scikit_learn():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(100, 5, generator=generator)
    target = (torch.rand(100, 5, generator=generator) > 0.6).float()
    whole, sharded = _shards(build_task(TaskConfig(name="multilabel")), logits, target, CUTS)
    assert whole == pytest.approx(sharded, rel=1e-6)  # float32 sums within a batch
    predicted = (logits > 0).int().numpy()
    assert whole["f1"] == pytest.approx(f1_score(target.int().numpy(), predicted, average="micro"))
    assert whole["exact_match"] == pytest.approx(accuracy_score(target.int().numpy(), predicted))


def test_language_model_metrics_are_exact_over_shards():
    generator = torch.Generator().manual_seed(3)
    logits, ids = torch.randn(100, 9, 11, generator=generator), torch.randint(0, 11, (100, 9), generator=generator)
    ids[5, 4:] = -100  # padding
    task = build_task(TaskConfig(name="language-model"))
    whole, sharded = _shards(task, logits, ids, CUTS)
    assert whole == pytest.approx(sharded, rel=1e-6)  # float32 sums within a batch
    nll = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1), ignore_index=-100)
    assert whole["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-6)


# --- in-process fit of every task -------------------------------------------------

LOCAL = ["--progress", "off", "--engine", "local", "--threads", "1"]


def _fit(tmp_path, *args):
    return fit_here(tmp_path, "--threads", "1", *args)


def test_regression_from_an_npz_with_float_targets(tmp_path):
    generator = np.random.default_rng(0)
    x = generator.normal(size=(400, 5)).astype(np.float32)
    np.savez(tmp_path / "r.npz", x=x, y=x @ np.arange(1, 6, dtype=np.float32))
    summary = _fit(tmp_path / "run", "--data", str(tmp_path / "r.npz"), "--task", "regression", "--epochs", "8",
                   "--optimizer", "adamw", "--lr", "0.01")
    assert summary["best_metric"] == "val_r2" and summary["val_r2"] > 0.9
    assert {"val_mse", "val_mae", "val_loss"} <= summary.keys()
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["task"] == "regression"
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "manifest.json").read_text())
    assert manifest["best_metric"] == "val_r2" and manifest["maximize"] is True
    assert all("val_r2" in entry for entry in manifest["checkpoints"])


def test_a_float_target_column_under_classification_is_refused_before_training(tmp_path, capsys):
    """8 float features and one float target per sample, shaped (N, 1), and no --task: it trained as one
    class, reporting loss 0 and accuracy 1. Refused before training, with the hint."""
    generator = np.random.default_rng(0)
    x = generator.normal(size=(300, 8)).astype(np.float32)
    np.savez(tmp_path / "r.npz", x=x, y=(x @ np.ones(8, dtype=np.float32))[:, None])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *LOCAL, "--run-dir", str(tmp_path / "run"), "--data", str(tmp_path / "r.npz"), "--model", "mlp"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "classification needs integer class labels: for float targets use --task regression" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_negative_labels_are_named_as_negative_not_as_one_class(tmp_path, capsys):
    """Labels 0, -1, ..., -99: the data set's largest label, 0, made a model of one output, refused as
    "one class: nothing to tell apart". The first negative label and its index are named instead."""
    x = np.random.default_rng(0).normal(size=(100, 4)).astype(np.float32)
    np.savez(tmp_path / "n.npz", x=x, y=-np.arange(100))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *LOCAL, "--run-dir", str(tmp_path / "run"), "--data", str(tmp_path / "n.npz")])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hvdtrain: error:")]
    assert errors == ["hvdtrain: error: task classification: the labels include -1 (the first negative one, at "
                      "index 1 of the data set's labels); class labels run from 0 to classes - 1 "
                      "(task.ignore_index -100 marks a label to skip)"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_multilabel_and_language_model_train(tmp_path):
    multi = _fit(tmp_path / "m", "--data", "user_code:multilabel_data", "--task", "multilabel", "--epochs", "10",
                 "--batch-size", "16")
    assert multi["best_metric"] == "val_f1" and multi["val_f1"] > 0.8
    lm = _fit(tmp_path / "l", "--data", "user_code:sequences", "--model", "user_code:bigram_lm",
              "--task", "language-model", "--epochs", "10", "--batch-size", "16", "--optimizer", "adamw", "--lr", "0.05")
    assert lm["best_metric"] == "val_perplexity" and lm["val_perplexity"] < 2.0 and lm["val_token_acc"] > 0.9


def test_label_smoothing_and_a_chosen_best_metric(tmp_path):
    summary = _fit(tmp_path, "--data", "random", "--set", "data.samples=256", "--epochs", "3",
                   "--set", "task.label_smoothing=0.1", "--set", "run.best_metric=val_loss")
    manifest = json.loads((tmp_path / "checkpoints" / "manifest.json").read_text())
    best = min(manifest["checkpoints"], key=lambda e: e["val_loss"])
    assert summary["best_metric"] == "val_loss" and manifest["best"] == best["file"]


@pytest.mark.parametrize("task", ["torch.nn.functional:cross_entropy", "torch.nn:CrossEntropyLoss"])
def test_a_loss_function_or_loss_module_is_a_task(task, tmp_path):
    summary = _fit(tmp_path, "--data", "user_code:blobs", "--model", "user_code:tiny_net", "--task", task,
                   "--epochs", "3", "--batch-size", "16")
    assert summary["best_metric"] == "val_loss" and summary["val_loss"] < 0.5


def test_the_class_count_can_be_given_when_the_data_cannot_tell(tmp_path):
    summary = _fit(tmp_path, "--data", "user_code:int_labels", "--model", "user_code:needs_num_classes",
                   "--set", "data.num_classes=3", "--epochs", "3", "--batch-size", "16")
    assert summary["val_acc"] > 0.8


def test_a_model_that_returns_its_own_loss_from_dict_batches(tmp_path):
    summary = _fit(tmp_path, "--data", "user_code:dict_blobs", "--model", "user_code:own_loss",
                   "--set", "task.target_key=y", "--epochs", "3", "--batch-size", "16")
    assert summary["val_acc"] > 0.8  # the task's metrics read the model's logits


def test_a_model_that_returns_only_a_scalar_loss(tmp_path):
    summary = _fit(tmp_path, "--data", "user_code:dict_blobs", "--model", "user_code:only_loss",
                   "--set", "task.target_key=y", "--epochs", "3", "--batch-size", "16")
    assert summary["best_metric"] == "val_loss" and summary["val_loss"] < 0.5
    assert not any(key.startswith("val_") and key not in ("val_loss", "val_samples") for key in summary)


def test_a_user_task_object_with_vector_metrics(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    try:
        summary = _fit(tmp_path, "--data", "digits_two_inputs:data", "--model", "digits_two_inputs:model",
                       "--task", "digits_two_inputs:BalancedDigits", "--epochs", "2")
    finally:
        sys.path.pop(0)
    assert summary["best_metric"] == "val_balanced_acc" and summary["val_balanced_acc"] > 0.5


# --- the first batch ----------------------------------------------------------------


def _check(task_config, model, batch, held=None):
    return check_first_batch(build_task(task_config), model, batch, held, Precision("32", CPU))


def test_the_first_batch_names_what_does_not_fit():
    three = nn.Linear(4, 3)
    x = torch.randn(8, 4)
    with pytest.raises(UserError, match=r"the labels reach 9 but the model's output has 3 classes"):
        _check(TaskConfig(), three, (x, torch.tensor([0, 1, 2, 0, 1, 2, 0, 9])))
    with pytest.raises(UserError, match=r"the labels reach 7 .* at least 8 outputs"):
        _check(TaskConfig(), three, (x, torch.zeros(8, dtype=torch.long)), held=torch.tensor([0, 7]))
    with pytest.raises(UserError, match=r"the labels include -2 \(the first negative one, at index 0 of the data"):
        _check(TaskConfig(), three, (x, torch.zeros(8, dtype=torch.long)), held=torch.tensor([-2, 1]))
    per_position = torch.tensor([[0, 1, 2, 0, 1], [2, 0, -3, -4, 1]])
    with pytest.raises(UserError, match=r"include -3 \(the first negative one, at position \(1, 2\) of the first"):
        _check(TaskConfig(), nn.Conv1d(4, 3, 1), (torch.randn(2, 4, 5), per_position))
    with pytest.raises(UserError, match=r"classification needs integer class labels .* --task regression"):
        _check(TaskConfig(), three, (x, torch.randn(8)))
    with pytest.raises(UserError, match=r"the labels are true/false \(torch.bool\): give them as integer class "
                                        r"labels, 0 and 1"):
        _check(TaskConfig(), nn.Linear(4, 2), (x, torch.rand(8) > 0.5))
    with pytest.raises(UserError, match=r"1 output per sample, one class: nothing to tell apart. .*--task regression"):
        _check(TaskConfig(), nn.Linear(4, 1), (x, torch.randn(8, 1)))
    with pytest.raises(UserError, match=r"sample \d of the first batch has probabilities summing to .*, not 1"):
        _check(TaskConfig(), three, (x, torch.rand(8, 3) + 0.5))
    _check(TaskConfig(), three, (x, torch.softmax(torch.randn(8, 3), 1)))  # class probabilities are fine
    with pytest.raises(UserError, match=r"the model gives 3 value\(s\) per sample .* the targets hold 1"):
        _check(TaskConfig(name="regression"), three, (x, torch.randn(8)))
    with pytest.raises(UserError, match=r"targets must be 0 or 1, found 2.0"):
        _check(TaskConfig(name="multilabel"), three, (x, torch.full((8, 3), 2.0)))
    with pytest.raises(UserError, match=r"dict with keys 'x', 'y' but no 'labels'.*task.target_key=KEY"):
        _check(TaskConfig(), _Keyword(three), {"x": x, "y": torch.zeros(8, dtype=torch.long)})
    with pytest.raises(UserError, match=r"unexpected keyword argument 'y'.* no 'labels' key .*task.target_key=KEY"):
        _check(TaskConfig(), _OnlyX(three), {"x": x, "y": torch.zeros(8, dtype=torch.long)})
    with pytest.raises(UserError, match=r"failed in the model's forward .*mat1 and mat2.*tensor \(8, 5\) float32"):
        _check(TaskConfig(), three, (torch.randn(8, 5), torch.zeros(8, dtype=torch.long)))
    with pytest.raises(UserError, match=r"tensor \(8, 4\) float16, .*; the batch holds float16 or bfloat16 where the "
                                        r"model's weights are float32: return float32 from your Dataset"):
        _check(TaskConfig(), three, (x.half(), torch.zeros(8, dtype=torch.long)))


class _Nested(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        logits = self.inner(x)
        return (logits, logits.sum(1)), {"hidden": logits * 2}


def test_a_loss_taken_off_the_graph_is_refused_and_working_losses_are_left_alone():
    three, x, y = nn.Linear(4, 3), torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    with pytest.raises(UserError, match=r"loss does not follow the model's output back"):
        _check(TaskConfig(name="user_code:detached_loss"), three, (x, y))
    task = build_task(TaskConfig(name="user_code:detached_loss"))
    check_first_batch(task, three, (x, y), None, Precision("32", CPU), stage="evaluation")  # no step taken there
    _check(TaskConfig(name="user_code:in_place_loss"), three, (x, y))
    _check(TaskConfig(name="user_code:nested_output_loss"), _Nested(three), (x, y))
    _check(TaskConfig(name="torch.nn.functional:cross_entropy"), three, (x, y))


class _OnlyX(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class _Keyword(_OnlyX):
    def forward(self, x, **ignored):
        return self.inner(x)


@pytest.mark.parametrize("task, message", [
    ("user_code:per_sample_loss", r"returned a tensor of shape \(8,\), not a scalar"),
    ("user_code:log_of_zero_loss", r"is -?inf on the first training batch"),  # the sign follows the output's
    ("user_code:MeanMetrics", r"'acc' is tensor\(.*\), not a \(sum, count\) pair"),
    ("user_code:OnlyMetrics", r"has no loss method and the model returned no loss"),
    ("user_code:not_a_model", r"task 'user_code:not_a_model' is an object of type int: give a loss function"),
])
def test_a_user_task_s_mistakes_are_one_line(task, message):
    with pytest.raises(UserError, match=message):
        _check(TaskConfig(name=task), nn.Linear(4, 3), (torch.randn(8, 4), torch.zeros(8, dtype=torch.long)))


def test_best_metric_must_exist_and_have_a_direction():
    first = _check(TaskConfig(name="user_code:F1WithoutDirection"), nn.Linear(4, 3),
                   (torch.randn(8, 4), torch.zeros(8, dtype=torch.long)))
    task = build_task(TaskConfig(name="user_code:F1WithoutDirection"))
    assert best_metric("auto", "auto", task, first.reported) == ("val_loss", False)
    with pytest.raises(UserError, match="cannot tell whether a higher or lower val_hits is better"):
        best_metric("val_hits", "auto", task, first.reported)
    assert best_metric("val_hits", "max", task, first.reported) == ("val_hits", True)
    with pytest.raises(UserError, match="'val_f1' is not a metric of task .* it reports val_hits, val_loss"):
        best_metric("val_f1", "auto", task, first.reported)


def test_a_rank_without_validation_batches_still_reduces_the_same_tensors():
    from hvdtrain.train.loop import evaluate

    task = build_task(TaskConfig())
    first = _check(TaskConfig(), nn.Linear(4, 3), (torch.randn(8, 4), torch.zeros(8, dtype=torch.long)))
    result = evaluate(nn.Linear(4, 3), LocalEngine(CPU), task, [], first.template)
    assert result.samples == 0 and set(result.metrics) == {"loss", "acc"}
