"""examples/maml_sinusoid.py --quick runs to the end, prints its table and writes the PNG."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "maml_sinusoid.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_quick_run_prints_the_table_and_writes_the_figure(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--quick", "--out", "figure.png"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^(MAML|pretrained)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                      out.stdout, flags=re.M)
    assert sorted((name, int(k)) for name, k, *_ in rows) == [
        ("MAML", 5), ("MAML", 10), ("pretrained", 5), ("pretrained", 10)]
    for *_, before, one, ten in rows:
        # Mean squared errors of sine waves of amplitude <= 5: finite, positive.
        assert all(0.0 < float(v) < 50.0 for v in (before, one, ten))
    assert "MAML K=5: 20 meta-steps of 25 tasks" in out.stdout
    if HAS_MATPLOTLIB:
        assert (tmp_path / "figure.png").stat().st_size > 10_000
    else:
        assert "matplotlib is not installed" in out.stdout
