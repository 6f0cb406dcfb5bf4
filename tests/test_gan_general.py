"""Tests of `kt.GAN` against keras.io's DCGAN and conditional GAN and hand-written loops."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

from gan_oracle import LABEL_SEED
from gan_oracle import LATENT_SEED
from gan_oracle import KerasIOConditionalGAN
from gan_oracle import KerasIOConventions
from gan_oracle import KerasIODCGAN
from gan_oracle import SeededGAN
from gan_oracle import hand_written_loop
from gan_oracle import seeded_normal
from gan_oracle import seeded_uniform
from jax_gan_models import players_state

SIZE, LATENT, CLASSES, BATCH = 8, 4, 3, 8


# ------------------------------------------------------------------ networks
def dcgan_discriminator(channels=1):
    """keras.io's DCGAN discriminator, tiny."""
    return keras.Sequential(
        [
            keras.Input((SIZE, SIZE, channels)),
            keras.layers.Conv2D(4, (3, 3), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.GlobalMaxPooling2D(),
            keras.layers.Dense(1),
        ],
        name="discriminator",
    )


def dcgan_generator(inputs=LATENT):
    """keras.io's DCGAN generator, tiny (2x2 -> 4x4 -> 8x8)."""
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(2 * 2 * 4),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Reshape((2, 2, 4)),
            keras.layers.Conv2DTranspose(4, (4, 4), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2DTranspose(4, (4, 4), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2D(1, (3, 3), padding="same", activation="sigmoid"),
        ],
        name="generator",
    )


def mlp(inputs, outputs, name, activation=None):
    return keras.Sequential(
        [keras.Input((inputs,)), keras.layers.Dense(8, activation="tanh"),
         keras.layers.Dense(outputs, activation=activation)],
        name=name,
    )


def copy_of(model):
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    return clone


def images(n=32, seed=0):
    return np.random.default_rng(seed).uniform(size=(n, SIZE, SIZE, 1)).astype("float32")


def one_hot(n=32, seed=1):
    return keras.utils.to_categorical(
        np.random.default_rng(seed).integers(0, CLASSES, n), CLASSES
    ).astype("float32")


def points(n=32, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 2)).astype("float32")


def batches(x, size=BATCH):
    return [x[i:i + size] for i in range(0, len(x), size)]


def adam():
    return keras.optimizers.Adam(3e-4)   # keras.io's learning rate


def max_difference(models, expected):
    return max(
        float(np.abs(u - v).max())
        for model, other in zip(models, expected)
        for u, v in zip(model.get_weights(), other.get_weights())
    )


def assert_weights_close(models, expected, atol=1e-6):
    for model, other in zip(models, expected):
        for i, (u, v) in enumerate(zip(model.get_weights(), other.get_weights())):
            np.testing.assert_allclose(u, v, rtol=0, atol=atol, err_msg=f"{model.name} {i}")


# ------------------------------------------------- keras.io DCGAN oracle
def dcgan_pair(label_noise=0.05, oracle_noise=0.05, cls=KerasIOConventions, **kwargs):
    """Fits `cls` for 4 steps and runs the keras.io oracle from the same start."""
    gen, disc = dcgan_generator(), dcgan_discriminator()
    oracle_gen, oracle_disc = copy_of(gen), copy_of(disc)
    if cls is KerasIOConventions:
        kwargs["label_noise"] = label_noise
    gan = cls(gen, disc, latent_dim=LATENT, **kwargs)
    gan.compile(generator_optimizer=adam(), discriminator_optimizer=adam())
    x = images()
    history = gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    uniform = seeded_uniform(LABEL_SEED)
    oracle = KerasIODCGAN(
        oracle_disc, oracle_gen, LATENT, adam(), adam(),
        keras.losses.BinaryCrossentropy(from_logits=True),
        normal=seeded_normal(LATENT_SEED),
        uniform=lambda shape: uniform(shape) * (oracle_noise / 0.05),
    )
    for real in batches(x):
        oracle.train_step(tf.constant(real))
    return gan, history, (oracle_gen, oracle_disc)


def test_dcgan_equals_keras_io_train_step():
    gan, history, oracle = dcgan_pair()
    assert_weights_close((gan.generator, gan.discriminator), oracle, atol=1e-6)
    assert sorted(history.history) == ["discriminator_loss", "generator_loss"]
    assert int(gan.discriminator_optimizer.iterations) == 4
    assert int(gan.generator_optimizer.iterations) == 4
    # It trained: the comparison is between moved weights.
    assert max_difference((gan.generator, gan.discriminator),
                          (dcgan_generator(), dcgan_discriminator())) > 1e-3


