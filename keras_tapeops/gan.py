"""`WGANGP`: a Wasserstein GAN with gradient penalty, trained with `fit()`.

Built from the library's pieces: `gradient_penalty` for the critic's penalty,
`GradientTransform`s for the critic's gradients (applied to true gradients,
as in `TapeOpsMixin.apply_optimizer_step`), and Keras-style loss scaling for
`tf.distribute` and mixed precision.
"""

import numbers

import keras
import tensorflow as tf

from keras_tapeops._keras import private
from keras_tapeops import replicas
from keras_tapeops import true_gradients
from keras_tapeops import validation
from keras_tapeops.penalty import gradient_penalty
from keras_tapeops.registration import register
from keras_tapeops.registration import serialize_all
from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.transforms.base import apply_in_order

_STOCK_COMPILE_KWARGS = ("run_eagerly", "steps_per_execution", "jit_compile", "auto_scale_loss")


@register
class WGANGP(keras.Model):
    """WGAN-GP (Gulrajani et al., 2017) as a Keras model: `compile()` then `fit(real)`.

    Each train step runs `critic_steps` critic updates, each with fresh latent
    noise and the loss `mean(critic(fake)) - mean(critic(real)) + gp_weight *
    gradient_penalty(critic, real, fake)`, then one generator update with the
    loss `-mean(critic(generator(z)))`. It logs `critic_loss` (the critic's
    total loss, penalty included), `generator_loss` and `gradient_penalty`
    (unweighted), each the epoch's sample-weighted mean over all steps.
    Calling the model on latent vectors generates samples:
    `gan.predict(noise)`.

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

    def __init__(
        self, generator, critic, latent_dim, critic_steps=5, gp_weight=10.0, **kwargs
    ):
        _check_model(generator, "generator")
        _check_model(critic, "critic")
        latent_dim = validation.positive_int(latent_dim, "latent_dim")
        critic_steps = validation.positive_int(critic_steps, "critic_steps")
        gp_weight = validation.non_negative_number(gp_weight, "gp_weight")
        super().__init__(**kwargs)
        self.generator = generator
        self.critic = critic
        self.latent_dim = latent_dim
        self.critic_steps = critic_steps
        self.gp_weight = gp_weight
        self.critic_loss_tracker = keras.metrics.Mean(name="critic_loss")
        self.generator_loss_tracker = keras.metrics.Mean(name="generator_loss")
        self.gradient_penalty_tracker = keras.metrics.Mean(name="gradient_penalty")
        self.generator_optimizer = None
        self.critic_optimizer = None
        self._critic_transforms = ()
        self._bound_critic_transforms = ()
        self._build_submodels()

    def _build_submodels(self):
        """Builds both sub-models symbolically so `fit` never builds them on real data."""
        if not (self.generator.built and self.critic.built):
            self.critic(self.generator(keras.Input((self.latent_dim,))))
        self.built = True

    def call(self, latent, training=False):
        """Returns `generator(latent)`: generated samples."""
        return self.generator(latent, training=training)

    # ----------------------------------------------------------------- compile
    def compile(
        self,
        generator_optimizer=None,
        critic_optimizer=None,
        gradient_transforms=None,
        **kwargs,
    ):
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
        for key in kwargs:
            if key not in _STOCK_COMPILE_KWARGS:
                hint = (
                    " Pass generator_optimizer= and critic_optimizer= instead."
                    if key == "optimizer"
                    else ""
                )
                raise TypeError(
                    f"WGANGP.compile() does not take `{key}` (it accepts "
                    f"{', '.join(_STOCK_COMPILE_KWARGS)}).{hint} "
                    f"Received: {key}={kwargs[key]!r}"
                )
        generator_optimizer = _get_optimizer(generator_optimizer, "generator_optimizer")
        critic_optimizer = _get_optimizer(critic_optimizer, "critic_optimizer")
        if generator_optimizer is critic_optimizer:
            raise ValueError(
                "`generator_optimizer` and `critic_optimizer` must be two "
                "different optimizer instances (each keeps its own state). "
                f"Received: the same object twice: {critic_optimizer!r}"
            )
        transforms = validation.instances(
            gradient_transforms, GradientTransform, "gradient_transforms",
            "kt.GradientTransform (e.g. kt.ClipByNorm(1.0))",
        )
        critic_variables = list(self.critic.trainable_variables)
        bound = [(t, t.bind(self.critic, critic_variables)) for t in transforms]
        auto_scale_loss = kwargs.pop("auto_scale_loss", True)
        if auto_scale_loss and self.dtype_policy.name == "mixed_float16":
            generator_optimizer = _loss_scaled(generator_optimizer, "generator")
            critic_optimizer = _loss_scaled(critic_optimizer, "critic")
        super().compile(optimizer=None, loss=None, auto_scale_loss=False, **kwargs)
        self.generator_optimizer = generator_optimizer
        self.critic_optimizer = critic_optimizer
        self._critic_transforms = transforms
        self._bound_critic_transforms = tuple(bound)
        self._wgangp_compile_kwargs = dict(kwargs)

    def make_train_function(self, force=False):
        self.build_optimizers()
        return super().make_train_function(force=force)

    def build_optimizers(self):
        """Creates both optimizers' variables (in the model's strategy scope).

        Keras builds only `model.optimizer` before the first step; variables
        created lazily inside a replicated step would break `tf.distribute`.
        """
        with self.distribute_strategy.scope():
            if not self.generator_optimizer.built:
                self.generator_optimizer.build(self.generator.trainable_variables)
            if not self.critic_optimizer.built:
                self.critic_optimizer.build(self.critic.trainable_variables)

    @property
    def gradient_transforms(self):
        """The critic's compiled gradient transforms (a tuple)."""
        return self._critic_transforms

    @property
    def metrics(self):
        return [
            self.critic_loss_tracker,
            self.generator_loss_tracker,
            self.gradient_penalty_tracker,
        ]

    # -------------------------------------------------------------- the steps
    def train_step(self, data):
        real, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        n = replicas.batch_size(real)
        critic_losses, penalties = [], []
        for step in range(self.critic_steps):
            critic_loss, penalty = self.critic_train_step(real, step)
            critic_losses.append(critic_loss)
            penalties.append(penalty)
        # One tracker update per batch (the mean over its critic steps, all
        # of the same size): the same epoch mean as one update per step.
        self.critic_loss_tracker.update_state(_mean(critic_losses), sample_weight=n)
        self.gradient_penalty_tracker.update_state(_mean(penalties), sample_weight=n)
        generator_loss = self.generator_train_step(real)
        self.generator_loss_tracker.update_state(generator_loss, sample_weight=n)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        real, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        n = replicas.batch_size(real)
        critic_loss, penalty = self.critic_losses(real, 0, training=False)
        generator_loss = self.generator_loss(real, training=False)
        self.critic_loss_tracker.update_state(critic_loss, sample_weight=n)
        self.gradient_penalty_tracker.update_state(penalty, sample_weight=n)
        self.generator_loss_tracker.update_state(generator_loss, sample_weight=n)
        return {m.name: m.result() for m in self.metrics}

    def critic_train_step(self, real, step):
        """One critic update; returns the (unscaled) `(critic_loss, penalty)`."""
        variables = self.critic.trainable_variables
        with tf.GradientTape() as tape:
            loss, penalty = self.critic_losses(real, step, training=True)
            scaled = self.critic_optimizer.scale_loss(
                replicas.scale_for_distribution(loss)
            )
        grads = tape.gradient(scaled, variables)
        self.apply_critic_gradients(grads, variables)
        return loss, penalty

    def generator_train_step(self, real):
        """One generator update; returns the (unscaled) generator loss."""
        variables = self.generator.trainable_variables
        with tf.GradientTape() as tape:
            loss = self.generator_loss(real, training=True)
            scaled = self.generator_optimizer.scale_loss(
                replicas.scale_for_distribution(loss)
            )
        grads = tape.gradient(scaled, variables)
        self.generator_optimizer.apply_gradients(zip(grads, variables))
        return loss

    def critic_losses(self, real, step, training):
        """Returns `(critic_loss, penalty)` (float32) for `real` and fresh noise."""
        fake = self.generator(self.sample_latent(real, step), training=training)
        fake_score = _mean_score(self.critic(fake, training=training))
        real_score = _mean_score(self.critic(real, training=training))
        penalty = gradient_penalty(
            self.critic, real, fake, alpha=self.sample_alpha(real, step),
            target=1.0, training=training,
        )
        loss = fake_score - real_score + tf.cast(self.gp_weight, "float32") * penalty
        return loss, penalty

    def generator_loss(self, real, training):
        """Returns `-mean(critic(generator(z)))` (float32) for fresh noise."""
        fake = self.generator(
            self.sample_latent(real, self.critic_steps), training=training
        )
        return -_mean_score(self.critic(fake, training=training))

    def sample_latent(self, real, step):
        """Latent vectors for one update: `N(0, 1)` of shape `(batch, latent_dim)`.

        Override for other priors or for deterministic tests.

        Args:
            real: the real batch (its batch size sets the number of vectors).
            step: the critic step index, or `critic_steps` for the generator.

        Returns:
            A float tensor of shape `(batch, latent_dim)`.
        """
        return tf.random.normal([replicas.batch_size(real), self.latent_dim])

    def sample_alpha(self, real, step):
        """Interpolation weights of the penalty: `U[0, 1]` of shape `(batch,)`.

        Override for deterministic tests (same arguments as `sample_latent`).
        """
        return tf.random.uniform([replicas.batch_size(real)], 0.0, 1.0)

    def apply_critic_gradients(self, grads, variables):
        """Applies the critic's gradients, through the gradient transforms if any.

        As in `TapeOpsMixin.apply_optimizer_step`: the transforms see true
        gradients (unscaled, summed once over replicas); a non-finite step
        still reaches a `LossScaleOptimizer` as non-finite so it is skipped.
        """
        optimizer = self.critic_optimizer
        if not self._critic_transforms:
            optimizer.apply_gradients(zip(grads, variables))
            return
        true_gradients.apply_transformed(
            optimizer, grads, variables,
            transform=lambda g, v: apply_in_order(self._bound_critic_transforms, g, v),
        )

    # ------------------------------------------------------------------ saving
    def get_config(self):
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
    def from_config(cls, config):
        config = dict(config)
        for key in ("generator", "critic"):
            config[key] = keras.saving.deserialize_keras_object(config[key])
        return cls(**config)

    def get_compile_config(self):
        if not self.compiled or self.generator_optimizer is None:
            return {}
        return {
            "generator_optimizer": keras.saving.serialize_keras_object(
                self.generator_optimizer
            ),
            "critic_optimizer": keras.saving.serialize_keras_object(
                self.critic_optimizer
            ),
            "gradient_transforms": serialize_all(self._critic_transforms, self.critic),
            **self._wgangp_compile_kwargs,
        }

    def compile_from_config(self, config):
        config = dict(config)
        for key in ("generator_optimizer", "critic_optimizer"):
            config[key] = keras.saving.deserialize_keras_object(config[key])
        config["gradient_transforms"] = [
            keras.saving.deserialize_keras_object(t)
            for t in config.get("gradient_transforms") or []
        ]
        self.compile(**config)
        # Create the optimizer variables so the saved states load into them.
        self.build_optimizers()


def _mean(values):
    return tf.add_n(values) / float(len(values))


def _mean_score(scores):
    flat = [tf.cast(s, "float32") for s in tf.nest.flatten(scores)]
    return tf.add_n([tf.reduce_mean(s) for s in flat])


def _check_model(model, name):
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"`{name}` must be a Keras model or layer. "
            f"Received: {name}={model!r} of type {type(model).__name__}"
        )


def _get_optimizer(identifier, name):
    if identifier is None:
        raise ValueError(
            f"WGANGP.compile() needs `{name}` (an optimizer, e.g. "
            f"keras.optimizers.Adam(2e-4)). Received: {name}=None"
        )
    try:
        return keras.optimizers.get(identifier)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"`{name}` must be a Keras optimizer, its name or its config. "
            f"Received: {name}={identifier!r}"
        ) from error


def _loss_scaled(optimizer, name):
    if private.is_loss_scale_optimizer(optimizer):
        return optimizer
    return keras.optimizers.LossScaleOptimizer(
        optimizer, name=f"{name}_loss_scale_optimizer"
    )
