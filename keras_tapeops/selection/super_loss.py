"""`kt.SuperLoss`: confidence weights from the loss (Castells et al., NeurIPS 2020)."""

from __future__ import annotations

from typing import Any
import math

import keras
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.paths import LayerTree
from keras_tapeops.registration import register
from keras_tapeops.selection.base import SelectionOption
from keras_tapeops.selection.base import SelectionState


def lambert_w(z, iterations=8):
    """Principal branch W0 of the Lambert W function, float32, for z >= -1/e.

    Halley's iteration from a branch-point series (z near -1/e), log1p(z)
    (moderate z) or log(z) - log(log(z)) (large z).
    """
    z = tf.maximum(tf.cast(z, "float32"), -1.0 / math.e)
    p = tf.sqrt(tf.maximum(2.0 * (math.e * z + 1.0), 0.0))
    near_branch = -1.0 + p - p * p / 3.0 + 11.0 / 72.0 * p * p * p
    large = tf.math.log(tf.maximum(z, 3.0)) - tf.math.log(tf.math.log(tf.maximum(z, 3.0)))
    middle = tf.math.log1p(tf.maximum(z, -0.25))
    w = tf.where(z < -0.25, near_branch, tf.where(z > 3.0, large, middle))
    for _ in range(iterations):
        ew = tf.exp(w)
        f = w * ew - z
        # w + 1 vanishes at the branch point (z = -1/e, W = -1).
        w_plus_one = tf.where(tf.abs(w + 1.0) < 1e-6, 1e-6, w + 1.0)
        denominator = ew * w_plus_one - (w + 2.0) * f / (2.0 * w_plus_one)
        w = w - tf.math.divide_no_nan(f, denominator)
    return tf.where(z <= -1.0 / math.e, -1.0, w)


@register
class SuperLoss(SelectionOption):
    """Weights each example's loss by its SuperLoss confidence sigma*.

    SuperLoss (Castells et al.) replaces loss_i by
    (loss_i - tau) sigma_i + lam (log sigma_i)^2, minimized in closed form by
    sigma*_i = exp(-W(max(-2/e, (loss_i - tau) / lam) / 2)) (W: Lambert W).
    At sigma* its gradient with respect to the weights is sigma*_i times
    loss_i's gradient, so the step multiplies each example's sample weight
    by sigma*_i (held constant): easy examples (loss below tau) weigh more
    than 1, hard ones less.

    Args:
        lam: the regularization lambda (> 0); larger is closer to the plain loss.
        tau: the loss threshold: a number (e.g. log(num_classes) for
            cross-entropy) or None for a running mean of the batch losses
            (exponential, `momentum`).
        momentum: the running mean's momentum, in [0, 1).

    Returns:
        An option for `compile(sample_selection=...)`.

    Example:
    ```python
    import keras, numpy as np, keras_tapeops as kt
    model = kt.upgrade(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer="sgd", loss="mse", sample_selection=kt.SuperLoss(lam=1.0))
    model.fit(np.random.rand(16, 4), np.zeros((16, 1)), batch_size=8, verbose=0)
    ```
    """

    def __init__(self, lam: float = 1.0, tau: float | None = None, momentum: float = 0.9) -> None:
        self.lam = validation.positive_number(lam, "lam")
        self.tau = None if tau is None else validation.finite_number(tau, "tau")
        self.momentum = validation.non_negative_number(momentum, "momentum")
        if self.momentum >= 1.0:
            raise ValueError(f"`momentum` must be in [0, 1). Received: momentum={momentum!r}")

    def bind(self, model: keras.Model, tree: LayerTree) -> SuperLossState:
        return SuperLossState(self)

    def get_config(self) -> dict[str, Any]:
        return {"lam": self.lam, "tau": self.tau, "momentum": self.momentum}


def confidence(losses, tau, lam):
    """sigma* of SuperLoss for per-example `losses` (float32 `[n]`)."""
    beta = (tf.cast(losses, "float32") - tau) / lam
    return tf.exp(-lambert_w(0.5 * tf.maximum(-2.0 / math.e, beta)))


class SuperLossState(SelectionState):
    def __init__(self, option):
        super().__init__(None, value_name="tau")
        self.option = option
        first_replica = tf.VariableAggregation.ONLY_FIRST_REPLICA
        self.tau = tf.Variable(
            0.0, trainable=False, name="superloss_tau", aggregation=first_replica
        )
        self.started = tf.Variable(
            False, trainable=False, name="superloss_started", aggregation=first_replica
        )
        self.variables += [self.tau, self.started]

    def current_tau(self, losses):
        if self.option.tau is not None:
            return tf.constant(self.option.tau, "float32")
        # An empty batch (no losses) leaves the running mean as it is.
        present = tf.shape(losses)[0] > 0
        mean = tf.math.divide_no_nan(tf.reduce_sum(losses), tf.cast(tf.shape(losses)[0], "float32"))
        m = self.option.momentum
        tau = tf.where(self.started, m * self.tau + (1.0 - m) * mean, mean)
        tau = tf.where(present, tau, self.tau)
        self.tau.assign(tau)
        self.started.assign(tf.logical_or(self.started, present))
        return tau

    def select(self, model, x, y, sample_weight, losses, ids, y_pred):
        tau = self.current_tau(losses)
        return None, tf.stop_gradient(confidence(losses, tau, self.option.lam))
