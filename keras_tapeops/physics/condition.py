"""`ConditionLoss`: the mean squared mismatch of the model with given values on given points."""

from __future__ import annotations

from typing import Callable
from typing import TYPE_CHECKING
import numbers
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops import selectors
from keras_tapeops.physics import replicas
from keras_tapeops.physics.points_term import PointsTerm
from keras_tapeops.physics.samplers import FixedPoints
from keras_tapeops.physics.samplers import Sampler
from keras_tapeops.registration import register
from keras_tapeops.terms.base import TermContext
from keras_tapeops.terms.base import Weight
from keras_tapeops.typing_aliases import Array

if TYPE_CHECKING:
    from typing_extensions import Self


@register
class ConditionLoss(PointsTerm):
    """Adds `weight * mean((model(points) - values)**2)` to the loss.

    A boundary or initial condition.

    The points are the term's own (not the training batch), so several
    conditions can be trained next to a data loss and logged apart, each
    under its `name`. For a condition on derivatives (Neumann), use a
    `kt.PDEResidual` whose residual is `dy_dx[..] - g` on the boundary points.

    Args:
        points: a `kt.physics.BoxSampler` (fresh points every step; a face of
            the box for a boundary), a `kt.physics.FixedPoints` or an array
            `(n, dim)`.
        values: the target values: a number (every output, every point), an
            array `(n, n_out)` or `(n,)` matching fixed `points`, or a
            callable `values(points) -> (n, n_out)` tensor (needed with a
            sampler; register it with `@keras.saving.register_keras_serializable`
            to save the model).
        weight: a number, a schedule or a callable `step -> number`.
        name: the name logged in History and the progress bar.
        in_validation: default False (the validation loss is the data loss).

    Returns:
        A term for `compile(loss_terms=[...])`.

    Example:
    ```python
    import keras, numpy as np
    import keras_tapeops as kt

    net = kt.upgrade(keras.Sequential([keras.Input((2,)),
        keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]))
    walls = kt.physics.BoxSampler(low=[1.0, 0.0], high=[1.0, 1.0], n=32)   # x = 1
    net.compile(optimizer="adam", loss="mse", loss_terms=[
        kt.ConditionLoss(walls, values=0.0, name="boundary")])
    x0 = np.stack([np.linspace(0, 1, 32), np.zeros(32)], 1).astype("float32")
    net.fit(x0, np.sin(np.pi * x0[:, :1]), epochs=2, verbose=0)   # logs loss, boundary
    ```
    """

    points_argument = "points"

    def __init__(
        self,
        points: Sampler | Array,
        values: float | Array | Callable[[tf.Tensor], tf.Tensor],
        weight: Weight = 1.0,
        name: str = "condition",
        in_validation: bool = False,
    ) -> None:
        super().__init__(points, weight=weight, name=name, in_validation=in_validation)
        self.values = _check_values(values, self.sampler)

    def call(self, context: TermContext) -> tf.Tensor:
        """The mean squared mismatch at this step's points (float32 scalar)."""
        points, indices, count = self.step_points(context)
        predicted = tf.cast(self.model_fn(context)(points), "float32")
        if predicted.shape.rank == 1:
            predicted = predicted[:, None]
        values = self.values
        if callable(values):
            target = tf.cast(values(points), "float32")
        elif isinstance(values, np.ndarray):
            target = replicas.take(tf.constant(values), indices)
        else:
            target = tf.constant(values, "float32")
        if target.shape.rank == 1:
            target = target[:, None]
        return self.mean_square(predicted - target, count)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        values = self.values
        if callable(values):
            values = selectors.serialize_callable(
                values, "values", owner=f"ConditionLoss {self.name!r}"
            )
        elif isinstance(values, np.ndarray):
            values = {"array": values.tolist()}
        config["values"] = values
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        values = config["values"]
        if isinstance(values, dict) and "array" in values:
            config["values"] = np.asarray(values["array"], "float32")
        elif isinstance(values, dict):
            config["values"] = keras.saving.deserialize_keras_object(values)
        return super().from_config(config)


def _check_values(values, sampler):
    """A float, a float32 array matching fixed points, or a callable."""
    if callable(values):
        return values
    if isinstance(values, numbers.Real) and not isinstance(values, (bool, np.bool_)):
        value = float(values)
        if not np.isfinite(np.float32(value)):
            raise ValueError(f"`values` must be finite. Received: values={values!r}")
        return value
    if isinstance(values, (str, bytes, bool, np.bool_)) or values is None:
        raise TypeError(
            "`values` must be a number, an array (n, n_out) or a callable "
            f"points -> values. Received: values={values!r}"
        )
    array = np.asarray(values)
    if array.dtype.kind not in "fiu" or array.ndim not in (1, 2):
        raise TypeError(
            "`values` must be a number, an array (n, n_out) or a callable "
            f"points -> values. Received: values of dtype {array.dtype} and "
            f"shape {array.shape}"
        )
    if not isinstance(sampler, FixedPoints):
        raise ValueError(
            "An array of `values` needs fixed `points` (an array); with a "
            "sampler, pass a callable values(points). "
            f"Received: values of shape {array.shape}, points={sampler!r}"
        )
    if array.shape[0] != sampler.n:
        raise ValueError(
            "`values` must have one row per point. Received: values of shape "
            f"{array.shape} for {sampler.n} points"
        )
    array = array.astype("float32")
    if not np.isfinite(array).all():
        raise ValueError("`values` must be finite. Received: values with non-finite entries")
    array.setflags(write=False)
    return array
