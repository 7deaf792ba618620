"""--sync-batchnorm: BatchNorm over the global batch on both engines, forward and backward, and a fit
on 2 ranks x B with it ending with the weights of one process x 2B (plain BatchNorm)."""

from __future__ import annotations

import re

import pytest

from conftest import (HOROVOD_AND_TORCH, ROOT, assert_ok, assert_same_weights, final_weights, fit_here, fit_under,
                      python_under, requires_launchers, run)

pytestmark = [pytest.mark.multiprocess, requires_launchers]

WORKER = ROOT / "tests" / "workers" / "sync_batchnorm.py"
BN_RUN = ["--data", "random", "--set", "data.samples=600", "--set", "data.features=12", "--threads", "1",
          "--model", "user_code:batch_norm_net", "--epochs", "2", "--no-scale-lr", "--warmup-epochs", "0"]


@pytest.mark.parametrize("launcher", HOROVOD_AND_TORCH)
def test_statistics_and_gradients_are_those_of_the_global_batch(launcher):
    done = run([*python_under(launcher), str(WORKER)], timeout=120)
    assert_ok(done)
    found = re.findall(r"rank (\d): output (\S+) input grad (\S+) running stats (\S+) weight grads (\S+) "
                       r"\(this rank's mean is (\S+) from the global one\)", done.stdout)
    assert sorted(rank for rank, *_ in found) == ["0", "1"], done.stdout[-2000:]
    for rank, *differences, gap in found:
        assert all(float(d) <= 1e-5 for d in differences), (rank, differences)
        assert float(gap) > 1.0  # each rank's own statistics would be far from the global batch's


def test_two_ranks_with_sync_batchnorm_end_with_one_process_s_weights(tmp_path):
    """Plain BatchNorm on 2 ranks x 8 normalizes each rank's 8 samples apart; synchronized, it normalizes
    the 16 together, as one process with a batch of 16 does."""
    fit_here(tmp_path / "one", *BN_RUN, "--batch-size", "16")
    for launcher in HOROVOD_AND_TORCH:
        two = fit_under(launcher, *BN_RUN, "--batch-size", "8", "--sync-batchnorm", "--run-dir", str(tmp_path / launcher))
        assert_ok(two)
        assert_same_weights(final_weights(tmp_path / launcher), final_weights(tmp_path / "one"), atol=1e-5)
    # Without it the ranks' statistics differ from the global batch's (the worker above shows by how
    # much), and so would the weights: test_two_ranks_batch_b_equal_one_process_batch_2b has no BatchNorm.