def test_dcgan_oracle_check_can_fail():
    # The library's own conventions (real = 1, no label noise) are another
    # training run: the 1e-6 check above would catch a wrong convention.
    # (The matching run above differs by about 1e-8; these by about 2e-3.)
    gan, _, oracle = dcgan_pair(cls=SeededGAN)
    assert max_difference((gan.generator, gan.discriminator), oracle) > 1e-3
    # So would forgetting the label noise (the oracle keeps 0.05).
    gan, _, oracle = dcgan_pair(label_noise=0.0)
    assert max_difference((gan.generator, gan.discriminator), oracle) > 1e-3


# -------------------------------------------- keras.io conditional GAN oracle
@keras.saving.register_keras_serializable(package="test_gan_general")
class KerasIOLabelMaps(keras.layers.Layer):
    """keras.io's label maps for the discriminator, verbatim: `tf.repeat` then reshape.

    (That reshape does not tile each one-hot vector over the pixels: it
    spreads the repeated entries over the channels. The port keeps it.)
    """

    def call(self, one_hot_labels):
        maps = tf.repeat(one_hot_labels[:, :, None, None], repeats=[SIZE * SIZE])
        return tf.reshape(maps, (-1, SIZE, SIZE, CLASSES))


def conditional_networks():
    """keras.io's conditional networks on concatenated inputs, and `[input, labels]` views."""
    gen_core = dcgan_generator(LATENT + CLASSES)
    disc_core = dcgan_discriminator(1 + CLASSES)
    z, labels = keras.Input((LATENT,)), keras.Input((CLASSES,))
    gen = keras.Model([z, labels], gen_core(keras.layers.Concatenate()([z, labels])))
    x, labels = keras.Input((SIZE, SIZE, 1)), keras.Input((CLASSES,))
    disc = keras.Model(
        [x, labels], disc_core(keras.layers.Concatenate()([x, KerasIOLabelMaps()(labels)]))
    )
    return gen, disc, gen_core, disc_core


def test_conditional_gan_equals_keras_io_train_step():
    gen, disc, gen_core, disc_core = conditional_networks()
    oracle_gen, oracle_disc = copy_of(gen_core), copy_of(disc_core)
    gan = KerasIOConventions(gen, disc, latent_dim=LATENT, conditional=True, label_noise=0.0)
    gan.compile(generator_optimizer=adam(), discriminator_optimizer=adam())
    x, y = images(), one_hot()
    history = gan.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    oracle = KerasIOConditionalGAN(
        oracle_disc, oracle_gen, LATENT, adam(), adam(),
        keras.losses.BinaryCrossentropy(from_logits=True),
        normal=seeded_normal(LATENT_SEED), image_size=SIZE, num_classes=CLASSES,
    )
    for real, labels in zip(batches(x), batches(y)):
        logs = oracle.train_step((tf.constant(real), tf.constant(labels)))
    assert_weights_close((gen_core, disc_core), (oracle_gen, oracle_disc), atol=1e-6)
    # keras.io logs running means: the epoch's mean, as History holds.
    np.testing.assert_allclose(history.history["generator_loss"], [float(logs["g_loss"])],
                               atol=1e-6)
    np.testing.assert_allclose(history.history["discriminator_loss"], [float(logs["d_loss"])],
                               atol=1e-6)


