"""The GAN cases of the JAX process (called by `jax_cases.py`; TensorFlow unimportable).

Each case saves its weights (and History) as `<name>.npz` under `out`;
`test_jax_backend.py` compares them with TensorFlow's runs of the same
models (`jax_gan_models.py`) and with the hand-written loop below.
"""

import jax
import keras
import numpy as np

import keras_tapeops as kt
from jax_gan_models import (
    GAN_BATCH,
    GAN_EPOCHS,
    SeededGAN,
    compared_cases,
    fit_gan,
    hinge_gan,
    networks,
    players_state,
    points,
    r1_gan,
)


def _save(out, name, gan, history):
    arrays = {f"w{i}": w for i, w in enumerate(gan.get_weights())}
    arrays.update({f"h_{k}": np.asarray(v) for k, v in history.items()})
    np.savez(out / f"{name}.npz", **arrays)


def hand_written_hinge_loop(x):
    """The seed-style JAX loop for `hinge_gan()`: `jax.grad` per player, SGD, jitted."""
    generator, critic = networks(seed=12)
    reference = hinge_gan()  # for its sample_latent (a function of the batch size)
    lr = 0.05

    def scores(critic_weights, samples):
        out, _ = critic.stateless_call(critic_weights, [], samples, training=True)
        return out

    def generate(generator_weights, z):
        out, _ = generator.stateless_call(generator_weights, [], z, training=True)
        return out

    def critic_loss(critic_weights, generator_weights, real, z):
        fake = generate(generator_weights, z)
        return jax.numpy.mean(jax.nn.relu(1.0 - scores(critic_weights, real))) + jax.numpy.mean(
            jax.nn.relu(1.0 + scores(critic_weights, fake))
        )

    def generator_loss(generator_weights, critic_weights, z):
        return -jax.numpy.mean(scores(critic_weights, generate(generator_weights, z)))

    @jax.jit
    def step(generator_weights, critic_weights, real):
        z = reference.sample_latent(real.shape[0])
        grads = jax.grad(critic_loss)(critic_weights, generator_weights, real, z)
        critic_weights = [w - lr * g for w, g in zip(critic_weights, grads)]
        grads = jax.grad(generator_loss)(generator_weights, critic_weights, z)
        generator_weights = [w - lr * g for w, g in zip(generator_weights, grads)]
        return generator_weights, critic_weights

    g = [v.value for v in generator.trainable_variables]
    c = [v.value for v in critic.trainable_variables]
    for _ in range(GAN_EPOCHS):
        for start in range(0, len(x), GAN_BATCH):
            g, c = step(g, c, x[start : start + GAN_BATCH])
    return [np.asarray(w) for w in g + c]


