"""Where a physics term evaluates the model: sampled boxes and fixed point sets.

A sampler is immutable configuration. `sample(step)` returns the points used
at optimizer step `step` as a float32 tensor `(n, dim)`: a `BoxSampler` draws
fresh uniform points from a stateless RNG keyed by `(seed, step)` (the same
points on every replica, after a restart, and in a hand-written loop that
calls it with the same step); `FixedPoints` returns the same array every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
import numbers
from typing import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.config_repr import ConfigRepr
from keras_tapeops.registration import register
from keras_tapeops.typing_aliases import Array

if TYPE_CHECKING:
    from typing_extensions import Self


class Sampler(ConfigRepr):
    """Base class of collocation-point sources (`BoxSampler`, `FixedPoints`).

    Subclasses set `n` (points per step) and `dim` (coordinates per point),
    implement `sample(step)` and `get_config()`.
    """

    # Set by every subclass (None only on this base).
    n: int = None  # type: ignore[assignment]
    dim: int = None  # type: ignore[assignment]

    def sample(self, step: int | tf.Tensor) -> tf.Tensor:
        """Returns the points of optimizer step `step`: float32 `(n, dim)`."""
        raise NotImplementedError(f"{type(self).__name__} must implement sample().")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        return cls(**config)


@register
class BoxSampler(Sampler):
    """Uniform points in the box `low <= x <= high`, fresh at every optimizer step.

    The points of step `s` are `low + (high - low) * U`, with `U` drawn by
    `tf.random.stateless_uniform(seed=(seed, s // resample_every),
    alg="philox")`: a pure function of the seed and the step, so every
    replica draws the same points, with or without `jit_compile`, and a
    resumed run draws what the uninterrupted one would have. A
    coordinate with `low == high` is held fixed, which samples a face of the
    box (a boundary, or `t = 0` for an initial condition).

    Args:
        low: the lower corner, a list of `dim` finite numbers.
        high: the upper corner, same length, `high[i] >= low[i]`.
        n: points per step (positive integer).
        seed: a non-negative integer; two samplers with the same seed and
            bounds draw the same points.
        resample_every: keep the same points for this many optimizer steps
            (default 1: new points every step).

    Returns:
        A sampler for `kt.PDEResidual(collocation=...)` or
        `kt.ConditionLoss(points=...)`.

    Example:
    ```python
    import keras_tapeops as kt
    interior = kt.physics.BoxSampler(low=[-1.0, 0.0], high=[1.0, 1.0], n=256, seed=0)
    points = interior.sample(step=0)          # float32, shape (256, 2)
    initial = kt.physics.BoxSampler(low=[-1.0, 0.0], high=[1.0, 0.0], n=64)  # t = 0
    ```
    """

    def __init__(
        self,
        low: Sequence[float],
        high: Sequence[float],
        n: int,
        seed: int | None = 0,
        resample_every: int = 1,
    ) -> None:
        self.low = _corner(low, "low")
        self.high = _corner(high, "high")
        if len(self.low) != len(self.high):
            raise ValueError(
                "`low` and `high` must have the same length (one bound per "
                f"coordinate). Received: low={low!r}, high={high!r}"
            )
        for i, (a, b) in enumerate(zip(self.low, self.high)):
            if a > b:
                raise ValueError(
                    f"`high` must be >= `low` in every coordinate; coordinate {i} "
                    f"is not. Received: low={low!r}, high={high!r}"
                )
        self.n = validation.positive_int(n, "n")
        self.seed = _seed(seed)
        self.resample_every = validation.positive_int(resample_every, "resample_every")

    # A property over the base's class attribute: the length of `low`.
    @property
    def dim(self) -> int:  # type: ignore[override]
        """Coordinates per point (the length of `low`)."""
        return len(self.low)

    def sample(self, step: int | tf.Tensor) -> tf.Tensor:
        """Returns the `(n, dim)` float32 points of optimizer step `step`.

        Args:
            step: an integer or integer tensor (the optimizer's iterations).

        Returns:
            A float32 tensor of shape `(n, dim)` inside the box.
        """
        key = tf.cast(step, "int64") // self.resample_every
        seed = tf.stack([tf.constant(self.seed, "int64"), key])
        # Philox named explicitly: "auto_select" draws other numbers under XLA.
        unit = tf.random.stateless_uniform(
            (self.n, self.dim), seed=seed, dtype="float32", alg="philox"
        )
        low = tf.constant(self.low, "float32")
        high = tf.constant(self.high, "float32")
        return low + (high - low) * unit

    def get_config(self) -> dict[str, Any]:
        return {
            "low": list(self.low),
            "high": list(self.high),
            "n": self.n,
            "seed": self.seed,
            "resample_every": self.resample_every,
        }


@register
class FixedPoints(Sampler):
    """The same points at every step (an array given once).

    A plain array passed as `collocation=` or `points=` becomes one of these.
    The points are stored in the saved model's config as a list, so prefer a
    `BoxSampler` for large sets (10000 2-D points add about 400 kB).

    Args:
        points: a finite floating array of shape `(n, dim)`, stored as float32.

    Returns:
        A sampler whose `sample(step)` is always `points`.

    Example:
    ```python
    import numpy as np
    import keras_tapeops as kt
    grid = np.stack(np.meshgrid(np.linspace(-1, 1, 8), np.linspace(0, 1, 8)), -1)
    fixed = kt.physics.FixedPoints(grid.reshape(-1, 2))
    fixed.sample(step=5).shape   # (64, 2)
    ```
    """

    def __init__(self, points: Array | Sequence[Sequence[float]]) -> None:
        array = np.asarray(points)
        if array.dtype.kind not in "fiu":
            raise TypeError(
                "`points` must be a numeric array of shape (n, dim). "
                f"Received: points of dtype {array.dtype}"
            )
        if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
            raise ValueError(
                "`points` must have shape (n, dim) with n, dim >= 1. "
                f"Received: points of shape {array.shape}"
            )
        array = array.astype("float32")
        if not np.isfinite(array).all():
            raise ValueError(
                "`points` must be finite (in float32). Received: points with "
                f"{int((~np.isfinite(array)).sum())} non-finite entries"
            )
        array.setflags(write=False)
        self.points = array
        self.n, self.dim = array.shape

    def sample(self, step: int | tf.Tensor) -> tf.Tensor:
        """Returns the points (a float32 constant); `step` is ignored."""
        return tf.constant(self.points)

    def get_config(self) -> dict[str, Any]:
        return {"points": self.points.tolist()}

    def __repr__(self):
        return f"FixedPoints(n={self.n}, dim={self.dim})"


def as_sampler(value, name):
    """Returns `value` as a `Sampler`: a sampler as is, an array as `FixedPoints`.

    Args:
        value: a `Sampler` or an array-like of shape `(n, dim)`.
        name: the argument name used in error messages.

    Returns:
        A `Sampler`.
    """
    if isinstance(value, Sampler):
        return value
    if value is None or isinstance(value, (str, bytes, numbers.Number)) or callable(value):
        raise TypeError(
            f"`{name}` must be a sampler (e.g. kt.physics.BoxSampler(low, high, n)) "
            f"or an array of shape (n, dim). Received: {name}={value!r}"
        )
    try:
        return FixedPoints(value)
    except (TypeError, ValueError) as error:
        raise type(error)(
            str(error)
            .replace("`points`", f"`{name}`")
            .replace("Received: points", f"Received: {name}")
        ) from error


def _corner(value, name):
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        value = [value]
    if not isinstance(value, (list, tuple, np.ndarray)) or len(value) == 0:
        raise TypeError(
            f"`{name}` must be a non-empty list of numbers (one per coordinate). "
            f"Received: {name}={value!r}"
        )
    return tuple(validation.finite_number(v, f"{name}[{i}]") for i, v in enumerate(value))


def _seed(seed):
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"`seed` must be a non-negative integer. Received: seed={seed!r}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"`seed` must be a non-negative integer. Received: seed={seed!r}")
    return int(seed)
