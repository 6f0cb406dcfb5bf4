"""Tests of `kt.gradient_penalty` against the keras.io WGAN-GP nested-tape penalty."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt


def keras_io_gradient_penalty(critic, real, fake, alpha):
    """The penalty of the keras.io WGAN-GP example, with `alpha` passed in.

    From https://keras.io/examples/generative/wgan_gp/ (`gradient_penalty`),
    the norm's axes generalized from `[1, 2, 3]` to all non-batch axes.
    """
    diff = fake - real
    interpolated = real + alpha * diff
    with tf.GradientTape() as gp_tape:
        gp_tape.watch(interpolated)
        pred = critic(interpolated, training=True)
    grads = gp_tape.gradient(pred, [interpolated])[0]
    axes = list(range(1, len(grads.shape)))
    norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=axes))
    return tf.reduce_mean((norm - 1.0) ** 2)


def image_critic():
    return keras.Sequential(
        [
            keras.Input((4, 4, 2)),
            keras.layers.Conv2D(3, 2, activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(4, activation="softplus"),
            keras.layers.Dense(1),
        ]
    )


def dense_critic(shape):
    return keras.Sequential(
        [
            keras.Input(shape),
            keras.layers.Flatten(),
            keras.layers.Dense(5, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def value_and_weight_grads(fn, critic):
    with tf.GradientTape() as tape:
        value = fn()
    return value, tape.gradient(value, critic.trainable_variables)


def test_matches_keras_io_value_and_weight_gradients(rng):
    critic = image_critic()
    real = tf.constant(rng.normal(size=(6, 4, 4, 2)), "float32")
    fake = tf.constant(rng.normal(size=(6, 4, 4, 2)), "float32")
    alpha = tf.constant(rng.uniform(size=(6, 1, 1, 1)), "float32")

    ours, our_grads = value_and_weight_grads(
        lambda: kt.gradient_penalty(critic, real, fake, alpha=alpha), critic
    )
    ref, ref_grads = value_and_weight_grads(
        lambda: keras_io_gradient_penalty(critic, real, fake, alpha), critic
    )
    assert float(ref) > 1e-3  # a non-trivial penalty
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)
    # The last bias does not move the input gradient: None on both sides.
    assert [g is None for g in our_grads] == [r is None for r in ref_grads]
    assert sum(r is not None for r in ref_grads) >= 4
    for g, r in zip(our_grads, ref_grads):
        if r is not None:
            assert np.abs(r.numpy()).max() > 0
            np.testing.assert_allclose(g, r, rtol=0, atol=1e-5)


def test_weight_gradient_check_can_fail(rng):
    # A penalty that is not differentiated through the inner gradient
    # (first-order only) gives different weight gradients.
    critic = image_critic()
    real = tf.constant(rng.normal(size=(6, 4, 4, 2)), "float32")
    fake = tf.constant(rng.normal(size=(6, 4, 4, 2)), "float32")
    alpha = tf.constant(rng.uniform(size=(6, 1, 1, 1)), "float32")
    _, ours = value_and_weight_grads(
        lambda: kt.gradient_penalty(critic, real, fake, alpha=alpha), critic
    )
    _, stopped = value_and_weight_grads(
        lambda: tf.stop_gradient(keras_io_gradient_penalty(critic, real, fake, alpha))
        + 0.0 * tf.add_n([tf.reduce_sum(v) for v in critic.trainable_variables]),
        critic,
    )
    assert max(
        float(np.abs(a - b).max()) for a, b in zip(ours, stopped) if a is not None
    ) > 1e-4


@pytest.mark.parametrize("shape", [(3,), (5, 2)])
def test_any_rank_and_per_sample_alpha_vector(rng, shape):
    critic = dense_critic(shape)
    real = tf.constant(rng.normal(size=(8,) + shape), "float32")
    fake = tf.constant(rng.normal(size=(8,) + shape), "float32")
    alpha = rng.uniform(size=(8,)).astype("float32")
    ours = kt.gradient_penalty(critic, real, fake, alpha=tf.constant(alpha))
    broadcast = tf.constant(alpha.reshape((8,) + (1,) * len(shape)))
    ref = keras_io_gradient_penalty(critic, real, fake, broadcast)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)


def test_target_and_linear_critic_closed_form(rng):
    # Linear critic: the input gradient is the kernel for every sample.
    critic = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    kernel = np.array([[0.5], [-1.0], [2.0]], "float32")
    critic.set_weights([kernel, np.zeros(1, "float32")])
    real = tf.constant(rng.normal(size=(4, 3)), "float32")
    fake = tf.constant(rng.normal(size=(4, 3)), "float32")
    norm = np.linalg.norm(kernel)
    for target in (0.0, 1.0, 2.5):
        value = kt.gradient_penalty(critic, real, fake, target=target)
        np.testing.assert_allclose(value, (norm - target) ** 2, rtol=1e-6)


def test_random_alpha_is_uniform_per_sample():
    # critic(x) = sum(x^2)/2 has input gradient x, so with real = 0 the norm
    # is alpha * ||fake|| per sample and the target-0 penalty is
    # mean(alpha^2) * ||fake||^2, with E[alpha^2] = 1/3 for U[0, 1].
    def critic(x, training=True):
        return 0.5 * tf.reduce_sum(tf.square(x), axis=1)

    n = 4096
    real = tf.zeros((n, 2))
    fake = tf.ones((n, 2))  # ||fake||^2 = 2
    value = float(kt.gradient_penalty(critic, real, fake, target=0.0))
    assert abs(value / 2.0 - 1.0 / 3.0) < 0.03
    # alpha varies per sample (one shared alpha would give alpha^2 exactly).
    one = float(kt.gradient_penalty(critic, real[:1], fake[:1], target=0.0)) / 2.0
    assert 0.0 <= one <= 1.0


def test_zero_input_gradient_is_finite():
    critic = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    critic.set_weights([np.zeros((3, 1), "float32"), np.ones(1, "float32")])
    real = tf.ones((4, 3))
    fake = tf.zeros((4, 3))
    value, grads = value_and_weight_grads(
        lambda: kt.gradient_penalty(critic, real, fake, alpha=0.5), critic
    )
    assert float(value) == pytest.approx(1.0)  # (0 - 1)^2
    assert grads[0] is not None
    for g in grads:
        assert g is None or np.all(np.isfinite(g.numpy()))
    # The naive sqrt gives NaN weight gradients here: the check can fail.
    _, naive = value_and_weight_grads(
        lambda: keras_io_gradient_penalty(critic, real, fake, 0.5), critic
    )
    assert not np.all(np.isfinite(naive[0].numpy()))


def test_dict_inputs_use_the_joint_norm(rng):
    a_in = keras.Input((3,), name="a")
    b_in = keras.Input((2, 2), name="b")
    merged = keras.layers.Concatenate()([a_in, keras.layers.Flatten()(b_in)])
    hidden = keras.layers.Dense(4, activation="tanh")(merged)
    critic = keras.Model({"a": a_in, "b": b_in}, keras.layers.Dense(1)(hidden))
    real = {"a": rng.normal(size=(5, 3)), "b": rng.normal(size=(5, 2, 2))}
    fake = {"a": rng.normal(size=(5, 3)), "b": rng.normal(size=(5, 2, 2))}
    real = {k: tf.constant(v, "float32") for k, v in real.items()}
    fake = {k: tf.constant(v, "float32") for k, v in fake.items()}
    alpha = rng.uniform(size=(5,)).astype("float32")

    ours = kt.gradient_penalty(critic, real, fake, alpha=tf.constant(alpha))

    xa = real["a"] + alpha[:, None] * (fake["a"] - real["a"])
    xb = real["b"] + alpha[:, None, None] * (fake["b"] - real["b"])
    with tf.GradientTape() as tape:
        tape.watch([xa, xb])
        pred = critic({"a": xa, "b": xb})
    ga, gb = tape.gradient(pred, [xa, xb])
    squared = tf.reduce_sum(ga**2, 1) + tf.reduce_sum(gb**2, [1, 2])
    ref = tf.reduce_mean((tf.sqrt(squared) - 1.0) ** 2)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)

    pair = kt.gradient_penalty(
        lambda t, training: critic({"a": t[0], "b": t[1]}, training=training),
        (real["a"], real["b"]), (fake["a"], fake["b"]), alpha=tf.constant(alpha),
    )
    np.testing.assert_allclose(pair, ref, rtol=0, atol=1e-5)


def test_jit_compiled_function_matches_eager(rng):
    critic = dense_critic((3,))
    real = tf.constant(rng.normal(size=(8, 3)), "float32")
    fake = tf.constant(rng.normal(size=(8, 3)), "float32")
    alpha = tf.constant(rng.uniform(size=(8,)), "float32")

    def step():
        return value_and_weight_grads(
            lambda: kt.gradient_penalty(critic, real, fake, alpha=alpha), critic
        )

    eager_value, eager_grads = step()
    jit_value, jit_grads = tf.function(step, jit_compile=True)()
    np.testing.assert_allclose(jit_value, eager_value, atol=1e-5)
    for a, b in zip(jit_grads, eager_grads):
        if b is not None:
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_mixed_precision_critic_is_close_to_float32(rng):
    real = tf.constant(rng.normal(size=(8, 3)), "float32")
    fake = tf.constant(rng.normal(size=(8, 3)), "float32")
    alpha = tf.constant(rng.uniform(size=(8,)), "float32")
    critic32 = dense_critic((3,))
    keras.config.set_dtype_policy("mixed_float16")
    critic16 = dense_critic((3,))
    critic16.set_weights(critic32.get_weights())
    value16, grads16 = value_and_weight_grads(
        lambda: kt.gradient_penalty(critic16, real, fake, alpha=alpha), critic16
    )
    value32 = kt.gradient_penalty(critic32, real, fake, alpha=alpha)
    assert value16.dtype == tf.float32
    np.testing.assert_allclose(value16, value32, rtol=1e-2, atol=1e-3)
    assert all(g is None or np.all(np.isfinite(g.numpy())) for g in grads16)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"critic": 3}, TypeError, "Received: critic=3"),
        ({"fake": tf.zeros((4, 3))}, ValueError, r"Received: real.shape=\(4, 2\), fake.shape=\(4, 3\)"),
        ({"fake": (tf.zeros((4, 2)),)}, ValueError, "same structure"),
        ({"alpha": 1.5}, ValueError, r"Received: alpha=1.5"),
        ({"alpha": "half"}, TypeError, "Received: alpha='half'"),
        ({"target": -1.0}, ValueError, r"Received: target=-1.0"),
        ({"target": "one"}, TypeError, "Received: target='one'"),
        ({"training": "yes"}, TypeError, "Received: training='yes'"),
        ({"real": tf.zeros((4, 2), "int32"), "fake": tf.zeros((4, 2), "int32")},
         TypeError, "floating-point"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    arguments = {
        "critic": dense_critic((2,)),
        "real": tf.zeros((4, 2)),
        "fake": tf.ones((4, 2)),
    }
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        kt.gradient_penalty(**arguments)


def test_outputs_independent_of_inputs_raise():
    def critic(x, training=True):
        return tf.ones((4, 1))

    with pytest.raises(ValueError, match="do not depend"):
        kt.gradient_penalty(critic, tf.zeros((4, 2)), tf.ones((4, 2)))
