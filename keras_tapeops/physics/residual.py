"""`PDEResidual`: the mean squared residual of a differential equation on collocation points."""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Sequence
from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from keras_tapeops import selectors
from keras_tapeops import validation
from keras_tapeops.derivatives import MODES
from keras_tapeops.derivatives import check_diagonal
from keras_tapeops.derivatives import check_mixed
from keras_tapeops.derivatives import check_order
from keras_tapeops.derivatives import input_derivatives
from keras_tapeops.physics.points_term import PointsTerm
from keras_tapeops.physics.samplers import Sampler
from keras_tapeops.registration import register
from keras_tapeops.terms.base import TermContext
from keras_tapeops.terms.base import Weight
from keras_tapeops.typing_aliases import Array

if TYPE_CHECKING:
    from typing_extensions import Self


@register
class PDEResidual(PointsTerm):
    """Adds `weight * mean(residual**2)` over collocation points to the loss.

    At every training step the term takes the collocation points of the
    optimizer step (a `kt.physics.BoxSampler` draws new ones, an array is
    used as is), evaluates the model and its input derivatives there with
    `kt.input_derivatives`, and calls
    `residual_fn(x, y, dy_dx[, d2y_dx2[, d2y_mixed]])`. The points are not
    the training batch: fit's `x, y` stay the data (initial and boundary
    values, measurements) of the compiled loss. Everything is recorded by
    the step's tape, so the optimizer minimizes the residual w.r.t. the
    weights (reverse over the derivative computation).

    Under `tf.distribute` the points are split among the replicas and the
    value is scaled so that the update equals one device's (see
    `keras_tapeops.physics.replicas`). Under mixed precision the
    derivatives and the residual are float32 (the model runs in float16).

    Args:
        residual_fn: `residual_fn(x, y, dy_dx, d2y_dx2) -> residual` (order
            2; order 1 omits `d2y_dx2`; with `mixed`, a last argument
            `d2y_mixed`). `x` is `(n, dim)`, `y` `(n, n_out)`, the
            derivatives are indexed `[point, output, coordinate]` as in
            `kt.input_derivatives`. The residual is `(n,)` or `(n, k)`, or a
            list of those (a system: the mean squares are summed). To save the
            model, register it with `@keras.saving.register_keras_serializable`.
        collocation: a `kt.physics.BoxSampler`, a `kt.physics.FixedPoints`
            or an array `(n, dim)` (fixed points, saved in the config).
        order: 1 or 2, the highest derivative `residual_fn` needs.
        mode: `"auto"`, `"forward"` or `"reverse"`: how the input
            derivatives are computed (`kt.input_derivatives`).
        mixed: optional `(i, j)` index pairs of mixed second derivatives.
        diagonal: optional list of the coordinates `i` whose second
            derivatives `residual_fn` reads (default: all). Each one costs a
            backward pass through the model and its weight gradient: for
            `u(x, t)` with only `u_xx`, `diagonal=[0]` makes the step about
            twice as fast (the others are NaN).
        weight: a number, a schedule or a callable `step -> number`.
        name: the name logged in History and the progress bar.
        in_validation: default False: `evaluate()`/validation does not
            compute it (the validation loss is the data loss only).

    Returns:
        A term for `compile(loss_terms=[...])`.

    Example:
    ```python
    import keras, numpy as np
    import keras_tapeops as kt

    def heat(x, u, du, d2u):                 # u_t - 0.1 u_xx = 0, x = (x, t)
        return du[:, 0, 1] - 0.1 * d2u[:, 0, 0]

    net = kt.upgrade(keras.Sequential([keras.Input((2,)),
        keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]))
    net.compile(optimizer="adam", loss="mse", loss_terms=[kt.PDEResidual(
        heat, collocation=kt.physics.BoxSampler([0.0, 0.0], [1.0, 1.0], n=128),
        diagonal=[0], name="pde")])           # only u_xx is read
    x0 = np.stack([np.linspace(0, 1, 32), np.zeros(32)], 1).astype("float32")
    net.fit(x0, np.sin(np.pi * x0[:, :1]), epochs=2, verbose=0)   # logs loss, pde
    ```
    """

    points_argument = "collocation"

    def __init__(
        self,
        residual_fn: Callable[..., Any],
        collocation: Sampler | Array,
        order: int = 2,
        mode: str = "auto",
        mixed: Sequence[tuple[int, int]] | None = None,
        diagonal: Sequence[int] | None = None,
        weight: Weight = 1.0,
        name: str = "pde_residual",
        in_validation: bool = False,
    ) -> None:
        if not callable(residual_fn):
            raise TypeError(
                "`residual_fn` must be a callable residual_fn(x, y, dy_dx, "
                f"d2y_dx2) -> residual. Received: residual_fn={residual_fn!r}"
            )
        self.residual_fn = residual_fn
        self.order = check_order(order)
        self.mode = validation.choice(mode, "mode", MODES)
        super().__init__(collocation, weight=weight, name=name, in_validation=in_validation)
        pairs = check_mixed(mixed, self.order, self.sampler.dim)
        self.mixed = [list(p) for p in pairs] if pairs else None
        if diagonal is not None:
            diagonal = list(check_diagonal(diagonal, self.order, self.sampler.dim, pairs))
        self.diagonal = diagonal

    def call(self, context: TermContext) -> tf.Tensor:
        """The mean squared residual at this step's points (float32 scalar)."""
        points, _, count = self.step_points(context)
        derivatives = input_derivatives(
            self.model_fn(context),
            points,
            order=self.order,
            mode=self.mode,
            mixed=self.mixed,
            diagonal=self.diagonal,
        )
        residual = self.residual_fn(points, *derivatives)
        return self.mean_square(residual, count)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "residual_fn": selectors.serialize_callable(
                    self.residual_fn, "residual_fn", owner=f"PDEResidual {self.name!r}"
                ),
                "order": self.order,
                "mode": self.mode,
                "mixed": self.mixed,
                "diagonal": self.diagonal,
            }
        )
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        config["residual_fn"] = keras.saving.deserialize_keras_object(config["residual_fn"])
        return super().from_config(config)
