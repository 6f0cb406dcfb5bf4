"""`GAN`: a two-player adversarial model trained with `fit()`.

One step for every GAN of the package (`kt.WGANGP` is a configuration of
it): `discriminator_steps` discriminator updates, each with fresh latent
noise, then one generator update. The losses come from `losses.py` by name
or from the overridable hooks; a discriminator penalty from `penalties.py`.
Each player has its own optimizer and its own gradient transforms, applied
to true gradients (unscaled, summed over replicas) as in
`TapeOpsMixin.apply_optimizer_step`; losses are scaled like Keras scales
them for `tf.distribute` and mixed precision. The step itself is the
backend's (`gan/tf_step.py`, `backend/jax/gan.py`); everything here is
shared.
"""

from __future__ import annotations

import contextlib
from typing import Any
from typing import Callable
from typing import Sequence
from typing import TYPE_CHECKING

import keras
from keras import ops

from keras_tapeops._keras import private
from keras_tapeops import validation
from keras_tapeops.gan import backend_ops
from keras_tapeops.gan import losses
from keras_tapeops.gan.penalties import DiscriminatorPenalty
from keras_tapeops.registration import register
from keras_tapeops.registration import serialize_all
from keras_tapeops.training_state import TrainingState
from keras_tapeops.training_state import transform_state_items
from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.typing_aliases import Nested

if keras.backend.backend() == "jax":
    from keras_tapeops.backend.jax.gan import JaxGANStep as _Step
else:
    from keras_tapeops.gan.tf_step import TensorFlowGANStep as _Step  # type: ignore[assignment]

if TYPE_CHECKING:
    from typing_extensions import Self

_STOCK_COMPILE_KWARGS = ("run_eagerly", "steps_per_execution", "jit_compile", "auto_scale_loss")


