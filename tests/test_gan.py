"""Tests of `kt.WGANGP` against a keras.io-style hand-written WGAN-GP loop."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

LATENT, CRITIC_STEPS, GP_WEIGHT, BATCH = 3, 2, 10.0, 16


# ------------------------------------------------------------------ helpers
def latent_for(real, step, latent_dim):
    """Noise that is a fixed function of each real sample: replicas agree."""
    k = tf.range(latent_dim, dtype="float32")
    return tf.sin(real[:, :1] * (step + 1.3) + 0.7 * k) + tf.cos(real[:, 1:2] * (k + 1.0))


def alpha_for(real, step):
    return tf.sigmoid(tf.reduce_sum(real, axis=1) * (step + 1.0))


@keras.saving.register_keras_serializable(package="test_gan")
class DeterministicWGANGP(kt.WGANGP):
    """WGANGP whose noise and alpha depend on the real samples only."""

    def sample_latent(self, real, step):
        return latent_for(real, step, self.latent_dim)

    def sample_alpha(self, real, step):
        return alpha_for(real, step)


def make_generator():
    return keras.Sequential(
        [
            keras.Input((LATENT,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(2),
        ],
        name="generator",
    )


def make_critic():
    return keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ],
        name="critic",
    )


def adam():
    return keras.optimizers.Adam(1e-2, beta_1=0.5, beta_2=0.9)


def ring_data(n, seed=0):
    rng = np.random.default_rng(seed)
    angle = 2 * np.pi * rng.integers(0, 8, n) / 8
    points = 2.0 * np.stack([np.cos(angle), np.sin(angle)], axis=1)
    return (points + 0.05 * rng.normal(size=(n, 2))).astype("float32")


def keras_io_gradient_penalty(critic, real, fake, alpha):
    """keras.io WGAN-GP example's penalty (norm over axis 1 for 2-D data)."""
    interpolated = real + alpha * (fake - real)
    with tf.GradientTape() as gp_tape:
        gp_tape.watch(interpolated)
        pred = critic(interpolated, training=True)
    grads = gp_tape.gradient(pred, [interpolated])[0]
    norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1]))
    return tf.reduce_mean((norm - 1.0) ** 2)


def keras_io_train_step(gen, critic, g_opt, c_opt, real, gp_weight, critic_grad_fn=None):
    """The keras.io WGAN-GP `train_step`, with deterministic noise and alpha.

    Returns the batch's `(critic_loss, gradient_penalty, generator_loss)` as
    WGANGP logs them: the critic values averaged over the critic steps.
    """
    d_losses, gps = [], []
    for step in range(CRITIC_STEPS):
        z = latent_for(real, step, LATENT)
        with tf.GradientTape() as tape:
            fake = gen(z, training=True)
            fake_logits = critic(fake, training=True)
            real_logits = critic(real, training=True)
            d_cost = tf.reduce_mean(fake_logits) - tf.reduce_mean(real_logits)
            gp = keras_io_gradient_penalty(
                critic, real, fake, alpha_for(real, step)[:, None]
            )
            d_loss = d_cost + gp * gp_weight
        d_losses.append(float(d_loss))
        gps.append(float(gp))
        grads = tape.gradient(d_loss, critic.trainable_variables)
        if critic_grad_fn is not None:
            grads = critic_grad_fn(grads)
        c_opt.apply_gradients(zip(grads, critic.trainable_variables))
    z = latent_for(real, CRITIC_STEPS, LATENT)
    with tf.GradientTape() as tape:
        g_loss = -tf.reduce_mean(critic(gen(z, training=True), training=True))
    grads = tape.gradient(g_loss, gen.trainable_variables)
    g_opt.apply_gradients(zip(grads, gen.trainable_variables))
    return float(np.mean(d_losses)), float(np.mean(gps)), float(g_loss)


def sgd():
    return keras.optimizers.SGD(0.05)


LOG_NAMES = ("critic_loss", "gradient_penalty", "generator_loss")


