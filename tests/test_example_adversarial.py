"""The issue 21 examples run to the end with `--quick` and write their PNGs (smoke tests)."""

import re

from example_runner import run_example

PNG = b"\x89PNG\r\n\x1a\n"


def run_quick(name, tmp_path):
    return run_example(name, tmp_path, "--quick", "--out", tmp_path)


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
