"""The `Example:` of every public docstring runs (issue 23).

The public API is `docs/gen_api.py`'s list (everything in `kt.__all__`,
`kt.callbacks` and the public submodules, with the public methods their
classes define), the same list the API reference is generated from. Each
```python block of those docstrings runs after `gen_api.EXAMPLE_SETUP` (the
imports and a small `model`, `x`, `y`, shown on the reference's index page),
like doctest's globals. Extracted fences rather than doctest: the docstrings
are Markdown for mkdocstrings, and a fence reads better than `>>>` prompts.
"""

import inspect

import pytest

from conftest_docs import load_docs_module
from conftest_docs import python_blocks
from conftest_docs import run_block

gen_api = load_docs_module("gen_api")


def _docstring_blocks():
    blocks, ids, seen = [], [], set()
    for dotted, obj in gen_api.public_symbols():
        short = "kt" + dotted[len("keras_tapeops"):]
        for suffix, member in gen_api.documented_callables(obj):
            doc = member.__doc__
            if not doc:
                continue
            try:
                source = inspect.getsourcefile(member)
                start = inspect.getsourcelines(member)[1]
            except (OSError, TypeError):
                continue
            if (source, start) in seen:
                continue
            seen.add((source, start))
            lines = open(source, encoding="utf-8").read().splitlines()
            opening = next(i for i in range(start - 1, len(lines)) if '"""' in lines[i])
            found, _ = python_blocks(inspect.cleandoc(doc), source, line_offset=opening)
            for k, block in enumerate(found):
                blocks.append(block)
                ids.append(f"{short}{suffix}[{k}]")
    return blocks, ids


BLOCKS, IDS = _docstring_blocks()


@pytest.mark.parametrize("block", BLOCKS, ids=IDS)
def test_docstring_example_runs(block, tmp_path):
    setup = type(block)("<docs/gen_api.py EXAMPLE_SETUP>", 1, gen_api.EXAMPLE_SETUP)
    run_block(block, tmp_path, namespace=run_block(setup, tmp_path))


def test_every_public_symbol_is_listed():
    import keras_tapeops as kt

    names = {d for d, _ in gen_api.public_symbols()}
    for name in kt.__all__:
        if not inspect.ismodule(getattr(kt, name)):
            assert f"keras_tapeops.{name}" in names
    for name in kt.callbacks.__all__:
        assert f"keras_tapeops.callbacks.{name}" in names
    assert len(BLOCKS) >= 20
