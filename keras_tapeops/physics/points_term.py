"""`PointsTerm`: the base of loss terms evaluated on their own points, not the batch.

`kt.PDEResidual` and `kt.ConditionLoss` call the model on points drawn from a
sampler at the optimizer's step (not on the training batch), split those
points among replicas (`keras_tapeops.physics.replicas`), and reduce squared
residuals to a mean. This class holds what they share.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Sequence
from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from keras_tapeops._keras import private
from keras_tapeops.paths import LayerTree
from keras_tapeops.physics import replicas
from keras_tapeops.physics.samplers import as_sampler
from keras_tapeops.physics.samplers import Sampler
from keras_tapeops.terms.base import Term
from keras_tapeops.terms.base import TermContext
from keras_tapeops.terms.base import Weight
from keras_tapeops.typing_aliases import Nested

if TYPE_CHECKING:
    from typing_extensions import Self


class PointsTerm(Term):
    """A term computed on `sampler`'s points at the optimizer step.

    Subclasses name the sampler argument in `points_argument` (the attribute
    and config key holding it: `"collocation"` or `"points"`).

    Args:
        sampler: a `kt.physics.BoxSampler`, `kt.physics.FixedPoints` or an
            array `(n, dim)`.
        weight, name, in_validation: as for every `kt.Term`.
    """

    points_argument = "points"

    def __init__(
        self,
        sampler: Sampler | Any,
        weight: Weight = 1.0,
        name: str | None = None,
        in_validation: bool = False,
    ) -> None:
        super().__init__(weight=weight, name=name, in_validation=in_validation)
        setattr(self, self.points_argument, as_sampler(sampler, self.points_argument))

    @property
    def sampler(self) -> Sampler:
        """The `Sampler` the term draws its points from."""
        return getattr(self, self.points_argument)

    def bind(self, model: keras.Model, tree: LayerTree | None = None) -> None:
        """Checks the model takes one input of the sampler's dimension (if known)."""
        super().bind(model, tree)
        inputs = getattr(model, "inputs", None) if model.built else None
        if inputs:
            if len(inputs) != 1:
                raise ValueError(
                    f"{type(self).__name__} {self.name!r} needs a model with one "
                    f"input of shape (batch, {self.sampler.dim}). Received: a "
                    f"model with {len(inputs)} inputs"
                )
            shape = tuple(inputs[0].shape)
            if len(shape) != 2 or shape[-1] not in (None, self.sampler.dim):
                raise ValueError(
                    f"{type(self).__name__} {self.name!r}: the model's input "
                    f"shape {shape} does not take points of dimension "
                    f"{self.sampler.dim} (`{self.points_argument}`). "
                    f"Received: {self.points_argument}={self.sampler!r}"
                )
        return None

    def step_points(self, context: TermContext) -> tuple[tf.Tensor, tf.Tensor | None, int]:
        """This replica's points at the current step, their indices and `R`.

        Returns:
            `(points, indices, replicas)`: float32 `(n_local, dim)`, the
            indices into the step's full set (None: all), the replica count.
        """
        optimizer = context.model.optimizer
        step = optimizer.iterations if optimizer is not None else 0
        every = self.sampler.sample(step)
        indices, count = replicas.replica_share(self.sampler.n)
        return replicas.take(every, indices), indices, count

    def model_fn(self, context: TermContext) -> Callable[[tf.Tensor], Nested]:
        """The model as a function of points: `training` as in the step."""
        model = context.model

        def fn(points):
            return private.call_model(model, points, context.training)

        return fn

    def mean_square(
        self, residual: tf.Tensor | Sequence[tf.Tensor], count: int | tf.Tensor
    ) -> tf.Tensor:
        """The mean over all replicas' points of `residual**2`, this replica's part.

        Args:
            residual: a tensor `(n_local, ...)` or a list of them (a system:
                the means of its members are summed).
            count: the replica count.

        Returns:
            A float32 scalar.
        """
        parts = residual if isinstance(residual, (list, tuple)) else [residual]
        total = []
        for part in parts:
            part = tf.cast(tf.convert_to_tensor(part), "float32")
            if part.shape.rank == 0:
                raise ValueError(
                    f"{type(self).__name__} {self.name!r}: the residual must have "
                    "one row per point, shape (n,) or (n, k). Received: a scalar"
                )
            per_point = 1
            for size in part.shape[1:]:
                per_point *= int(size)
            total.append(replicas.shared_mean(tf.square(part), self.sampler.n * per_point, count))
        return tf.add_n(total)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config[self.points_argument] = keras.saving.serialize_keras_object(self.sampler)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        key = cls.points_argument
        config[key] = keras.saving.deserialize_keras_object(config[key])
        return super().from_config(config)
