"""Resolution of `where=` selectors: which trainable variables a rule acts on.

Paths follow the one grammar of `keras_tapeops.paths`: layers named from the
outer model down, `"backbone/block_16_project"`, also inside nested
functional models. A selector is one of:

- `None`: every trainable variable.
- a string without wildcards: a layer path (`"backbone/block_16_project"`:
  that layer's variables, nested ones included), a bare layer name found at
  any depth (`"head"`; it must name one layer, else the error lists the
  paths), or a variable path (`"head/kernel"`, or Keras's `variable.path`).
- a glob (`fnmatch` wildcards `*`, `?`, `[...]`, case-sensitive): a variable
  is selected when the glob matches one of its layer paths
  (`"backbone/block_16*"`), its variable path (`"backbone/*"`,
  `"*/kernel"`), Keras's `variable.path`, or the name of a layer holding it
  (`"head*"`). A glob may select layers in several sub-models: that is what
  a glob asks for.
- a list or tuple of strings: the union of what each selects.
- a `keras.layers.Layer` (or sub-model) of the model: its variables.
- a callable `variable -> bool`.

A selector that names nothing in the model is an error naming it and listing
the layer paths: a typo never silently disables a rule. A selector whose
layers exist but are all frozen (`trainable=False`) selects nothing, with a
warning: the same rule list works in both phases of a fine-tuning recipe.
"""

import contextlib
import fnmatch
import threading
import types
import warnings
from typing import Any
from typing import Callable
from typing import Sequence
from typing import Union

import keras

from keras_tapeops._keras import private
from keras_tapeops import paths


class LayerPath:
    """A layer selector restored from a saved config: the layer at `path`.

    `get_config()` stores a layer selector by the layer's full path in the
    model being saved; loading gives this object, which selects that layer's
    variables exactly like the layer object did.

    Args:
        path: the layer's path from the outer model, e.g. `"tower_a/b1"`.

    Example:
    ```python
    kt.ClipByNorm(1.0, where=LayerPath("backbone/block_16_project"))
    ```
    """

    def __init__(self, path):
        if not isinstance(path, str) or not path.strip("/"):
            raise TypeError(f"`LayerPath` needs a non-empty layer path. Received: path={path!r}")
        if paths.is_glob(path):
            raise ValueError(
                f"`LayerPath` takes an exact path, not a glob. Received: path={path!r}"
            )
        self.path = path.strip("/")

    def __repr__(self):
        return f"LayerPath({self.path!r})"

    def __eq__(self, other):
        return isinstance(other, LayerPath) and other.path == self.path

    def __hash__(self):
        return hash(("LayerPath", self.path))


#: What a `where=` argument accepts (see the module docstring), for annotations.
Selector = Union[None, str, Sequence[str], "keras.layers.Layer", LayerPath, Callable[[Any], bool]]


def validate_selector(where):
    """Checks the type of a `where=` selector.

    Args:
        where: None, a string, a list/tuple of strings, a Keras layer, a
            `LayerPath`, or a callable `variable -> bool`.

    Returns:
        `where` unchanged (a list becomes a tuple, so it cannot change later).

    Raises:
        TypeError: naming `where` and what was received.
        ValueError: for an empty string or an empty list.

    Example:
    ```python
    validate_selector(["head*", "*/bias"])
    ```
    """
    if where is None or isinstance(where, (keras.layers.Layer, LayerPath)):
        return where
    if isinstance(where, str):
        if not where.strip("/"):
            raise ValueError(f"`where` must be a non-empty path or glob. Received: where={where!r}")
        return where
    if isinstance(where, (list, tuple)):
        if not where:
            raise ValueError(
                f"`where` must be a non-empty list of paths or globs. Received: where={where!r}"
            )
        for i, item in enumerate(where):
            if not isinstance(item, str) or not item.strip("/"):
                raise TypeError(
                    "`where` as a list must hold non-empty paths or globs; "
                    f"item {i} is {item!r} of type {type(item).__name__}. "
                    f"Received: where={where!r}"
                )
        return tuple(where)
    if callable(where):
        return where
    raise TypeError(
        "`where` must be None, a layer path or glob (e.g. 'backbone/*'), a "
        "list of them, a keras Layer, or a callable variable -> bool. "
        f"Received: where={where!r} of type {type(where).__name__}"
    )


