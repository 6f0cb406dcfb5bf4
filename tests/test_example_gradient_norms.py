"""examples/gradient_norms.py runs to the end, logs sensible values and writes a PNG."""

import importlib.util
import re
from pathlib import Path

import pytest

from example_runner import run_example

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gradient_norms.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gradient_norms")
    return folder, run_example(EXAMPLE, folder, "norms.png")


def test_per_step_values_reproduce_the_logged_epoch_means(output):
    _, out = output
    assert "per-step values reproduce the epoch means: True" in out


def test_the_clip_fires_on_some_steps_not_all(output):
    _, out = output
    clipped, total = map(int, re.search(r"ClipByGlobalNorm\(1\.2\): (\d+) of (\d+)", out).groups())
    assert 0 < clipped < total


def test_logged_norms_are_consistent(output):
    """Per epoch: the mean after the clip <= the mean before <= the max; the clip caps it."""
    _, out = output
    rows = [
        [float(v) for v in line.split()[1:]]
        for line in out.splitlines() if re.match(r"^\s+\d+\s+\d", line)
    ]
    assert len(rows) == 8
    for grad_norm, grad_max, clipped, *groups in rows:
        assert clipped <= grad_norm <= grad_max
        assert clipped <= 1.2
        # On every step a group's norm is at most the whole model's.
        assert max(groups) < grad_norm


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib (the examples extra) is not installed")
def test_writes_the_png(output):
    folder, out = output
    assert "wrote norms.png" in out
    assert (folder / "norms.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
