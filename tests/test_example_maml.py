"""examples/maml_sinusoid.py --quick runs to the end, prints its table and writes the PNG."""

import importlib.util
import re
from pathlib import Path

from example_runner import run_example

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "maml_sinusoid.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_quick_run_prints_the_table_and_writes_the_figure(tmp_path):
    out = run_example(EXAMPLE, tmp_path, "--quick", "--out", "figure.png")
    rows = re.findall(r"^(MAML|pretrained)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                      out, flags=re.M)
    assert sorted((name, int(k)) for name, k, *_ in rows) == [
        ("MAML", 5), ("MAML", 10), ("pretrained", 5), ("pretrained", 10)]
    for *_, before, one, ten in rows:
        # Mean squared errors of sine waves of amplitude <= 5: finite, positive.
        assert all(0.0 < float(v) < 50.0 for v in (before, one, ten))
    assert "MAML K=5: 20 meta-steps of 25 tasks" in out
    if HAS_MATPLOTLIB:
        assert (tmp_path / "figure.png").stat().st_size > 10_000
    else:
        assert "matplotlib is not installed" in out
