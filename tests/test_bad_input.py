"""Every bad input: one clear line, exit status 2, no traceback, nothing overwritten."""

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from types import SimpleNamespace

import pytest
import torch

import hvdtrain
from conftest import DOWNLOADED, epoch_records, launch_env
from hvdtrain.cli import main
from hvdtrain.errors import UserError


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory) -> Path:
    """A finished run that no bad command may touch."""
    run_dir = tmp_path_factory.mktemp("existing") / "run"
    main(["fit", "--data", "random", "--set", "data.samples=256", "--epochs", "1", "--progress", "off",
          "--engine", "local", "--run-dir", str(run_dir)])
    return run_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("inputs")
    np.savez(folder / "no_x.npz", inputs=np.zeros((8, 2)), y=np.zeros(8, int))
    np.savez(folder / "negative.npz", x=np.zeros((8, 2)), y=np.array([0, 1, -1, 1, 0, 1, 0, 1]))
    np.savez(folder / "float_y.npz", x=np.zeros((8, 2)), y=np.linspace(0, 1, 8))
    x = np.ones((8, 2))
    x[5, 1] = np.nan
    np.savez(folder / "nan_x.npz", x=x, y=np.array([0, 1] * 4))
    (folder / "wrong_type.yaml").write_text("data:\n  batch_size: lots\n")
    (folder / "unknown_key.yaml").write_text("train:\n  epohcs: 3\n")
    (folder / "table.csv").write_text("a,b,label\n1,2,0\n3,4,1\n")
    torch.save((torch.zeros(8, 2), torch.zeros(8, dtype=torch.long)), folder / "saved.pt")
    np.save(folder / "one_array.npy", np.zeros((8, 2)))
    return {name: str(folder / f"{name}.{ext}") for name, ext in [
        ("no_x", "npz"), ("negative", "npz"), ("float_y", "npz"), ("nan_x", "npz"), ("wrong_type", "yaml"),
        ("unknown_key", "yaml"), ("table", "csv"), ("saved", "pt"), ("one_array", "npy")]}


