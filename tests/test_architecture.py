"""The package's structure, read from its own source: imports only go down, and
private Keras is touched only in `keras_tapeops/_keras/`."""

import ast
import collections
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "keras_tapeops"
ISOLATION = "keras_tapeops._keras"
# The top: the public import path and the modules that build the model classes.
TOP = {"keras_tapeops", "keras_tapeops.mixin", "keras_tapeops.upgrade"}


def _modules(root=PACKAGE):
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _import_graph(root=PACKAGE):
    """module -> the package modules it imports (a package's own re-exports excluded)."""
    modules = _modules(root)
    package = root.name

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = collections.defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            for target in targets:
                if target.split(".")[0] != package:
                    continue
                target = resolve(target)
                is_reexport = path.name == "__init__.py" and target.startswith(name + ".")
                if target != name and not is_reexport:
                    graph[name].add(target)
    return graph


def _cycles(graph):
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def _package_graph(graph):
    """The same graph between top-level modules and subpackages."""
    def unit(name):
        return ".".join(name.split(".")[:2])

    collapsed = collections.defaultdict(set)
    for source, targets in graph.items():
        for target in targets:
            if unit(source) != unit(target) and unit(source) != "keras_tapeops":
                collapsed[unit(source)].add(unit(target))
    return collapsed


def test_no_import_circle_between_modules():
    assert _cycles(_import_graph()) == []


def test_no_import_circle_between_subpackages():
    # e.g. aggregation/ importing multitask/ while multitask/ imports aggregation/.
    assert _cycles(_package_graph(_import_graph())) == []


def test_nothing_imports_the_top_but_the_top():
    graph = _import_graph()
    upward = sorted(
        (source, target) for source, targets in graph.items() for target in targets
        if target in TOP - {"keras_tapeops"} and source not in TOP
    )
    assert upward == []


def test_the_isolation_package_imports_nothing_above_it():
    graph = _import_graph()
    above = sorted(
        (source, target) for source, targets in graph.items() for target in targets
        if source.startswith(ISOLATION) and not target.startswith(ISOLATION)
    )
    assert above == []


# Packages that read the same per-layer records: what they share sits below both
# (`layer_records/`), so neither imports the other.
SIBLINGS = ("keras_tapeops.privacy", "keras_tapeops.multitask")
SHARED_BELOW = "keras_tapeops.layer_records"


def _crossings(graph, siblings=SIBLINGS, below=SHARED_BELOW):
    """Imports from one sibling into another, or from `below` into either."""
    def owner(name):
        return next((p for p in (*siblings, below) if name == p or name.startswith(p + ".")), None)

    return sorted(
        (source, target)
        for source, targets in graph.items()
        for target in targets
        if owner(source) and owner(target) and owner(source) != owner(target)
        and owner(target) != below
    )


def test_privacy_and_multitask_share_layer_records_without_importing_each_other():
    graph = _import_graph()
    assert _crossings(graph) == []
    # both do read the shared records
    for sibling in SIBLINGS:
        assert any(
            source.startswith(sibling) and any(t.startswith(SHARED_BELOW) for t in targets)
            for source, targets in graph.items()
        ), sibling


def test_the_sibling_check_can_fail():
    graph = {
        "keras_tapeops.multitask.layerwise": {"keras_tapeops.privacy.sites"},
        "keras_tapeops.privacy.engine": {
            "keras_tapeops.layer_records.sites", "keras_tapeops.multitask.engine",
        },
        "keras_tapeops.layer_records.sites": {"keras_tapeops.privacy.rules"},
        "keras_tapeops.layer_records.dense": {"keras_tapeops.multitask"},
    }
    assert _crossings(graph) == [
        ("keras_tapeops.layer_records.dense", "keras_tapeops.multitask"),
        ("keras_tapeops.layer_records.sites", "keras_tapeops.privacy.rules"),
        ("keras_tapeops.multitask.layerwise", "keras_tapeops.privacy.sites"),
        ("keras_tapeops.privacy.engine", "keras_tapeops.multitask.engine"),
    ]


