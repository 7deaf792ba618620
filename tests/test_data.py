import numpy as np
import pytest
import torch

from hvdtrain.config import DataConfig, ModelConfig
from hvdtrain.data.loading import batches
from hvdtrain.data.sources import build_data
from hvdtrain.errors import UserError
from hvdtrain.models import build_model
from hvdtrain.data.sampler import ShardedBatchSampler


def test_digits_is_built_in_and_standardised():
    split = build_data(DataConfig(), seed=0)
    assert split.input_shape == (1, 8, 8) and split.num_classes == 10
    assert len(split.train) + len(split.val) == 1797
    train_x = split.train.tensors[0]
    assert train_x.mean().abs() < 0.05


def test_random_teacher_is_seeded():
    a = build_data(DataConfig(name="random", samples=100, features=4, classes=3), seed=1)
    b = build_data(DataConfig(name="random", samples=100, features=4, classes=3), seed=1)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])
    assert a.input_shape == (4,) and a.num_classes == 3


def test_npz(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.random.rand(50, 3).astype(np.float32), y=np.arange(50) % 4)
    split = build_data(DataConfig(name=str(path)), seed=0)
    assert split.num_classes == 4 and len(split.train) + len(split.val) == 50


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"inputs": np.zeros((4, 2)), "y": np.zeros(4, int)}, "has no array 'x'"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(5, int)}, "x has 4 samples but y has 5"),
        ({"x": np.zeros((4, 2)), "y": np.array(["a", "b", "c", "d"])}, "y must hold class labels or numbers"),
    ],
)
def test_bad_npz(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(UserError, match=message):
        build_data(DataConfig(name=str(path)), seed=0)


def test_not_an_npz(tmp_path):
    path = tmp_path / "text.npz"
    path.write_text("not numpy")
    with pytest.raises(UserError, match="not a readable .npz"):
        build_data(DataConfig(name=str(path)), seed=0)


def test_user_dataset_and_model_factories_work_unchanged():
    split = build_data(DataConfig(name="user_code:blobs"), seed=0)
    assert split.num_classes == 3 and split.input_shape == (5,)
    model = build_model(ModelConfig(name="user_code:tiny_net"), split.input_shape, split.num_classes)
    sampler = ShardedBatchSampler(len(split.train), 8, 0, 1)
    x, y = next(iter(batches(split.train, sampler, num_workers=0, pin_memory=False)))
    assert model(x).shape == (8, 3) and y.shape == (8,)


def test_factory_of_tensor_datasets_counts_classes_from_labels():
    assert build_data(DataConfig(name="user_code:tensors"), seed=0).num_classes == 2


def test_factory_returning_a_pair():
    split = build_data(DataConfig(name="user_code:blobs_split"), seed=0)
    assert (len(split.train), len(split.val)) == (240, 60)


@pytest.mark.parametrize(
    "name, message",
    [
        ("nowhere.module:fn", "module 'nowhere' not found"),
        ("user_code:absent", "has no attribute 'absent'"),
        ("user_code:raises_on_import_of_missing", "not_installed_anywhere"),
        ("imagenet", "unknown data set 'imagenet'"),
        ("missing.npz", "data file 'missing.npz' does not exist"),
    ],
)
def test_bad_data_names(name, message):
    with pytest.raises(UserError, match=message):
        build_data(DataConfig(name=name), seed=0)


def test_bad_models():
    with pytest.raises(UserError, match="unknown model 'resnet9000'"):
        build_model(ModelConfig(name="resnet9000"), (4,), 3)
    with pytest.raises(UserError, match="returned int"):
        build_model(ModelConfig(name="user_code:not_a_model"), (4,), 3)
    with pytest.raises(UserError, match="needs image inputs"):
        build_model(ModelConfig(name="cnn"), (4,), 3)


@pytest.mark.parametrize("budget, train, val", [(4, 3, 1), (1, 1, 0), (0, 0, 0)])
def test_the_training_and_validation_loaders_share_one_worker_budget(budget, train, val):
    """Both loaders keep their workers across epochs, so data.num_workers counts them together."""
    from hvdtrain.config import load_config
    from hvdtrain.engine import LocalEngine
    from hvdtrain.train.setup import build, shard

    config = load_config(None, {"data.name": "user_code:blobs_split", "data.num_workers": budget})
    engine = LocalEngine(torch.device("cpu"))
    part = shard(build(config, engine), config, engine)
    assert (part.train_batches.num_workers, part.val_batches.num_workers) == (train, val)
