"""docs/from_keras_io.md: the line-count table is honest, the blocks are what it says (issue 29).

The page marks each counted block with `<!-- count: <section> original -->`
or `<!-- count: <section> short -->` on the line before its fence, where
`<section>` is the anchor of the section's heading. Lines are counted as the
page states: not blank, not a comment, not part of a docstring. The originals
are `notest` blocks (tests/test_docs_blocks.py says why they are not run);
the short versions are run by tests/test_docs_blocks.py, so each must be a
runnable block. Each table row names its oracle, a test that exists.
"""

import ast
import re

import pytest

from conftest_docs import REPO
from conftest_docs import fences

PAGE = REPO / "docs" / "from_keras_io.md"
MARKER = re.compile(r"^<!-- count: ([a-z0-9-]+) (original|short) -->$")
ROW = re.compile(r"^\| \[[^\]]+\]\(#([a-z0-9-]+)\) \| (\d+) \| (\d+) \| "
                 r"\[`([\w.]+)::(\w+)`\]\(\.\./tests/([\w.]+)\) \|$")


def code_lines(code):
    """The page's rule: lines that are not blank, not comments, not docstrings."""
    docstrings = set()
    for node in ast.walk(ast.parse(code)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for number, line in enumerate(code.splitlines(), start=1)
               if line.strip() and not line.strip().startswith("#") and number not in docstrings)


def counted_blocks(text):
    """{(section, "original" | "short"): (fence info words, code)} of the marked fences."""
    lines = text.splitlines()
    blocks = {}
    for info, start, code in fences(text):
        match = MARKER.match(lines[start - 2]) if start >= 2 else None  # the line before
        if match:
            assert match.groups() not in blocks, f"{match.groups()} is marked twice"
            blocks[match.groups()] = (info, code)
    return blocks


def table(text):
    return {m.group(1): m.groups()[1:] for m in map(ROW.match, text.splitlines()) if m}


def headings(text):
    """The anchors of the page's `## ` headings (mkdocs' toc slugs of these simple titles)."""
    return [re.sub(r"[^a-z0-9]+", "-", line[3:].lower()).strip("-")
            for line in text.splitlines() if line.startswith("## ")]


TEXT = PAGE.read_text("utf-8")
BLOCKS = counted_blocks(TEXT)
TABLE = table(TEXT)
SECTIONS = sorted({section for section, _ in BLOCKS})


@pytest.mark.unit
def test_every_section_has_an_original_a_short_version_and_a_row():
    assert len(SECTIONS) == 10, SECTIONS
    for section in SECTIONS:
        assert (section, "original") in BLOCKS and (section, "short") in BLOCKS, section
    assert sorted(TABLE) == SECTIONS
    assert set(SECTIONS) <= set(headings(TEXT))


@pytest.mark.unit
@pytest.mark.parametrize("section", SECTIONS)
def test_the_table_counts_are_the_blocks_counts(section):
    original, short = TABLE[section][:2]
    counted = (code_lines(BLOCKS[section, "original"][1]), code_lines(BLOCKS[section, "short"][1]))
    assert (int(original), int(short)) == counted, (
        f"{section}: the table says {original} and {short}, the blocks count {counted}")


@pytest.mark.unit
@pytest.mark.parametrize("section", SECTIONS)
def test_originals_are_not_run_and_short_versions_are(section):
    original_info, _ = BLOCKS[section, "original"]
    short_info, _ = BLOCKS[section, "short"]
    assert original_info[0] == "python" and "notest" in original_info[1:], original_info
    assert short_info[0] == "python" and "notest" not in short_info[1:], short_info


@pytest.mark.unit
@pytest.mark.parametrize("section", SECTIONS)
def test_each_row_names_an_oracle_test_that_exists(section):
    label_file, test_name, linked_file = TABLE[section][2:]
    assert label_file == linked_file
    source = (REPO / "tests" / linked_file).read_text("utf-8")
    assert re.search(rf"^def {test_name}\(", source, re.M), f"{linked_file}::{test_name}"


@pytest.mark.unit
def test_the_rule_skips_blanks_comments_and_docstrings():
    code = '''def f(x):
    """A docstring
    on two lines."""

    # a comment
    y = x + 1  # code with a comment
    return (y,
            "not a docstring")
'''
    assert code_lines(code) == 4


@pytest.mark.unit
def test_the_check_can_fail():
    wrong = TEXT.replace(f"| {TABLE['vae'][0]} | {TABLE['vae'][1]} |",
                         f"| {int(TABLE['vae'][0]) + 1} | {TABLE['vae'][1]} |")
    assert table(wrong)["vae"][0] != str(code_lines(BLOCKS["vae", "original"][1]))
