"""GANs for the JAX backend's tests, built alike on TensorFlow and JAX.

Imported by the JAX process (`jax_gan_cases.py`) and by the TensorFlow test
process (`test_jax_backend.py`): the networks start from the same NumPy
weights, and the noise and interpolation hooks are functions of the real
batch written with `keras.ops`, so both backends draw the same numbers.
"""

import keras
import numpy as np
from keras import ops

import keras_tapeops as kt

PACKAGE = "tapeops_jax_gan"
GAN_BATCH, GAN_EPOCHS, SAMPLES = 8, 2, 32
LABELS = 3


@keras.saving.register_keras_serializable(package=PACKAGE)
class SeededWGANGP(kt.WGANGP):
    """WGANGP whose noise and interpolation weights are functions of the real batch."""

    def sample_latent(self, real, step):
        k = ops.arange(self.latent_dim, dtype="float32")
        return ops.sin(real[:, :1] * (step + 1.3) + 0.7 * k) + ops.cos(real[:, 1:2] * (k + 1.0))

    def sample_alpha(self, real, step):
        return ops.sigmoid(ops.sum(real, axis=1) * (step + 1.0))


@keras.saving.register_keras_serializable(package=PACKAGE)
class SeededGAN(kt.GAN):
    """kt.GAN whose noise depends on the batch size only (the same every update)."""

    def sample_latent(self, batch_size):
        grid = ops.arange(batch_size * self.latent_dim, dtype="float32")
        return ops.reshape(ops.sin(grid * 0.37), (batch_size, self.latent_dim))


def points(n=SAMPLES, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 2)).astype("float32")


def labels(n=SAMPLES, seed=1):
    return np.eye(LABELS, dtype="float32")[np.random.default_rng(seed).integers(0, LABELS, n)]


def _weights(shapes, seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=0.5, size=s).astype("float32") for s in shapes]


def networks(conditional=False, seed=0):
    """`(generator, critic)`: small MLPs with fixed NumPy weights."""
    if conditional:
        z, y = keras.Input((2,)), keras.Input((LABELS,))
        h = keras.layers.Dense(4, activation="tanh")(keras.layers.Concatenate()([z, y]))
        generator = keras.Model([z, y], keras.layers.Dense(2)(h), name="generator")
        x, y2 = keras.Input((2,)), keras.Input((LABELS,))
        h = keras.layers.Dense(4, activation="tanh")(keras.layers.Concatenate()([x, y2]))
        critic = keras.Model([x, y2], keras.layers.Dense(1)(h), name="critic")
    else:
        generator = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)],
            name="generator",
        )
        critic = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)],
            name="critic",
        )
    for i, model in enumerate((generator, critic)):
        model.set_weights(_weights([w.shape for w in model.get_weights()], seed + i))
    return generator, critic


def wgangp(**compile_kwargs):
    """SeededWGANGP (2 critic steps, penalty weight 1) with a clipped critic, SGD."""
    generator, critic = networks()
    gan = SeededWGANGP(generator, critic, latent_dim=2, critic_steps=2, gp_weight=1.0)
    gan.compile(
        generator_optimizer=keras.optimizers.SGD(0.05),
        critic_optimizer=keras.optimizers.SGD(0.05),
        gradient_transforms=[kt.ClipByGlobalNorm(0.5)],
        **compile_kwargs,
    )
    return gan


def r1_gan(**compile_kwargs):
    """SeededGAN, non-saturating loss, R1 penalty, Adam, a clipped generator."""
    generator, critic = networks(seed=4)
    gan = SeededGAN(
        generator, critic, latent_dim=2, loss="non_saturating", gradient_penalty=kt.R1Penalty(2.0)
    )
    gan.compile(
        generator_optimizer=keras.optimizers.Adam(0.01),
        discriminator_optimizer=keras.optimizers.Adam(0.01),
        generator_gradient_transforms=[kt.ClipByNorm(0.3)],
        **compile_kwargs,
    )
    return gan


def conditional_gan():
    """A conditional SeededGAN, hinge loss, two discriminator steps, SGD."""
    generator, critic = networks(conditional=True, seed=8)
    gan = SeededGAN(
        generator, critic, latent_dim=2, loss="hinge", discriminator_steps=2, conditional=True
    )
    gan.compile(
        generator_optimizer=keras.optimizers.SGD(0.05),
        discriminator_optimizer=keras.optimizers.SGD(0.05),
    )
    return gan


def hinge_gan():
    """SeededGAN, hinge loss, one discriminator step, SGD(0.05): the hand loop's model."""
    generator, critic = networks(seed=12)
    gan = SeededGAN(generator, critic, latent_dim=2, loss="hinge")
    gan.compile(
        generator_optimizer=keras.optimizers.SGD(0.05),
        discriminator_optimizer=keras.optimizers.SGD(0.05),
    )
    return gan


def stateful_gan():
    """SeededGAN, hinge, 2 discriminator steps; the players' stateful transforms.

    The discriminator (Adam) logs its gradient norm, skips non-finite
    updates and clips; the generator logs its update ratio (an `after_apply`
    hook). Trained on `nan_points()`.
    """
    generator, critic = networks(seed=16)
    gan = SeededGAN(generator, critic, latent_dim=2, loss="hinge", discriminator_steps=2)
    gan.compile(
        generator_optimizer=keras.optimizers.SGD(0.05),
        discriminator_optimizer=keras.optimizers.Adam(0.01),
        generator_gradient_transforms=[kt.LogUpdateRatio(name="g_ratio")],
        discriminator_gradient_transforms=[
            kt.LogGradientNorm(name="d_norm"),
            kt.SkipNonFinite(name="d_skipped"),
            kt.ClipByNorm(0.3),
        ],
    )
    return gan


def nan_points():
    """`points()` with a nan in the second batch (its discriminator updates are skipped)."""
    x = points()
    x[GAN_BATCH + 3, 0] = np.nan
    return x


def compared_cases():
    """`(name, build, x, targets)` of the GAN runs both backends make and compare."""
    x, y = points(), labels()
    return [
        ("gan_wgangp", wgangp, x, None),
        ("gan_r1", r1_gan, x, None),
        ("gan_conditional", conditional_gan, x, y),
        ("gan_hinge", hinge_gan, x, None),
        ("gan_stateful", stateful_gan, nan_points(), None),
    ]


def players_state(gan):
    """The players' transform state a GAN saves, key -> value (either backend)."""
    items = gan._tapeops_training_state._state.training_state_items()
    return {key: float(np.asarray(value)) for key, value in items}


def fit_gan(gan, x, y=None, epochs=GAN_EPOCHS):
    return gan.fit(
        x, y, batch_size=GAN_BATCH, epochs=epochs, shuffle=False, verbose=0
    ).history


def penalty_critic():
    """An MLP critic (2 -> 5 tanh -> 1) with fixed NumPy weights, for `kt.gradient_penalty`."""
    critic = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)],
        name="penalty_critic",
    )
    critic.set_weights(_weights([w.shape for w in critic.get_weights()], seed=20))
    return critic


def penalty_inputs():
    """`(real, fake, alpha)`: 16 samples of 2 features and one alpha per sample."""
    rng = np.random.default_rng(21)
    real = rng.normal(size=(16, 2)).astype("float32")
    fake = rng.normal(size=(16, 2)).astype("float32")
    return real, fake, rng.uniform(size=(16,)).astype("float32")