def reference_run(x, epochs=1, gp_weight=GP_WEIGHT, critic_grad_fn=None, critic_opt=adam):
    """Runs the keras.io-style oracle.

    Returns `(initial weights, final weights, logs)`, `logs` mapping each of
    `LOG_NAMES` to its per-epoch sample-weighted mean over the batches (what
    History holds).
    """
    gen, critic = make_generator(), make_critic()
    initial = (gen.get_weights(), critic.get_weights())
    g_opt, c_opt = adam(), critic_opt()
    logs = {name: [] for name in LOG_NAMES}
    for _ in range(epochs):
        values, sizes = [], []
        for start in range(0, len(x), BATCH):
            real = tf.constant(x[start:start + BATCH])
            values.append(keras_io_train_step(
                gen, critic, g_opt, c_opt, real, gp_weight, critic_grad_fn,
            ))
            sizes.append(len(real))
        for name, column in zip(LOG_NAMES, np.transpose(values)):
            logs[name].append(float(np.average(column, weights=sizes)))
    return initial, (gen.get_weights(), critic.get_weights()), logs


def assert_logs_close(history, expected, atol=1e-5):
    assert sorted(history.history) == sorted(LOG_NAMES)
    for name in LOG_NAMES:
        np.testing.assert_allclose(
            history.history[name], expected[name], rtol=0, atol=atol, err_msg=name
        )


def max_log_difference(history, expected):
    return max(
        float(np.max(np.abs(np.subtract(history.history[name], expected[name]))))
        for name in LOG_NAMES
    )


def build_gan(initial, gp_weight=GP_WEIGHT, cls=DeterministicWGANGP):
    gen, critic = make_generator(), make_critic()
    gen.set_weights(initial[0])
    critic.set_weights(initial[1])
    return cls(gen, critic, latent_dim=LATENT, critic_steps=CRITIC_STEPS, gp_weight=gp_weight)


def assert_submodels_close(gan, weights, atol):
    for model, expected in zip((gan.generator, gan.critic), weights):
        for i, (u, v) in enumerate(zip(model.get_weights(), expected)):
            np.testing.assert_allclose(u, v, rtol=0, atol=atol, err_msg=f"{model.name} {i}")


def max_difference(gan, weights):
    return max(
        float(np.abs(u - v).max())
        for model, expected in zip((gan.generator, gan.critic), weights)
        for u, v in zip(model.get_weights(), expected)
    )


class HalveCriticGradients(kt.GradientTransform):
    def transform(self, grads, variables, state):
        return [g * 0.5 if on else g for g, on in zip(grads, state.selected)]


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    "options", [{}, {"jit_compile": True}, {"steps_per_execution": 2}]
)
def test_fit_equals_keras_io_loop(options):
    x = ring_data(32)
    initial, expected, expected_logs = reference_run(x)
    gan = build_gan(initial)
    gan.compile(generator_optimizer=adam(), critic_optimizer=adam(), **options)
    history = gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_submodels_close(gan, expected, atol=1e-5)
    assert_logs_close(history, expected_logs)
    assert int(gan.critic_optimizer.iterations) == 2 * CRITIC_STEPS
    assert int(gan.generator_optimizer.iterations) == 2


def test_comparison_fails_without_the_penalty():
    x = ring_data(32)
    initial, expected, expected_logs = reference_run(x)
    gan = build_gan(initial, gp_weight=0.0)
    gan.compile(generator_optimizer=adam(), critic_optimizer=adam())
    history = gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert max_difference(gan, expected) > 1e-3
    # The logged losses too differ far beyond the 1e-5 of assert_logs_close.
    assert max_log_difference(history, expected_logs) > 1e-3


def halve(grads):
    return [g * 0.5 for g in grads]


@pytest.mark.parametrize("with_transform", [False, True])
def test_mirrored_strategy_equals_single_device(mirrored, with_transform):
    x = ring_data(32)
    # SGD on the critic: a scaled gradient changes the step (Adam would not).
    initial, expected, expected_logs = reference_run(
        x, critic_grad_fn=halve if with_transform else None, critic_opt=sgd
    )
    with mirrored.scope():
        gan = build_gan(initial)
        gan.compile(
            generator_optimizer=adam(), critic_optimizer=sgd(),
            gradient_transforms=[HalveCriticGradients()] if with_transform else None,
        )
    history = gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_submodels_close(gan, expected, atol=1e-5)
    # The logged losses are those of the single-device run, not per-replica
    # values or values scaled by 1 / num_replicas (which would be off by
    # half of each value, far beyond the tolerance).
    assert_logs_close(history, expected_logs)
    assert min(abs(v) for name in LOG_NAMES for v in expected_logs[name]) > 1e-3


