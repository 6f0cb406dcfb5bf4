"""Every example script runs to the end and prints what it promises (smoke tests)."""

import re

import pytest

from example_runner import run_example
from keras_tapeops import _compat


def test_quickstart_trains_like_stock_and_restores_options(tmp_path):
    out = run_example("quickstart.py", tmp_path)
    assert "same final weights as stock: True; same val_loss: True" in out
    assert "gradient_transforms=['ClipByNorm', 'ClipByGlobalNorm']" in out
    assert "loss_terms=['sparsity']" in out


def test_accumulation_example_matches_the_large_batch(tmp_path):
    out = run_example("accumulation.py", tmp_path)
    diffs = [float(d) for d in re.findall(r"max \|w - stock batch 64\| = (\S+)", out)]
    assert len(diffs) == 2 and max(diffs) < 1e-5, out


def test_wgan_gp_example_moves_samples_onto_the_ring(tmp_path):
    out = run_example("wgan_gp.py", tmp_path, "ring.png")
    before = float(re.search(r"ring before: +([0-9.]+)", out).group(1))
    after = float(re.search(r"ring after: +([0-9.]+)", out).group(1))
    assert after < before / 2, out
    assert (tmp_path / "ring.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name, expected", [
    ("per_layer_clipping.py", "restored transforms:"),
    ("multi_loss.py", "terms after load:"),
    pytest.param(
        "per_group_learning_rates.py", "same optimizer state: True",
        marks=pytest.mark.skipif(  # `make test-oldest` runs Keras 3.10
            _compat.multi_optimizer_class() is None,
            reason="kt.optimizer_groups needs keras.optimizers.MultiOptimizer (Keras 3.15)",
        ),
    ),
])
def test_other_examples_run_to_the_end(tmp_path, name, expected):
    assert expected in run_example(name, tmp_path)


def test_sam_example_reaches_a_flatter_minimum(tmp_path):
    out = run_example("sam.py", tmp_path)
    eigenvalues = [float(v) for v in re.findall(r"top Hessian eigenvalue (\S+)", out)]
    accuracies = [float(v) for v in re.findall(r"test accuracy (\S+)", out)]
    assert len(eigenvalues) == 2 and len(accuracies) == 2, out
    assert min(accuracies) > 0.9, out
    assert "SAM ends at a flatter minimum: True" in out, out
