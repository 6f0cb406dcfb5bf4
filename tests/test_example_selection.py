"""examples/loss_based_selection.py --quick runs the four methods, prints the table, writes a PNG."""

import importlib.util
import re
from pathlib import Path

from example_runner import run_example

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "loss_based_selection.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_quick_run(tmp_path):
    out = run_example(EXAMPLE, tmp_path, "--quick", "--out", "curves.png")
    rows = re.findall(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["stock", "TopLoss", "RHO-LOSS", "SelectiveBackprop"], out
    for name, steps, final, best, seconds in rows:
        assert int(steps) == 30  # the same number of gradient steps for every method
        assert 0.1 < float(final) <= float(best) <= 1.0 and float(seconds) > 0
    if HAS_MATPLOTLIB:
        assert (tmp_path / "curves.png").stat().st_size > 1000