@register
class GAN(_Step, keras.Model):
    """A GAN as a Keras model: `compile()` then `fit(real)` (or `fit(real, labels)`).

    Each train step runs `discriminator_steps` discriminator updates, each
    with fresh noise `z = sample_latent(batch)` and the loss
    `discriminator_loss(D(x), D(G(z))) + weight * penalty`, then one generator
    update with the loss `generator_loss(D(G(z)))`. It logs
    `discriminator_loss` (penalty included), `generator_loss` and, with a
    penalty, `gradient_penalty` (unweighted): each the epoch's sample-weighted
    mean over all updates. Calling the model runs the generator:
    `gan.predict(noise)` (conditional: `gan.predict([noise, labels])`).

    Args:
        generator: a Keras model mapping `(batch, latent_dim)` noise to samples
            (conditional: mapping `[noise, labels]`).
        discriminator: a Keras model mapping samples to one logit (score) per
            sample, larger for "real" (conditional: mapping `[samples, labels]`).
        latent_dim: int >= 1, the size of the noise vectors.
        loss: `"non_saturating"` (binary cross-entropy on logits, real = 1,
            generator trained on the label "real"), `"hinge"`,
            `"least_squares"` or `"wasserstein"` (see `kt.gan.losses`).
        discriminator_steps: int >= 1, discriminator updates per generator update.
        gradient_penalty: None, `kt.R1Penalty(gamma)` or
            `kt.WGANGradientPenalty(weight)` (or a `kt.gan.DiscriminatorPenalty`).
        conditional: bool. True: batches are `(samples, labels)` and both
            networks take `[input, labels]`; the generator is conditioned on the
            real batch's labels. Both networks must be built (e.g. functional).
        **kwargs: `name`, `trainable` and other base `keras.Model` arguments.

    Returns:
        A `keras.Model`; compile it with `generator_optimizer=` and
        `discriminator_optimizer=`.

    Example:
    ```python
    discriminator = critic   # any model: samples -> one logit per sample
    gan = kt.GAN(generator, discriminator, latent_dim=128, loss="non_saturating")
    gan.compile(generator_optimizer=keras.optimizers.Adam(3e-4),
                discriminator_optimizer=keras.optimizers.Adam(3e-4))
    gan.fit(real_images, batch_size=64, epochs=1, verbose=0)
    samples = gan.predict(keras.random.normal((16, 128)))
    ```
    """

    # The second player's role: its attribute, argument and log names
    # (`discriminator`, `discriminator_optimizer`, `discriminator_steps`,
    # `discriminator_loss`); `kt.WGANGP` calls it "critic".
    _role = "discriminator"
    # compile()'s argument for each player's gradient transforms (None: not taken).
    _transform_arguments: tuple[str | None, str] = (
        "generator_gradient_transforms",
        "discriminator_gradient_transforms",
    )

    def __init__(
        self,
        generator: keras.Model,
        discriminator: keras.Model,
        latent_dim: int,
        loss: str = "non_saturating",
        discriminator_steps: int = 1,
        gradient_penalty: DiscriminatorPenalty | None = None,
        conditional: bool = False,
        **kwargs: Any,
    ) -> None:
        role = self._role
        _check_model(generator, "generator")
        _check_model(discriminator, role)
        latent_dim = validation.positive_int(latent_dim, "latent_dim")
        steps = validation.positive_int(discriminator_steps, f"{role}_steps")
        loss = validation.choice(loss, "loss", losses.LOSS_NAMES)
        if gradient_penalty is not None and not isinstance(gradient_penalty, DiscriminatorPenalty):
            raise TypeError(
                "`gradient_penalty` must be None, kt.R1Penalty(gamma) or "
                "kt.WGANGradientPenalty(weight). "
                f"Received: gradient_penalty={gradient_penalty!r}"
            )
        conditional = validation.boolean(conditional, "conditional")
        if conditional and not (generator.built and discriminator.built):
            raise ValueError(
                "conditional=True needs built networks (e.g. functional models on "
                "keras.Input([...]) for [input, labels]): the labels' shape is not "
                f"known. Received: generator.built={generator.built}, "
                f"{role}.built={discriminator.built}"
            )
        super().__init__(**kwargs)
        self.generator = generator
        setattr(self, role, discriminator)
        self.latent_dim = latent_dim
        setattr(self, f"{role}_steps", steps)
        self.adversarial_loss = loss
        self.gradient_penalty = gradient_penalty
        self.conditional = conditional
        setattr(self, f"{role}_loss_tracker", keras.metrics.Mean(name=f"{role}_loss"))
        self.generator_loss_tracker = keras.metrics.Mean(name="generator_loss")
        self.gradient_penalty_tracker = keras.metrics.Mean(name="gradient_penalty")
        self.generator_optimizer: keras.optimizers.Optimizer = None  # set by compile()
        setattr(self, f"{role}_optimizer", None)
        self._generator_transforms = ()
        self._bound_generator_transforms = ()
        setattr(self, f"_{role}_transforms", ())
        setattr(self, f"_bound_{role}_transforms", ())
        # Both players' transform state (`kt.SkipNonFinite`'s count...): saved
        # by `save`/`save_weights` (so `BackupAndRestore`) under this entry,
        # as a `TapeOpsMixin` model saves its transforms'; not in `weights`.
        self._tapeops_training_state = TrainingState(
            _PlayersTransformState(self), restorable=lambda: bool(self.compiled)
        )
        self._build_submodels()

    # The second player under its generic name (WGANGP stores it as `critic`).
    @property
    def _discriminator(self):
        return getattr(self, self._role)

    @property
    def _discriminator_optimizer(self):
        return getattr(self, f"{self._role}_optimizer")

    @property
    def _discriminator_steps(self):
        return getattr(self, f"{self._role}_steps")

    @property
    def _discriminator_tracker(self):
        return getattr(self, f"{self._role}_loss_tracker")

    def _build_submodels(self):
        """Builds both sub-models symbolically so `fit` never builds them on real data."""
        if not (self.generator.built and self._discriminator.built):
            self._discriminator(self.generator(keras.Input((self.latent_dim,))))
        self.built = True

    def call(self, inputs: Nested, training: bool = False) -> Nested:
        """Returns `generator(inputs)`: generated samples."""
        return self.generator(inputs, training=training)

    # ----------------------------------------------------------------- compile
    def compile(
        self,
        generator_optimizer: keras.optimizers.Optimizer | str | dict[str, Any] | None = None,
        discriminator_optimizer: keras.optimizers.Optimizer | str | dict[str, Any] | None = None,
        generator_gradient_transforms: Sequence[GradientTransform] | None = None,
        discriminator_gradient_transforms: Sequence[GradientTransform] | None = None,
        **kwargs: Any,
    ) -> None:
        """Configures training: each player's optimizer and gradient transforms.

        Args:
            generator_optimizer: optimizer (instance, name or config) of the
                generator.
            discriminator_optimizer: optimizer of the discriminator (a
                different instance). Under the `"mixed_float16"` policy both
                are wrapped in a `LossScaleOptimizer` (unless
                `auto_scale_loss=False`).
            generator_gradient_transforms: list of `kt.GradientTransform`
                applied, in order, to the generator's true gradients (unscaled,
                summed over replicas); `where=` resolves against the generator.
            discriminator_gradient_transforms: the same for the discriminator.
            **kwargs: `run_eagerly`, `steps_per_execution`, `jit_compile`,
                `auto_scale_loss` as in `keras.Model.compile`.

        Returns:
            None. Raises before changing anything if an argument is invalid.
        """
        self._compile_players(
            generator_optimizer,
            discriminator_optimizer,
            generator_gradient_transforms,
            discriminator_gradient_transforms,
            kwargs,
        )

    def _compile_players(
        self,
        generator_optimizer,
        discriminator_optimizer,
        generator_transforms,
        discriminator_transforms,
        kwargs,
    ):
        role, owner = self._role, self._public_name()
        for key in kwargs:
            if key not in _STOCK_COMPILE_KWARGS:
                hint = (
                    f" Pass generator_optimizer= and {role}_optimizer= instead."
                    if key == "optimizer"
                    else ""
                )
                raise TypeError(
                    f"{owner}.compile() does not take `{key}` (it accepts "
                    f"{', '.join(_STOCK_COMPILE_KWARGS)}).{hint} "
                    f"Received: {key}={kwargs[key]!r}"
                )
        generator_optimizer = _get_optimizer(generator_optimizer, "generator_optimizer", owner)
        discriminator_optimizer = _get_optimizer(
            discriminator_optimizer, f"{role}_optimizer", owner
        )
        if generator_optimizer is discriminator_optimizer:
            raise ValueError(
                f"`generator_optimizer` and `{role}_optimizer` must be two "
                "different optimizer instances (each keeps its own state). "
                f"Received: the same object twice: {discriminator_optimizer!r}"
            )
        transforms, bound = [], []
        for player, values, argument in zip(
            (self.generator, self._discriminator),
            (generator_transforms, discriminator_transforms),
            self._transform_arguments,
        ):
            values = validation.instances(
                values,
                GradientTransform,
                argument or "gradient_transforms",
                "kt.GradientTransform (e.g. kt.ClipByNorm(1.0))",
            )
            variables = list(player.trainable_variables)
            transforms.append(values)
            bound.append(tuple((t, t.bind(player, variables)) for t in values))
        self._check_logged_names(bound)
        self._gan_check(bound)  # what the backend's step cannot run, before compiling
        auto_scale_loss = kwargs.pop("auto_scale_loss", True)
        if auto_scale_loss and self.dtype_policy.name == "mixed_float16":
            generator_optimizer = _loss_scaled(generator_optimizer, "generator")
            discriminator_optimizer = _loss_scaled(discriminator_optimizer, role)
        super().compile(optimizer=None, loss=None, auto_scale_loss=False, **kwargs)
        self.generator_optimizer = generator_optimizer
        setattr(self, f"{role}_optimizer", discriminator_optimizer)
        self._generator_transforms, discriminator_values = transforms
        setattr(self, f"_{role}_transforms", discriminator_values)
        self._bound_generator_transforms, discriminator_bound = bound
        setattr(self, f"_bound_{role}_transforms", discriminator_bound)
        self._gan_compile_kwargs = dict(kwargs)
        self._gan_compiled()
        self._tapeops_training_state.restore_pending()  # a file loaded before compile()

    def _public_name(self):
        """The class named in messages: the first package class in the MRO."""
        for cls in type(self).__mro__:
            if cls.__module__.startswith("keras_tapeops."):
                return cls.__name__
        return type(self).__name__

    def make_train_function(self, force: bool = False) -> Callable[..., Any]:
        self.build_optimizers()
        return super().make_train_function(force=force)

    def build_optimizers(self) -> None:
        """Creates both optimizers' variables (in the model's strategy scope).

        Keras builds only `model.optimizer` before the first step; variables
        created lazily inside a replicated step would break `tf.distribute`.
        """
        players = (
            (self.generator_optimizer, self.generator),
            (self._discriminator_optimizer, self._discriminator),
        )
        strategy = getattr(self, "distribute_strategy", None)  # TensorFlow only
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            for optimizer, player in players:
                if not optimizer.built:
                    optimizer.build(player.trainable_variables)

    @property
    def generator_gradient_transforms(self) -> tuple[GradientTransform, ...]:
        """The generator's compiled gradient transforms (a tuple)."""
        return self._generator_transforms

    @property
    def discriminator_gradient_transforms(self) -> tuple[GradientTransform, ...]:
        """The discriminator's compiled gradient transforms (a tuple)."""
        return getattr(self, f"_{self._role}_transforms")

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        return self._trackers() + self._transform_metrics() + self._carried_metrics()

    def _players_bound_transforms(self) -> tuple[tuple[str, Sequence[Any]], ...]:
        """`(player name, its bound (transform, state) pairs)` for the generator, then the other."""
        return (
            ("generator", self._bound_generator_transforms),
            (self._role, getattr(self, f"_bound_{self._role}_transforms")),
        )

    def _transform_metrics(self) -> list[keras.metrics.Metric]:
        """What the players' transforms log in training (`kt.LogGradientNorm`, ...)."""
        return [
            m
            for _, bound in self._players_bound_transforms()
            for _, state in bound
            for m in state.metrics.values()
        ]

    def _check_logged_names(self, bound: Sequence[Sequence[Any]]) -> None:
        """Refuses two logs under one name (a transform's metric and a loss, or two players')."""
        seen = {tracker.name: "the GAN's losses" for tracker in self._trackers()}
        seen["gradient_penalty"] = "the GAN's losses"
        roles = ("generator", self._role)
        for role, argument, pairs in zip(roles, self._transform_arguments, bound):
            argument = argument or "gradient_transforms"
            for transform, state in pairs:
                for name in state.metrics:
                    if name in seen:
                        raise ValueError(
                            f"`{argument}` logs {name!r}, which {seen[name]} already log; "
                            "give the transform its own name (e.g. "
                            f"{type(transform).__name__}(name='{role}_{name}')). "
                            f"Received: {argument}=[..., {transform!r}, ...]"
                        )
                    seen[name] = f"`{argument}`"

    def _trackers(self) -> list[keras.metrics.Metric]:
        """The logged loss trackers."""
        trackers = [self._discriminator_tracker, self.generator_loss_tracker]
        if self.gradient_penalty is not None:
            trackers.append(self.gradient_penalty_tracker)
        return trackers

    # -------------------------------------------------------------- the steps
    def _unpack(self, data):
        real, labels, _ = keras.utils.unpack_x_y_sample_weight(data)
        if not self.conditional:
            return real, None
        if labels is None:
            raise ValueError(
                "A conditional GAN trains on `(samples, labels)` batches: pass "
                "fit(samples, labels) or a dataset of pairs. Received: a batch "
                "without labels"
            )
        return real, labels

    def discriminator_losses(
        self, real: Nested, step: int, training: bool, labels: Nested = None
    ) -> tuple[Any, Any]:
        """Returns `(loss, penalty)` (float32; penalty None without one) for fresh noise."""
        fake = self.generator(self._generator_input(real, step, labels), training=training)
        fake_logits = self._discriminate(fake, labels, training)
        real_logits = self._discriminate(real, labels, training)
        loss = ops.cast(self.discriminator_loss(real_logits, fake_logits), "float32")
        penalty = self.gradient_penalty
        if penalty is None:
            return loss, None
        if labels is None:
            discriminator = self._discriminator
        else:

            def discriminator(x, training=True):
                return self._discriminator([x, labels], training=training)

            setattr(discriminator, "tapeops_player", self._discriminator)  # its statistics

        alpha = self._alpha(real, step) if penalty.interpolates else None
        value = ops.cast(
            penalty(discriminator, real, fake, alpha=alpha, training=training), "float32"
        )
        return loss + ops.cast(penalty.weight, "float32") * value, value

    def generator_objective(self, real: Nested, training: bool, labels: Nested = None) -> Any:
        """Returns the generator's loss (float32) for fresh noise."""
        step = self._discriminator_steps
        fake = self.generator(self._generator_input(real, step, labels), training=training)
        return ops.cast(
            self._generator_loss_of(self._discriminate(fake, labels, training)), "float32"
        )

    def _generator_input(self, real, step, labels):
        latent = self._latent(real, step)
        return latent if labels is None else [latent, labels]

    def _discriminate(self, samples, labels, training):
        inputs = samples if labels is None else [samples, labels]
        return self._discriminator(inputs, training=training)

    # ---------------------------------------------------- overridable hooks
    def sample_latent(self, batch_size: Any) -> Any:
        """Latent vectors for one update: `N(0, 1)` of shape `(batch_size, latent_dim)`.

        Called once per discriminator update and once per generator update.
        Override for other priors or deterministic tests.

        Args:
            batch_size: a scalar int tensor, the batch's size.

        Returns:
            A float tensor of shape `(batch_size, latent_dim)`.
        """
        return backend_ops.normal(self, [batch_size, self.latent_dim])

    def discriminator_loss(self, real_logits: Any, fake_logits: Any) -> Any:
        """The discriminator's loss (the penalty is added after), a scalar.

        Default: the `loss` given to the constructor (see `kt.gan.losses`).
        Override for other conventions (label smoothing, flipped labels).

        Args:
            real_logits: the discriminator's output on the real batch.
            fake_logits: its output on the generated batch.
        """
        return losses.discriminator_loss(self.adversarial_loss, real_logits, fake_logits)

    def generator_loss(self, fake_logits: Any) -> Any:
        """The generator's loss from the discriminator's output on generated samples."""
        return losses.generator_loss(self.adversarial_loss, fake_logits)

    # Dispatch points kept apart from the public hooks: WGANGP's own methods
    # `sample_latent(real, step)`, `sample_alpha(real, step)` and
    # `generator_loss(real, training)` have other signatures.
    def _latent(self, real, step):
        return self.sample_latent(backend_ops.batch_size(real))

    def _alpha(self, real, step):
        return backend_ops.uniform(self, [backend_ops.batch_size(real)])

    def _generator_loss_of(self, fake_logits):
        return self.generator_loss(fake_logits)

    # ------------------------------------------------------------------ saving
    def get_config(self) -> dict[str, Any]:
        penalty = self.gradient_penalty
        return {
            "name": self.name,
            "trainable": self.trainable,
            "generator": keras.saving.serialize_keras_object(self.generator),
            "discriminator": keras.saving.serialize_keras_object(self._discriminator),
            "latent_dim": self.latent_dim,
            "loss": self.adversarial_loss,
            "discriminator_steps": self._discriminator_steps,
            "gradient_penalty": None
            if penalty is None
            else keras.saving.serialize_keras_object(penalty),
            "conditional": self.conditional,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        for key in ("generator", "discriminator", "gradient_penalty"):
            if config.get(key) is not None:
                config[key] = keras.saving.deserialize_keras_object(config[key])
        return cls(**config)

    def get_compile_config(self) -> dict[str, Any]:
        if not self.compiled or self.generator_optimizer is None:
            return {}
        role = self._role
        config = {
            "generator_optimizer": keras.saving.serialize_keras_object(self.generator_optimizer),
            f"{role}_optimizer": keras.saving.serialize_keras_object(self._discriminator_optimizer),
        }
        for argument, transforms, player in zip(
            self._transform_arguments,
            (self._generator_transforms, self.discriminator_gradient_transforms),
            (self.generator, self._discriminator),
        ):
            if argument is not None:
                config[argument] = serialize_all(transforms, player)
        config.update(self._gan_compile_kwargs)
        return config

    def compile_from_config(self, config: dict[str, Any]) -> None:
        config = dict(config)
        for key in ("generator_optimizer", f"{self._role}_optimizer"):
            config[key] = keras.saving.deserialize_keras_object(config[key])
        for argument in self._transform_arguments:
            if argument is not None:
                config[argument] = [
                    keras.saving.deserialize_keras_object(t) for t in config.get(argument) or []
                ]
        self.compile(**config)
        # Create the optimizer variables so the saved states load into them.
        self.build_optimizers()


def _check_model(model, name):
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"`{name}` must be a Keras model or layer. "
            f"Received: {name}={model!r} of type {type(model).__name__}"
        )


def _get_optimizer(identifier, name, owner):
    if identifier is None:
        raise ValueError(
            f"{owner}.compile() needs `{name}` (an optimizer, e.g. "
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
    return keras.optimizers.LossScaleOptimizer(optimizer, name=f"{name}_loss_scale_optimizer")


class _PlayersTransformState:
    """What `TrainingState` reads of a GAN: its players' bound transforms.

    Keys are `"generator.<key>"` and `"<role>.<key>"`, with the keys of
    `training_state.transform_state_items`.

    The transforms are bound at `compile()` (`load_model` compiles before
    it loads the state); values loaded into an uncompiled GAN are assigned
    when it is compiled (the GAN's `TrainingState` is restorable once
    compiled).
    """

    def __init__(self, gan: GAN) -> None:
        self._gan = gan

    def training_state_items(self) -> list[tuple[str, Any]]:
        return [
            (f"{player}.{key}", variable)
            for player, bound in self._gan._players_bound_transforms()
            for key, variable in transform_state_items(bound)
        ]
