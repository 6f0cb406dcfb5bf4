"""How a site's call is recorded: its input, and the output whose gradient the step needs.

A recording's `forward(layer, original_call, args, kwargs)` returns the
layer's usual outputs and a record: `record["a"]`, the call's first input,
and `record["z"]`, the tensors whose gradient the backward pass computes
(a Dense layer's pre-activation output: the gradient of the activation is
then applied by the backward pass, not by the rule).

Example:
```python
outputs, record = pre_activation_forward(dense, dense.call, (x,), {})
# record["a"] is x; record["z"] is [x @ dense.kernel + dense.bias]: the
# pre-activation output, and outputs = dense.activation(record["z"][0])
```
"""

from __future__ import annotations

import tensorflow as tf


def float32(tensor):
    """`tensor` cast to float32 (records keep the layer's compute dtype)."""
    return tf.cast(tensor, tf.float32)


def split_activation(layer, original, args, kwargs):
    """Calls a layer whose `call` ends with `self.activation(x)`, without it.

    Returns `(outputs, z)`: `z` is the pre-activation output (the tensor
    whose gradient the step's rules read) and `outputs = activation(z)`, what
    the stock call returns.
    """
    activation = layer.activation
    # object.__setattr__: Keras's attribute tracking need not see the swap.
    object.__setattr__(layer, "activation", None)
    try:
        z = original(*args, **kwargs)
    finally:
        object.__setattr__(layer, "activation", activation)
    outputs = activation(z) if activation is not None else z
    return outputs, z


def first_input(args, kwargs):
    """The first positional argument of a layer call (Keras names it `inputs`)."""
    return args[0] if args else kwargs["inputs"]


def pre_activation_forward(layer, original, args, kwargs):
    """`forward` of a layer ending in `self.activation`: records its input and pre-activation."""
    outputs, z = split_activation(layer, original, args, kwargs)
    return outputs, {"a": first_input(args, kwargs), "z": [z]}


def output_forward(layer, original, args, kwargs):
    """`forward` of a layer without activation: records its input and output."""
    outputs = original(*args, **kwargs)
    return outputs, {"a": first_input(args, kwargs), "z": [outputs]}


def stock_call(layer, base):
    """True if `layer` is a `base` running `base`'s own `call` (not overridden), without LoRA."""
    return (
        isinstance(layer, base) and type(layer).call is base.call and not _lora_or_quantized(layer)
    )


def _lora_or_quantized(layer):
    if getattr(layer, "lora_enabled", False):
        return True
    policy = getattr(layer, "dtype_policy", None)
    return getattr(policy, "quantization_mode", None) is not None