def gan_cases(out, report):
    """kt.GAN and kt.WGANGP on JAX: against TensorFlow, the hand loop, two devices, files."""
    x = points()
    cases = compared_cases()
    for name, make, data, targets in cases:
        gan = make()
        _save(out, name, gan, fit_gan(gan, data, targets))
    report["gan_evaluate"] = gan.evaluate(x, batch_size=GAN_BATCH, verbose=0, return_dict=True)
    np.savez(out / "gan_hinge_hand.npz", *hand_written_hinge_loop(x))

    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    try:
        for name, make, data, _ in cases:
            if name in ("gan_wgangp", "gan_r1", "gan_stateful"):
                gan = make()
                _save(out, f"{name}_data_parallel", gan, fit_gan(gan, data))
    finally:
        keras.distribution.set_distribution(None)

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        gan = r1_gan()
        report["gan_mixed_optimizer"] = type(gan.generator_optimizer).__name__
        _save(out, "gan_r1_mixed", gan, fit_gan(gan, x))
    finally:
        keras.mixed_precision.set_global_policy("float32")

    # A static loss_scale_factor on the clipped generator's SGD: its
    # ClipByNorm acts on true gradients, so the run equals the one without.
    for name, factor in [("gan_clip_sgd", None), ("gan_clip_sgd_static_scale", 8.0)]:
        generator, critic = networks(seed=4)
        gan = SeededGAN(generator, critic, latent_dim=2, loss="non_saturating")
        gan.compile(
            generator_optimizer=keras.optimizers.SGD(0.05, loss_scale_factor=factor),
            discriminator_optimizer=keras.optimizers.SGD(0.05),
            generator_gradient_transforms=[kt.ClipByNorm(0.05)],
        )
        _save(out, name, gan, fit_gan(gan, x))

    # Saving: one epoch, save, load, one more epoch (Adam's state included).
    gan = r1_gan()
    fit_gan(gan, x, epochs=1)
    gan.save(out / "gan_from_jax.keras")
    reloaded = keras.saving.load_model(out / "gan_from_jax.keras")
    _save(out, "gan_r1_resumed", reloaded, fit_gan(reloaded, x, epochs=1))
    tf_file = out / "gan_from_tf.keras"
    if tf_file.exists():
        continued = keras.saving.load_model(tf_file)
        _save(out, "gan_tf_file_continued", continued, fit_gan(continued, x, epochs=1))

    # The players' transform state is saved with the weights: SkipNonFinite's
    # count of consecutive skipped updates goes on after a reload.
    generator, critic = networks(seed=16)
    gan = kt.GAN(generator, critic, latent_dim=2)
    gan.compile(
        generator_optimizer="sgd",
        discriminator_optimizer="sgd",
        discriminator_gradient_transforms=[kt.SkipNonFinite()],  # no stop on JAX (refused)
    )
    nan = np.full((2 * GAN_BATCH, 2), np.nan, "float32")  # every real batch non-finite
    fit_gan(gan, nan, epochs=1)
    report["gan_skips_saved"] = players_state(gan)
    gan.save(out / "gan_skips.keras")
    loaded = keras.saving.load_model(out / "gan_skips.keras")
    report["gan_skips_loaded"] = players_state(loaded)
    fit_gan(loaded, nan[:GAN_BATCH], epochs=1)
    report["gan_skips_continued"] = players_state(loaded)

    # The default noise: keyed by the model's seed and step, so a run repeats.
    runs = []
    for _ in range(2):
        keras.utils.set_random_seed(3)
        generator, critic = networks()
        gan = kt.GAN(generator, critic, latent_dim=2)
        gan.compile(generator_optimizer="sgd", discriminator_optimizer="sgd")
        history = fit_gan(gan, x)
        runs.append(gan.get_weights())
    report["gan_default_noise_repeats"] = all(
        np.array_equal(a, b) for a, b in zip(*runs)
    )
    report["gan_default_noise_finite"] = all(np.all(np.isfinite(w)) for w in runs[0])
    report["gan_default_noise_losses"] = [float(v) for v in history["discriminator_loss"]]

    # A noise hook drawing without a seed fails under jit (Keras's JAX RNG
    # rule): fit raises and the weights stay in place.
    class Unseeded(kt.GAN):
        def sample_latent(self, batch_size):
            return keras.random.normal((batch_size, self.latent_dim))

    generator, critic = networks()
    unseeded = Unseeded(generator, critic, latent_dim=2)
    unseeded.compile(generator_optimizer="sgd", discriminator_optimizer="sgd")
    before = [w.copy() for w in unseeded.get_weights()]
    try:
        fit_gan(unseeded, x)
        report["gan_unseeded_error"] = None
    except Exception as error:  # Keras's ValueError about seeded random ops
        report["gan_unseeded_error"] = f"{type(error).__name__}: {error}"[:300]
    report["gan_unseeded_weights_kept"] = all(
        np.array_equal(a, b) for a, b in zip(before, unseeded.get_weights())
    )

    # Refusals, each before anything is compiled or trained.
    class TapeHook(SeededGAN):
        def discriminator_train_step(self, real, step, labels=None):
            raise AssertionError("never called on JAX")

    generator, critic = networks()
    try:
        TapeHook(generator, critic, latent_dim=2).compile(
            generator_optimizer="sgd", discriminator_optimizer="sgd"
        )
        report["gan_hook_refusal"] = None
    except ValueError as error:
        report["gan_hook_refusal"] = str(error)
    generator, critic = networks()
    try:
        SeededGAN(generator, critic, latent_dim=2).compile(
            generator_optimizer="sgd",
            discriminator_optimizer="sgd",
            discriminator_gradient_transforms=[kt.SkipNonFinite(max_consecutive=2)],
        )
        report["gan_transform_refusal"] = None
    except ValueError as error:
        report["gan_transform_refusal"] = str(error)
