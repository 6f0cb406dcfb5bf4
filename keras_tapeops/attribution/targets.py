"""The inputs and the output unit an attribution explains."""

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops._keras import private


def check_model(model):
    """Raises TypeError unless `model` is a Keras model (or layer)."""
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model. Received: model={model!r}")


def input_tensor(x):
    """`x` as a floating tensor (float64 becomes float32); one input tensor.

    Raises:
        TypeError: `x` is a structure of inputs, or not floating point.
    """
    if isinstance(x, (dict, list, tuple)):
        raise TypeError(
            "Attribution takes the one input tensor of a single-input model. "
            f"Received: x of type {type(x).__name__}"
        )
    x = tf.convert_to_tensor(x)
    if x.dtype == tf.float64:
        x = tf.cast(x, tf.float32)
    if not x.dtype.is_floating or x.shape.rank is None or x.shape.rank < 1:
        raise TypeError(
            "`x` must be a batch of floating-point inputs (batch first). "
            f"Received: x with dtype {x.dtype.name} and shape {x.shape}"
        )
    return x


def target_tensor(target, n):
    """`(batch,)` int32 targets; -1 means "the predicted class".

    Args:
        target: None, a non-negative int, or one non-negative int per example.
        n: the batch size.

    Returns:
        An int32 tensor of shape `(n,)`.
    """
    if target is None:
        return tf.fill([n], -1)
    if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
        if target < 0:
            raise ValueError(
                f"`target` must be a non-negative output unit. Received: target={target!r}"
            )
        return tf.fill([n], int(target))
    array = np.asarray(target)
    if array.dtype.kind not in "iu" or array.shape != (n,) or (array < 0).any():
        raise ValueError(
            "`target` must be None (the predicted class), a non-negative int, "
            f"or one non-negative int per example (shape ({n},)). Received: "
            f"target={target!r}"
        )
    return tf.constant(array, tf.int32)


def outputs_of(model, x, output_name=None):
    """The chosen output at `x` in inference mode, flattened to `(batch, units)` float32.

    Args:
        model: the Keras model.
        x: the model's inputs (see `join`).
        output_name: None (the only output), an output's name (a key of a
            dict output, or a name in the model's `output_names`), or its index.
    """
    outputs = private.call_model(model, x, training=False)
    if isinstance(outputs, dict):
        keys = list(outputs)
        outputs = outputs[keys[_choose(output_name, keys, "output_name", "output", "outputs")]]
    elif isinstance(outputs, (list, tuple)):
        names = _output_names(model, len(outputs))
        outputs = outputs[
            _choose(output_name, names, "output_name", "output", "outputs", len(outputs))
        ]
    elif output_name is not None:
        _check_single_choice(output_name, _output_names(model, 1), "output_name", "output")
    if tf.nest.is_nested(outputs):
        raise ValueError(
            "Attribution explains one output tensor; the chosen output is a "
            f"structure {tf.nest.map_structure(lambda t: t.shape, outputs)}. "
            f"Received: output_name={output_name!r}"
        )
    outputs = tf.cast(outputs, tf.float32)
    return tf.reshape(outputs, [tf.shape(outputs)[0], -1])


def selected(outputs, target):
    """`(scores, resolved)`: each example's output at its target unit.

    `target` -1 picks the arg-max. An out-of-range unit is clamped here and
    reported by `check_resolved` after the call.
    """
    units = tf.shape(outputs)[1]
    resolved = tf.where(target < 0, tf.argmax(outputs, axis=1, output_type=tf.int32), target)
    safe = tf.minimum(resolved, units - 1)
    scores = tf.gather(outputs, safe, axis=1, batch_dims=1)
    return scores, resolved, units


def check_resolved(target, resolved, units):
    """Raises ValueError if a requested unit is not an output of the model."""
    resolved = np.asarray(resolved)
    if (resolved >= int(units)).any():
        raise ValueError(
            f"`target` must name an output unit below {int(units)}. Received: target={target!r}"
        )


def split_inputs(model, x, input_name, floating=True):
    """The input to attribute to, and the other inputs held fixed.

    Args:
        model: the Keras model.
        x: one input tensor, or the model's inputs as a list/tuple or dict.
        input_name: None (the only input), an input's name (a key of a dict
            `x`, or the name of a functional model's `keras.Input`), or its
            index.
        floating: the chosen input must be floating point (False: any
            dtype, for a choice that is not differentiated).

    Returns:
        `(chosen, rest, position)`: the chosen input as a floating tensor,
        the other inputs (tensors, in their structure, without the chosen
        one; None for a single input) and where the chosen one goes back
        (None for a single input; a dict key or a list index).
    """
    names = _input_names(model)
    if not isinstance(x, (dict, list, tuple)):
        if names is not None and len(names) > 1:
            raise TypeError(
                f"The model has several inputs ({names!r}): pass all of them (a list or "
                "a dict) and choose the one to explain with `input_name=`. Received: x "
                f"of type {type(x).__name__}"
            )
        if input_name is not None:
            _check_single_choice(input_name, names, "input_name", "input")
        return input_tensor(x), None, None
    if names is not None and len(names) == 1:
        raise TypeError(
            "Attribution takes the one input tensor of a single-input model. "
            f"Received: x of type {type(x).__name__}"
        )
    if isinstance(x, dict):
        keys = list(x)
        position = keys[_choose(input_name, keys, "input_name", "input", "inputs")]
        rest = {k: _fixed(v) for k, v in x.items() if k != position}
        chosen = x[position]
    else:
        labels = names if names is not None and len(names) == len(x) else None
        position = _choose(input_name, labels, "input_name", "input", "inputs", len(x))
        rest = tuple(_fixed(v) for i, v in enumerate(x) if i != position)
        chosen = x[position]
    chosen = input_tensor(chosen) if floating else _fixed(chosen)
    for other in tf.nest.flatten(rest):
        if other.shape.rank and other.shape[0] != chosen.shape[0]:
            raise ValueError(
                f"Every input needs the chosen input's batch size {chosen.shape[0]}. "
                f"Received: an input of shape {other.shape} with input_name={input_name!r}"
            )
    return chosen, rest, position