def test_logged_losses_match_the_reference():
    x = ring_data(16)
    gen, critic = make_generator(), make_critic()
    initial = (gen.get_weights(), critic.get_weights())
    g_opt, c_opt = adam(), adam()
    real = tf.constant(x)
    d_losses, gps = [], []
    for step in range(CRITIC_STEPS):
        # The logs average all critic steps of the epoch.
        z = latent_for(real, step, LATENT)
        fake = gen(z)
        d_cost = tf.reduce_mean(critic(fake)) - tf.reduce_mean(critic(real))
        gp = keras_io_gradient_penalty(critic, real, fake, alpha_for(real, step)[:, None])
        d_losses.append(float(d_cost + GP_WEIGHT * gp))
        gps.append(float(gp))
        with tf.GradientTape() as tape:
            fake = gen(z, training=True)
            d_cost = tf.reduce_mean(critic(fake)) - tf.reduce_mean(critic(real))
            gp = keras_io_gradient_penalty(critic, real, fake, alpha_for(real, step)[:, None])
            loss = d_cost + GP_WEIGHT * gp
        c_opt.apply_gradients(
            zip(tape.gradient(loss, critic.trainable_variables), critic.trainable_variables)
        )
    g_loss = -float(tf.reduce_mean(critic(gen(latent_for(real, CRITIC_STEPS, LATENT)))))

    gan = build_gan(initial)
    gan.compile(generator_optimizer=g_opt.__class__.from_config(g_opt.get_config()),
                critic_optimizer=adam())
    seen = []
    callback = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(logs))
    history = gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=[callback])
    assert sorted(history.history) == ["critic_loss", "generator_loss", "gradient_penalty"]
    assert len(seen) == 1
    np.testing.assert_allclose(history.history["critic_loss"][0], np.mean(d_losses), atol=1e-5)
    np.testing.assert_allclose(history.history["gradient_penalty"][0], np.mean(gps), atol=1e-5)
    np.testing.assert_allclose(history.history["generator_loss"][0], g_loss, atol=1e-5)


def test_ring_of_gaussians_generator_moves_onto_the_ring():
    x = ring_data(2048)
    gen = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(64, activation="relu"),
         keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)]
    )
    critic = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(64, activation="relu"),
         keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)]
    )
    gan = kt.WGANGP(gen, critic, latent_dim=2, critic_steps=5, gp_weight=1.0)
    gan.compile(
        generator_optimizer=keras.optimizers.Adam(2e-3, beta_1=0.5, beta_2=0.9),
        critic_optimizer=keras.optimizers.Adam(2e-3, beta_1=0.5, beta_2=0.9),
    )
    noise = np.random.default_rng(1).normal(size=(1024, 2)).astype("float32")

    def distance_to_ring():
        samples = gan.predict(noise, batch_size=1024, verbose=0)
        return float(np.mean(np.abs(np.linalg.norm(samples, axis=1) - 2.0)))

    before = distance_to_ring()
    history = gan.fit(x, batch_size=64, epochs=3, verbose=0)
    after = distance_to_ring()
    assert after <= 0.5 * before, (before, after)
    for values in history.history.values():
        assert np.all(np.isfinite(values))


