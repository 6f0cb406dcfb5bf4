"""`InnerSGD`: the inner loop's optimizer (SGD, optionally with momentum), functional.

The inner loop updates tensors, not variables, so its optimizer is a pure
function: `init(weights) -> slots` and `update(weight, grad, rate, slot) ->
(weight, slot)`, differentiable (MAML's second order flows through the
momentum too). The formulas are `keras.optimizers.SGD`'s, operation for
operation, so an inner loop with `InnerSGD(momentum=m)` equals a fresh
`keras.optimizers.SGD(rate, momentum=m)` stepping the support mini-batches.
The step size is the learner's `inner_learning_rate` (or Meta-SGD's learned
rates), never a second number here. The velocities start at zero for every
task: nothing is carried from one task or meta-batch to the next.
"""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.config_repr import ConfigRepr
from keras_tapeops.registration import register


@register
class InnerSGD(ConfigRepr):
    """SGD with optional (Nesterov) momentum for `kt.MetaLearner`'s inner loop.

    With velocity `m` (zero at the start of every task's inner loop), rate
    `lr` and gradient `g`, as `keras.optimizers.SGD` writes it:
    `m <- momentum * m - lr * g`, then `w <- w + m`, or with
    `nesterov=True` `w <- w + momentum * m - lr * g`. With `momentum=0` the
    step is plain SGD, `w <- w - lr * g` (the default inner loop).

    Args:
        momentum: float in [0, 1], the velocity's decay.
        nesterov: bool, Nesterov momentum (no effect when `momentum=0`).

    Returns:
        The configuration object; pass it as `kt.MetaLearner(...,
        inner_optimizer=...)`.

    Example:
    ```python
    import keras_tapeops as kt
    optimizer = kt.meta.InnerSGD(momentum=0.9, nesterov=True)
    optimizer.get_config()   # {'momentum': 0.9, 'nesterov': True}
    ```
    """

    def __init__(self, momentum: float = 0.0, nesterov: bool = False):
        checked = validation.non_negative_number(momentum, "momentum")
        if checked > 1.0:
            raise ValueError(
                f"`momentum` must be a number in [0, 1]. Received: momentum={momentum!r}"
            )
        self.momentum = checked
        self.nesterov = validation.boolean(nesterov, "nesterov")

    def init(self, weights: Sequence[tf.Tensor]) -> list[tf.Tensor | None]:
        """The velocity of each weight (zeros), or Nones without momentum."""
        if self.momentum == 0.0:
            return [None] * len(weights)
        return [tf.zeros_like(w) for w in weights]

    def update(
        self, weight: tf.Tensor, grad: tf.Tensor, rate: tf.Tensor, slot: tf.Tensor | None
    ) -> tuple[tf.Tensor, tf.Tensor | None]:
        """One step: returns `(new_weight, new_slot)`; `rate` in `grad`'s dtype."""
        if slot is None:
            return weight - grad * rate, None
        momentum = tf.cast(self.momentum, weight.dtype)
        slot = slot * momentum - grad * rate
        if self.nesterov:
            return weight + (slot * momentum - grad * rate), slot
        return weight + slot, slot

    def get_config(self) -> dict:
        return {"momentum": self.momentum, "nesterov": self.nesterov}

    @classmethod
    def from_config(cls, config: dict) -> "InnerSGD":
        return cls(**config)

    def __eq__(self, other):
        return type(other) is type(self) and other.get_config() == self.get_config()

    def __hash__(self):
        return hash((type(self).__name__, self.momentum, self.nesterov))


def resolve(value):
    """`inner_optimizer=` as given -> an `InnerSGD` or None (plain SGD).

    Accepts None, an `InnerSGD`, or its serialized form (a saved learner's
    config).

    Raises:
        TypeError: anything else, naming the argument and the value.
    """
    if value is None or isinstance(value, InnerSGD):
        return value
    if isinstance(value, dict):
        try:
            value = keras.saving.deserialize_keras_object(value)
        except (TypeError, ValueError) as error:
            raise TypeError(_message(value)) from error
        if isinstance(value, InnerSGD):
            return value
    raise TypeError(_message(value))


def serialize(value):
    """The config form of `resolve`'s result (None stays None)."""
    return None if value is None else keras.saving.serialize_keras_object(value)


def _message(value):
    return (
        "`inner_optimizer` must be None (plain SGD at `inner_learning_rate`) or "
        "a `kt.meta.InnerSGD(momentum=..., nesterov=...)`. "
        f"Received: inner_optimizer={value!r}"
    )