def test_conditional_oracle_check_can_fail():
    # The same run with shuffled labels gives other weights.
    gen, disc, gen_core, disc_core = conditional_networks()
    oracle_gen, oracle_disc = copy_of(gen_core), copy_of(disc_core)
    gan = KerasIOConventions(gen, disc, latent_dim=LATENT, conditional=True, label_noise=0.0)
    gan.compile(generator_optimizer=adam(), discriminator_optimizer=adam())
    x, y = images(), one_hot()
    gan.fit(x, y[::-1], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    oracle = KerasIOConditionalGAN(
        oracle_disc, oracle_gen, LATENT, adam(), adam(),
        keras.losses.BinaryCrossentropy(from_logits=True),
        normal=seeded_normal(LATENT_SEED), image_size=SIZE, num_classes=CLASSES,
    )
    for real, labels in zip(batches(x), batches(y)):
        oracle.train_step((tf.constant(real), tf.constant(labels)))
    assert max_difference((gen_core, disc_core), (oracle_gen, oracle_disc)) > 1e-3


# --------------------------------------- the other losses vs a hand-written loop
def sgd():
    return keras.optimizers.SGD(0.05)


def mean(t):
    return tf.reduce_mean(t)


HAND_LOSSES = {
    "hinge": (lambda r, f: mean(tf.nn.relu(1.0 - r)) + mean(tf.nn.relu(1.0 + f)),
              lambda f: -mean(f)),
    "least_squares": (lambda r, f: 0.5 * mean((r - 1.0) ** 2) + 0.5 * mean(f ** 2),
                      lambda f: 0.5 * mean((f - 1.0) ** 2)),
    "non_saturating": (lambda r, f: mean(tf.math.log1p(tf.exp(-r)))
                       + mean(tf.math.log1p(tf.exp(f))),
                       lambda f: mean(tf.math.log1p(tf.exp(-f)))),
    "wasserstein": (lambda r, f: mean(f) - mean(r), lambda f: -mean(f)),
}


def hand_pair(loss, penalty=None, r1_gamma=None, steps=2, g_transforms=None,
              d_transforms=None, d_grad_fn=None, g_grad_fn=None, optimizer=sgd,
              x=None, d_skip_nonfinite=False, d_norms=None, **compile_options):
    gen, disc = mlp(LATENT, 2, "generator"), mlp(2, 1, "discriminator")
    ref_gen, ref_disc = copy_of(gen), copy_of(disc)
    gan = SeededGAN(gen, disc, latent_dim=LATENT, loss=loss, discriminator_steps=steps,
                    gradient_penalty=penalty)
    gan.compile(generator_optimizer=optimizer(), discriminator_optimizer=optimizer(),
                generator_gradient_transforms=g_transforms,
                discriminator_gradient_transforms=d_transforms, **compile_options)
    x = points() if x is None else x
    history = gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    d_loss, g_loss = HAND_LOSSES[loss]
    hand_written_loop(ref_gen, ref_disc, batches(x), LATENT, d_loss, g_loss,
                      optimizer(), optimizer(), seeded_normal(LATENT_SEED),
                      discriminator_steps=steps, r1_gamma=r1_gamma,
                      d_grad_fn=d_grad_fn, g_grad_fn=g_grad_fn,
                      jit_compile=compile_options.get("jit_compile", False),
                      d_skip_nonfinite=d_skip_nonfinite, d_norms=d_norms)
    return gan, history, (ref_gen, ref_disc)


@pytest.mark.parametrize("loss", ["hinge", "least_squares", "non_saturating", "wasserstein"])
def test_loss_equals_hand_written_loop(loss):
    gan, history, reference = hand_pair(loss)
    assert_weights_close((gan.generator, gan.discriminator), reference, atol=1e-6)
    assert int(gan.discriminator_optimizer.iterations) == 2 * 4
    assert all(np.isfinite(v).all() for v in history.history.values())


@pytest.mark.parametrize("options", [{"steps_per_execution": 2}, {"jit_compile": True}])
def test_step_options_keep_the_result(options):
    gan, _, reference = hand_pair("hinge", penalty=kt.R1Penalty(2.0), r1_gamma=2.0,
                                  **options)
    assert_weights_close((gan.generator, gan.discriminator), reference, atol=1e-6)


def test_hand_written_loop_check_can_fail():
    # Hinge trained, least squares as reference: far apart.
    gan, _, _ = hand_pair("hinge")
    _, _, reference = hand_pair("least_squares")
    assert max_difference((gan.generator, gan.discriminator), reference) > 1e-3


def test_r1_penalty_equals_hand_written_loop():
    gan, history, reference = hand_pair(
        "non_saturating", penalty=kt.R1Penalty(gamma=4.0), r1_gamma=4.0
    )
    assert_weights_close((gan.generator, gan.discriminator), reference, atol=1e-6)
    assert sorted(history.history) == ["discriminator_loss", "generator_loss",
                                       "gradient_penalty"]
    assert history.history["gradient_penalty"][0] > 1e-4
    # Without the penalty in the model: a different run.
    plain, _, _ = hand_pair("non_saturating")
    assert max_difference((plain.generator, plain.discriminator), reference) > 1e-4


def scale_by(factor):
    return lambda grads: [g * factor for g in grads]


@keras.saving.register_keras_serializable(package="test_gan_general")
class Scale(kt.GradientTransform):
    def __init__(self, factor, where=None):
        super().__init__(where=where)
        self.factor = factor

    def transform(self, grads, variables, state):
        return [g * self.factor if on else g for g, on in zip(grads, state.selected)]

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


def test_each_player_has_its_own_gradient_transforms():
    gan, _, reference = hand_pair(
        "hinge", g_transforms=[Scale(0.5)], d_transforms=[Scale(0.25)],
        g_grad_fn=scale_by(0.5), d_grad_fn=scale_by(0.25),
    )
    assert_weights_close((gan.generator, gan.discriminator), reference, atol=1e-6)
    # Swapped between the players: another run.
    swapped, _, _ = hand_pair("hinge", g_transforms=[Scale(0.25)], d_transforms=[Scale(0.5)])
    assert max_difference((swapped.generator, swapped.discriminator), reference) > 1e-4


def test_players_stateful_transforms_gate_log_and_hook():
    # A NaN example in the second batch: the discriminator's SkipNonFinite
    # skips both of its updates there (the generator's loss never reads the
    # real batch, so the generator still steps), as the hand-written loop
    # that skips non-finite updates; LogGradientNorm logs the mean of the
    # finite norms; LogUpdateRatio's after_apply hook logs the generator's.
    x = points()
    x[11] = np.nan
    norms = tf.Variable(tf.zeros(2))
    gan, history, reference = hand_pair(
        "hinge", x=x, d_skip_nonfinite=True, d_norms=norms,
        d_transforms=[kt.SkipNonFinite(name="d_skipped"), kt.LogGradientNorm(name="d_norm")],
        g_transforms=[kt.LogUpdateRatio(name="g_ratio")],
    )
    assert_weights_close((gan.generator, gan.discriminator), reference, atol=1e-6)
    logs = history.history
    assert logs["d_skipped"] == [2.0]
    assert int(gan.discriminator_optimizer.iterations) == 2 * 3
    total, count = norms.numpy()
    assert count == 6.0
    np.testing.assert_allclose(logs["d_norm"][0], total / count, rtol=1e-5)
    assert 0.0 < logs["g_ratio"][0] < 1.0
    # Training-only logs are not in evaluate().
    evaluated = gan.evaluate(points(), batch_size=BATCH, verbose=0, return_dict=True)
    assert sorted(evaluated) == ["discriminator_loss", "generator_loss"]
    # Without the gate the same data ruins the discriminator (the check can fail).
    plain, _, _ = hand_pair("hinge", x=x)
    assert not all(np.isfinite(w).all() for w in plain.discriminator.get_weights())


def test_players_logging_under_one_name_is_refused():
    gan = kt.GAN(mlp(LATENT, 2, "generator"), mlp(2, 1, "discriminator"), latent_dim=LATENT)
    with pytest.raises(ValueError, match=r"`discriminator_gradient_transforms` logs "
                       r"'skipped_steps', which `generator_gradient_transforms` already"):
        gan.compile(generator_optimizer="sgd", discriminator_optimizer="sgd",
                    generator_gradient_transforms=[kt.SkipNonFinite()],
                    discriminator_gradient_transforms=[kt.SkipNonFinite()])
    with pytest.raises(ValueError, match=r"logs 'generator_loss', which the GAN's losses"):
        gan.compile(generator_optimizer="sgd", discriminator_optimizer="sgd",
                    generator_gradient_transforms=[kt.LogGradientNorm(name="generator_loss")])


def test_gan_with_wasserstein_and_the_wgan_penalty_is_wgangp():
    x = points()
    gen, critic = mlp(LATENT, 2, "generator"), mlp(2, 1, "critic")
    start = (gen.get_weights(), critic.get_weights())
    results = []
    for make in (
        lambda g, c: kt.WGANGP(g, c, latent_dim=LATENT, critic_steps=2, gp_weight=5.0),
        lambda g, c: kt.GAN(g, c, latent_dim=LATENT, loss="wasserstein", discriminator_steps=2,
                            gradient_penalty=kt.WGANGradientPenalty(5.0)),
    ):
        g, c = mlp(LATENT, 2, "generator"), mlp(2, 1, "critic")
        g.set_weights(start[0])
        c.set_weights(start[1])
        gan = make(g, c)
        gan.compile(sgd(), sgd())
        keras.utils.set_random_seed(3)
        history = gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        results.append((g, c, history.history))
    assert_weights_close(results[0][:2], results[1][:2], atol=1e-6)
    np.testing.assert_allclose(results[0][2]["critic_loss"],
                               results[1][2]["discriminator_loss"], atol=1e-6)
    np.testing.assert_allclose(results[0][2]["gradient_penalty"],
                               results[1][2]["gradient_penalty"], atol=1e-6)


class DataNoiseGAN(kt.GAN):
    """Noise that is a fixed function of each real sample, so replicas agree.

    (Overrides the private per-update draw, which sees the batch: the public
    `sample_latent(batch_size)` cannot tell one replica's half from another's.)
    """

    def _latent(self, real, step):
        k = tf.range(self.latent_dim, dtype="float32")
        return tf.sin(real[:, :1] * (step + 1.3) + 0.7 * k) + tf.cos(real[:, 1:2] * (k + 1.0))


@pytest.mark.parametrize("conditional", [False, True])
def test_mirrored_strategy_equals_single_device(mirrored, conditional):
    x = points(32)
    labels = one_hot(32) if conditional else None

    def networks():
        if not conditional:
            return mlp(LATENT, 2, "generator"), mlp(2, 1, "discriminator")
        z, y = keras.Input((LATENT,)), keras.Input((CLASSES,))
        gen = keras.Model([z, y], mlp(LATENT + CLASSES, 2, "g")(keras.layers.Concatenate()([z, y])))
        s, y = keras.Input((2,)), keras.Input((CLASSES,))
        disc = keras.Model([s, y], mlp(2 + CLASSES, 1, "d")(keras.layers.Concatenate()([s, y])))
        return gen, disc

    start = [m.get_weights() for m in networks()]
    runs = []
    for strategy in (tf.distribute.get_strategy(), mirrored):
        with strategy.scope():
            gen, disc = networks()
            gen.set_weights(start[0])
            disc.set_weights(start[1])
            gan = DataNoiseGAN(gen, disc, latent_dim=LATENT, loss="hinge", discriminator_steps=2,
                               gradient_penalty=kt.R1Penalty(2.0), conditional=conditional)
            # With the players' stateful transforms: a gate, a log, an after_apply hook.
            gan.compile(generator_optimizer=adam(), discriminator_optimizer=sgd(),
                        discriminator_gradient_transforms=[
                            kt.LogGradientNorm(name="d_norm"), Scale(0.5),
                            kt.SkipNonFinite(name="d_skipped")],
                        generator_gradient_transforms=[kt.LogUpdateRatio(name="g_ratio")])
        history = gan.fit(x, labels, batch_size=16, epochs=1, shuffle=False, verbose=0)
        runs.append((gan, history.history))
    (single, single_logs), (replicated, replicated_logs) = runs
    assert replicated.distribute_strategy.num_replicas_in_sync == 2
    assert_weights_close((replicated.generator, replicated.discriminator),
                         (single.generator, single.discriminator), atol=1e-5)
    for name, values in single_logs.items():
        np.testing.assert_allclose(replicated_logs[name], values, atol=1e-5, err_msg=name)
    assert single_logs.pop("d_skipped") == [0.0]
    assert single_logs.pop("g_ratio")[0] > 1e-4
    assert "d_norm" in single_logs
    assert min(abs(v) for values in single_logs.values() for v in values) > 1e-3


# -------------------------------------------------------------- saving
def fit_once(gan, x):
    return gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


@pytest.mark.parametrize("conditional", [False, True])
def test_save_load_continue_equals_uninterrupted(tmp_path, conditional):
    if conditional:
        gen, disc = conditional_networks()[:2]
        data = (images(16), one_hot(16))
    else:
        gen, disc = mlp(LATENT, 2, "generator"), mlp(2, 1, "discriminator")
        data = (points(16), None)
    gan = SeededGAN(gen, disc, latent_dim=LATENT, loss="hinge", discriminator_steps=2,
                    gradient_penalty=kt.R1Penalty(1.0), conditional=conditional)
    gan.compile(generator_optimizer=adam(), discriminator_optimizer=keras.optimizers.RMSprop(1e-2),
                generator_gradient_transforms=[kt.ClipByGlobalNorm(1.0)],
                discriminator_gradient_transforms=[Scale(0.5, where="dense*")]
                if not conditional else None)
    gan.fit(*data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "gan.keras")
    gan.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is SeededGAN
    assert json.loads(json.dumps(loaded.get_config())) == json.loads(json.dumps(gan.get_config()))
    assert (json.loads(json.dumps(loaded.get_compile_config()))
            == json.loads(json.dumps(gan.get_compile_config())))
    assert int(loaded.discriminator_optimizer.iterations) == 2 * 2
    a = gan.fit(*data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    b = loaded.fit(*data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights_close((loaded.generator, loaded.discriminator),
                         (gan.generator, gan.discriminator), atol=1e-6)
    for name, values in a.history.items():
        np.testing.assert_allclose(b.history[name], values, atol=1e-6, err_msg=name)
    logs = loaded.evaluate(*data, batch_size=BATCH, verbose=0, return_dict=True)
    assert sorted(logs) == ["discriminator_loss", "generator_loss", "gradient_penalty"]
    assert all(np.isfinite(v) for v in logs.values())


def test_resume_check_can_fail(tmp_path):
    # Restarting the noise sequence after loading gives other weights: the
    # 1e-6 check above compares runs that really draw the same noise.
    gen, disc = mlp(LATENT, 2, "generator"), mlp(2, 1, "discriminator")
    x = points(16)
    gan = SeededGAN(gen, disc, latent_dim=LATENT, loss="hinge")
    gan.compile(generator_optimizer=adam(), discriminator_optimizer=adam())
    fit_once(gan, x)
    gan.save(str(tmp_path / "gan.keras"))
    loaded = keras.models.load_model(str(tmp_path / "gan.keras"))
    loaded.latent_draws.assign(0)
    fit_once(gan, x)
    fit_once(loaded, x)
    assert max_difference((loaded.generator, loaded.discriminator),
                          (gan.generator, gan.discriminator)) > 1e-5


WGANGP_WEIGHTS_LAYOUT = [
    ("critic/layers/dense/vars/0", (2, 8)), ("critic/layers/dense/vars/1", (8,)),
    ("critic/layers/dense_1/vars/0", (8, 1)), ("critic/layers/dense_1/vars/1", (1,)),
    ("critic_optimizer/vars/0", ()), ("critic_optimizer/vars/1", ()),
    ("critic_optimizer/vars/2", (2, 8)), ("critic_optimizer/vars/3", (8,)),
    ("critic_optimizer/vars/4", (8, 1)), ("critic_optimizer/vars/5", (1,)),
    ("generator/layers/dense/vars/0", (3, 8)), ("generator/layers/dense/vars/1", (8,)),
    ("generator/layers/dense_1/vars/0", (8, 2)), ("generator/layers/dense_1/vars/1", (2,)),
    ("generator_optimizer/vars/0", ()), ("generator_optimizer/vars/1", ()),
] + [
    (f"generator_optimizer/vars/{i}", shape)
    for i, shape in enumerate([(3, 8), (3, 8), (8,), (8,), (8, 2), (8, 2), (2,), (2,)], start=2)
]


def test_wgangp_saved_file_layout_is_unchanged(tmp_path):
    # The weights file of a WGANGP saved before it became a GAN (adam for the
    # generator, RMSprop for the critic) had exactly these entries: files saved
    # then load into today's class.
    import io
    import zipfile

    import h5py

    g = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    c = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    gan = kt.WGANGP(g, c, latent_dim=3, critic_steps=2)
    gan.compile(generator_optimizer="adam", critic_optimizer="rmsprop",
                gradient_transforms=[kt.ClipByGlobalNorm(0.5)])
    gan.build_optimizers()
    path = str(tmp_path / "wgangp.keras")
    gan.save(path)
    with zipfile.ZipFile(path) as archive:
        store = h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r")
        found = []
        store.visititems(lambda name, obj: found.append((name, obj.shape))
                         if isinstance(obj, h5py.Dataset) else None)
        config = json.loads(archive.read("config.json"))
    assert found == WGANGP_WEIGHTS_LAYOUT
    assert config["registered_name"] == "keras_tapeops>WGANGP"
    assert sorted(config["config"]) == sorted(
        ["name", "trainable", "generator", "critic", "latent_dim", "critic_steps", "gp_weight"])
    assert sorted(config["compile_config"]) == sorted(
        ["generator_optimizer", "critic_optimizer", "gradient_transforms"])


# ------------------------------------------------------ config round trips
def test_penalties_round_trip_and_are_registered():
    for penalty in (kt.R1Penalty(gamma=3.0), kt.WGANGradientPenalty(weight=2.0, target=0.5)):
        name = keras.saving.get_registered_name(type(penalty))
        assert name == f"keras_tapeops>{type(penalty).__name__}"
        again = type(penalty).from_config(penalty.get_config())
        assert again.get_config() == penalty.get_config()
        via_keras = keras.saving.deserialize_keras_object(
            keras.saving.serialize_keras_object(penalty))
        assert type(via_keras) is type(penalty)
        assert repr(via_keras) == repr(penalty)
    assert kt.R1Penalty(3.0).weight == 1.5
    assert kt.WGANGradientPenalty(2.0).weight == 2.0


def test_penalty_values():
    # R1 of D(x) = sum(w * x): ||w||^2 per sample; WGAN-GP: (||w|| - 1)^2.
    w = tf.constant([[3.0], [4.0]])
    disc = lambda x, training=True: tf.matmul(x, w)
    real, fake = tf.ones((5, 2)), tf.zeros((5, 2))
    assert float(kt.R1Penalty(1.0)(disc, real)) == pytest.approx(25.0)
    assert float(kt.WGANGradientPenalty()(disc, real, fake, alpha=tf.fill([5], 0.3))) == (
        pytest.approx(16.0))


def test_gan_config_round_trip():
    gan = kt.GAN(mlp(LATENT, 2, "generator"), mlp(2, 1, "discriminator"), latent_dim=LATENT,
                 loss="least_squares", discriminator_steps=3,
                 gradient_penalty=kt.R1Penalty(2.0), name="gan")
    config = gan.get_config()
    assert (config["loss"], config["discriminator_steps"], config["conditional"]) == (
        "least_squares", 3, False)
    clone = kt.GAN.from_config(config)
    assert clone.get_config() == config
    assert type(clone.gradient_penalty) is kt.R1Penalty
    assert keras.saving.get_registered_name(kt.GAN) == "keras_tapeops>GAN"
    gan.compile(generator_optimizer=adam(), discriminator_optimizer="rmsprop",
                discriminator_gradient_transforms=[Scale(0.5)], jit_compile=False)
    compile_config = gan.get_compile_config()
    clone.compile_from_config(compile_config)
    assert clone.get_compile_config() == compile_config
    assert isinstance(clone.discriminator_gradient_transforms[0], Scale)
    assert clone.generator_gradient_transforms == ()
    via_keras = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(gan))
    assert via_keras.get_config() == gan.get_config()


# ----------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"loss": "bce"}, ValueError,
         (r"`loss` must be one of \['non_saturating', 'hinge', 'least_squares', "
          r"'wasserstein'\]. Received: loss='bce'")),
        ({"discriminator_steps": 0}, ValueError, "Received: discriminator_steps=0"),
        ({"latent_dim": 0}, ValueError, "Received: latent_dim=0"),
        ({"latent_dim": -2}, ValueError, "Received: latent_dim=-2"),
        ({"gradient_penalty": 10.0}, TypeError, "Received: gradient_penalty=10.0"),
        ({"conditional": "yes"}, TypeError, "Received: conditional='yes'"),
        ({"discriminator": "d"}, TypeError, "Received: discriminator='d'"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    arguments = {"generator": mlp(LATENT, 2, "g"), "discriminator": mlp(2, 1, "d"),
                 "latent_dim": LATENT}
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        kt.GAN(**arguments)


def test_bad_penalty_arguments():
    with pytest.raises(ValueError, match="Received: gamma=-1"):
        kt.R1Penalty(gamma=-1.0)
    with pytest.raises(ValueError, match="Received: weight=-2"):
        kt.WGANGradientPenalty(weight=-2.0)


def test_conditional_needs_built_networks_and_labels():
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="Received: generator.built=False"):
        kt.GAN(unbuilt, mlp(2, 1, "d"), latent_dim=LATENT, conditional=True)
    gen, disc = conditional_networks()[:2]
    gan = kt.GAN(gen, disc, latent_dim=LATENT, conditional=True)
    gan.compile(generator_optimizer=adam(), discriminator_optimizer=adam())
    with pytest.raises(ValueError, match="Received: a batch without labels"):
        gan.fit(images(8), batch_size=BATCH, verbose=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"discriminator_optimizer": None}, ValueError,
         r"GAN.compile\(\) needs `discriminator_optimizer`.*Received: discriminator_optimizer=None"),
        ({"optimizer": "adam"}, TypeError,
         "discriminator_optimizer= instead. Received: optimizer='adam'"),
        ({"generator_gradient_transforms": ["clip"]}, TypeError,
         r"Received: generator_gradient_transforms\[0\]='clip'"),
    ],
)
def test_bad_compile_arguments(kwargs, error, match):
    gan = kt.GAN(mlp(LATENT, 2, "g"), mlp(2, 1, "d"), latent_dim=LATENT)
    arguments = {"generator_optimizer": adam(), "discriminator_optimizer": adam()}
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        gan.compile(**arguments)
    assert not gan.compiled


