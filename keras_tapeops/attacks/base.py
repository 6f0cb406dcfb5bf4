"""`Attack`: the configuration and the step loop shared by FGSM and PGD.

An attack is immutable configuration. Called on a model it ascends an
objective (by default the model's compiled loss) with respect to the
model's floating inputs, the model in inference mode (`training=False`: no
BatchNormalization update, no dropout). Each step is

1. a signed (`norm="inf"`) or per-example normalized (`norm="l2"`) gradient
   step of size `step_size`,
2. a projection onto the `epsilon` ball around the clean input,
3. a clip to the valid range `clip` (if given).

Perturbations are computed in float32, also under mixed precision; the
result is held constant (`tf.stop_gradient`) and cast back to the input's
dtype. Several inputs (`inputs=`) are perturbed jointly: the L2 norm is
taken per example over all of them together.
"""

from __future__ import annotations

from typing import Callable
from typing import Sequence
from typing import TYPE_CHECKING
import numbers
from typing import Any

import keras
import tensorflow as tf

from keras_tapeops._keras import private
from keras_tapeops import validation
from keras_tapeops.attacks import noise
from keras_tapeops.attacks import objectives
from keras_tapeops.attacks.inputs import select_inputs
from keras_tapeops.attacks.inputs import validate_inputs
from keras_tapeops.config_repr import ConfigRepr
from keras_tapeops.typing_aliases import LossLike
from keras_tapeops.typing_aliases import Nested

if TYPE_CHECKING:
    from typing_extensions import Self

NORMS = ("inf", "l2")
_TINY = 1e-12  # L2 normalization guard: a zero gradient gives a zero step


