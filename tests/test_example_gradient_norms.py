"""examples/gradient_norms.py runs to the end, logs sensible values and writes a PNG."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gradient_norms.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_example(tmp_path, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gradient_norms")
    return folder, run_example(folder, "norms.png")


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
