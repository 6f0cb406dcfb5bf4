"""examples/multi_task.py --quick runs to the end, prints each method and writes the PNG."""

import importlib.util
import re
from pathlib import Path

from example_runner import run_example

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "multi_task.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_quick_run(tmp_path):
    out = run_example(EXAMPLE, tmp_path, "--quick", "--out", "mt.png")
    text = out
    for method in ("sum", "PCGrad", "MGDA", "CAGrad c=0.4"):
        assert re.search(rf"^{re.escape(method)}\s+f=\(", text, re.M), method
    rows = {m: re.search(rf"^{m}\s+([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s+(\S+)\s+([\d.]+)$",
                         text, re.M) for m in ("sum", "PCGrad", "MGDA", "uncertainty")}
    assert all(rows.values()), text
    # MGDA's weights are a convex combination; the plain sum weighs each task 1.
    mgda = rows["MGDA"]
    assert abs(float(mgda.group(3)) + float(mgda.group(4)) - 1.0) < 1e-3
    assert rows["sum"].group(3) == "1.000" and rows["sum"].group(4) == "1.000"
    assert rows["PCGrad"].group(5) != "nan"  # the conflict signal is logged
    if HAS_MATPLOTLIB:
        assert (tmp_path / "mt.png").stat().st_size > 10_000
