"""examples/private_training.py --quick runs, spends at most each target epsilon, writes a PNG."""

import importlib.util
import re
from pathlib import Path

from example_runner import run_example

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "private_training.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_quick_run(tmp_path):
    out = run_example(EXAMPLE, tmp_path, "--quick", "--out", "acc.png")
    rows = re.findall(r"^\s+(\S+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["1", "3", "8", "none"], out
    for target, sigma, spent, accuracy, seconds in rows[:3]:
        assert 0 < float(spent) <= float(target)  # the budget is kept
        assert float(sigma) > 0 and 0 <= float(accuracy) <= 1 and float(seconds) > 0
    sigmas = [float(r[1]) for r in rows[:3]]
    assert sigmas == sorted(sigmas, reverse=True)  # more privacy, more noise
    assert rows[3][2] == "inf" and float(rows[3][3]) > 0.3  # the non-private run learns
    if HAS_MATPLOTLIB:
        assert (tmp_path / "acc.png").stat().st_size > 1000