def test_mixed_precision_wraps_optimizers_and_trains():
    x = ring_data(32)
    gen, critic = make_generator(), make_critic()
    initial = (gen.get_weights(), critic.get_weights())
    keras.config.set_dtype_policy("mixed_float16")
    gan = build_gan(initial)
    gan.compile(generator_optimizer=sgd(), critic_optimizer=sgd())
    assert isinstance(gan.generator_optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(gan.critic_optimizer, keras.optimizers.LossScaleOptimizer)
    # A fixed, moderate loss scale: the default 2**15 overflows float16 in the
    # first steps, which the LossScaleOptimizer then (correctly) skips.
    # SGD: Adam's normalized steps would magnify float16 rounding.
    gan.compile(
        generator_optimizer=keras.optimizers.LossScaleOptimizer(sgd(), initial_scale=64.0),
        critic_optimizer=keras.optimizers.LossScaleOptimizer(sgd(), initial_scale=64.0),
        gradient_transforms=[HalveCriticGradients()],
    )
    history = gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for values in history.history.values():
        assert np.all(np.isfinite(values))
    keras.config.set_dtype_policy("float32")
    reference = build_gan(initial)
    reference.compile(generator_optimizer=sgd(), critic_optimizer=sgd(),
                      gradient_transforms=[HalveCriticGradients()])
    reference.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    expected = (reference.generator.get_weights(), reference.critic.get_weights())
    assert_submodels_close(gan, expected, atol=5e-3)
    # float16 rounding is far smaller than the transform's effect.
    untransformed = build_gan(initial)
    untransformed.compile(generator_optimizer=sgd(), critic_optimizer=sgd())
    untransformed.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    other = (untransformed.generator.get_weights(), untransformed.critic.get_weights())
    assert max_difference(gan, expected) < 0.5 * max_difference(gan, other)
    assert max_difference(gan, [initial[0], initial[1]]) > 1e-3


def test_save_load_resumes_training(tmp_path):
    x = ring_data(32)
    gan = build_gan((make_generator().get_weights(), make_critic().get_weights()))
    gan.compile(generator_optimizer=adam(), critic_optimizer=adam(), steps_per_execution=2)
    gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "wgan.keras")
    gan.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is DeterministicWGANGP
    assert (loaded.latent_dim, loaded.critic_steps, loaded.gp_weight) == (LATENT, CRITIC_STEPS, GP_WEIGHT)
    assert loaded.steps_per_execution == 2
    for ours, theirs in ((gan.generator_optimizer, loaded.generator_optimizer),
                         (gan.critic_optimizer, loaded.critic_optimizer)):
        assert ours.get_config() == theirs.get_config()
        assert len(ours.variables) == len(theirs.variables)
        for u, v in zip(ours.variables, theirs.variables):
            np.testing.assert_array_equal(u.numpy(), v.numpy())
    assert int(loaded.critic_optimizer.iterations) == 2 * CRITIC_STEPS
    gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_submodels_close(
        loaded, (gan.generator.get_weights(), gan.critic.get_weights()), atol=1e-6
    )


def as_json(config):
    return json.loads(json.dumps(config))


def submodel_weights(gan):
    return (gan.generator.get_weights(), gan.critic.get_weights())


def test_callbacks_early_stopping_checkpoint_and_history(tmp_path):
    x = ring_data(32)
    initial, _, expected_logs = reference_run(x, epochs=2)
    gan = build_gan(initial)
    gan.compile(generator_optimizer=adam(), critic_optimizer=adam())
    at_epoch_end = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: at_epoch_end.append(submodel_weights(gan))
    )
    # No later epoch can improve by 1e6: it stops after the second epoch and
    # restores the weights of the first (the best). An unknown monitor would
    # only warn and run all 10 epochs.
    stop = keras.callbacks.EarlyStopping(
        monitor="generator_loss", mode="min", patience=1, min_delta=1e6,
        restore_best_weights=True,
    )
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "gan_{epoch}.keras"))
    history = gan.fit(x, batch_size=BATCH, epochs=10, shuffle=False, verbose=0,
                      callbacks=[stop, checkpoint, record])
    assert history is gan.history
    assert history.epoch == [0, 1]
    assert stop.stopped_epoch == 1 and stop.best_epoch == 0
    assert_logs_close(history, expected_logs)
    assert_submodels_close(gan, at_epoch_end[0], atol=0)
    assert sorted(os.listdir(tmp_path)) == ["gan_1.keras", "gan_2.keras"]
    for epoch, weights in enumerate(at_epoch_end):
        saved = keras.models.load_model(str(tmp_path / f"gan_{epoch + 1}.keras"))
        assert type(saved) is DeterministicWGANGP
        assert_submodels_close(saved, weights, atol=0)
        assert int(saved.critic_optimizer.iterations) == 2 * CRITIC_STEPS * (epoch + 1)
    # The two epochs' weights differ: the weight checks above can fail.
    assert max_difference(gan, at_epoch_end[1]) > 1e-3


