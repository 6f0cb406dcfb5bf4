"""Every ```python block of README.md and docs/*.md runs as written (issue 23).

The pages are found when the tests are collected, so a new docs/*.md is
executed without editing this file. A changed API breaks a test here, not only
the documentation. Fence options are pytest-markdown-docs' (see
tests/conftest_docs.py); the same pages also run under that plugin:
`pytest --markdown-docs README.md docs`.
"""

import dataclasses
import re

import pytest

from conftest_docs import documentation_pages
from conftest_docs import fences
from conftest_docs import needs_own_process
from conftest_docs import python_blocks
from conftest_docs import run_block

PAGES = documentation_pages()
BLOCKS = []
SKIPPED = {}
for _page in PAGES:
    _blocks, SKIPPED[_page.name] = python_blocks(_page.read_text("utf-8"), _page)
    BLOCKS.extend(_blocks)


# The namespace and directory of the last block run, by id, while the next
# block of its chain may still come: a `continuation` block whose predecessor
# just ran here runs alone in what that one left (its variables, the files it
# wrote), instead of running the whole chain again. A block run on its own
# (`pytest -k`, or the predecessor failed) runs its chain from the start, and
# so does a chain that creates a strategy (it runs in its own process).
_LAST_RUN = {}


def run_continuing(block, directory, last_run):
    """Runs `block`, continuing from its predecessor's run if `last_run` holds it.

    Args:
        block: the block to run.
        directory: its working directory when it starts a run of its own.
        last_run: {block id: (namespace, directory)} of the block run just
            before; replaced by this block's.

    Returns:
        The namespace the block ran in.
    """
    before = last_run.pop(block.after, None) if block.after else None
    last_run.clear()
    if before is not None and not needs_own_process(block):
        namespace, directory = before
        run_block(dataclasses.replace(block, code=block.own_code), directory, namespace)
    else:
        namespace = run_block(block, directory)
    if namespace:  # a block run in its own process leaves nothing to continue
        last_run[block.id] = (namespace, directory)
    return namespace


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block, tmp_path):
    run_continuing(block, tmp_path, _LAST_RUN)


def quoted_originals(text):
    """The `notest` blocks that quote another project's code (docs/from_keras_io.md).

    Such a block is marked `<!-- count: <section> original -->` on the line
    before its fence: it is the code the library replaces, shown for
    comparison, not an example of ours (it still says why it is not run).
    """
    lines = text.splitlines()
    return sum(1 for info, start, _ in fences(text)
               if "notest" in info[1:] and start >= 2
               and re.match(r"<!-- count: [a-z0-9-]+ original -->$", lines[start - 2]))


def test_at_least_90_percent_of_the_blocks_run():
    # Of our own examples: quoted originals are not counted as skipped.
    skipped = sum(SKIPPED.values()) - sum(quoted_originals(p.read_text("utf-8")) for p in PAGES)
    assert len(BLOCKS) >= 0.9 * (len(BLOCKS) + skipped), SKIPPED


def test_every_notest_block_says_why():
    # A block kept out of the run is named `notest` and the page explains it
    # in the paragraph just before ("cannot run here: ...").
    for page in PAGES:
        lines = page.read_text("utf-8").splitlines()
        for i, line in enumerate(lines):
            words = line.strip().lstrip("`").split()
            if line.strip().startswith("```") and "notest" in words[1:]:
                before = " ".join(lines[max(0, i - 8):i]).lower()
                assert "not run" in before or "cannot run" in before, (
                    f"{page.name}:{i + 1}: say why this block is not run"
                )


def test_pages_are_found():
    names = {p.name for p in PAGES}
    assert {"README.md", "accumulation.md", "upgrade.md"} <= names
    assert len(BLOCKS) >= 30


PAGE = """
Text.

```python
a = 1
```

```python continuation
b = a + 1
```

```python notest
never_run()
```

```text
not python
```

- a list item:

  ```python
  c = 3
  ```
"""


def test_blocks_follow_pytest_markdown_docs_fence_options(tmp_path):
    blocks, skipped = python_blocks(PAGE, "page.md")
    assert skipped == 1
    assert [b.line for b in blocks] == [5, 9, 23]
    # A continuation runs after the blocks before it; the others start afresh.
    assert run_block(blocks[1], tmp_path)["b"] == 2
    assert "a" not in run_block(blocks[2], tmp_path)
    # Line numbers in tracebacks are the page's.
    assert blocks[1].code.splitlines()[8] == "b = a + 1"
    assert blocks[1].own_code.splitlines()[8] == "b = a + 1"
    # Right after its predecessor, a continuation runs alone in what that left.
    last_run = {}
    first = run_continuing(blocks[0], tmp_path, last_run)
    first["a"] = 5  # shows that block 1 did not run block 0 again
    assert run_continuing(blocks[1], tmp_path, last_run)["b"] == 6
    assert run_continuing(blocks[1], tmp_path, {})["b"] == 2  # on its own: the chain
    assert "a" not in run_continuing(blocks[2], tmp_path, last_run)


def test_a_block_creating_a_strategy_runs_in_its_own_process(tmp_path):
    import os

    code = "import os\nopen('pid', 'w').write(str(os.getpid()))  # MirroredStrategy()\n"
    [block], _ = python_blocks(f"```python\n{code}```\n", "page.md")
    run_block(block, tmp_path)
    assert int((tmp_path / "pid").read_text()) != os.getpid()
    [failing], _ = python_blocks("```python\n# MirroredStrategy()\nraise SystemExit(3)\n```\n", "p.md")
    with pytest.raises(AssertionError, match="p.md:2 failed"):
        run_block(failing, tmp_path)


@pytest.mark.unit
def test_only_marked_quotes_leave_the_ratio():
    page = ("<!-- count: demo original -->\n```python notest\nquoted()\n```\n\n"
            "```python notest\nours()\n```\n")
    assert quoted_originals(page) == 1
    assert quoted_originals(page.replace("original", "short")) == 0
