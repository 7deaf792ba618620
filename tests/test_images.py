"""Class folders of images: listed as torchvision's ImageFolder lists them, decoded to uint8 where they
are loaded, augmented on the device from (seed, epoch, step, rank) and nothing else; ResNets under
torchvision's names; the bad inputs, one line each; and real runs under horovodrun and torchrun."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import (ROOT, assert_ok, assert_same_weights, epoch_records, final_weights, fit_under,
                      requires_launchers)
from hvdtrain.cli import main
from hvdtrain.config import DataConfig, ModelConfig
from hvdtrain.data.augment import AugmentSettings, DeviceAugment
from hvdtrain.data.sources import build_data, build_part
from hvdtrain.models import build_model

sys.path.insert(0, str(ROOT))
from benchmarks.image_folder import write_image_folder  # noqa: E402

LOCAL = ["--progress", "off", "--engine", "local", "--threads", "1"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """800 JPEGs of 16x16 in 10 classes, train/ and val/ (made once for the module)."""
    return write_image_folder(tmp_path_factory.mktemp("images"), 800, 16)


def _image(path: Path, size: tuple[int, int] = (8, 6), mode: str = "RGB", value: int = 100) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value if mode in ("L", "P") else (value,) * len(mode)).save(path)


def test_classes_and_images_are_listed_as_torchvision_lists_them(tmp_path):
    for name in ("b/2.JPG", "b/1.png", "a/x/3.webp", "a/0.jpeg", "C/9.jpg", "C/8.bmp", "a/7.TIF", "train_notes.txt",
                 "C/readme.md"):
        if name.endswith((".txt", ".md")):
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text("not an image")
        else:
            _image(tmp_path / name, mode="RGBA" if name.endswith(".webp") else "L" if name.endswith(".png") else "RGB")
    whole = build_part(DataConfig(name=str(tmp_path)), 0, "labels", "all")
    assert whole.classes == ["C", "a", "b"]  # sorted by code point, as torchvision sorts
    assert [whole.file(i) for i in range(len(whole))] == ["C/8.bmp", "C/9.jpg", "a/0.jpeg", "a/7.TIF", "a/x/3.webp",
                                                          "b/1.png", "b/2.JPG"]
    assert whole.targets.tolist() == [0, 0, 1, 1, 1, 2, 2]
    for index in range(len(whole)):  # grey, RGBA and RGB alike: 3 channels, uint8, (C, H, W)
        image, label = whole[index]
        assert (image.dtype, tuple(image.shape), label) == (torch.uint8, (3, 6, 8), whole.targets[index])


def test_train_and_val_folders_or_a_held_out_part(folder, tmp_path):
    split = build_data(DataConfig(name=str(folder)), 0)
    assert (len(split.train), len(split.val), split.num_classes, split.input_shape) == (640, 160, 10, (3, 16, 16))
    assert split.train.file(0).startswith("train/class_00/") and split.val.file(0).startswith("val/class_00/")
    assert len(split.held_targets) == 800 and split.target_dtype == torch.int64
    # Class folders alone: every 5th image held out (val_fraction 0.2), so each class keeps its share.
    for index in range(20):
        _image(tmp_path / f"k{index % 2}" / f"{index:02d}.png", value=index)
    split = build_data(DataConfig(name=str(tmp_path)), 0)
    train = {split.train.file(i) for i in range(len(split.train))}
    val = [split.val.file(i) for i in range(len(split.val))]
    assert len(train) == 16 and val == ["k0/08.png", "k0/18.png", "k1/09.png", "k1/19.png"]
    assert not train & set(val)


def test_image_size_decodes_every_image_to_one_square(tmp_path):
    _image(tmp_path / "a" / "wide.jpg", (40, 20))
    _image(tmp_path / "b" / "tall.png", (10, 30))
    whole = build_part(DataConfig(name=str(tmp_path), image_size=12), 0, "labels", "all")
    assert [tuple(whole[i][0].shape) for i in range(2)] == [(3, 12, 12), (3, 12, 12)]


def test_training_augmentation_draws_from_seed_epoch_step_and_rank_alone():
    images = torch.randint(0, 256, (6, 3, 20, 20), dtype=torch.uint8)
    labels = torch.arange(6)
    augment = DeviceAugment(AugmentSettings.of({"size": 16}), seed=3, image_shape=(3, 20, 20))
    before = torch.get_rng_state()
    first, again = augment((images, labels), 1, 5, 0), augment((images, labels), 1, 5, 0)
    assert torch.equal(torch.get_rng_state(), before)  # the global random state is not touched
    assert first[0].dtype == torch.float32 and first[0].shape == (6, 3, 16, 16) and first[1] is labels
    assert torch.equal(first[0], again[0])
    for other in ((2, 5, 0), (1, 6, 0), (1, 5, 1)):  # another epoch, step or rank: other draws
        assert not torch.equal(augment((images, labels), *other)[0], first[0])
    assert not torch.equal(DeviceAugment(AugmentSettings(), 4, (3, 20, 20))((images, labels), 1, 5, 0)[0],
                           DeviceAugment(AugmentSettings(), 3, (3, 20, 20))((images, labels), 1, 5, 0)[0])


def test_validation_and_augmentation_off_only_convert_cut_the_centre_and_normalise():
    images = torch.randint(0, 256, (2, 3, 20, 20), dtype=torch.uint8)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    expected = ((images[..., 2:18, 2:18].float() / 255) - mean[:, None, None]) / std[:, None, None]
    augment = DeviceAugment(AugmentSettings.of({"size": "16"}), 0, (3, 20, 20))
    assert torch.allclose(augment.evaluation((images,))[0], expected, atol=1e-6)
    off = DeviceAugment(AugmentSettings.of({"enabled": False, "size": 16}), 0, (3, 20, 20))
    assert torch.allclose(off((images,), 1, 2, 3)[0], expected, atol=1e-6)


@pytest.mark.parametrize("name, parameters, entries", [("resnet18", 11_689_512, 122), ("resnet50", 25_557_032, 320)])
def test_resnets_have_torchvision_s_parameters_under_its_names(name, parameters, entries):
    model = build_model(ModelConfig(name=name), (3, 224, 224), 1000)
    state = model.state_dict()
    assert sum(p.numel() for p in model.parameters()) == parameters and len(state) == entries
    for key in ("conv1.weight", "bn1.running_var", "layer1.0.conv1.weight", "layer2.0.downsample.0.weight",
                "layer2.0.downsample.1.num_batches_tracked", "layer4.1.bn2.bias", "fc.weight", "fc.bias"):
        assert key in state
    assert build_model(ModelConfig(name=name), (3, 32, 32), 10)(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_fit_evaluate_and_predict_read_the_same_folder_and_predictions_name_the_files(folder, tmp_path):
    run_dir = tmp_path / "run"
    main(["fit", *LOCAL, "--data", str(folder), "--model", "cnn", "--set", "model.hidden=8", "--epochs", "1",
          "--batch-size", "32", "--run-dir", str(run_dir)])
    last = epoch_records(run_dir)[-1]
    main(["evaluate", str(run_dir), "--checkpoint", "last", "--output", str(tmp_path / "e.json")])
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["samples"] == 160 and result["loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    main(["predict", str(run_dir), "--split", "all", "--output", str(tmp_path / "p.jsonl")])
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(rows) == 800 and rows[0]["file"].startswith("train/class_00/") and rows[-1]["file"].startswith("val/")
    assert all(row["class"] == f"class_{row['prediction']:02d}" for row in rows)  # the class's name, by its number


def _bad_inputs(top: Path) -> dict[str, tuple[str, str]]:
    """Each bad folder: (its path, what the one line says)."""
    (top / "empty").mkdir()
    for name in ("a/1.jpg", "b/1.jpg"):
        _image(top / "no_images" / name)
    (top / "no_images" / "c").mkdir()
    _image(top / "broken" / "a" / "1.jpg")
    _image(top / "broken" / "b" / "1.jpg")
    (top / "broken" / "a" / "2.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    _image(top / "mixed" / "a" / "1.jpg", (8, 8))
    _image(top / "mixed" / "b" / "2.jpg", (9, 8))
    for name in ("train/a/1.jpg", "train/b/1.jpg", "val/a/1.jpg", "val/d/1.jpg"):
        _image(top / "other_val" / name)
    return {"missing": (str(top / "absent"), f"data path '{top / 'absent'}' does not exist"),
            "empty": (str(top / "empty"), "is empty: give class folders of images"),
            "class without images": (str(top / "no_images"),
                                     f"class folder '{top / 'no_images' / 'c'}' holds no images"),
            "image that does not decode": (str(top / "broken"),
                                           f"image '{top / 'broken' / 'a' / '2.jpg'}' does not decode"),
            "mixed sizes": (str(top / "mixed"),
                            "images of several sizes need a size to decode them to: set data.image_size"),
            "other classes in val": (str(top / "other_val"),
                                     "val/ holds other classes than train/ (missing from val/: b; only in val/: d)")}


def test_bad_image_folders_are_one_line_each(tmp_path, capsys):
    for case, (data, message) in _bad_inputs(tmp_path).items():
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", *LOCAL, "--data", data, "--model", "cnn", "--batch-size", "1", "--set",
                  "data.val_fraction=0.5", "--run-dir", str(tmp_path / "run"), "--overwrite"])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("hvdtrain: rank")]
        assert exit_info.value.code == 2 and len(lines) == 1 and message in lines[0], (case, err)
        assert "Traceback" not in err


# 640 training images, a global batch of 2 x 32: 10 steps an epoch. The CNN drops out 0.2 of its input,
# so that a resume is exact only with every rank's random state restored beside the augmentation's.
AUGMENTED = ["--model", "user_code:signals_itself_cnn", "--epochs", "3", "--batch-size", "32", "--optimizer", "adamw",
             "--lr", "0.003", "--threads", "1", "--set", "run.stop_check_seconds=0"]


@pytest.fixture(scope="module")
def uninterrupted(folder, tmp_path_factory) -> Path:
    """3 epochs under horovodrun -np 2, augmentation on (made once for the module)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert_ok(fit_under("horovodrun-gloo", "--data", str(folder), *AUGMENTED, "--run-dir", str(run_dir)))
    return run_dir