class Attack(ConfigRepr):
    """Base class of `kt.attacks.FGSM` and `kt.attacks.PGD`.

    Args:
        epsilon: positive radius of the perturbation ball (in the input's
            units, e.g. `8/255` for images in [0, 1]).
        step_size: positive size of each gradient step.
        steps: positive int, the number of gradient steps.
        norm: `"inf"` (signed steps, box projection) or `"l2"` (normalized
            steps, ball projection).
        random_start: start from a uniform random point of the ball instead
            of the clean input.
        clip: None or `(min, max)` with `min < max`: the valid input range.
        inputs: which inputs to perturb: None (every floating input), a
            dict key or input name, an index into the flattened inputs, or a
            list of them. Selecting an integer input is an error.
        loss: None (the model's compiled loss) or a loss to ascend instead
            (a Keras loss, its name, or a function `(y_true, y_pred)`).
        seed: None or a non-negative int. With a seed the random start is
            drawn from a stateless generator keyed by `(seed, step)` (the
            optimizer step in `fit`, 0 when called directly), for the whole
            global batch, so two replicas equal one device. Without a seed
            it comes from TensorFlow's global generator (random per call).

    Example:
    ```python
    attack = kt.attacks.PGD(epsilon=0.1, step_size=0.025, steps=10, clip=(0.0, 1.0))
    x_adv = attack(model, x, y)
    ```
    """

    def __init__(
        self,
        epsilon: float,
        step_size: float,
        steps: int,
        norm: str = "inf",
        random_start: bool = True,
        clip: tuple[float, float] | None = None,
        inputs: str | int | Sequence[str | int] | None = None,
        loss: LossLike | None = None,
        seed: int | None = None,
    ) -> None:
        self.epsilon = validation.positive_number(epsilon, "epsilon")
        self.step_size = validation.positive_number(step_size, "step_size")
        self.steps = validation.positive_int(steps, "steps")
        self.norm = validation.choice(norm, "norm", NORMS)
        self.random_start = validation.boolean(random_start, "random_start")
        self.clip = _validate_clip(clip)
        self.inputs = validate_inputs(inputs)
        self.loss = objectives.validate_loss(loss)
        self.seed = noise.validate_seed(seed)

    def __call__(
        self, model: keras.Model, x: Nested, y: Nested, sample_weight: Nested = None
    ) -> Nested:
        """Returns the adversarial version of `x` (same structure and dtypes).

        Args:
            model: a Keras model (any kind), compiled with a loss unless the
                attack has its own `loss`.
            x: the clean inputs (anything the model accepts).
            y: the targets of the loss.
            sample_weight: unused by the attack (every example is attacked
                in full); accepted so a `(x, y, sample_weight)` batch can be
                passed as is.

        Returns:
            `x_adv`, held constant (no gradient flows through it).
        """
        del sample_weight
        x = tf.nest.map_structure(_as_tensor, x)
        y = tf.nest.map_structure(_as_tensor, y)
        objective = objectives.loss_objective(model, self.loss, y)
        return self.perturb(model, x, objective, step=0)

    def perturb(
        self,
        model: keras.Model,
        x: Nested,
        objective: Callable[[Nested], tf.Tensor],
        step: int | tf.Tensor,
        gather_batch_sizes: bool = True,
    ) -> Nested:
        """Runs the attack on `x` for an arbitrary objective to maximize.

        Args:
            model: the model (called with `training=False`).
            x: the clean inputs.
            objective: `objective(y_pred) -> float32 scalar` to ascend.
            step: an integer scalar (Python or tensor) keying a seeded
                random start (see `seed`).
            gather_batch_sizes: under a multi-replica strategy, all-gather
                the replicas' batch sizes to place this replica's rows of a
                seeded start (False: assume equal sizes; see
                `keras_tapeops.attacks.noise.random_start`).

        Returns:
            The adversarial inputs, structured like `x`, held constant.
        """
        flat = tf.nest.flatten(x)
        chosen = select_inputs(model, x, flat, self.inputs)
        clean = [tf.stop_gradient(tf.cast(flat[i], tf.float32)) for i in chosen]
        adv = clean
        if self.random_start:
            deltas = noise.random_start(
                clean, self.epsilon, self.norm, self.seed, step, gather_batch_sizes
            )
            adv = [c + d for c, d in zip(clean, deltas)]
        adv = self._clip(adv)

        def forward(points):
            merged = list(flat)
            for i, point in zip(chosen, points):
                merged[i] = point
            return private.call_model(model, tf.nest.pack_sequence_as(x, merged), training=False)

        def body(i, points):
            return i + 1, self._step(forward, objective, clean, points)

        if self.steps == 1:
            adv = self._step(forward, objective, clean, adv)
        else:
            _, adv = tf.while_loop(
                lambda i, _: i < self.steps,
                body,
                (tf.constant(0), adv),
            )
        merged = list(flat)
        for i, point in zip(chosen, adv):
            merged[i] = tf.stop_gradient(tf.cast(point, flat[i].dtype))
        return tf.nest.pack_sequence_as(x, merged)

    # ------------------------------------------------------------ one step
    def _step(self, forward, objective, clean, points):
        with tf.GradientTape() as tape:
            tape.watch(points)
            value = objective(forward(points))
        grads = tape.gradient(value, points, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads = [tf.cast(g, tf.float32) for g in grads]
        if self.norm == "inf":
            moved = [p + self.step_size * tf.sign(g) for p, g in zip(points, grads)]
        else:
            scale = self.step_size / tf.maximum(per_example_norm(grads), _TINY)
            moved = [p + _per_example(scale, g) * g for p, g in zip(points, grads)]
        deltas = self.project([m - c for m, c in zip(moved, clean)])
        return self._clip([c + d for c, d in zip(clean, deltas)])

    def project(self, deltas: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Projects perturbations onto the `epsilon` ball (per example, jointly)."""
        if self.norm == "inf":
            return [tf.clip_by_value(d, -self.epsilon, self.epsilon) for d in deltas]
        norm = per_example_norm(deltas)
        factor = tf.minimum(1.0, self.epsilon / tf.maximum(norm, _TINY))
        return [_per_example(factor, d) * d for d in deltas]

    def _clip(self, points):
        if self.clip is None:
            return list(points)
        low, high = self.clip
        return [tf.clip_by_value(p, low, high) for p in points]

    # ------------------------------------------------------------- config
    def get_config(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon,
            "step_size": self.step_size,
            "steps": self.steps,
            "norm": self.norm,
            "random_start": self.random_start,
            "clip": list(self.clip) if self.clip is not None else None,
            "inputs": _listed(self.inputs),
            "loss": objectives.serialize_loss(self.loss),
            "seed": self.seed,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        config["loss"] = objectives.deserialize_loss(config.get("loss"))
        if isinstance(config.get("clip"), list):
            config["clip"] = tuple(config["clip"])
        return cls(**config)


def per_example_norm(tensors):
    """The L2 norm per example over all (batch-first) `tensors` jointly: shape `(batch,)`."""
    squares = [
        tf.reduce_sum(tf.reshape(tf.square(t), [tf.shape(t)[0], -1]), axis=1) for t in tensors
    ]
    return tf.sqrt(tf.add_n(squares))


def _per_example(values, like):
    """Reshapes a `(batch,)` tensor to broadcast against `like`."""
    rank = like.shape.rank
    return tf.reshape(values, [-1] + [1] * (rank - 1))


def _validate_clip(clip):
    if clip is None:
        return None
    if (
        not isinstance(clip, (tuple, list))
        or len(clip) != 2
        or not all(isinstance(c, numbers.Real) and not isinstance(c, bool) for c in clip)
    ):
        raise ValueError(
            f"`clip` must be None or a pair (min, max) of numbers. Received: clip={clip!r}"
        )
    low = validation.finite_number(clip[0], "clip[0]")
    high = validation.finite_number(clip[1], "clip[1]")
    if not low < high:
        raise ValueError(f"`clip` must be (min, max) with min < max. Received: clip={clip!r}")
    return (low, high)


def _listed(inputs):
    return list(inputs) if isinstance(inputs, tuple) else inputs


def _as_tensor(value):
    if value is None or tf.is_tensor(value):
        return value
    return tf.convert_to_tensor(value)


def check_attack(attack, name="attack"):
    """Raises TypeError unless `attack` is a `kt.attacks` attack; returns it."""
    if not isinstance(attack, Attack):
        raise TypeError(
            f"`{name}` must be a kt.attacks attack (e.g. "
            f"kt.attacks.FGSM(epsilon=8/255)). Received: {name}={attack!r}"
        )
    return attack
