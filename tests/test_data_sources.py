"""A new kind of data source is one class and one registration line in `hvdtrain.data.sources.SOURCES`:
this module adds a kind that claims names starting with `ones:` and trains, evaluates and predicts on
it in process, changing nothing in hvdtrain."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hvdtrain.cli import main
from hvdtrain.config import DataConfig
from hvdtrain.data import sources
from hvdtrain.data.sources.tensors import InMemory
from hvdtrain.errors import UserError

LOCAL = ["--progress", "off", "--engine", "local", "--threads", "1"]


class Ones(InMemory):
    """`ones:N`: N samples of 4 features, all +1 for label 1 and all -1 for label 0, alternating."""

    def claims(self, name: str) -> bool:
        return name.startswith("ones:")

    def tensors(self, cfg: DataConfig, seed: int, need_targets: bool) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.arange(int(cfg.name.removeprefix("ones:"))) % 2
        return torch.ones(len(labels), 4) * (2 * labels[:, None] - 1), labels


@pytest.fixture
def ones_registered(monkeypatch):
    # The registration line: first, since a factory's package.module:function would claim 'ones:64' too.
    monkeypatch.setattr(sources, "SOURCES", (Ones(), *sources.SOURCES))


def test_without_its_registration_line_the_name_is_a_factory_s():
    with pytest.raises(UserError, match="data set factory 'ones:64': module 'ones' not found"):
        sources.build_data(DataConfig(name="ones:64"), seed=0)


def test_a_source_registered_from_outside_trains_evaluates_and_predicts(ones_registered, tmp_path):
    split = sources.build_data(DataConfig(name="ones:64"), seed=0)
    assert (len(split.train), len(split.val), split.input_shape, split.num_classes) == (51, 13, (4,), 2)
    run_dir = tmp_path / "run"
    main(["fit", *LOCAL, "--data", "ones:64", "--epochs", "2", "--batch-size", "8", "--run-dir", str(run_dir)])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["epochs"], summary["steps"]) == (2, 2 * (51 // 8))
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    main(["evaluate", str(run_dir), "--checkpoint", "last", "--output", str(tmp_path / "e.json")])
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["samples"] == 13 and result["loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    main(["predict", str(run_dir), "--split", "all", "--output", str(tmp_path / "p.npy")])
    assert np.load(tmp_path / "p.npy").shape == (64,)