def validate_listed_selector(where, label):
    """`validate_selector(where)` for one item of a list argument.

    Args:
        where: the item's selector.
        label: the item, as messages name it (e.g. `"groups[2]"`).

    Returns:
        The validated selector. Errors keep their type and start with `label`.

    Example:
    ```python
    validate_listed_selector("head", "layers[0]")
    ```
    """
    try:
        return validate_selector(where)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{label}: {error}") from None


def select(where, model, variables, tree=None):
    """Resolves `where` against `model`: which of `variables` it selects.

    Args:
        where: a selector (see the module docstring).
        model: the Keras model that owns `variables`.
        variables: the trainable variables, in gradient order.
        tree: an optional `paths.LayerTree(model)` to reuse.

    Returns:
        A list of bools aligned with `variables`. All False (with a warning)
        when the selector names layers whose variables are all frozen.

    Raises:
        ValueError: if `where` names nothing in `model`; the message names
            the selector and lists the model's layer paths.

    Example:
    ```python
    mask = select("backbone/*", model, model.trainable_variables)
    ```
    """
    where = validate_selector(where)
    variables = list(variables)
    if where is None:
        return [True] * len(variables)
    tree = tree or paths.LayerTree(model)
    try:
        matches = _matcher(where, model, tree)
    except ValueError as error:  # an unknown path or an ambiguous bare name
        raise ValueError(f"{error}. Received: where={describe(where)}") from None
    mask = [matches(v) for v in variables]
    if any(mask):
        return mask
    trainable_ids = {id(v) for v in variables}
    # Frozen: created trainable, not trainable now (a layer with
    # trainable=False, or a variable whose own flag was turned off).
    frozen = [
        v
        for v in private.trainable_capable_variables(model)
        if id(v) not in trainable_ids and matches(v)
    ]
    if frozen:
        warnings.warn(
            f"`where={describe(where)}` selects only frozen variables of model "
            f"{model.name!r} (their layers have trainable=False), so this rule "
            "acts on nothing until they are trainable again.",
            stacklevel=2,
        )
        return mask
    raise ValueError(
        f"`where` selects no trainable variable of model {model.name!r}. "
        f"Received: where={describe(where)}. Available layer paths: "
        f"{_trainable_paths(tree)}"
    )


def _matcher(where, model, tree):
    """Returns `variable -> bool` for a validated, non-None selector."""
    if isinstance(where, (str, tuple)):
        tests = [_string_matcher(s, tree) for s in _as_tuple(where)]
        return lambda v: any(test(v) for test in tests)
    if isinstance(where, (keras.layers.Layer, LayerPath)):
        layer = _resolve_layer(where, model, tree)
        ids = {id(v) for v in layer.weights}
        return lambda v: id(v) in ids
    return lambda v: bool(where(v))


def _string_matcher(text, tree):
    text = text.strip("/") if not paths.is_glob(text) else text
    if paths.is_glob(text):

        def matches(v):
            owners = tree.owner_paths(v)
            candidates = (
                owners + [p.rsplit("/", 1)[-1] for p in owners] + tree.variable_paths(v) + [v.path]
            )
            return any(fnmatch.fnmatchcase(c, text) for c in candidates)

        return matches
    layers = tree.find_all(text)
    if len(layers) > 1:
        tree.find(text)  # raises: an ambiguous bare name lists the paths
    if layers:
        ids = {id(v) for v in layers[0].weights}
        return lambda v: id(v) in ids
    _check_one_variable(text, tree)
    return lambda v: text == v.path or text in tree.variable_paths(v)


def _check_one_variable(text, tree):
    """Raises if a variable path without wildcards names several variables.

    Keras's `variable.path` leaves out nested functional models, so the
    variables of two sub-models may share one (`"b1/kernel"` in `"tower_a"`
    and in `"tower_b"`); like a shared bare layer name, that is an error.
    """
    found = {
        id(v): tree.variable_paths(v)
        for v in tree.model.weights
        if text == v.path or text in tree.variable_paths(v)
    }
    if len(found) > 1:
        raise ValueError(
            f"Several variables of model {tree.model.name!r} have the path "
            f"{text!r} ({sorted(p for ps in found.values() for p in ps)}); give "
            "the path from the outer model instead, or a glob to select them all"
        )


def _resolve_layer(where, model, tree):
    if isinstance(where, LayerPath):
        return tree.find(where.path)
    if where is model or tree.paths_of(where):
        return where
    raise ValueError(
        f"The layer given as `where` is not part of model {model.name!r}; "
        f"available layer paths: {_trainable_paths(tree)}"
    )