def test_default_gan_trains_evaluates_and_predicts():
    gan = kt.GAN(mlp(LATENT, 2, "g"), mlp(2, 1, "d"), latent_dim=LATENT)
    gan.compile(generator_optimizer=adam(), discriminator_optimizer=adam())
    history = gan.fit(points(), batch_size=BATCH, epochs=1, verbose=0)
    assert sorted(history.history) == ["discriminator_loss", "generator_loss"]
    logs = gan.evaluate(points(), batch_size=BATCH, verbose=0, return_dict=True)
    assert sorted(logs) == ["discriminator_loss", "generator_loss"]
    noise = np.zeros((3, LATENT), "float32")
    np.testing.assert_allclose(gan.predict(noise, verbose=0), gan.generator(noise), atol=1e-6)


def _generator_skips():
    return kt.SkipNonFinite(max_consecutive=10, name="generator_skipped_steps")


def _gan_skipping_nan_updates(discriminator_transforms):
    gan = kt.GAN(mlp(LATENT, 2, "generator"), mlp(2, 1, "discriminator"), latent_dim=LATENT)
    gan.compile(generator_optimizer=adam(), discriminator_optimizer=adam(),
                generator_gradient_transforms=[_generator_skips()],
                discriminator_gradient_transforms=discriminator_transforms)
    return gan


