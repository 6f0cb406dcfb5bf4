"""The issue 21 examples run to the end with `--quick` and write their PNGs (smoke tests)."""

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PNG = b"\x89PNG\r\n\x1a\n"


def run_quick(name, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--quick", "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_adversarial_training_example(tmp_path):
    out = run_quick("adversarial_training.py", tmp_path)
    rows = re.findall(r"^(standard|FGSM-RS|PGD-7|TRADES)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)$",
                      out, flags=re.MULTILINE)
    assert [r[0] for r in rows] == ["standard", "FGSM-RS", "PGD-7", "TRADES"], out
    for _, clean, robust, seconds in rows:
        assert 0.0 <= float(robust) <= 1.0 and 0.0 <= float(clean) <= 1.0
        assert float(seconds) > 0.0
    assert (tmp_path / "adversarial_examples.png").read_bytes()[:8] == PNG


def test_attribution_example(tmp_path):
    out = run_quick("attribution.py", tmp_path)
    error = float(re.search(r"IG completeness: max relative error (\S+)", out).group(1))
    assert error < 0.05, out
    assert (tmp_path / "attribution.png").read_bytes()[:8] == PNG