def _as_tuple(where):
    return (where,) if isinstance(where, str) else where


def _trainable_paths(tree):
    return [path for path, layer in tree.entries if layer.trainable_weights]


# ------------------------------------------------------------- serialization
_SAVING = threading.local()


@contextlib.contextmanager
def paths_relative_to(model):
    """Inside this block, layer selectors serialize as their path in `model`.

    `TapeOpsMixin.get_compile_config` uses it, so a `where=<layer>` is saved
    as `"backbone/b1"`, not the bare name `"b1"` another sub-model may share.
    """
    previous = getattr(_SAVING, "model", None)
    _SAVING.model = model
    try:
        yield
    finally:
        _SAVING.model = previous


def serialize_selector(where):
    """Returns a JSON-friendly form of `where` for `get_config()`.

    Strings and lists of strings are kept; a layer is stored by its full path
    in the model being saved (see `paths_relative_to`; by its name outside
    it); a callable only if registered with
    `keras.saving.register_keras_serializable`.

    Args:
        where: a selector.

    Returns:
        None, a string, a list of strings, or a dict.

    Raises:
        ValueError: for a callable Keras cannot serialize (a lambda, an
            unregistered function).

    Example:
    ```python
    serialize_selector("head*")  # "head*"
    ```
    """
    if where is None or isinstance(where, str):
        return where
    if isinstance(where, (list, tuple)):
        return list(where)
    if isinstance(where, LayerPath):
        return {"layer_path": where.path}
    if isinstance(where, keras.layers.Layer):
        model = getattr(_SAVING, "model", None)
        found = paths.LayerTree(model).paths_of(where) if model is not None else []
        return {"layer_path": found[0] if found else where.name}
    if callable(where):
        return {"callable": serialize_callable(where, "where")}
    raise TypeError(f"Cannot serialize selector. Received: where={where!r}")


def deserialize_selector(config):
    """Inverse of `serialize_selector` (a layer comes back as a `LayerPath`).

    Args:
        config: the output of `serialize_selector` (older saves with
            `{"layer_name": ...}` load as that name).

    Returns:
        A selector accepted by `validate_selector`.

    Example:
    ```python
    deserialize_selector({"layer_path": "backbone/b1"})  # LayerPath("backbone/b1")
    ```
    """
    if isinstance(config, dict):
        if "layer_path" in config:
            return LayerPath(config["layer_path"])
        if "layer_name" in config:
            return LayerPath(config["layer_name"])
        if "callable" in config:
            return keras.saving.deserialize_keras_object(config["callable"])
        raise ValueError(f"Unknown selector config. Received: where={config!r}")
    return validate_selector(config)


def serialize_callable(fn, name, owner=None):
    """Serializes a callable argument, or raises if it could not be loaded back.

    Functions must be registered with `keras.saving.register_keras_serializable`
    (lambdas and local functions cannot be); objects need `get_config` and a
    registered class.

    Args:
        fn: the callable.
        name: the argument name used in the message.
        owner: optional description of what holds it (e.g. "LossTerm 'm'").

    Returns:
        Keras's serialized form of `fn`.

    Example:
    ```python
    serialize_callable(my_registered_fn, "fn")
    ```
    """
    try:
        config = keras.saving.serialize_keras_object(fn)
        restored = keras.saving.deserialize_keras_object(config)
    except Exception:  # any failure means the saved model would not load
        restored = None
    loads_back = restored is fn if _is_function(fn) else restored is not None
    if not loads_back:
        if owner:
            subject = f"{owner} cannot be saved: its `{name}`"
        else:
            subject = f"`{name}` cannot be saved: it"
        raise ValueError(
            f"{subject} is not registered for Keras "
            "serialization (lambdas and local functions cannot be). Define it "
            "at module level and decorate it (or its class) with "
            "@keras.saving.register_keras_serializable(package='my_package'). "
            f"Received: {name}={fn!r}"
        )
    return config


def _is_function(fn):
    return isinstance(fn, (types.FunctionType, types.BuiltinFunctionType))


def describe(where):
    """A short readable form of a selector for messages and `repr`."""
    if isinstance(where, keras.layers.Layer):
        return f"<{type(where).__name__} name={where.name!r}>"
    if isinstance(where, tuple):
        return repr(list(where))
    return repr(where)
