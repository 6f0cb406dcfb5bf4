"""Discriminator penalties of `kt.GAN`: `R1Penalty` and `WGANGradientPenalty`.

A penalty is configuration (validated, serializable, no state). Called inside
the discriminator's tape it returns its *unweighted* value, a float32 scalar
differentiable w.r.t. the discriminator's weights (double backprop); the GAN
adds `weight * value` to the discriminator loss and logs the value as
`gradient_penalty`. In conditional mode the discriminator callable it
receives already holds the labels: gradients are taken w.r.t. the samples only.
Both penalties run on TensorFlow and JAX (input gradients by
`gan/backend_ops.py`).
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import TYPE_CHECKING

import keras
from keras import ops

from keras_tapeops import validation
from keras_tapeops.config_repr import ConfigRepr
from keras_tapeops.gan import backend_ops
from keras_tapeops.penalty import gradient_penalty
from keras_tapeops.penalty import interpolated_penalty
from keras_tapeops.registration import register
from keras_tapeops.transforms.clipping import add_n
from keras_tapeops.typing_aliases import Nested

if TYPE_CHECKING:
    from typing_extensions import Self


class DiscriminatorPenalty(ConfigRepr):
    """Base class of discriminator penalties (subclass it for your own).

    Subclasses set `weight` (the factor the GAN applies) and implement
    `__call__`; set `interpolates = True` to receive per-sample
    interpolation weights `alpha` (`U[0, 1]`, shape `(batch,)`).

    Example:
    ```python
    class ZeroCentredGP(kt.gan.DiscriminatorPenalty):
        interpolates = True
        def __init__(self, weight=10.0):
            self.weight = weight
        def __call__(self, discriminator, real, fake, alpha=None, training=True):
            return kt.gradient_penalty(discriminator, real, fake, alpha, target=0.0,
                                       training=training)
        def get_config(self):
            return {"weight": self.weight}
    ```
    """

    interpolates = False
    weight = 1.0

    def __call__(
        self,
        discriminator: Callable[..., Any],
        real: Nested,
        fake: Nested,
        alpha: Any = None,
        training: bool = True,
    ) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must implement "
            "__call__(discriminator, real, fake, alpha=None, training=True)."
        )

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement get_config().")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        return cls(**config)


@register
class R1Penalty(DiscriminatorPenalty):
    """R1 (Mescheder et al., 2018): `gamma / 2 * mean_x ||grad_x D(x)||^2` on real `x`.

    The squared norm runs over all non-batch axes of the (real) samples.

    Args:
        gamma: number >= 0; the GAN adds `gamma / 2` times the value.

    Example:
    ```python
    gan = kt.GAN(generator, critic, latent_dim=128, gradient_penalty=kt.R1Penalty(gamma=10.0))
    ```
    """

    def __init__(self, gamma: float = 10.0) -> None:
        self.gamma = validation.non_negative_number(gamma, "gamma")

    # A property over the base's class attribute: gamma / 2.
    @property
    def weight(self) -> float:  # type: ignore[override]
        return self.gamma / 2.0

    def __call__(
        self,
        discriminator: Callable[..., Any],
        real: Nested,
        fake: Nested = None,
        alpha: Any = None,
        training: bool = True,
    ) -> Any:
        def scores(flat: list[Any]) -> Any:
            return discriminator(keras.tree.pack_sequence_as(real, flat), training=training)

        grads = backend_ops.input_gradients(
            scores, keras.tree.flatten(real), _statistics(discriminator)
        )
        squared = [
            ops.sum(ops.square(ops.cast(g, "float32")), axis=tuple(range(1, len(g.shape))))
            for g in grads
            if g is not None
        ]
        if not squared:
            raise ValueError(
                "R1Penalty: the discriminator's output does not depend on the real "
                "samples. Received: gradients that are all None"
            )
        return ops.mean(add_n(squared))

    def get_config(self) -> dict[str, Any]:
        return {"gamma": self.gamma}


@register
class WGANGradientPenalty(DiscriminatorPenalty):
    """WGAN-GP (Gulrajani et al., 2017): `weight * mean((||grad D(x_hat)|| - target)^2)`.

    `x_hat = real + alpha * (fake - real)`, `alpha ~ U[0, 1]` per sample
    (see `kt.gradient_penalty`). `kt.WGANGP` is `kt.GAN` with
    `loss="wasserstein"` and this penalty.

    Args:
        weight: number >= 0 (10 in the paper).
        target: number >= 0, the norm the penalty pulls towards.

    Example:
    ```python
    gan = kt.GAN(generator, critic, latent_dim=128, loss="wasserstein",
                 discriminator_steps=5, gradient_penalty=kt.WGANGradientPenalty(10.0))
    ```
    """

    interpolates = True

    def __init__(self, weight: float = 10.0, target: float = 1.0) -> None:
        self.weight = validation.non_negative_number(weight, "weight")
        self.target = validation.non_negative_number(target, "target")

    def __call__(
        self,
        discriminator: Callable[..., Any],
        real: Nested,
        fake: Nested,
        alpha: Any = None,
        training: bool = True,
    ) -> Any:
        if alpha is None:
            return gradient_penalty(
                discriminator, real, fake, target=self.target, training=training
            )
        return interpolated_penalty(
            discriminator, real, fake, alpha, self.target, training, _statistics(discriminator)
        )

    def get_config(self) -> dict[str, Any]:
        return {"weight": self.weight, "target": self.target}


def _statistics(discriminator: Any) -> list[Any]:
    """The discriminator's non-trainable variables (a plain callable: none known)."""
    owner = getattr(discriminator, "tapeops_player", discriminator)
    return list(getattr(owner, "non_trainable_variables", []))