def join(chosen, rest, position, copies=1):
    """The model's inputs: `chosen` in its place, the others tiled `copies` times."""
    if position is None:
        return chosen

    def tile(t):
        return tf.tile(t, [copies] + [1] * (t.shape.rank - 1)) if copies != 1 else t

    rest = tf.nest.map_structure(tile, rest)
    if isinstance(rest, dict):
        return {**rest, position: chosen}
    return list(rest[:position]) + [chosen] + list(rest[position:])


class Forward:
    """The model called with the chosen input replaced, read at the chosen output.

    `Forward(model, rest, position, output_name)(chosen, copies=1)` calls the
    model on `join(chosen, rest, position, copies)` and returns
    `outputs_of(..., output_name)`: `(copies * batch, units)` float32.
    """

    def __init__(self, model, rest, position, output_name):
        self.model = model
        self.rest = rest
        self.position = position
        self.output_name = output_name

    def __call__(self, chosen, copies=1):
        inputs = join(chosen, self.rest, self.position, copies)
        return outputs_of(self.model, inputs, self.output_name)


def choice_key(position, output_name):
    """The part of a trace key that the input and output choice adds (empty by default)."""
    return () if position is None and output_name is None else (position, output_name)


def _fixed(value):
    value = tf.convert_to_tensor(value)
    return tf.cast(value, tf.float32) if value.dtype == tf.float64 else value


def _input_names(model):
    """A functional or Sequential model's input names; None if it has none to offer."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    return [getattr(t, "name", None) for t in inputs]


def _output_names(model, count):
    """The model's output names if it has `count` of them, else None.

    A functional model's `output_names` (the layers that make its outputs);
    a Sequential model's last layer.
    """
    try:
        names = list(model.output_names)
    except (AttributeError, TypeError, ValueError):
        names = [model.layers[-1].name] if isinstance(model, keras.Sequential) else []
    return names if len(names) == count else None


def check_output_name(model, output_name):
    """Checks `output_name` before tracing where the model's outputs are known.

    A functional or Sequential model declares its outputs; a subclassed
    model's are checked on its first traced call (`outputs_of`).
    """
    if isinstance(model, keras.Sequential):
        structure = None
    else:
        try:
            structure = model.output
        except (AttributeError, ValueError):
            return
    if isinstance(structure, dict):
        _choose(output_name, list(structure), "output_name", "output", "outputs")
    elif isinstance(structure, (list, tuple)):
        names = _output_names(model, len(structure))
        _choose(output_name, names, "output_name", "output", "outputs", len(structure))
    elif output_name is not None:
        _check_single_choice(output_name, _output_names(model, 1), "output_name", "output")


def _check_single_choice(choice, names, argument, what):
    """A single input or output: accept its name, index 0 or -1."""
    if _is_index(choice) and choice in (0, -1):
        return
    if isinstance(choice, str) and names and choice == names[0]:
        return
    listed = f" {names!r}" if names else ""
    raise ValueError(
        f"`{argument}` must name one of the model's {what}s{listed} (the model has "
        f"one {what}), or be its index 0. Received: {argument}={choice!r}"
    )


def _is_index(choice):
    return isinstance(choice, (int, np.integer)) and not isinstance(choice, bool)


def _choose(choice, names, argument, what, plural, count=None):
    """The index of the chosen entry among `names` (or `count` unnamed entries)."""
    count = len(names) if names is not None else count
    listed = f"{names!r}" if names is not None else f"{count} unnamed {plural}"
    if choice is None:
        if count == 1:
            return 0
        raise ValueError(
            f"The model has several {plural} ({listed}); choose the one to explain "
            f"with `{argument}=` (a name or an index). Received: {argument}=None"
        )
    if _is_index(choice):
        if -count <= choice < count:
            return int(choice) % count
    elif isinstance(choice, str) and names is not None and choice in names:
        return names.index(choice)
    raise ValueError(
        f"`{argument}` must be one of the model's {plural} {listed} or an index "
        f"below {count}. Received: {argument}={choice!r}"
    )
