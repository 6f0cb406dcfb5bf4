"""examples/loss_based_selection.py --quick runs the four methods, prints the table, writes a PNG."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "loss_based_selection.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_quick_run(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--quick", "--out", "curves.png"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out.stdout, re.M)
    assert [r[0] for r in rows] == ["stock", "TopLoss", "RHO-LOSS", "SelectiveBackprop"], out.stdout
    for name, steps, final, best, seconds in rows:
        assert int(steps) == 30  # the same number of gradient steps for every method
        assert 0.1 < float(final) <= float(best) <= 1.0 and float(seconds) > 0
    if HAS_MATPLOTLIB:
        assert (tmp_path / "curves.png").stat().st_size > 1000