def test_early_stopping_on_a_missing_metric_runs_every_epoch():
    # The companion of the test above: the stop there comes from reading
    # `generator_loss`, not from something that stops any run.
    x = ring_data(16)
    gan = build_gan((make_generator().get_weights(), make_critic().get_weights()))
    gan.compile(generator_optimizer=adam(), critic_optimizer=adam())
    stop = keras.callbacks.EarlyStopping(
        monitor="gen_loss", mode="min", patience=1, min_delta=1e6
    )
    with pytest.warns(UserWarning, match="gen_loss.*not available"):
        history = gan.fit(x, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                          callbacks=[stop])
    assert history.epoch == [0, 1, 2]


def fit_and_save_wgangp(tmp_path):
    """A plain kt.WGANGP (random noise and alpha) fitted 2 steps and saved."""
    x = ring_data(32)
    gan = kt.WGANGP(make_generator(), make_critic(), latent_dim=LATENT,
                    critic_steps=CRITIC_STEPS, gp_weight=GP_WEIGHT)
    gan.compile(generator_optimizer=adam(), critic_optimizer=keras.optimizers.RMSprop(1e-2),
                gradient_transforms=[kt.ClipByGlobalNorm(0.5, where="dense*")])
    gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "wgangp.keras")
    gan.save(path)
    return x, gan, keras.models.load_model(path)


def fit_seeded(gan, x, seed):
    """One epoch whose noise and alpha draws depend only on `seed`.

    Re-tracing the train function makes its random ops start their
    sequences afresh from the seed, as a newly loaded model's do.
    """
    keras.utils.set_random_seed(seed)
    gan.make_train_function(force=True)
    return gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def test_wgangp_save_load_restores_everything_and_resumes(tmp_path):
    x, gan, loaded = fit_and_save_wgangp(tmp_path)
    assert type(loaded) is kt.WGANGP
    assert (loaded.latent_dim, loaded.critic_steps, loaded.gp_weight) == (
        LATENT, CRITIC_STEPS, GP_WEIGHT)
    # Through JSON, as in the saved file (tuples become lists).
    assert as_json(loaded.get_config()) == as_json(gan.get_config())
    assert_submodels_close(loaded, submodel_weights(gan), atol=0)
    assert isinstance(loaded.generator_optimizer, keras.optimizers.Adam)
    assert isinstance(loaded.critic_optimizer, keras.optimizers.RMSprop)
    for ours, theirs in ((gan.generator_optimizer, loaded.generator_optimizer),
                         (gan.critic_optimizer, loaded.critic_optimizer)):
        assert ours.get_config() == theirs.get_config()
        assert len(theirs.variables) == len(ours.variables)
        for u, v in zip(ours.variables, theirs.variables):
            np.testing.assert_array_equal(u.numpy(), v.numpy())
    assert int(loaded.critic_optimizer.iterations) == 2 * CRITIC_STEPS
    assert int(loaded.generator_optimizer.iterations) == 2
    (transform,) = loaded.gradient_transforms
    assert isinstance(transform, kt.ClipByGlobalNorm)
    assert transform.get_config() == gan.gradient_transforms[0].get_config()
    assert as_json(loaded.get_compile_config()) == as_json(gan.get_compile_config())
    before = submodel_weights(loaded)
    a = fit_seeded(gan, x, seed=7)
    b = fit_seeded(loaded, x, seed=7)
    assert_submodels_close(loaded, submodel_weights(gan), atol=1e-6)
    assert_logs_close(b, a.history, atol=1e-6)
    assert max_difference(loaded, before) > 1e-3  # it did train


def test_wgangp_resume_check_can_fail(tmp_path):
    # Other random draws after loading give other weights: the 1e-6 check
    # above compares runs whose noise and alpha really are the same.
    x, gan, loaded = fit_and_save_wgangp(tmp_path)
    fit_seeded(gan, x, seed=7)
    fit_seeded(loaded, x, seed=8)
    assert max_difference(loaded, submodel_weights(gan)) > 1e-3


def test_registered_name():
    assert keras.saving.get_registered_name(kt.WGANGP) == "keras_tapeops>WGANGP"
    assert keras.saving.get_registered_object("keras_tapeops>WGANGP") is kt.WGANGP
    assert (keras.saving.get_registered_name(DeterministicWGANGP)
            == "test_gan>DeterministicWGANGP")