def test_the_checks_find_a_circle_and_an_upward_import(tmp_path):
    """The checks can fail: a package with a circle and an import of the mixin."""
    root = tmp_path / "keras_tapeops"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    (root / "a.py").write_text("from keras_tapeops import b\n")
    (root / "b.py").write_text("import keras_tapeops.a\nfrom keras_tapeops.mixin import X\n")
    (root / "mixin.py").write_text("X = 1\n")
    (root / "sub" / "c.py").write_text("from keras_tapeops.d import y\n")
    (root / "d.py").write_text("from keras_tapeops.sub import c\n")
    graph = _import_graph(root)
    assert sorted(map(tuple, _cycles(graph))) == [
        ("keras_tapeops.a", "keras_tapeops.b"), ("keras_tapeops.d", "keras_tapeops.sub.c"),
    ]
    assert "keras_tapeops.mixin" in graph["keras_tapeops.b"]


# ------------------------------------------------------------- private Keras
def _keras_private_names():
    """Private attribute names Keras's own classes define (`self._x = ...`, `def _x`)."""
    import keras

    source_root = Path(keras.__file__).parent / "src"
    names = set()
    for path in source_root.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def _own_private_names():
    """Private names keras_tapeops itself defines (its own attributes and helpers)."""
    names = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif (
                isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and getattr(node.value, "id", None) in ("self", "cls")
            ):
                names.add(node.attr)  # our own attributes; not stores into Keras objects
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                or isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "__setattr__"
            ):
                for arg in node.args[1:2]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        names.add(arg.value)
    return {n for n in names if n.startswith("_")}


def private_keras_accesses(modules, keras_private, own):
    """`(module, line, what)` for each `keras.src` import or private Keras attribute."""
    found = []
    for name, path in modules.items():
        if name.startswith(ISOLATION):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras.src"):
                found.append((name, node.lineno, node.module))
            elif isinstance(node, ast.Import):
                found += [(name, node.lineno, a.name) for a in node.names
                          if a.name.startswith("keras.src")]
            elif isinstance(node, ast.Attribute):
                attr = node.attr
                if attr in keras_private and attr not in own:
                    found.append((name, node.lineno, attr))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                "getattr", "hasattr", "setattr",
            ):
                for arg in node.args[1:2]:
                    if (isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                            and arg.value in keras_private and arg.value not in own):
                        found.append((name, node.lineno, arg.value))
    return found


# Accesses not yet moved into `_keras/` (issue 27): this list may only shrink.
NOT_YET_ISOLATED: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def keras_private():
    return _keras_private_names()


def test_private_keras_is_touched_only_in_the_isolation_package(keras_private):
    found = private_keras_accesses(_modules(), keras_private, _own_private_names())
    new = [(m, line, what) for m, line, what in found if (m, what) not in NOT_YET_ISOLATED]
    assert new == [], "\n".join(f"{m}:{line}: {what}" for m, line, what in new)
    # The allow-list only shrinks: an entry no longer found must be removed.
    assert {(m, what) for m, _, what in found} == NOT_YET_ISOLATED


def test_the_private_access_check_can_fail(tmp_path, keras_private):
    path = tmp_path / "leaky.py"
    path.write_text(
        "from keras.src.models.functional import Functional\n"
        "def f(model):\n    return model._compile_loss, getattr(model, '_loss_tracker')\n"
    )
    found = private_keras_accesses({"keras_tapeops.leaky": path}, keras_private, set())
    assert [what for _, _, what in found] == [
        "keras.src.models.functional", "_compile_loss", "_loss_tracker",
    ]


@pytest.mark.unit
@pytest.mark.parametrize("subpackage, base", [
    ("transforms", "GradientTransform"), ("terms", "Term"),
])
def test_subpackage_exports_every_public_class_of_its_kind(subpackage, base):
    """`kt.transforms` lists every transform and `kt.terms` every term, as `kt` does."""
    import importlib
    import inspect
    import pkgutil

    import keras_tapeops as kt

    package = importlib.import_module(f"keras_tapeops.{subpackage}")
    base_class = getattr(package, base)
    defined = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, base_class)
                    and obj.__module__ == module.__name__ and not name.startswith("_")):
                defined.add(name)
    assert defined <= set(package.__all__), sorted(defined - set(package.__all__))
    assert all(getattr(kt, name) is getattr(package, name) for name in defined)
