"""Finds and runs the ```python blocks of the documentation (issue 23).

One extractor serves README.md, docs/*.md (tests/test_docs_blocks.py) and the
`Example:` sections of the public API's docstrings
(tests/test_docstring_examples.py). It follows pytest-markdown-docs' fence
options, so a page runs the same under that plugin and under the suite:

- ```python (also `py`, `python3`): a test; it runs in a fresh namespace.
- ```python continuation: runs after the blocks before it on the same page,
  so a page may define its model and data once. On its own the chain is
  executed again, as pytest-markdown-docs does; in a test session that has
  just run the block before it (tests/test_docs_blocks.py), only the new
  block runs, in that block's namespace and directory.
- ```python notest: shown, not run; the page says why next to it.

Blocks run with the current directory set to a fresh temporary directory, so
a block that saves `model.keras` or writes a PNG leaves nothing behind. A
block that creates a `MirroredStrategy` runs in its own Python process.
"""

import dataclasses
import importlib.util
import os
import pathlib

from markdown_it import MarkdownIt

REPO = pathlib.Path(__file__).resolve().parents[1]
PYTHON_LANGUAGES = ("python", "py", "python3")


@dataclasses.dataclass(frozen=True)
class Block:
    """One runnable ```python block.

    `code` is the block with the chain of `continuation` blocks before it,
    padded with blank lines so a traceback names the block's own line in
    `origin` (a file path). `own_code` is the block alone, padded the same
    way, and `after` the id of the block it continues (None if it starts a
    chain): `code` equals running `after`'s `code`, then `own_code`.
    """

    origin: str
    line: int
    code: str
    own_code: str = ""
    after: str | None = None

    @property
    def id(self):
        return f"{pathlib.Path(self.origin).name}:{self.line}"


def documentation_pages():
    """README.md and every docs/*.md, found anew at each collection."""
    return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def fences(text):
    """(info words, first code line index, code) of every fence in `text`."""
    for token in MarkdownIt("commonmark").parse(text):
        if token.type == "fence" and token.map:
            yield token.info.split(), token.map[0] + 1, token.content


def python_blocks(text, origin, line_offset=0):
    """Returns (runnable blocks, number of ```python blocks marked notest).

    Args:
        text: Markdown (a page, or a docstring's text).
        origin: the file the text comes from, named in tracebacks.
        line_offset: the file line of `text`'s first line, minus one.
    """
    blocks, skipped, previous, previous_id = [], 0, "", None
    for info, start, code in fences(text):
        if not info or info[0] not in PYTHON_LANGUAGES:
            continue
        options = set(info[1:])
        if "notest" in options:
            skipped += 1
            continue
        if "continuation" not in options:
            previous, previous_id = "", None
        line = line_offset + start + 1  # the block's first code line, 1-based
        padding = "\n" * (line - 1 - previous.count("\n"))
        chained = previous + padding + code
        block = Block(str(origin), line, chained, "\n" * (line - 1) + code, previous_id)
        blocks.append(block)
        previous, previous_id = chained, block.id
    return blocks, skipped


def load_docs_module(name):
    """Imports `docs/<name>.py` (the site's scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def needs_own_process(block):
    """True for a block whose code (chain included) creates a MirroredStrategy."""
    return "MirroredStrategy(" in block.code


def run_block(block, directory, namespace=None):
    """Executes `block` as a script whose current directory is `directory`.

    Returns its namespace: `namespace` (a block run before it, e.g. a setup)
    or a fresh one.
    """
    if needs_own_process(block) and namespace is None:
        return _run_in_new_process(block, directory)
    if namespace is None:
        namespace = {"__name__": "__main__", "__file__": block.origin}
    here = os.getcwd()
    os.chdir(directory)
    try:
        exec(compile(block.code, block.origin, "exec"), namespace)  # noqa: S102
    except RuntimeError as error:
        # On an older supported Keras (make test-oldest), a block using a
        # feature that needs a newer one gets the library's own error.
        if "which Keras added in version" in str(error):
            import pytest

            pytest.skip(str(error))
        raise
    finally:
        os.chdir(here)
    return namespace


def _run_in_new_process(block, directory):
    """Runs a block that creates a tf.distribute strategy in its own process.

    TensorFlow allows one MirroredStrategy per process (docs/concepts.md, Known
    limitations), and the test processes already hold the suite's one.
    """
    import subprocess
    import sys

    script = pathlib.Path(directory) / "block.py"
    script.write_text(block.code, "utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=directory, capture_output=True,
                            text=True, timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if result.returncode != 0:
        raise AssertionError(f"{block.id} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return {}
