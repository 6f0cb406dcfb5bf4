"""Every public signature is annotated (issue 30).

The public API is the API reference's list (`docs/gen_api.py`): every symbol
in `kt.__all__`, `kt.callbacks` and the public submodules, with each class's
public methods and properties defined in the package (`documented_callables`)
and its own `__init__` and `__call__`. Every parameter but `self`/`cls`, and
every return but `__init__`'s, carries an annotation: mypy then checks the
function's body (`make lint`), and users' type checkers read it (`py.typed`).
"""

import inspect

import pytest

from conftest_docs import load_docs_module

pytestmark = pytest.mark.unit

gen_api = load_docs_module("gen_api")
PACKAGE = gen_api.PACKAGE
# Public although underscored: the constructor and the call of a callable object.
SPECIAL_METHODS = ("__init__", "__call__")


def _in_package(obj):
    return getattr(obj, "__module__", "").startswith(PACKAGE)


def _own_special_method(cls, name):
    """`cls`'s `name` method where the package defines it (not Keras's), else None."""
    for klass in cls.__mro__:
        if name in vars(klass):
            method = vars(klass)[name]
            return method if _in_package(klass) and inspect.isfunction(method) else None
    return None


def public_signatures(symbols):
    """`(dotted name, function)` of every public signature of `symbols`.

    Args:
        symbols: `(dotted name, object)` pairs, as `gen_api.public_symbols()`.
    """
    for dotted, obj in symbols:
        if not inspect.isclass(obj):
            if inspect.isfunction(obj) and _in_package(obj):
                yield dotted, obj
            continue
        for name in SPECIAL_METHODS:
            method = _own_special_method(obj, name)
            if method is not None:
                yield f"{dotted}.{name}", method
        for suffix, member in gen_api.documented_callables(obj)[1:]:
            yield dotted + suffix, member


def missing_annotations(signatures):
    """`"name(parameter)"` and `"name -> ?"` for each missing annotation."""
    missing = []
    for name, function in signatures:
        signature = inspect.signature(function)
        for i, parameter in enumerate(signature.parameters.values()):
            if i == 0 and parameter.name in ("self", "cls"):
                continue
            if parameter.annotation is parameter.empty:
                missing.append(f"{name}({parameter.name})")
        is_init = function.__name__ == "__init__"
        if not is_init and signature.return_annotation is signature.empty:
            missing.append(f"{name} -> ?")
    return missing


def test_every_public_signature_is_annotated():
    signatures = list(public_signatures(gen_api.public_symbols()))
    assert len(signatures) > 500  # the walk reached the whole API
    missing = missing_annotations(signatures)
    assert not missing, f"{len(missing)} missing annotations:\n" + "\n".join(missing)


def test_the_walk_finds_every_kind_of_missing_annotation():
    class Fake:
        __module__ = f"{PACKAGE}.fake"  # as if the package defined it

        def __init__(self, a, b: int = 0) -> None:
            pass

        def __call__(self, c: int) -> int:
            return c

        def method(self, d: int):
            return d

        @property
        def value(self):
            return 0

        @classmethod
        def make(cls, config) -> "Fake":
            return cls(config)

        def annotated(self, e: int) -> int:
            return e

        def _private(self, f):
            return f

    def function(x, y: int = 1):
        return y

    function.__module__ = f"{PACKAGE}.fake"
    symbols = [(f"{PACKAGE}.Fake", Fake), (f"{PACKAGE}.function", function)]
    assert missing_annotations(public_signatures(symbols)) == [
        f"{PACKAGE}.Fake.__init__(a)",
        f"{PACKAGE}.Fake.method -> ?",
        f"{PACKAGE}.Fake.value -> ?",
        f"{PACKAGE}.Fake.make(config)",
        f"{PACKAGE}.function(x)",
        f"{PACKAGE}.function -> ?",
    ]
