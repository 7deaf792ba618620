"""A factory gets the names it declares, a `**kwargs` factory what its convention passes, and every
factory its own arguments from the config (`model.args`, `data.args`, `task.args`, `optim.args`),
kept in the run's config so that the commands after fit build the same objects; a warm-up as long as
the run is one warning line from rank 0."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch
import yaml

import hvdtrain
from conftest import HOROVOD_AND_TORCH, ROOT, assert_ok, epoch_records, fit_under, requires_launchers, run
from factory_signatures import ResNetLike, TinyConv
from hvdtrain import UserError
from hvdtrain.cli import main
from hvdtrain.config import Config, ModelConfig, TaskConfig, describe, settings_config
from hvdtrain.data.sources import source_of
from hvdtrain.factory import resolve_factory
from hvdtrain.models import build_model
from hvdtrain.tasks import build_task

DIGITS = (1, 8, 8)
TORCHVISION = ["--model", "factory_signatures:resnet50"]
TIMM = ["--model", "factory_signatures:create_model", "--set", "model.args.model_name=tiny_conv",
        "--set", "model.args.in_chans=1"]
WARMUP = "hvdtrain: warning: optim.warmup_epochs (3) is longer than train.epochs (2)"


def test_a_torchvision_model_function_gets_num_classes_alone():
    made = build_model(ModelConfig(name="factory_signatures:resnet50"), DIGITS, 10, 10)
    assert isinstance(made, ResNetLike) and made.fc.out_features == 10


def test_timm_s_create_model_gets_its_name_and_the_class_s_arguments_from_model_args():
    cfg = Config.from_dict({}, {"model.name": "factory_signatures:create_model", "model.args.model_name": "tiny_conv",
                                "model.args.in_chans": 1, "model.args.width": 4}).model
    made = build_model(cfg, DIGITS, 10)
    assert isinstance(made, TinyConv) and made(torch.zeros(2, *DIGITS)).shape == (2, 10)
    assert made.body[0].in_channels == 1 and made.body[0].out_channels == 4


def test_model_args_win_over_hvdtrain_s_names():
    made = build_model(ModelConfig(name="factory_signatures:resnet50", args={"num_classes": 3}), DIGITS, 10)
    assert made.fc.out_features == 3


@pytest.mark.parametrize("args, message", [
    ({"depth": 2, "width": 8}, "model factory 'factory_signatures:net' takes no argument 'width' (from "
                               "model.args.width): it takes input_shape, num_classes, depth"),
    ({}, "model factory 'factory_signatures:net' needs depth: give it in model.args (--set model.args.depth=...)"),
])
def test_a_factory_declaring_its_names_refuses_others_in_one_line(args, message):
    with pytest.raises(UserError) as raised:
        build_model(ModelConfig(name="factory_signatures:net", args=args), (5,), 3)
    assert str(raised.value) == message


def test_args_are_for_factories_only():
    with pytest.raises(UserError, match=r"config key 'model.args' gives a package.module:function its own arguments; "
                                        r"'mlp' is built in"):
        Config.from_dict({}, {"model.args.depth": 50})


def test_task_args_reach_a_loss_class_and_unknown_ones_are_named():
    task = build_task(TaskConfig(name="torch.nn:CrossEntropyLoss", args={"label_smoothing": 0.25}))
    assert task.function.label_smoothing == 0.25
    with pytest.raises(UserError, match=r"task factory 'torch.nn:CrossEntropyLoss' takes no argument 'smoothing' "
                                        r"\(from task.args.smoothing\): it takes weight, .*label_smoothing"):
        build_task(TaskConfig(name="torch.nn:CrossEntropyLoss", args={"smoothing": 0.25}))


def test_the_listing_of_every_key_shows_the_args_keys():
    listing = yaml.safe_load(describe())
    assert all(listing[section]["args"] == {} for section in ("data", "model", "task", "optim"))


def test_set_data_args_reach_a_dataset_class_and_stay_in_the_run_s_config(tmp_path, capsys):
    """The tutorial's RandomDataset(size, length), named as it is, its arguments from --set; a torch.optim
    class as the optimizer (given the model's parameters as `params`), its own arguments from optim.args;
    and evaluate of the run builds the same data set again."""
    run_dir = tmp_path / "run"
    main(["fit", "--data", "factory_signatures:RandomDataset", "--set", "data.args.size=5",
          "--set", "data.args.length=200", "--optimizer", "torch.optim:Adam",
          "--set", "optim.args.betas=[0.8, 0.9]",
          "--lr", "0.01", "--epochs", "2", "--batch-size", "16", "--engine", "local", "--progress", "off",
          "--threads", "1", "--run-dir", str(run_dir)])
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["args"] == {"size": 5, "length": 200} and saved["optim"]["args"] == {"betas": [0.8, 0.9]}
    groups = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [tuple(group["betas"]) for group in groups] == [(0.8, 0.9)] and len(groups[0]["params"]) == 4
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]["1.weight"].shape == (128, 5)
    evaluated = hvdtrain.evaluate(run_dir)
    assert evaluated["samples"] == 40


@pytest.mark.parametrize("overrides, message", [
    ({"optim.name": "torch.optim.AdamW"}, "config key 'optim.name' must be sgd, adamw or package.module:function, got "
                                          "'torch.optim.AdamW' (a module's function is named with a colon: "
                                          "'torch.optim:AdamW')"),
    ({"data.collate": "user_code.pad"}, "config key 'data.collate' must be pad or package.module:function, got "
                                        "'user_code.pad' (a module's function is named with a colon: 'user_code:pad')"),
    ({"data.collate": "batches.pkl"}, "config key 'data.collate' must be pad or package.module:function, got "
                                      "'batches.pkl'"),  # no module `batches`: no hint
    ({"optim.name": "adamw", "optim.momentum": 0.5}, "config key 'optim.momentum' is sgd's, and optim.name is 'adamw': "
                                                     "for AdamW's betas use --optimizer torch.optim:AdamW --set "
                                                     "'optim.args.betas=[0.9, 0.95]'"),
    ({"optim.name": "torch.optim:Adam", "optim.weight_decay": 0.1},
     "config key 'optim.weight_decay' is for sgd and adamw, and optim.name is 'torch.optim:Adam': give your "
     "optimizer's own in optim.args (--set optim.args.weight_decay=...)"),
])
def test_a_name_in_the_wrong_form_or_a_key_that_would_change_nothing_is_one_line(overrides, message):
    with pytest.raises(UserError) as raised:
        settings_config(None, overrides, {})
    assert str(raised.value) == message


def test_a_saved_run_with_a_key_that_changed_nothing_still_loads():
    """evaluate and predict take a run's saved config as it was, before such keys were refused."""
    config = Config.from_dict({"optim": {"name": "adamw", "momentum": 0.5}})
    assert config.optim.momentum == 0.5


@pytest.mark.parametrize("name, message", [
    ("factory_signatures.net", "unknown model 'factory_signatures.net': use one of mlp, cnn, resnet18, resnet34, "
                               "resnet50, resnet101, resnet152 or package.module:function (a module's function is "
                               "named with a colon: 'factory_signatures:net')"),
    ("src/factory_signatures.py:net", "model factory 'src/factory_signatures.py:net' names a file: name its module and "
                                      "put its folder on PYTHONPATH (PYTHONPATH=src and factory_signatures:net)"),
])
def test_a_model_named_as_a_dotted_path_or_a_file_says_how_to_name_it(name, message):
    with pytest.raises(UserError) as raised:
        build_model(ModelConfig(name=name), DIGITS, 10)
    assert str(raised.value) == message


def test_a_module_in_the_current_directory_is_found_without_pythonpath(tmp_path):
    """As `python -m hvdtrain` finds it (and uvicorn's `main:app`): the command's own path starts at its
    folder. Data-loader workers and `evaluate` from the same directory find it too."""
    (tmp_path / "mydata.py").write_text(
        "import torch\nfrom torch.utils.data import TensorDataset\n"
        "def data():\n    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(0))\n"
        "    return TensorDataset(x, (x[:, 0] > 0).long())\n")
    fit = ["--data", "mydata:data", "--epochs", "1", "--num-workers", "1", "--engine", "local", "--run-dir", "r"]
    assert_ok(run(["hvdtrain", "fit", "--progress", "off", *fit], cwd=tmp_path, pythonpath=str(ROOT)))
    assert_ok(run(["hvdtrain", "evaluate", "r"], cwd=tmp_path, pythonpath=str(ROOT)))


def test_a_dotted_name_of_a_module_in_the_current_directory_says_to_use_a_colon(tmp_path, monkeypatch):
    """`--data mydata.make` where mydata.py is in the current directory, not on the path: the colon's hint
    (it looked only on the path). The task's unknown name gives it too."""
    (tmp_path / "mydata.py").write_text("def make():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    hint = " (a module's function is named with a colon: 'mydata:make')"
    with pytest.raises(UserError) as data:
        source_of("mydata.make")
    assert str(data.value).endswith(hint)
    with pytest.raises(UserError) as task:
        build_task(TaskConfig(name="mydata.make"))
    assert str(task.value).endswith(hint)
    with pytest.raises(UserError) as task:  # not "did you mean 'regression'?"
        build_task(TaskConfig(name="mydata.regression"))
    assert str(task.value).endswith(" (a module's function is named with a colon: 'mydata:regression')")


def test_a_folder_of_the_current_directory_that_is_no_package_is_not_imported(tmp_path, monkeypatch):
    (tmp_path / "plain_folder").mkdir()  # no __init__.py: Python would take it for a namespace package
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    with pytest.raises(UserError, match="module 'plain_folder' not found; install it or add its folder to PYTHONPATH"):
        resolve_factory("plain_folder:make", "data set")
    assert str(tmp_path) not in sys.path


def test_a_module_hidden_by_another_of_its_name_says_which_was_imported(tmp_path, monkeypatch):
    """A user's io.py on the path: Python's own io, imported first, answers for it."""
    (tmp_path / "io.py").write_text("def data():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as raised:
        resolve_factory("io:data", "data set")
    assert str(raised.value) == ("data set factory 'io:data': 'io' has no attribute 'data' (the 'io' imported is "
                                 f"{io.__file__}, not {tmp_path / 'io.py'}, which defines it: another module of that "
                                 "name came first; rename yours)")
    # A misspelt name in a module found twice (a checkout and its installed copy) is no such case.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        (tmp_path / folder / "twice_found.py").write_text("def make():\n    pass\n")
        monkeypatch.syspath_prepend(str(tmp_path / folder))
    with pytest.raises(UserError) as raised:
        resolve_factory("twice_found:mak", "model")
    assert str(raised.value) == "model factory 'twice_found:mak': 'twice_found' has no attribute 'mak'"


def test_a_dataset_class_without_its_arguments_says_which_to_give(tmp_path):
    with pytest.raises(UserError) as raised:
        hvdtrain.fit(data="factory_signatures:RandomDataset", epochs=1, run_dir=str(tmp_path / "run"), progress="off",
                     engine="local")
    assert str(raised.value) == ("data set factory 'factory_signatures:RandomDataset' needs size, length: give them "
                                 "in data.args (--set data.args.size=...)")


def test_a_warm_up_as_long_as_the_run_is_one_warning_line(tmp_path, capsys):
    hvdtrain.fit(data="factory_signatures:RandomDataset", overrides={"data.args": {"size": 5, "length": 64}},
                 epochs=2, warmup_epochs=3, batch_size=16, run_dir=str(tmp_path / "run"), progress="off",
                 engine="local", threads=1)
    assert capsys.readouterr().out.count(WARMUP) == 1
    hvdtrain.fit(data="factory_signatures:RandomDataset", overrides={"data.args": {"size": 5, "length": 64}},
                 epochs=2, warmup_epochs=2, schedule="cosine", batch_size=16, run_dir=str(tmp_path / "other"),
                 progress="off", engine="local", threads=1)
    assert "warning" not in capsys.readouterr().out


def test_a_model_with_a_training_step_is_told_that_its_loss_is_the_task_s(tmp_path, capsys):
    """A LightningModule's loss lives in training_step, which hvdtrain never calls: with a built-in task rank 0
    says so once; with the user's own loss there is nothing to say."""
    class Lit(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(5, 3)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self(batch[0]), batch[1], label_smoothing=0.1)

    blobs = "user_code:blobs"
    hvdtrain.fit(model=Lit(), data=blobs, epochs=1, batch_size=16, run_dir=str(tmp_path / "run"), progress="off",
                 engine="local", threads=1)
    assert capsys.readouterr().out.count("hvdtrain: warning: the model has a training_step (a LightningModule's), "
                                         "which hvdtrain never calls") == 1
    hvdtrain.fit(model=Lit(), data=blobs, task=torch.nn.CrossEntropyLoss(label_smoothing=0.1), epochs=1, batch_size=16,
                 run_dir=str(tmp_path / "own-loss"), progress="off", engine="local", threads=1)
    assert "warning" not in capsys.readouterr().out


def test_class_names_for_targets_train_where_a_collate_of_the_user_s_makes_them_numbers(tmp_path):
    summary = hvdtrain.fit(data="user_code:NamedLabels", model="user_code:tiny_net", epochs=1, batch_size=16,
                           overrides={"data.collate": "user_code:names_to_indices", "data.num_classes": 2},
                           run_dir=str(tmp_path / "run"), progress="off", engine="local", threads=1)
    assert summary["epochs"] == 1


def test_onecycle_s_warning_says_it_has_a_warm_up_of_its_own():
    config = Config.from_dict({}, {"optim.schedule": "onecycle", "optim.warmup_epochs": 100, "train.epochs": 1})
    assert config.warnings() == ["optim.warmup_epochs (100) is longer than train.epochs (1), and the onecycle "
                                 "schedule does not use it: its own rise over the first 30% of the run is its warm-up"]


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.parametrize("launcher, model", list(zip(HOROVOD_AND_TORCH, (TORCHVISION, TIMM))),
                         ids=["torchvision", "timm"])
def test_library_signatures_train_under_a_launcher_and_the_run_builds_again(launcher, model, tmp_path):
    """torchvision's and timm's signatures under horovodrun and torchrun; evaluate and export rebuild
    the model from the run's config alone. The warm-up warning comes from rank 0 only."""
    run_dir = tmp_path / "run"
    done = assert_ok(fit_under(launcher, *model, "--epochs", "2", "--warmup-epochs", "3", "--batch-size", "32",
                               "--threads", "1", "--run-dir", str(run_dir), cwd=tmp_path))
    assert done.stdout.count(WARMUP) == 1, done.stdout[-3000:]
    assert_ok(run(["hvdtrain", "evaluate", str(run_dir), "--checkpoint", "last", "--output",
                   str(tmp_path / "evaluate.json")], cwd=tmp_path))
    metrics, last = json.loads((tmp_path / "evaluate.json").read_text()), epoch_records(run_dir)[-1]
    assert metrics["loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    assert metrics["acc"] == pytest.approx(last["val_acc"])
    exported = assert_ok(run(["hvdtrain", "export", str(run_dir), "--checkpoint", "last"], cwd=tmp_path))
    assert (run_dir / "export" / "model.safetensors").is_file(), exported.stdout
