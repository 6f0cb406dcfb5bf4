"""`FGSM`: one gradient step (Goodfellow et al. 2015), with a random start (Wong et al. 2020)."""

from __future__ import annotations

from typing import Any
from typing import Sequence

from keras_tapeops import validation
from keras_tapeops.attacks.base import Attack
from keras_tapeops.registration import register
from keras_tapeops.typing_aliases import LossLike


@register
class FGSM(Attack):
    """The fast gradient sign method: one step, then projection and clip.

    `x_adv = clip(x0 + project(step_size * sign(grad)))`, `x0` the clean input
    or (with `random_start`) a uniform point of the epsilon ball around it.
    With `random_start=True` this is Wong et al.'s "fast" adversarial
    training attack ("Fast is better than free", 2020), whose default step
    is `1.25 * epsilon`; without a random start the step is `epsilon`
    (Goodfellow et al.). `norm="l2"` takes a normalized gradient step
    (the fast gradient method).

    Args:
        epsilon: positive radius of the perturbation ball.
        random_start: start from a uniform point of the ball.
        step_size: None (`1.25 * epsilon` with a random start, else
            `epsilon`) or a positive number.
        clip: None or `(min, max)`: the valid input range.
        inputs: which inputs to perturb (see `kt.attacks.PGD`).
        norm: `"inf"` or `"l2"`.
        loss: None (the compiled loss) or the loss to ascend.
        seed: None or a non-negative int for the random start (see
            `kt.attacks.PGD`).

    Returns:
        An attack: `attack(model, x, y)` returns `x_adv`.

    Example:
    ```python
    # `model` compiled with a loss; `x` in [0, 1], `y` its targets.
    x_adv = kt.attacks.FGSM(epsilon=0.1, clip=(0.0, 1.0), seed=0)(model, x, y)
    ```
    """

    def __init__(
        self,
        epsilon: float,
        random_start: bool = True,
        step_size: float | None = None,
        clip: tuple[float, float] | None = None,
        inputs: str | int | Sequence[str | int] | None = None,
        norm: str = "inf",
        loss: LossLike | None = None,
        seed: int | None = None,
    ) -> None:
        epsilon = validation.positive_number(epsilon, "epsilon")
        random_start = validation.boolean(random_start, "random_start")
        if step_size is None:
            step_size = 1.25 * epsilon if random_start else epsilon
        super().__init__(
            epsilon,
            step_size,
            1,
            norm=norm,
            random_start=random_start,
            clip=clip,
            inputs=inputs,
            loss=loss,
            seed=seed,
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        del config["steps"]
        return config
