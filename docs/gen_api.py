"""The public API, listed from `kt.__all__`, and its reference pages (issue 23).

One list serves the site (`docs/hooks.py` writes one page per module under
`api/`) and the tests (`tests/test_docstring_examples.py` runs the `Example:`
of every object listed here; `tests/test_docs_site.py` checks every name has
its entry). A name added to `kt.__all__`, to `kt.callbacks.__all__` or to the
`__all__` of a module listed in `kt.__all__` (`kt.attacks`, ...) appears without
editing anything.

Run `python docs/gen_api.py` to print the inventory.
"""

import importlib
import inspect
import types

PACKAGE = "keras_tapeops"
# Modules documented even if `kt.__all__` does not list them.
ALWAYS = ("callbacks",)


def public_modules():
    """`(dotted name, module)` of the package and each public submodule, in order."""
    package = importlib.import_module(PACKAGE)
    found = [(PACKAGE, package)]
    names = list(ALWAYS) + [
        n for n in package.__all__ if isinstance(getattr(package, n), types.ModuleType)
    ]
    queue = [(f"{PACKAGE}.{n}", getattr(package, n)) for n in dict.fromkeys(names)]
    while queue:
        dotted, module = queue.pop(0)
        if any(dotted == d for d, _ in found):
            continue
        found.append((dotted, module))
        for n in getattr(module, "__all__", ()):
            member = getattr(module, n)
            if isinstance(member, types.ModuleType):
                queue.append((f"{dotted}.{n}", member))
    return found


def public_symbols():
    """`(dotted name, object)` of every public symbol that is not a module.

    `keras_tapeops.ClipByNorm`, `keras_tapeops.callbacks.Sharpness`, ...:
    the names a user imports, in `__all__` order.
    """
    out = []
    for dotted, module in public_modules():
        for name in getattr(module, "__all__", ()):
            member = getattr(module, name)
            if not isinstance(member, types.ModuleType):
                out.append((f"{dotted}.{name}", member))
    return out


def documented_callables(obj):
    """`(suffix, function)` of `obj` and its public methods defined in the package.

    A class's own methods and properties (not Keras's), with the class itself
    first (suffix ""); a function alone.
    """
    items = [("", obj)]
    if inspect.isclass(obj):
        for klass in obj.__mro__:
            if not klass.__module__.startswith(PACKAGE):
                continue
            for name, member in vars(klass).items():
                if name.startswith("_"):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member) and all(name != s[1:] for s, _ in items):
                    items.append((f".{name}", member))
    return items


def page_name(dotted_module):
    """`api/<name>.md` for a module: `keras_tapeops` -> `api/kt.md`."""
    if dotted_module == PACKAGE:
        return "api/kt.md"
    return "api/" + dotted_module[len(PACKAGE) + 1:].replace(".", "_") + ".md"


def title(dotted_module):
    return "kt" if dotted_module == PACKAGE else "kt." + dotted_module[len(PACKAGE) + 1:]


def api_pages():
    """{page path: markdown} of the API reference: an index and one page per module."""
    pages = {}
    index = [
        "# API reference",
        "",
        "Generated from the docstrings of everything in `kt.__all__` (`import",
        "keras_tapeops as kt`), `kt.callbacks` and the public submodules. Each",
        "`Example:` shown here runs in the test suite",
        "(`tests/test_docstring_examples.py`) with the setup below.",
        "",
        "```python",
        EXAMPLE_SETUP.strip(),
        "```",
        "",
        "| name | kind | summary |",
        "|---|---|---|",
    ]
    for dotted, module in public_modules():
        names = [n for n in getattr(module, "__all__", ())
                 if not isinstance(getattr(module, n), types.ModuleType)]
        if not names:
            continue
        page = page_name(dotted)
        lines = [f"# `{title(dotted)}`", ""]
        summary = _first_line(module)
        if summary:
            lines += [summary, ""]
        for name in names:
            member = getattr(module, name)
            lines += [f"::: {dotted}.{name}", ""]
            kind = "class" if inspect.isclass(member) else "function"
            anchor = f"{dotted}.{name}"
            link = page[len("api/"):]
            index.append(
                f"| [`{title(dotted)}.{name}`]({link}#{anchor}) | {kind} | "
                f"{_first_line(member)} |"
            )
        pages[page] = "\n".join(lines)
    pages["api/index.md"] = "\n".join(index) + "\n"
    return pages


def _first_line(obj):
    doc = inspect.getdoc(obj) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ").replace("|", "\\|")


# What every docstring `Example:` may assume, like doctest's globals: the
# imports; a small compiled model: a `backbone` sub-model (layers `dense_1`,
# `block_1` to `block_3`) and a `head`; its data `x`, `y`
# (one-hot), `dataset` (unbatched) and batched `train_ds`, `val_ds`; a GAN's
# `generator`, `critic` and `real_images`.
EXAMPLE_SETUP = """
import keras
import numpy as np
import tensorflow as tf
import keras_tapeops as kt

inputs = keras.Input((8,))
backbone = keras.Sequential([keras.layers.Dense(16, activation="relu", name=name)
                             for name in ("dense_1", "block_1", "block_2", "block_3")],
                            name="backbone")
outputs = keras.layers.Dense(3, activation="softmax", name="head")(backbone(inputs))
model = kt.upgrade(keras.Model(inputs, outputs))
model.compile(optimizer="adam", loss="categorical_crossentropy")
x = np.random.rand(64, 8).astype("float32")
y = keras.utils.to_categorical(np.random.randint(0, 3, size=64), 3)
dataset = tf.data.Dataset.from_tensor_slices((x, y))           # unbatched samples
train_ds, val_ds = dataset.batch(16), dataset.take(32).batch(16)

generator = keras.Sequential([keras.Input((128,)), keras.layers.Dense(2)])
critic = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
real_images = np.random.normal(size=(128, 2)).astype("float32")
"""


if __name__ == "__main__":
    for dotted_name, _ in public_symbols():
        print(dotted_name)