@pytest.mark.multiprocess
@requires_launchers
def test_horovodrun_learns_the_folder_with_augmentation_on(uninterrupted):
    assert epoch_records(uninterrupted)[-1]["val_acc"] >= 0.9


@pytest.mark.multiprocess
@requires_launchers
def test_torchrun_stopped_inside_an_epoch_resumes_to_the_uninterrupted_weights(folder, uninterrupted, tmp_path):
    """SIGTERM to rank 1 in epoch 2 under torchrun, resumed there: the weights of the uninterrupted
    horovodrun run (the engines' are the same), the same validation accuracy, above 0.9."""
    run_dir = tmp_path / "run"
    args = ["--data", str(folder), *AUGMENTED, "--run-dir", str(run_dir)]
    stopped = fit_under("torchrun", *args, env={"HVDTRAIN_TEST_SIGNAL": "1:15:SIGTERM"})
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 75 and "stopped by SIGTERM at epoch 2, step 15" in output, output[-3000:]
    resumed = assert_ok(fit_under("torchrun", *args, "--resume"))
    assert "(epoch 1, step 15, 320 samples into epoch 2)" in resumed.stdout
    assert_same_weights(final_weights(uninterrupted), final_weights(run_dir), atol=0.0)  # exactly
    assert epoch_records(run_dir)[-1]["val_acc"] == epoch_records(uninterrupted)[-1]["val_acc"] >= 0.9


@pytest.mark.multiprocess
@requires_launchers
def test_without_augmentation_two_ranks_of_b_train_as_one_process_of_2b(folder, tmp_path):
    common = ["--data", str(folder), "--model", "cnn", "--set", "model.hidden=8", "--set", "data.augment.enabled=false",
              "--epochs", "1", "--no-scale-lr", "--warmup-epochs", "0", "--lr", "0.01"]
    assert_ok(fit_under("torchrun", *common, "--threads", "1", "--batch-size", "16",
                        "--run-dir", str(tmp_path / "two")))
    main(["fit", *LOCAL, *common, "--batch-size", "32", "--run-dir", str(tmp_path / "one")])
    assert_same_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), atol=1e-6)
