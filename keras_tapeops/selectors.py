"""Resolution of `where=` selectors: which trainable variables a transform acts on.

A selector is one of:

- `None`: every trainable variable.
- a glob string (`fnmatch`, case-sensitive): a variable is selected when the
  glob matches the name of any layer that owns it (the layer itself or any
  enclosing layer or sub-model, e.g. `"head*"`), any layer name in its
  `variable.path`, or its whole path (e.g. `"*/kernel"`).
- a list or tuple of globs: the union of what each selects.
- a `keras.layers.Layer` (or sub-model): its trainable variables, nested ones
  included (compared by identity).
- a callable `variable -> bool`.

A selector that matches no trainable variable is an error naming it and
listing the model's layer names: a typo never silently disables a rule.
"""

import fnmatch

import keras

from keras_tapeops import _keras_private as private


class LayerByName:
    """A layer selector restored from a saved config: the layer named `name`.

    `get_config()` stores a layer selector by the layer's name; loading gives
    this object, which selects the trainable variables of the model's layer
    with that name (nested ones included), exactly like the layer did.

    Args:
        name: the layer's name.

    Example:
    ```python
    kt.ClipByNorm(1.0, where=LayerByName("head"))
    ```
    """

    def __init__(self, name):
        if not isinstance(name, str) or not name:
            raise TypeError(
                "`LayerByName` needs a non-empty layer name. "
                f"Received: name={name!r}"
            )
        self.name = name

    def __repr__(self):
        return f"LayerByName({self.name!r})"

    def __eq__(self, other):
        return isinstance(other, LayerByName) and other.name == self.name

    def __hash__(self):
        return hash(("LayerByName", self.name))


def validate_selector(where):
    """Checks the type of a `where=` selector.

    Args:
        where: None, a glob string, a list/tuple of globs, a Keras layer,
            a `LayerByName`, or a callable `variable -> bool`.

    Returns:
        `where` unchanged (a tuple of globs becomes a list).

    Raises:
        TypeError: naming `where` and what was received.
        ValueError: for an empty string or an empty list.

    Example:
    ```python
    validate_selector(["head*", "*/bias"])
    ```
    """
    if where is None or isinstance(where, (keras.layers.Layer, LayerByName)):
        return where
    if isinstance(where, str):
        if not where:
            raise ValueError(
                "`where` must be a non-empty glob string. Received: where=''"
            )
        return where
    if isinstance(where, (list, tuple)):
        if not where:
            raise ValueError(
                "`where` must be a non-empty list of glob strings. "
                f"Received: where={where!r}"
            )
        for i, item in enumerate(where):
            if not isinstance(item, str) or not item:
                raise TypeError(
                    "`where` as a list must hold non-empty glob strings; "
                    f"item {i} is {item!r} of type {type(item).__name__}. "
                    f"Received: where={where!r}"
                )
        return list(where)
    if callable(where):
        return where
    raise TypeError(
        "`where` must be None, a glob string (e.g. 'head*'), a list of glob "
        "strings, a keras Layer, or a callable variable -> bool. "
        f"Received: where={where!r} of type {type(where).__name__}"
    )


def select(where, model, variables):
    """Resolves `where` against `model`: which of `variables` it selects.

    Args:
        where: a selector (see the module docstring).
        model: the Keras model that owns `variables`.
        variables: the trainable variables, in gradient order.

    Returns:
        A list of bools aligned with `variables`.

    Raises:
        ValueError: if `where` selects none of `variables`; the message
            names the selector and lists the model's layer names.

    Example:
    ```python
    mask = select("head*", model, model.trainable_variables)
    ```
    """
    where = validate_selector(where)
    variables = list(variables)
    if where is None:
        return [True] * len(variables)
    layers = private.all_layers(model)
    if isinstance(where, (str, list)):
        globs = [where] if isinstance(where, str) else where
        owners = _owner_names(layers)
        mask = [_matches_any(globs, v, owners) for v in variables]
    elif isinstance(where, (keras.layers.Layer, LayerByName)):
        layer = _resolve_layer(where, model, layers)
        ids = (
            {id(v) for v in layer.trainable_variables}
            if layer is not None
            else set()
        )
        mask = [id(v) in ids for v in variables]
    else:
        mask = [bool(where(v)) for v in variables]
    if not any(mask):
        raise ValueError(
            f"`where` selects no trainable variable of model {model.name!r}. "
            f"Received: where={_describe(where)}. Available layer names: "
            f"{_layer_names(layers)}"
        )
    return mask


def serialize_selector(where):
    """Returns a JSON-friendly form of `where` for `get_config()`.

    Globs and lists of globs are kept as they are; a layer is stored by its
    name; a callable only if it is registered with
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
    serialize_selector(model.get_layer("head"))  # {"layer_name": "head"}
    ```
    """
    if where is None or isinstance(where, str):
        return where
    if isinstance(where, (list, tuple)):
        return list(where)
    if isinstance(where, (keras.layers.Layer, LayerByName)):
        return {"layer_name": where.name}
    if callable(where):
        if not _is_registered(where):
            raise ValueError(
                "A callable `where` selector can be saved only if it is "
                "registered with `keras.saving.register_keras_serializable()`; "
                "use a glob string or a layer instead, or register the "
                f"function. Received: where={where!r}"
            )
        return {"callable": keras.saving.serialize_keras_object(where)}
    raise TypeError(f"Cannot serialize selector. Received: where={where!r}")


def deserialize_selector(config):
    """Inverse of `serialize_selector` (a layer comes back as `LayerByName`).

    Args:
        config: the output of `serialize_selector`.

    Returns:
        A selector accepted by `validate_selector`.

    Example:
    ```python
    deserialize_selector({"layer_name": "head"})  # LayerByName("head")
    ```
    """
    if isinstance(config, dict):
        if "layer_name" in config:
            return LayerByName(config["layer_name"])
        if "callable" in config:
            return keras.saving.deserialize_keras_object(config["callable"])
        raise ValueError(f"Unknown selector config. Received: where={config!r}")
    return validate_selector(config)


def _is_registered(fn):
    name = keras.saving.get_registered_name(fn)
    return keras.saving.get_registered_object(name) is fn


def _owner_names(layers):
    """Maps `id(variable)` to the names of every layer that owns it."""
    owners = {}
    for layer in layers:
        for v in layer.trainable_variables:
            owners.setdefault(id(v), []).append(layer.name)
    return owners


def _matches_any(globs, variable, owners):
    path = variable.path
    names = path.split("/")[:-1] + owners.get(id(variable), [])
    for glob in globs:
        if fnmatch.fnmatchcase(path, glob):
            return True
        if any(fnmatch.fnmatchcase(name, glob) for name in names):
            return True
    return False


def _resolve_layer(where, model, layers):
    if isinstance(where, keras.layers.Layer):
        return where
    for layer in [model] + layers:
        if layer.name == where.name:
            return layer
    return None


def _layer_names(layers):
    return [layer.name for layer in layers if layer.trainable_variables]


def _describe(where):
    if isinstance(where, keras.layers.Layer):
        return f"<{type(where).__name__} name={where.name!r}>"
    return repr(where)