def test_registered_name_check_can_fail():
    class Unregistered(kt.WGANGP):
        pass

    assert keras.saving.get_registered_name(Unregistered) == "Unregistered"


def test_config_round_trip():
    gan = kt.WGANGP(make_generator(), make_critic(), latent_dim=LATENT,
                    critic_steps=3, gp_weight=5.0, name="gan")
    config = gan.get_config()
    assert (config["latent_dim"], config["critic_steps"], config["gp_weight"]) == (LATENT, 3, 5.0)
    clone = kt.WGANGP.from_config(config)
    assert clone.get_config() == config
    assert [l.name for l in clone.generator.layers] == [l.name for l in gan.generator.layers]
    gan.compile(generator_optimizer=adam(), critic_optimizer="rmsprop",
                gradient_transforms=[HalveCriticGradients()], jit_compile=False)
    compile_config = gan.get_compile_config()
    clone.compile_from_config(compile_config)
    assert clone.get_compile_config() == compile_config
    assert isinstance(clone.critic_optimizer, keras.optimizers.RMSprop)
    assert isinstance(clone.gradient_transforms[0], HalveCriticGradients)
    assert clone.critic_optimizer.built


keras.saving.register_keras_serializable(package="test_gan")(HalveCriticGradients)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"latent_dim": 0}, ValueError, "Received: latent_dim=0"),
        ({"latent_dim": 2.5}, TypeError, "Received: latent_dim=2.5"),
        ({"critic_steps": 0}, ValueError, "Received: critic_steps=0"),
        ({"gp_weight": -1.0}, ValueError, r"Received: gp_weight=-1.0"),
        ({"gp_weight": "ten"}, TypeError, "Received: gp_weight='ten'"),
        ({"generator": "g"}, TypeError, "Received: generator='g'"),
        ({"critic": None}, TypeError, "Received: critic=None"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    arguments = {"generator": make_generator(), "critic": make_critic(), "latent_dim": LATENT}
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        kt.WGANGP(**arguments)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"generator_optimizer": None}, ValueError, "Received: generator_optimizer=None"),
        ({"critic_optimizer": 3}, ValueError, "Received: critic_optimizer=3"),
        ({"optimizer": "adam"}, TypeError, "critic_optimizer= instead. Received: optimizer='adam'"),
        ({"loss": "mse"}, TypeError, "Received: loss='mse'"),
        ({"gradient_transforms": ["clip"]}, TypeError, r"Received: gradient_transforms\[0\]='clip'"),
    ],
)
def test_bad_compile_arguments(kwargs, error, match):
    gan = kt.WGANGP(make_generator(), make_critic(), latent_dim=LATENT)
    before = [w.copy() for w in gan.critic.get_weights()]
    arguments = {"generator_optimizer": adam(), "critic_optimizer": adam()}
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        gan.compile(**arguments)
    assert not gan.compiled
    for u, v in zip(gan.critic.get_weights(), before):
        np.testing.assert_array_equal(u, v)


def test_same_optimizer_twice_is_an_error():
    gan = kt.WGANGP(make_generator(), make_critic(), latent_dim=LATENT)
    shared = adam()
    with pytest.raises(ValueError, match="two different optimizer"):
        gan.compile(generator_optimizer=shared, critic_optimizer=shared)


def test_selector_that_matches_nothing_fails_at_compile():
    gan = kt.WGANGP(make_generator(), make_critic(), latent_dim=LATENT)
    with pytest.raises(ValueError, match="no_such_layer"):
        gan.compile(generator_optimizer=adam(), critic_optimizer=adam(),
                    gradient_transforms=[HalveCriticGradients(where="no_such_layer*")])


def test_evaluate_and_predict():
    x = ring_data(32)
    gan = kt.WGANGP(make_generator(), make_critic(), latent_dim=LATENT)
    gan.compile(generator_optimizer=adam(), critic_optimizer=adam())
    logs = gan.evaluate(x, batch_size=BATCH, verbose=0, return_dict=True)
    assert sorted(logs) == ["critic_loss", "generator_loss", "gradient_penalty"]
    assert all(np.isfinite(v) for v in logs.values())
    noise = np.zeros((5, LATENT), "float32")
    np.testing.assert_allclose(
        gan.predict(noise, verbose=0), gan.generator(noise).numpy(), atol=1e-6
    )
