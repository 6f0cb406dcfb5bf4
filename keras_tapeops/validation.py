"""Argument checks shared by every public class: one place, one message style.

Every check names the argument and shows the value as passed (Keras style:
"... Received: clip_norm=0"). NumPy scalars are accepted wherever a Python
number is (`np.int64(2)`, `np.float32(0.5)`), and numbers are returned as
plain Python `int`/`float`, so configs stay JSON-friendly.

Finite means finite in float32, the dtype the step computes in: `1e39`
overflows float32 to `inf` and is refused.
"""

import numbers

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)


def positive_int(value, name):
    """Returns `value` as an `int` if it is an integer >= 1.

    Args:
        value: a Python or NumPy integer.
        name: the argument name used in the message.

    Returns:
        `int(value)`.

    Raises:
        TypeError: for a bool or a non-integer. ValueError: for < 1.

    Example:
    ```python
    positive_int(np.int64(2), "micro_batches")  # 2
    ```
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be a positive integer. Received: {name}={value!r} "
            f"of type {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(f"`{name}` must be a positive integer (>= 1). Received: {name}={value!r}")
    return int(value)


def finite_number(value, name, minimum=None, strict=False):
    """Returns `value` as a `float` if it is a real number, finite in float32.

    Args:
        value: a Python or NumPy real number.
        name: the argument name used in the message.
        minimum: optional lower bound.
        strict: if True the bound is exclusive (`value > minimum`).

    Returns:
        `float(value)`.

    Raises:
        TypeError: for a bool or a non-number. ValueError: for nan, inf, a
        value that overflows float32, or one below the bound.

    Example:
    ```python
    finite_number(0.5, "weight")
    ```
    """
    kind = _kind(minimum, strict)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a {kind}. Received: {name}={value!r} of type {type(value).__name__}"
        )
    converted = float(value)
    too_small = minimum is not None and (converted <= minimum if strict else converted < minimum)
    if not abs(converted) <= FLOAT32_MAX or too_small:
        # `not <=` is also true for nan. Show the value as passed (`0`, not `0.0`).
        raise ValueError(f"`{name}` must be a {kind}. Received: {name}={value!r}")
    return converted


def positive_number(value, name):
    """A finite number > 0 (a threshold): see `finite_number`."""
    return finite_number(value, name, minimum=0.0, strict=True)


def non_negative_number(value, name):
    """A finite number >= 0 (a coefficient or target): see `finite_number`."""
    return finite_number(value, name, minimum=0.0)


def boolean(value, name):
    """Returns `value` if it is a bool (NumPy bools accepted), else raises TypeError."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return bool(value)


def choice(value, name, choices):
    """Returns `value` if it is one of the strings `choices`, else raises ValueError."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}. Received: {name}={value!r}")
    return value


def instances(values, kind, name, example):
    """Returns `values` (None, one `kind` or a list/tuple of them) as a tuple.

    Args:
        values: None, an instance of `kind`, or a list/tuple of instances.
        kind: the expected class.
        name: the argument name used in the message.
        example: how to describe one valid item.

    Returns:
        A tuple of `kind` instances.

    Example:
    ```python
    instances([kt.ClipByNorm(1.0)], GradientTransform, "gradient_transforms", "...")
    ```
    """
    if values is None:
        return ()
    if isinstance(values, kind):
        values = [values]
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"`{name}` must be a list of {example}. Received: {name}={values!r}")
    for i, value in enumerate(values):
        if not isinstance(value, kind):
            raise TypeError(
                f"`{name}` must be a list of {example}; item {i} is not. "
                f"Received: {name}[{i}]={value!r}"
            )
    return tuple(values)


def _kind(minimum, strict):
    if minimum is None:
        return "finite number"
    if minimum == 0:
        return "positive finite number" if strict else "non-negative finite number"
    relation = ">" if strict else ">="
    return f"finite number {relation} {minimum}"


def name(value, argument):
    """Returns `value` if it is a non-empty string (a logged name), else raises."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"`{argument}` must be a non-empty string. Received: {argument}={value!r}")
    return value
