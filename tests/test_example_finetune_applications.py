"""examples/finetune_applications.py runs on CPU and prints what each phase changed."""

import re
from pathlib import Path

from example_runner import run_example

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "finetune_applications.py"


def run_script(tmp_path):
    return run_example(SCRIPT, tmp_path)


def number(pattern, text):
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in:\n{text}"
    return float(match.group(1))


def test_two_phases_with_one_transform_list(tmp_path):
    out = run_script(tmp_path)

    # Phase 1: the backbone selector names only frozen layers: one warning, no effect.
    warned = re.findall(r"^phase (\d): warning: (.*)$", out, re.M)
    assert [p for p, _ in warned] == ["1"], out
    assert "'backbone/*'" in warned[0][1] and "frozen" in warned[0][1]
    assert re.search(r"phase 1: ClipByGlobalNorm\(.*where='backbone/\*'.*\) acts on 0 variables", out)
    assert number(r"phase 1: max \|dw\| backbone = (\S+)", out) == 0.0
    assert number(r"phase 1: max \|dw\| head = (\S+)", out) > 1e-3

    # Phase 2: the same list clips the unfrozen backbone (its gradient norm exceeds 1.0).
    assert number(r"phase 2: ClipByGlobalNorm\(.*\) acts on (\d+) variables", out) == 52
    for phase in (1, 2):
        assert number(rf"phase {phase}: ClipByNorm\(.*where='head'.*\) acts on (\d+) variables", out) == 2
    assert number(r"phase 2: gradient global norm on the first batch: backbone (\S+),", out) > 1.0
    assert number(r"phase 2: max \|dw\| backbone = (\S+)", out) > 1e-5
    assert number(r"phase 2: max \|dw\| head = (\S+)", out) > 1e-5

    # BatchNormalization stayed in inference mode, and both phases learned.
    assert out.count("BatchNormalization moving statistics unchanged: True") == 2, out
    for phase in (1, 2):
        first, last = map(float, re.search(
            rf"phase {phase}: trainable variables \d+, loss (\S+) -> (\S+)", out).groups())
        assert last < first, out