CASES = {
    "unknown data set": (["--data", "imagenet"], "unknown data set 'imagenet'"),
    "unknown model": (["--model", "resnet9000"], "unknown model 'resnet9000'"),
    "missing npz": (["--data", "absent.npz"], "data file 'absent.npz' does not exist"),
    "npz without x": (["--data", "{no_x}"], "has no array 'x'"),
    "SparseAdam": (["--optimizer", "torch.optim:SparseAdam"], "optimizer factory 'torch.optim:SparseAdam' made a "
                   "SparseAdam, which takes sparse gradients only, and gradients are allreduced dense"),
    "a table": (["--data", "{table}"], "a table (.csv) needs a data factory of yours that reads its columns into a "
                                      "Dataset (--data mymodule:data)"),
    "a file of torch.save": (["--data", "{saved}"], "a saved object (.pt) needs a data factory of yours that loads it "
                                                   "into a Dataset (TensorDataset(x, y), --data mymodule:data)"),
    "one .npy file": (["--data", "{one_array}"], "an .npy file holds one array: save the inputs as x.npy and the "
                                                 "targets as y.npy in one directory"),
    "factory does not import": (["--data", "nowhere.module:make"], "module 'nowhere' not found"),
    "factory attribute missing": (["--model", "user_code:absent"], "has no attribute 'absent'"),
    "lazy layers used in training only": (["--data", "random", "--model", "user_code:lazy_in_training_only"],
                                          "the model's lazy layers auxiliary.weight, auxiliary.bias got no weights from "
                                          "a forward in eval mode (one used in training only)"),
    "complex weights with bf16 on the wire": (["--data", "random", "--set", "data.features=12", "--model",
                                               "user_code:odd_layers", "--compression", "bf16"],
                                              "the model has complex weights (spectrum), whose gradients --compression "
                                              "bf16 would send without their imaginary parts: leave --compression out"),
    "lazy layers that do not fit": (["--data", "random", "--model", "user_code:lazy_sized_wrong"],
                                    "the first training batch failed in the model's forward (task classification): "
                                    "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x32 and 30x"),
    "unknown config key": (["--set", "train.epohcs=3"], "config key 'train.epohcs' does not exist: did you mean 'train.epochs'?"),
    "unknown key in yaml": (["--config", "{unknown_key}"], "config key 'train.epohcs' does not exist"),
    "wrong type in yaml": (["--config", "{wrong_type}"], "config key 'data.batch_size' must be an integer, got 'lots'"),
    "wrong type flag": (["--batch-size", "many"], "Invalid value for '--batch-size': 'many' is not a valid integer"),
    "batch size zero": (["--batch-size", "0"], "config key 'data.batch_size' must be at least 1, got 0"),
    "missing config file": (["--config", "absent.yaml"], "config file 'absent.yaml' does not exist"),
    "bad choice": (["--schedule", "sometimes"], "Invalid value for '--schedule'"),
    "batch larger than data": (["--data", "random", "--set", "data.samples=20", "--batch-size", "64"],
                               "the training set has 16 samples, fewer than one optimizer step needs"),
    "resume and overwrite": (["--resume", "--overwrite"], "exclude each other"),
    "unknown flag": (["--epochz", "3"], "No such option '--epochz'. (Did you mean one of: '--epochs'"),
    "elastic without its launcher": (["--elastic"], "--elastic needs processes started by horovodrun in elastic mode"),
    "DataLoaders for data sets": (["--data", "user_code:loaders_pair"], "its train set is a DataLoader: return its "
                                  "data set (loader.dataset): hvdtrain makes the loaders"),
    "Keras' (x, y)": (["--data", "user_code:keras_arrays"], "returned a tuple of 2 arrays of 64 rows, not a data set: "
                                                           "make them one, torch.utils.data.TensorDataset("),
    "a dict of splits": (["--data", "user_code:split_dict"], "returned a dict of 'train', 'test', 'validation': "
                         "return a (train, val) pair of its data sets, (splits['train'], splits['validation']) say"),
    "three data sets": (["--data", "user_code:three_splits"], "returned 3 data sets: return a (train, val) pair, "
                        "and evaluate another set after fit with `hvdtrain evaluate RUN_DIR --data module:function`"),
    "a pair of (x, y) arrays": (["--data", "user_code:arrays_pair"], "its train set is a tuple of 2 arrays of 64 rows"),
    "a model in DDP without a process group": (["--model", "user_code:ddp_mlp"], "model factory 'user_code:ddp_mlp' "
                                                "raised ValueError: Default process group has not been initialized"
                                                ", please make sure to call init_process_group: hvdtrain starts a "
                                                "torch.distributed process group only on the torch engine (torchrun, "
                                                "or --engine torch), and either engine averages the gradients itself: "
                                                "return the model without DistributedDataParallel"),
    "Horovod's optimizer without Horovod": (["--optimizer", "user_code:wrapped_optimizer"], "optimizer factory "
                                            "'user_code:wrapped_optimizer' uses Horovod, which this engine has not "
                                            "started (ValueError: Horovod has not been initialized; use hvd.init().): "
                                            "return the optimizer itself"),
    "a compiled DataParallel": (["--model", "user_code:compiled_data_parallel"], "model factory "
                                "'user_code:compiled_data_parallel' compiles a DataParallel: hvdtrain does its work "
                                "itself; compile the module inside it (or pass --compile)"),
    "class names for targets": (["--data", "user_code:NamedLabels"], "in the first): task classification needs "
                                "numbers: map each class name to its index in your Dataset, and give it a `classes` "
                                "list of the names"),
    "untransformed images": (["--data", "user_code:Pictures"], "the samples' inputs are PIL images, which do not "
                             "stack into a batch: give your Dataset a transform that makes each a tensor"),
    "a model built in half precision": (["--model", "user_code:half_net"], "a model built in float16 or bfloat16 "
                                        "(.half()) meets float32 inputs: build it in float32 and train with --precision"),
    "a model built in float64": (["--model", "user_code:double_net"], "a model built in float64 (.double()) meets "
                                 "float32 inputs: build it in float32, or return float64 from your Dataset"),
    "a model on the meta device": (["--model", "user_code:meta_net"], "the model's parameters are on the meta device "
                                   "(built under torch.device('meta')), which holds no values: build it with real "
                                   "tensors, or give them values in your factory"),
    "iterable data set": (["--data", "user_code:stream"], "returned an IterableDataset without a length: hvdtrain needs len()"),
    "negative stall timeout": (["--set", "train.stall_timeout=-5"], "config key 'train.stall_timeout' must be 0 (off) or more"),
    "unknown task": (["--task", "ranking"], "unknown task 'ranking': use one of classification, regression"),
    "misspelt task": (["--task", "regresion"], "unknown task 'regresion': did you mean 'regression'?"),
    "multilabel on class labels": (["--task", "multilabel"], "multilabel needs a 0/1 target per class"),
    "labels beyond the model's classes": (["--model", "user_code:three_logits"],
                                          "the labels reach 9 but the model's output has 3 classes"),
    "negative labels": (["--data", "{negative}", "--batch-size", "2"], "the labels include -1"),
    "NaN in the data file": (["--data", "{nan_x}", "--batch-size", "2"],
                             "x holds NaN or Inf in 1 of 8 samples, the first at index 5: clean or drop them"),
    "float targets for classification": (["--data", "{float_y}", "--batch-size", "2"],
                                         "classification needs integer class labels"),
    "dict batch without the target key": (["--data", "user_code:dict_blobs", "--model", "user_code:dict_net"],
                                          "it has no 'labels' key (task.target_key)"),
    "task without a loss": (["--data", "user_code:blobs", "--model", "user_code:tiny_net", "--task",
                             "user_code:OnlyMetrics"], "has no loss method and the model returned no loss"),
    "loss not finite at the start": (["--task", "user_code:log_of_zero_loss"], "is -inf on the first training batch"),
    # it failed at the first step, in a line from every rank
    "a loss taken off the graph": (["--task", "user_code:detached_loss"], "task 'user_code:detached_loss' loss does "
                                   "not follow the model's output back (it has no gradient: detached, or made anew "
                                   "from .item() or numbers): compute it from the output it is given"),
    "metrics not sums and counts": (["--task", "user_code:MeanMetrics"], "not a (sum, count) pair"),
    "input shape of dict samples": (["--data", "user_code:dict_blobs", "--model", "user_code:tiny_net"],
                                    "takes input_shape, but the samples' input is not one tensor (several, or a dict): "
                                    "give your model the sizes it needs as arguments of its own (--set model.args."),
    "a sample weight as the target": (["--data", "user_code:weighted"], "the targets (each sample's last item, or its "
                                      "'labels') are torch.float32 numbers, one per sample"),
    "generators of samples": (["--data", "user_code:generators"], "data factory 'user_code:generators': its train "
                              "set, a generator, is not a Dataset: return a map-style Dataset"),
    "class count unknown": (["--data", "user_code:int_labels", "--model", "user_code:needs_num_classes"],
                            "takes num_classes, but the data set does not say how many classes it has: set "
                            "data.num_classes"),
    # The built-in model: before, one label a sample made it one output, refused as "one class".
    "class count unknown, built-in model": (["--data", "user_code:int_labels"],
                                            "model 'mlp' needs the number of outputs, and the data set does not say "
                                            "how many classes it has: set data.num_classes"),
    "best metric the task lacks": (["--set", "run.best_metric=val_f1"],
                                   "run.best_metric 'val_f1' is not a metric of task classification"),
    "adasum with fp16": (["--adasum", "--precision", "fp16"], "'train.adasum' does not work with precision fp16"),
    "checkpoint interval of zero steps": (["--checkpoint-every-steps", "0"],
                                          "config key 'run.checkpoint_every_steps' must be at least 1"),
    "negative checkpoint minutes": (["--checkpoint-every-minutes", "-5"],
                                    "config key 'run.checkpoint_every_minutes' must be more than 0"),
    "unknown stop signal": (["--stop-signals", "SIGTERM,SIGFOO"], "'SIGFOO' is not a signal that can be caught"),
    "uncatchable stop signal": (["--stop-signals", "KILL"], "'KILL' is not a signal that can be caught"),
    "a data set whose first sample fails": (["--data", "user_code:first_sample_fails"],
                                            "data set 'user_code:first_sample_fails' could not be read: KeyError: "
                                            "'pixels' (/"),
    "samples of different lengths": (["--data", "user_code:ragged"],
                                     "the first training batch (samples 0 to 63) could not be made: RuntimeError: stack "
                                     "expects each tensor to be equal size, but got [4] at entry 0 and [5] at entry 1; "
                                     "samples of different shapes do not stack into a batch: pad sequences with --set "
                                     "data.collate=pad"),
    "float64 inputs": (["--data", "user_code:float64_blobs"],
                       "the batch holds float64 (NumPy's default) where the model's weights are float32: return "
                       "float32 from your Dataset (x.astype(np.float32)"),
    "samples that are not tensors": (["--data", "user_code:pictures", "--model", "user_code:bigram_lm"],
                                     "could not be made: TypeError: default_collate: batch must contain tensors, numpy "
                                     "arrays, numbers, dicts or lists; found <class 'user_code.Picture'>; return "
                                     "tensors, arrays or numbers from your Dataset"),
    "a pattern of shards the shell expanded": (["--data", "s/a-0.tar", "s/a-1.tar"],
                                               "a shell expanded a pattern of shards: quote it (--data 'shards/*.tar')"),
    "a launcher's option": (["-np", "4"], "hvdtrain fit takes no -np: it runs in each process a launcher starts, and "
                            "the number of processes is the launcher's: horovodrun -np 4 hvdtrain fit ..., or "
                            "torchrun --nproc-per-node 4 hvdtrain fit ..."),
    "another trainer's option": (["--devices=2"], "hvdtrain fit takes no --devices: it runs in each process"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_touches_nothing(case, existing_run, files, capsys):
    args, message = CASES[case]
    args = [a.format(**files) for a in args]
    before = snapshot(existing_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--engine", "local", "--progress", "off", "--run-dir", str(existing_run), "--overwrite", *args])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    lines = [line for line in captured.err.splitlines() if line.strip() and not line.startswith("hvdtrain: rank")]
    assert lines == [lines[0]] and lines[0].startswith("hvdtrain: error: "), captured.err
    assert message in lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert snapshot(existing_run) == before


def test_existing_run_directory_is_not_clobbered(existing_run, tmp_path, capsys):
    """Refused before the data is made: a download is not the price of a wrong --run-dir."""
    before = snapshot(existing_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--engine", "local", *DOWNLOADED(tmp_path / "cache"), "--run-dir", str(existing_run)])
    assert exit_info.value.code == 2
    assert "already holds a run: pass --resume to continue it, --overwrite" in capsys.readouterr().err
    assert snapshot(existing_run) == before
    assert not (tmp_path / "cache").exists()


def test_hvdtrain_alone_shows_its_usage_not_an_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("Usage: hvdtrain [OPTIONS] COMMAND") and "error" not in err


def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--engine", "local", "--progress", "off", "--run-dir", str(tmp_path / "a-file" / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert f"hvdtrain: error: could not make the directory {tmp_path}/a-file/run: Not a directory" in err


def test_resume_without_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--engine", "local", "--run-dir", str(tmp_path), "--resume"])
    assert "nothing to resume in" in capsys.readouterr().err


@pytest.mark.parametrize("given", ["run", "checkpoint"])
def test_resume_given_a_path_names_the_run_directory_meant(existing_run, given, capsys):
    """Other tools' habit (`--resume runs/a`, `--resume last.ckpt`): one line naming the flags for that run."""
    path = existing_run if given == "run" else existing_run / "checkpoints" / "epoch-0001.pt"
    before = snapshot(existing_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--engine", "local", "--epochs", "2", "--resume", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and snapshot(existing_run) == before
    assert err.strip() == ("hvdtrain: error: --resume takes no value, always or auto, not a path: it continues from "
                           f"the newest intact checkpoint of the run directory; for this one: --run-dir {existing_run} "
                           "--resume"), err
    with pytest.raises(UserError, match=re.escape(f"for this one: run_dir='{existing_run}', resume=True")):
        hvdtrain.fit(engine="local", resume=str(path))
    with pytest.raises(UserError, match="^resume takes True, False, 'always' or 'auto', got 'alwyas'$"):
        hvdtrain.fit(engine="local", resume="alwyas")
    checkpoints = existing_run / "checkpoints"  # the folder of checkpoints names its run too
    with pytest.raises(UserError, match=re.escape(f"for this one: run_dir='{existing_run}', resume=True")):
        hvdtrain.fit(engine="local", resume=str(checkpoints))


def test_a_run_directory_given_as_the_config_names_its_config_file(existing_run, capsys):
    before = snapshot(existing_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--engine", "local", "--config", str(existing_run)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and snapshot(existing_run) == before
    assert err.strip() == (f"hvdtrain: error: --config takes a YAML file, and '{existing_run}' is a directory: the "
                           f"run's recipe is {existing_run / 'config.yaml'} (to go on with that run instead: --run-dir "
                           f"{existing_run} --resume)"), err


def resume_refused(run_dir: Path, capsys, *args: str) -> str:
    """A resume of `run_dir` with `args` changed: refused with status 2, no traceback, nothing touched; its
    error output."""
    before = snapshot(run_dir)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--engine", "local", "--data", "random", "--set", "data.samples=256", *args, "--epochs", "2",
              "--run-dir", str(run_dir), "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert snapshot(run_dir) == before
    return err


def test_checkpoint_of_another_model(existing_run, capsys):
    err = resume_refused(existing_run, capsys, "--set", "model.hidden=32")
    assert "does not fit this model" in err and "size mismatch" in err
    assert err.strip().endswith("resume with the settings it was written with (model.hidden was 128, now 32): give "
                                f"them again, or add --config {existing_run / 'config.yaml'}"), err


def test_checkpoint_of_another_task(existing_run, capsys):
    """The same data and model shapes under another task: refused by name, not resumed with another loss."""
    err = resume_refused(existing_run, capsys, "--task", "user_code:CrossEntropyOfMyOwn")
    assert "was written by task 'classification', and this run's task is 'user_code:CrossEntropyOfMyOwn': resume with " \
           "--task classification" in err, err


def test_checkpoint_of_another_optimizer(existing_run, capsys):
    """SGD's state resumed with AdamW: the optimizer it was written with is named, not a KeyError's 'step'."""
    err = resume_refused(existing_run, capsys, "--optimizer", "adamw")
    assert "holds the state of optimizer 'sgd', which does not fit this run's 'adamw': resume with --optimizer sgd" \
        in err, err


class _FailsAtSeven(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        if index == 7:
            raise OSError("corrupt record 7")
        return torch.zeros(2)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_data_set_s_failure_is_named_by_its_own_message_and_line_in_a_data_loader_worker_or_not(workers):
    """PyTorch raises a worker's exception again in the main process, with the worker's traceback as
    its message: the one line gives the worker's message and the line in the user's data set, as it
    does for the exception itself where no worker read the data."""
    from hvdtrain.errors import where
    from hvdtrain.train.failures import worker_message

    with pytest.raises(OSError) as raised:
        list(torch.utils.data.DataLoader(_FailsAtSeven(), batch_size=4, num_workers=workers))
    assert worker_message(raised.value) == "corrupt record 7"
    line = _FailsAtSeven.__getitem__.__code__.co_firstlineno + 2
    assert where(raised.value) == f" ({__file__}:{line} in __getitem__)"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_that_does_not_stack_mid_run_says_how_to_make_one(workers):
    """Samples of another shape met mid-run (here in the first batch, read as the loop reads): the
    failing rank's line says how to batch them, in a data-loader worker or not."""
    from hvdtrain.engine.local import LocalEngine
    from hvdtrain.train.failures import located
    from user_code import ragged

    with pytest.raises(RuntimeError) as raised:
        list(torch.utils.data.DataLoader(ragged(), batch_size=8, num_workers=workers))
    line = str(located(raised.value, LocalEngine(torch.device("cpu")), "epoch 1, step 1"))
    assert line.startswith("rank 0 failed at epoch 1, step 1: RuntimeError: stack expects each tensor to be equal "
                           "size, but got [4] at entry 0 and [5] at entry 4"), line
    assert ("; samples of different shapes do not stack into a batch: pad sequences with --set data.collate=pad, or "
            "make batches with a function of yours (--set data.collate=package.module:function); every rank stops"
            ) in line


def test_a_user_s_exception_that_takes_no_attributes_is_located_as_any_other():
    """A frozen dataclass's exception refuses the note of where the job stood (for `hvdtrain runs`): the
    failure is said all the same, not a FrozenInstanceError in its place."""
    from dataclasses import dataclass

    from hvdtrain.engine.local import LocalEngine
    from hvdtrain.errors import where_the_job_stood
    from hvdtrain.train.failures import located

    @dataclass(frozen=True)
    class ShapeError(Exception):
        got: int

    failure = located(ShapeError(5), LocalEngine(torch.device("cpu")), "epoch 1, step 5")
    assert str(failure).startswith("rank 0 failed at epoch 1, step 5: ShapeError: 5")
    assert where_the_job_stood(failure) == ("epoch 1, step 5", "")


def test_a_data_loader_worker_s_death_raised_inside_horovod_s_wait_is_this_rank_s_own_failure():
    """torch's handler for a dead worker raises inside Horovod's wait, which raises every RuntimeError again as
    HorovodInternalError: taken for another rank's failure, no rank said what failed. A collective that broke
    off passes on as it is."""
    from horovod.common.exceptions import HorovodInternalError

    from hvdtrain.engine import horovod
    from hvdtrain.train.failures import located

    engine = SimpleNamespace(rank=1, is_root=False, is_engine_signal=horovod.is_collective_failure)
    try:
        try:
            raise RuntimeError("DataLoader worker (pid 4711) is killed by signal: Killed. ")
        except RuntimeError as died:
            raise HorovodInternalError(died)
    except HorovodInternalError as wrapped:
        line = str(located(wrapped, engine, "epoch 2, step 7"))
    assert line == ("rank 1 failed at epoch 2, step 7: a data-loader worker was killed (Killed: often the kernel's "
                    "out-of-memory killer); lower data.num_workers or data.shuffle_buffer")
    shut_down = HorovodInternalError("Horovod has been shut down. This was caused by an exception on one of the ranks")
    assert located(shut_down, engine, "epoch 2, step 7") is shut_down


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--engine", "local", "--data", "imagenet", "--debug"])
    err = capsys.readouterr().err
    assert "Traceback" in err and "hvdtrain: error: unknown data set" in err


def test_resume_auto_starts_afresh_where_a_run_was_killed_before_its_first_checkpoint(tmp_path, capsys):
    """A job killed in its first steps leaves the files rank 0 writes at its start, `where.json` among
    them (it is removed only when the job ends): they are the run's, and `--resume auto` begins again."""
    (tmp_path / "config.yaml").write_text("train:\n  epochs: 2\n")
    (tmp_path / "metrics.jsonl").write_text("")
    gone = subprocess.Popen(["true"])
    gone.wait()  # rank 0 of the killed job: a process of this host that no longer runs
    (tmp_path / "where.json").write_text(json.dumps({"host": socket.gethostname(), "port": 1, "token": "x",
                                                     "pid": gone.pid}))
    (tmp_path / ".where.json.4242").write_text("{")
    (tmp_path / ".summary.json.x1y2.tmp").write_text("{")  # killed inside an atomic write
    (tmp_path / "where").mkdir()
    (tmp_path / "mlflow_run_id").write_text("0123")
    main(["fit", "--engine", "local", "--data", "random", "--set", "data.samples=64", "--batch-size", "16",
          "--epochs", "1", "--run-dir", str(tmp_path), "--resume", "auto"])
    assert "error" not in capsys.readouterr().err
    assert (tmp_path / "summary.json").is_file() and not (tmp_path / "where.json").exists()
    assert not (tmp_path / "mlflow_run_id").exists()  # the killed run's MLflow run is not continued


def test_resume_auto_leaves_a_job_that_still_runs_there_alone(tmp_path, capsys):
    """Its where.json names a live process of this host (here: this test's own): refused, nothing removed."""
    (tmp_path / "config.yaml").write_text("train:\n  epochs: 2\n")
    (tmp_path / "where.json").write_text(json.dumps({"host": socket.gethostname(), "port": 1, "token": "x",
                                                     "pid": os.getpid()}))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--engine", "local", "--run-dir", str(tmp_path), "--resume", "auto"])
    assert exit_info.value.code == 2
    assert f"--resume auto: a job is still running in '{tmp_path}' (rank 0 is process {os.getpid()} on " \
           f"{socket.gethostname()}) and has written no checkpoint yet" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "where.json"]


@pytest.mark.parametrize("with_config", [False, True], ids=["other-files", "a-config-yaml-among-them"])
def test_resume_auto_refuses_a_directory_that_is_not_a_run(with_config, tmp_path, capsys):
    """Not even a config.yaml beside them makes someone's folder a run to start afresh in."""
    (tmp_path / "notes.txt").write_text("mine")
    if with_config:
        (tmp_path / "config.yaml").write_text("train:\n  epochs: 2\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--engine", "local", "--run-dir", str(tmp_path), "--resume", "auto"])
    assert exit_info.value.code == 2
    assert (f"--resume auto: '{tmp_path}' has no checkpoint to resume and holds files that are not a run's "
            "(notes.txt)") in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


PACED = ["--data", "random", "--set", "data.samples=6000", "--set", "data.features=12", "--model", "user_code:paced_mlp",
         "--progress", "off", "--threads", "1"]


def test_a_second_job_in_a_running_job_s_directory_is_refused_and_the_first_finishes(tmp_path, capsys):
    """`--overwrite` or `--resume` typed in another terminal (or a script started twice) while a job
    runs there: both used to train into one directory at once, writing the same checkpoints."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen(["hvdtrain", "fit", *PACED, "--epochs", "4", "--run-dir", str(run_dir)],
                             env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "checkpoints" / "last.pt").exists():  # mid-run, with something to resume
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.1)
        for how in ("--overwrite", "--resume"):  # refused before its data is made (a download, maybe)
            with pytest.raises(SystemExit) as exit_info:
                main(["fit", "--engine", "local", *PACED, *DOWNLOADED(tmp_path / "cache"), "--epochs", "4",
                      "--run-dir", str(run_dir), how])
            assert exit_info.value.code == 2
            err = capsys.readouterr().err
            assert f"hvdtrain: error: another job is running in run directory '{run_dir}'" in err, err
            assert not (tmp_path / "cache").exists()
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert [record["epoch"] for record in epoch_records(run_dir)] == [1, 2, 3, 4]
    # Once it has ended, the directory is free: the same --resume is taken.
    main(["fit", "--engine", "local", *PACED, "--epochs", "4", "--run-dir", str(run_dir), "--resume"])
    assert "nothing to do" in capsys.readouterr().out


def test_a_fit_that_failed_in_a_script_lets_its_run_directory_go(tmp_path, capsys):
    """A failed fit's process goes on (a notebook, a script that catches): another job may take the
    directory, and so may this process's next fit."""
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--engine", "local", "--data", "user_code:nan_in_one_sample", "--epochs", "2",
              "--run-dir", str(run_dir)])
    assert exit_info.value.code == 1 and "non-finite loss" in capsys.readouterr().err
    other = subprocess.run([sys.executable, "-c", "import fcntl, sys; fcntl.flock(open(sys.argv[1], 'r+'), "
                            "fcntl.LOCK_EX | fcntl.LOCK_NB)", str(run_dir / ".hvdtrain.lock")], capture_output=True,
                           text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    main(["fit", "--engine", "local", "--data", "random", "--set", "data.samples=256", "--batch-size", "16",
          "--epochs", "1", "--run-dir", str(run_dir), "--overwrite"])
    assert (run_dir / "summary.json").is_file()


def test_overwrite_through_a_symbolic_link_empties_the_run_it_points_to(tmp_path, capsys):
    """runs/latest -> runs/2026-11-27: the old run goes, the link stays a link (removing the directory
    itself refused a link, and on NFS could not remove one whose lock file was held open)."""
    real, link = tmp_path / "real", tmp_path / "latest"
    fit = ["fit", "--engine", "local", "--data", "random", "--set", "data.samples=256", "--batch-size", "16",
           "--progress", "off", "--run-dir", str(link)]
    real.mkdir()
    link.symlink_to(real)
    main([*fit, "--epochs", "2"])
    main([*fit, "--epochs", "1", "--overwrite"])
    assert "error" not in capsys.readouterr().err
    assert link.is_symlink() and [record["epoch"] for record in epoch_records(real)] == [1]


@pytest.mark.parametrize("env, seconds", [
    ({}, 30.0), ({"HVDTRAIN_QUIET_RANK_WAIT_SECONDS": "5"}, 5.0), ({"HVDTRAIN_QUIET_RANK_WAIT_SECONDS": "soon"}, 30.0),
    ({"HVDTRAIN_QUIET_RANK_WAIT_SECONDS": "inf"}, 30.0), ({"HVDTRAIN_QUIET_RANK_WAIT_SECONDS": "0"}, 30.0),
    ({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "h"}, 15.0),  # half of Gloo's rendezvous timeout, inside it
    ({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "h", "HVDTRAIN_QUIET_RANK_WAIT_SECONDS": "60"}, 15.0),
    ({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "h", "HOROVOD_GLOO_TIMEOUT_SECONDS": "120"}, 30.0)])
def test_a_rank_with_bad_input_waits_for_rank_0_s_line_as_long_as_asked_within_gloo_s_rendezvous(env, seconds,
                                                                                                  monkeypatch):
    from hvdtrain.cli.common import _quiet_rank_wait

    for name in ("HVDTRAIN_QUIET_RANK_WAIT_SECONDS", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_TIMEOUT_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _quiet_rank_wait() == seconds
