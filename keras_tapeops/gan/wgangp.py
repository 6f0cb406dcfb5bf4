"""`WGANGP`: `kt.GAN` with the Wasserstein loss and the WGAN-GP penalty.

It keeps its own names (`critic`, `critic_steps`, `gp_weight`,
`critic_optimizer`, `gradient_transforms`, the `critic_loss` log), its hooks
(`sample_latent(real, step)`, `sample_alpha(real, step)`), its methods and its
saved files; the step is `GAN`'s.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence
from typing import TYPE_CHECKING

import keras

from keras_tapeops import validation
from keras_tapeops.gan import backend_ops
from keras_tapeops.gan import losses
from keras_tapeops.gan.model import GAN
from keras_tapeops.gan.penalties import WGANGradientPenalty
from keras_tapeops.registration import register
from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.typing_aliases import Gradient
from keras_tapeops.typing_aliases import Nested

if TYPE_CHECKING:
    from typing_extensions import Self


@register
class WGANGP(GAN):
    """WGAN-GP (Gulrajani et al., 2017) as a Keras model: `compile()` then `fit(real)`.

    Each train step runs `critic_steps` critic updates, each with fresh latent
    noise and the loss `mean(critic(fake)) - mean(critic(real)) + gp_weight *
    gradient_penalty(critic, real, fake)`, then one generator update with the
    loss `-mean(critic(generator(z)))`. It logs `critic_loss` (the critic's
    total loss, penalty included), `generator_loss` and `gradient_penalty`
    (unweighted), each the epoch's sample-weighted mean over all steps.
    Calling the model on latent vectors generates samples:
    `gan.predict(noise)`. It is `kt.GAN(generator, critic, latent_dim,
    loss="wasserstein", discriminator_steps=critic_steps,
    gradient_penalty=kt.WGANGradientPenalty(gp_weight))` under its own names.

    Args:
        generator: a Keras model mapping `(batch, latent_dim)` noise to samples.
        critic: a Keras model mapping samples to one score per sample.
        latent_dim: int >= 1, the size of the noise vectors.
        critic_steps: int >= 1, critic updates per generator update.
        gp_weight: number >= 0, the weight of the gradient penalty.
        **kwargs: `name`, `trainable` and other base `keras.Model` arguments.

    Returns:
        A `keras.Model`; compile it with `generator_optimizer=` and
        `critic_optimizer=`.

    Example:
    ```python
    gan = kt.WGANGP(generator, critic, latent_dim=128, critic_steps=5)
    gan.compile(
        generator_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9),
        critic_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9),
        gradient_transforms=[kt.ClipByGlobalNorm(10.0)],   # critic only
    )
    gan.fit(real_images, batch_size=64, epochs=20)
    samples = gan.predict(keras.random.normal((16, 128)))
    ```
    """

    _role = "critic"
    _transform_arguments = (None, "gradient_transforms")

    def __init__(
        self,
        generator: keras.Model,
        critic: keras.Model,
        latent_dim: int,
        critic_steps: int = 5,
        gp_weight: float = 10.0,
        **kwargs: Any,
    ) -> None:
        gp_weight = validation.non_negative_number(gp_weight, "gp_weight")
        super().__init__(
            generator,
            critic,
            latent_dim,
            loss="wasserstein",
            discriminator_steps=critic_steps,
            gradient_penalty=WGANGradientPenalty(weight=gp_weight),
            **kwargs,
        )
        self.gp_weight = gp_weight

    # Its own arguments (the critic's), kept from before it shared `kt.GAN`'s step.
    def compile(  # type: ignore[override]
        self,
        generator_optimizer: keras.optimizers.Optimizer | str | dict[str, Any] | None = None,
        critic_optimizer: keras.optimizers.Optimizer | str | dict[str, Any] | None = None,
        gradient_transforms: Sequence[GradientTransform] | None = None,
        **kwargs: Any,
    ) -> None:
        """Configures training.

        Args:
            generator_optimizer: optimizer (instance, name or config) of the
                generator.
            critic_optimizer: optimizer of the critic. Under the
                `"mixed_float16"` policy both are wrapped in a
                `LossScaleOptimizer` (unless `auto_scale_loss=False`).
            gradient_transforms: list of `kt.GradientTransform` applied, in
                order, to the critic's true gradients (unscaled, summed over
                replicas); `where=` selectors resolve against the critic.
            **kwargs: `run_eagerly`, `steps_per_execution`, `jit_compile`,
                `auto_scale_loss` as in `keras.Model.compile`.

        Returns:
            None. Raises before changing anything if an argument is invalid.
        """
        self._compile_players(
            generator_optimizer, critic_optimizer, None, gradient_transforms, kwargs
        )

    @property
    def gradient_transforms(self) -> tuple[GradientTransform, ...]:
        """The critic's compiled gradient transforms (a tuple)."""
        return self._critic_transforms

    # WGANGP's own names of the shared step's pieces (an override of one of
    # them changes the step, as before WGANGP shared it).
    def discriminator_train_step(
        self, real: Nested, step: int, labels: Nested = None
    ) -> tuple[Any, Any]:
        return self.critic_train_step(real, step)

    def critic_train_step(self, real: Nested, step: int) -> tuple[Any, Any]:
        """One critic update; returns the (unscaled) `(critic_loss, penalty)`."""
        return GAN.discriminator_train_step(self, real, step)

    def discriminator_losses(
        self, real: Nested, step: int, training: bool, labels: Nested = None
    ) -> tuple[Any, Any]:
        return self.critic_losses(real, step, training)

    def critic_losses(self, real: Nested, step: int, training: bool) -> tuple[Any, Any]:
        """Returns `(critic_loss, penalty)` (float32) for `real` and fresh noise."""
        return GAN.discriminator_losses(self, real, step, training)

    def generator_objective(self, real: Nested, training: bool, labels: Nested = None) -> Any:
        return self.generator_loss(real, training)

    # WGANGP's own signature, kept from before it shared `kt.GAN`'s step.
    def generator_loss(  # type: ignore[override]
        self, real: Nested, training: bool
    ) -> Any:
        """Returns `-mean(critic(generator(z)))` (float32) for fresh noise."""
        return GAN.generator_objective(self, real, training)

    def _generator_loss_of(self, fake_logits):
        return losses.generator_loss("wasserstein", fake_logits)

    def apply_discriminator_gradients(
        self, grads: Sequence[Gradient], variables: Sequence[keras.Variable]
    ) -> Any:
        return self.apply_critic_gradients(grads, variables)

    def apply_critic_gradients(
        self, grads: Sequence[Gradient], variables: Sequence[keras.Variable]
    ) -> Any:
        """Applies the critic's gradients, through the gradient transforms if any.

        Returns:
            The transforms' gates' decision (a scalar bool tensor), or None.
        """
        return GAN.apply_discriminator_gradients(self, grads, variables)

    # WGANGP's own signature, kept from before it shared `kt.GAN`'s step.
    def sample_latent(  # type: ignore[override]
        self, real: Nested, step: int
    ) -> Any:
        """Latent vectors for one update: `N(0, 1)` of shape `(batch, latent_dim)`.

        Override for other priors or for deterministic tests.

        Args:
            real: the real batch (its batch size sets the number of vectors).
            step: the critic step index, or `critic_steps` for the generator.

        Returns:
            A float tensor of shape `(batch, latent_dim)`.
        """
        return backend_ops.normal(self, [backend_ops.batch_size(real), self.latent_dim])

    def sample_alpha(self, real: Nested, step: int) -> Any:
        """Interpolation weights of the penalty: `U[0, 1]` of shape `(batch,)`.

        Override for deterministic tests (same arguments as `sample_latent`).
        """
        return backend_ops.uniform(self, [backend_ops.batch_size(real)])

    def _latent(self, real, step):
        return self.sample_latent(real, step)

    def _alpha(self, real, step):
        return self.sample_alpha(real, step)

    # ------------------------------------------------------------------ saving
    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "trainable": self.trainable,
            "generator": keras.saving.serialize_keras_object(self.generator),
            "critic": keras.saving.serialize_keras_object(self.critic),
            "latent_dim": self.latent_dim,
            "critic_steps": self.critic_steps,
            "gp_weight": self.gp_weight,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        for key in ("generator", "critic"):
            config[key] = keras.saving.deserialize_keras_object(config[key])
        return cls(**config)
