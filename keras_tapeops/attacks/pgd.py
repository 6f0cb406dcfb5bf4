"""`PGD`: projected gradient descent on the loss, ascending (Madry et al. 2018)."""

from __future__ import annotations

from typing import Sequence

from keras_tapeops import validation
from keras_tapeops.attacks.base import Attack
from keras_tapeops.registration import register
from keras_tapeops.typing_aliases import LossLike


@register
class PGD(Attack):
    """Projected gradient ascent: `steps` steps, each projected and clipped.

    Each step moves by `step_size` along the gradient's sign (`norm="inf"`)
    or along the gradient normalized per example (`norm="l2"`), projects
    onto the epsilon ball around the clean input and clips to `clip`. The
    steps run in one `tf.while_loop` (one trace whatever `steps` is).

    Args:
        epsilon: positive radius of the perturbation ball.
        step_size: None (`2.5 * epsilon / steps`, Madry et al.'s rule) or a
            positive number.
        steps: positive int, the number of steps (PGD-7: `steps=7`).
        norm: `"inf"` or `"l2"`.
        random_start: start from a uniform point of the ball.
        clip: None or `(min, max)` with `min < max`: the valid input range.
        inputs: None (every floating input), a dict key or input name, an
            index into the flattened inputs, or a list of them.
        loss: None (the model's compiled loss) or the loss to ascend (a
            Keras loss, its name, or a function `(y_true, y_pred)`).
        seed: None or a non-negative int: the random start is drawn for the
            whole global batch from a stateless generator keyed by
            `(seed, step)`, so two replicas equal one device (see
            `keras_tapeops.attacks.noise`).

    Returns:
        An attack: `attack(model, x, y)` returns `x_adv`.

    Example:
    ```python
    # `model` compiled with a loss; `x` in [0, 1], `y` its targets.
    attack = kt.attacks.PGD(epsilon=0.1, step_size=0.025, steps=7, norm="inf",
                            clip=(0.0, 1.0), seed=0)
    x_adv = attack(model, x, y)   # max |x_adv - x| <= 0.1
    ```
    """

    def __init__(
        self,
        epsilon: float,
        step_size: float | None = None,
        steps: int = 10,
        norm: str = "inf",
        random_start: bool = True,
        clip: tuple[float, float] | None = None,
        inputs: str | int | Sequence[str | int] | None = None,
        loss: LossLike | None = None,
        seed: int | None = None,
    ) -> None:
        epsilon = validation.positive_number(epsilon, "epsilon")
        steps = validation.positive_int(steps, "steps")
        if step_size is None:
            step_size = 2.5 * epsilon / steps
        super().__init__(
            epsilon,
            step_size,
            steps,
            norm=norm,
            random_start=random_start,
            clip=clip,
            inputs=inputs,
            loss=loss,
            seed=seed,
        )
