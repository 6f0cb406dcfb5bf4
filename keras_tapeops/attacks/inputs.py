"""`inputs=`: which inputs of a (multi-input) model an attack perturbs."""

import numbers

import keras
import tensorflow as tf


def validate_inputs(inputs):
    """Checks `inputs=`: None, a name, an index, or a list of them; returns None or a tuple.

    Example:
    ```python
    validate_inputs(["image", 2])   # ("image", 2)
    ```
    """
    if inputs is None:
        return None
    items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    valid = bool(items) and all(_valid_item(item) for item in items)
    if not valid or len(set(items)) != len(items):
        raise ValueError(
            "`inputs` must be None, an input name or dict key, an index into "
            "the flattened inputs, or a non-empty list of distinct ones. "
            f"Received: inputs={inputs!r}"
        )
    return tuple(items)


def _valid_item(item):
    if isinstance(item, bool):
        return False
    if isinstance(item, numbers.Integral):
        return item >= 0
    return isinstance(item, str) and bool(item)


def select_inputs(model, x, flat, inputs):
    """Indices into `tf.nest.flatten(x)` of the inputs to perturb.

    Args:
        model: the model (its input names resolve names for list inputs).
        x: the inputs' structure.
        flat: `tf.nest.flatten(x)`.
        inputs: the validated `inputs=` (None or a tuple).

    Returns:
        A list of indices, each naming a floating tensor.

    Raises:
        ValueError: an unknown name or index, a non-floating input selected,
        or (with `inputs=None`) no floating input at all.
    """
    if inputs is None:
        chosen = [i for i, t in enumerate(flat) if _is_float(t)]
        if not chosen:
            raise ValueError(
                "The model has no floating-point input to perturb. Received: "
                f"inputs=None with input dtypes {[_dtype(t) for t in flat]}"
            )
        return chosen
    paths = ["/".join(str(key) for key in path) for path, _ in keras.tree.flatten_with_path(x)]
    names = [getattr(t, "name", None) for t in getattr(model, "inputs", None) or []]
    chosen = []
    for item in inputs:
        index = _index_of(item, paths, names, len(flat))
        if index is None:
            raise ValueError(
                f"`inputs` names no input of the batch: {item!r}. Available: "
                f"indices 0..{len(flat) - 1}, keys {paths}"
                + (f", input names {names}" if names else "")
                + f". Received: inputs={_show(inputs)}"
            )
        if not _is_float(flat[index]):
            raise ValueError(
                f"`inputs` selects input {item!r} of dtype {_dtype(flat[index])}; "
                "only floating-point inputs can be perturbed. Received: "
                f"inputs={_show(inputs)}"
            )
        chosen.append(index)
    return chosen


def _index_of(item, paths, names, count):
    if isinstance(item, numbers.Integral):
        return int(item) if item < count else None
    if item in paths:
        return paths.index(item)
    if len(names) == count and item in names:
        return names.index(item)
    return None


def _is_float(tensor):
    return tensor is not None and tf.as_dtype(tensor.dtype).is_floating


def _dtype(tensor):
    return None if tensor is None else tf.as_dtype(tensor.dtype).name


def _show(inputs):
    return repr(inputs[0] if len(inputs) == 1 else list(inputs))