def test_players_transform_state_is_saved_and_restored(tmp_path):
    # Real points that are all NaN: every discriminator update is skipped
    # (the generator's loss sees only fakes, so its updates are not).
    gan = _gan_skipping_nan_updates([kt.ClipByNorm(1.0), kt.SkipNonFinite(max_consecutive=10, name="generator_skips")])
    nan = np.full((2 * BATCH, 2), np.nan, "float32")
    gan.fit(nan, batch_size=BATCH, epochs=1, verbose=0)
    saved = {"generator.0.SkipNonFinite.consecutive_skips": 0.0,
             "discriminator.1.SkipNonFinite.consecutive_skips": 2.0}
    assert players_state(gan) == saved
    gan.save(str(tmp_path / "gan.keras"))
    assert "_tapeops_training_state" not in [w.path.split("/")[0] for w in gan.weights]

    loaded = keras.models.load_model(str(tmp_path / "gan.keras"))
    assert players_state(loaded) == saved
    loaded.fit(nan[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    assert players_state(loaded)["discriminator.1.SkipNonFinite.consecutive_skips"] == 3.0

    # Loaded before compile(): restored when compile() binds the transforms.
    uncompiled = keras.models.load_model(str(tmp_path / "gan.keras"), compile=False)
    uncompiled.compile(generator_optimizer=adam(), discriminator_optimizer=adam(),
                       generator_gradient_transforms=[_generator_skips()],
                       discriminator_gradient_transforms=[
                           kt.ClipByNorm(1.0), kt.SkipNonFinite(max_consecutive=10)])
    assert players_state(uncompiled) == saved

    # Other transforms: what matches by key is restored, the rest is named.
    other = _gan_skipping_nan_updates([kt.SkipNonFinite(max_consecutive=10)])
    with pytest.warns(UserWarning, match=r"discriminator\.1\.SkipNonFinite\.consecutive_skips"):
        other.load_weights(str(tmp_path / "gan.keras"))
    assert players_state(other) == {"generator.0.SkipNonFinite.consecutive_skips": 0.0,
                                     "discriminator.0.SkipNonFinite.consecutive_skips": 0.0}
