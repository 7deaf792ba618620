"""Every rank must be started with the same settings and build the same model: what the checks say of
each way a rank's differ from rank 0's (the checks under real launchers, both engines:
tests/test_multiprocess.py, bad input)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hvdtrain.alike import check_same_settings, digest, settings
from hvdtrain.config import Config
from hvdtrain.engine.local import LocalEngine
from hvdtrain.errors import UserError
from hvdtrain.model_layout import check_same_model, difference, layout


def _net(width: int = 8, extra: bool = False) -> nn.Module:
    layers = [nn.Linear(4, width), nn.BatchNorm1d(width)] + ([nn.Linear(width, width)] if extra else [])
    return nn.Sequential(*layers, nn.Linear(width, 3))


def _frozen_first() -> nn.Module:
    net = _net()
    net[0].weight.requires_grad_(False)
    return net


@pytest.mark.parametrize("other, said", [
    (lambda: _net(width=12), "'0.weight' is 12×4 there, 8×4 on rank 0"),
    (lambda: _net(extra=True), "'2.weight' is 8×8 there, 3×8 on rank 0 (11 tensors there, 9 on rank 0)"),
    (lambda: _net().double(), "'0.weight' is float64 there, float32 on rank 0"),
    (_frozen_first, "'0.weight' is frozen (requires_grad False) there, trained on rank 0"),
    (lambda: nn.Sequential(nn.Linear(4, 8), nn.Identity(), nn.Linear(8, 3)),
     "it lacks rank 0's '1.weight' (4 tensors there, 9 on rank 0)"),
])
def test_the_first_difference_from_rank_0_s_model_is_named(other, said):
    assert difference(layout(_net()), layout(other())) == said


def test_a_tensor_rank_0_lacks_and_an_order_of_its_own_are_named():
    root = layout(nn.Sequential(nn.Linear(4, 3)))
    more = layout(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3)))
    assert difference(root, more) == "it has '1.weight', which rank 0's has not (4 tensors there, 2 on rank 0)"
    assert difference(root, list(reversed(root))) == "the same tensors, in another order"


class _Versioned(nn.Linear):
    def get_extra_state(self):
        return {"vocabulary": ["a", "b"]}

    def set_extra_state(self, state):
        pass


def test_extra_state_is_compared_by_its_name_alone_and_named_where_a_rank_lacks_it():
    """Rank 0's extra state is broadcast over every rank's, whatever each built (rank 0's may come from a
    checkpoint already)."""
    assert layout(_Versioned(4, 3))[-1] == ("_extra_state", (), "extra state", None)
    assert difference(layout(_Versioned(4, 3)), layout(nn.Linear(4, 3))) == \
        "it lacks rank 0's '_extra_state' (2 tensors there, 3 on rank 0)"


def test_a_buffer_and_a_parameter_of_one_name_differ():
    with_buffer = nn.Linear(4, 3)
    bias = with_buffer.bias.detach().clone()
    del with_buffer.bias
    with_buffer.register_buffer("bias", bias)
    assert difference(layout(nn.Linear(4, 3)), layout(with_buffer)) == "'bias' is a buffer there, trained on rank 0"


class _RankOneHasAnother(LocalEngine):
    """Rank 0 of two, whose rank 1 holds `theirs` (None: what rank 0 holds): its allgathers answer with
    both ranks' shares."""

    def __init__(self, theirs):
        super().__init__(torch.device("cpu"))
        self.theirs = theirs
        self.gathered: list[str] = []

    def allgather_object(self, obj, name):
        self.gathered.append(name)
        if not name.endswith(".values"):  # the digests
            return [obj, obj if self.theirs is None else digest(self.theirs)]
        return [obj, self.theirs]


def test_the_check_gathers_a_digest_and_the_layouts_only_where_they_differ():
    alike = _RankOneHasAnother(None)
    check_same_model(_net(), alike)
    assert alike.gathered == ["model_layout"]  # one small collective where every rank built the same
    differs = _RankOneHasAnother(layout(_net(width=12)))
    with pytest.raises(UserError, match=r"^rank 1 built another model than rank 0: '0.weight' is 12×4 there, 8×4 "
                                        r"on rank 0; every rank must build the same model: seed"):
        check_same_model(_net(), differs)
    assert differs.gathered == ["model_layout", "model_layout.values"]


def test_settings_that_differ_are_named_three_at_most_and_a_host_s_own_are_not():
    root = Config.from_dict({"train": {"threads": 2}, "data": {"name": "/scratch/node0/x.npz"}})
    per_host = Config.from_dict({"train": {"threads": 8}, "data": {"name": "/scratch/node1/x.npz", "num_workers": 3},
                                 "run": {"dir": "elsewhere", "progress": "off"}})
    check_same_settings(settings(root), _RankOneHasAnother(settings(per_host)))
    edited = Config.from_dict({"data": {"batch_size": 8}, "train": {"epochs": 3, "seed": 1},
                               "optim": {"lr": 0.5, "name": "adamw"}})
    with pytest.raises(UserError, match=r"^rank 1 was started with other settings than rank 0: data.batch_size is 8 "
                                        r"there, 64 on rank 0; optim.name is 'adamw' there, 'sgd' on rank 0; optim.lr "
                                        r"is 0.5 there, 0.05 on rank 0 \(and 2 more\): start every rank with the same"):
        check_same_settings(settings(root), _RankOneHasAnother(settings(edited)))


def test_settings_written_otherwise_are_alike_and_one_a_rank_lacks_is_named():
    root = settings(Config.from_dict({"model": {"name": "mine:net", "args": {"a": 1, "b": 2}}}))
    reordered = {**root, "model.args": {"b": 2.0, "a": 1}}  # a script's overrides from a set, 1 and 1.0
    check_same_settings(root, _RankOneHasAnother(reordered))
    older = {key: value for key, value in root.items() if key != "train.sync_batchnorm"}  # another hvdtrain
    with pytest.raises(UserError, match=r"^rank 1 was started with other settings than rank 0: train.sync_batchnorm "
                                        r"is not known \(another hvdtrain version\?\) there, False on rank 0: start"):
        check_same_settings(root, _RankOneHasAnother(older))
