"""Tests of `kt.gradient_penalty` against the keras.io WGAN-GP nested-tape penalty."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt


def keras_io_gradient_penalty(critic, real, fake, alpha, target=1.0, axes=None):
    """The penalty of the keras.io WGAN-GP example, with `alpha` passed in.

    From https://keras.io/examples/generative/wgan_gp/ (`gradient_penalty`),
    the norm's axes generalized from `[1, 2, 3]` to all non-batch axes.
    `target` and `axes` exist only for the tests showing the check can fail.
    """
    diff = fake - real
    interpolated = real + alpha * diff
    with tf.GradientTape() as gp_tape:
        gp_tape.watch(interpolated)
        pred = critic(interpolated, training=True)
    grads = gp_tape.gradient(pred, [interpolated])[0]
    if axes is None:
        axes = list(range(1, len(grads.shape)))
    norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=axes))
    return tf.reduce_mean((norm - target) ** 2)


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


def test_value_check_can_fail(rng):
    # The 1e-5 value check above tells apart a wrong target and a norm over
    # the wrong axes (per channel instead of over all non-batch axes).
    critic = image_critic()
    real = tf.constant(rng.normal(size=(6, 4, 4, 2)), "float32")
    fake = tf.constant(rng.normal(size=(6, 4, 4, 2)), "float32")
    alpha = tf.constant(rng.uniform(size=(6, 1, 1, 1)), "float32")
    ours = float(kt.gradient_penalty(critic, real, fake, alpha=alpha))
    wrong_target = float(
        keras_io_gradient_penalty(critic, real, fake, alpha, target=0.0)
    )
    wrong_axes = float(
        keras_io_gradient_penalty(critic, real, fake, alpha, axes=[1, 2])
    )
    np.testing.assert_allclose(
        ours, float(keras_io_gradient_penalty(critic, real, fake, alpha)), atol=1e-5
    )
    assert abs(ours - wrong_target) > 1e-3
    assert abs(ours - wrong_axes) > 1e-3


def tanh_critic_penalty(critic, x_hat, hold_activation_derivative=False):
    """Closed-form penalty of `dense_critic`: score = tanh(x W1 + b1) W2 + b2.

    Its input gradient is `((1 - tanh(h)^2) * W2^T) W1^T`, written with the
    critic's variables so the outer tape differentiates it directly. With
    `hold_activation_derivative`, `1 - tanh(h)^2` is treated as a constant:
    a first-order-only shortcut that still moves W1 and W2 (non-zero
    gradients) but drops the second-derivative term of double backprop.
    """
    w1, b1, w2, _ = critic.trainable_variables
    derivative = 1.0 - tf.square(tf.tanh(x_hat @ w1 + b1))
    if hold_activation_derivative:
        derivative = tf.stop_gradient(derivative)
    grad_x = (derivative * tf.transpose(w2)) @ tf.transpose(w1)
    norm = tf.sqrt(tf.reduce_sum(tf.square(grad_x), axis=1))
    return tf.reduce_mean(tf.square(norm - 1.0))


def test_weight_gradients_equal_closed_form_double_backprop(rng):
    critic = dense_critic((3,))
    real = tf.constant(rng.normal(size=(8, 3)), "float32")
    fake = tf.constant(rng.normal(size=(8, 3)), "float32")
    alpha = rng.uniform(size=(8,)).astype("float32")
    x_hat = real + alpha[:, None] * (fake - real)
    ours_value, ours = value_and_weight_grads(
        lambda: kt.gradient_penalty(critic, real, fake, alpha=tf.constant(alpha)),
        critic,
    )
    ref_value, ref = value_and_weight_grads(
        lambda: tanh_critic_penalty(critic, x_hat), critic
    )
    np.testing.assert_allclose(ours_value, ref_value, rtol=0, atol=1e-6)
    for g, r in zip(ours[:3], ref[:3]):  # W1, b1, W2 (b2 does not move it)
        assert np.abs(r.numpy()).max() > 1e-3
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5)
    assert ours[3] is None and ref[3] is None


def test_weight_gradient_check_can_fail(rng):
    # The first-order-only shortcut gives non-zero weight gradients that
    # differ from double backprop far beyond the 1e-5 tolerance above.
    critic = dense_critic((3,))
    real = tf.constant(rng.normal(size=(8, 3)), "float32")
    fake = tf.constant(rng.normal(size=(8, 3)), "float32")
    alpha = rng.uniform(size=(8,)).astype("float32")
    x_hat = real + alpha[:, None] * (fake - real)
    _, ours = value_and_weight_grads(
        lambda: kt.gradient_penalty(critic, real, fake, alpha=tf.constant(alpha)),
        critic,
    )
    _, held = value_and_weight_grads(
        lambda: tanh_critic_penalty(critic, x_hat, hold_activation_derivative=True),
        critic,
    )
    assert np.abs(held[0].numpy()).max() > 1e-3  # non-zero, not a trivial check
    assert np.abs(held[2].numpy()).max() > 1e-3
    assert held[1] is None  # b1 only acts through the activation derivative
    assert max(
        float(np.abs(ours[0] - held[0]).max()), float(np.abs(ours[2] - held[2]).max())
    ) > 1e-3


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


def recorded_alphas(alpha, n=4096, seed=0):
    """Runs the penalty with `real = 0` and returns `(alphas, value, fake)`.

    The critic `sum(x^2)/2` records the `x_hat = alpha * fake` it is called
    on, so `x_hat / fake` recovers the alpha of every element; its input
    gradient is `x_hat`, so the target-1 penalty is
    `mean((||x_hat||_2 - 1)^2)`, computable in NumPy from the recording.
    """
    seen = []

    def critic(x, training=True):
        seen.append(x.numpy())
        return 0.5 * tf.reduce_sum(tf.square(x), axis=1)

    rng = np.random.default_rng(seed)
    # |fake| in [0.5, 1.5] with random signs: no division by ~0.
    fake = rng.uniform(0.5, 1.5, size=(n, 3)) * rng.choice([-1.0, 1.0], size=(n, 3))
    fake = fake.astype("float32")
    value = float(kt.gradient_penalty(critic, tf.zeros((n, 3)), tf.constant(fake),
                                      alpha=alpha, target=1.0))
    (x_hat,) = seen
    return x_hat / fake, value, x_hat


def alpha_problems(alphas):
    """What is wrong with recorded per-element alphas for U[0, 1] per sample."""
    problems = []
    per_sample = alphas[:, 0]
    if np.abs(alphas - per_sample[:, None]).max() > 1e-6:
        problems.append("not shared by the features of a sample")
    if per_sample.min() < 0.0 or per_sample.max() > 1.0:
        problems.append("outside [0, 1]")
    if len(np.unique(per_sample)) < 0.99 * len(per_sample):
        problems.append("not one independent draw per sample")
    # Kolmogorov-Smirnov distance to U[0, 1]; 1.95 / sqrt(n) is the 0.1% level.
    ordered = np.sort(per_sample)
    n = len(ordered)
    ks = max(
        np.max(np.arange(1, n + 1) / n - ordered), np.max(ordered - np.arange(n) / n)
    )
    if ks > 1.95 / np.sqrt(n):
        problems.append(f"not uniform (KS distance {ks:.3f})")
    return problems


def test_random_alpha_is_uniform_and_drawn_per_sample():
    alphas, value, x_hat = recorded_alphas(None)
    assert alpha_problems(alphas) == []
    # The value is the penalty of exactly these interpolations (NumPy oracle).
    expected = np.mean((np.linalg.norm(x_hat.astype("float64"), axis=1) - 1.0) ** 2)
    np.testing.assert_allclose(value, expected, rtol=1e-5)


@pytest.mark.parametrize(
    "bad_alpha, problem",
    [
        (0.5, "not one independent draw per sample"),
        (lambda n: tf.random.uniform((n, 3)), "not shared by the features"),
        (lambda n: tf.random.uniform((n,), 0.0, 0.5), "not uniform"),
    ],
)
def test_alpha_check_can_fail(bad_alpha, problem):
    n = 4096
    alpha = bad_alpha(n) if callable(bad_alpha) else bad_alpha
    alphas, _, _ = recorded_alphas(alpha, n=n)
    assert any(p.startswith(problem) for p in alpha_problems(alphas))


def recorded_dict_interpolation(n=256):
    """`x_hat` of a dict-input penalty with real = 0 and fake = 1 (= alpha)."""
    seen = []

    def critic(inputs, training=True):
        seen.append({k: v.numpy() for k, v in inputs.items()})
        return tf.reduce_sum(inputs["a"] ** 2, axis=1) + tf.reduce_sum(
            inputs["b"] ** 2, axis=[1, 2]
        )

    real = {"a": tf.zeros((n, 2)), "b": tf.zeros((n, 2, 2))}
    fake = {"a": tf.ones((n, 2)), "b": tf.ones((n, 2, 2))}
    kt.gradient_penalty(critic, real, fake)
    (x_hat,) = seen
    return x_hat


def alpha_shared_by_tensors(x_hat):
    alpha = x_hat["a"][:, 0]
    n = len(alpha)
    return bool(
        np.allclose(x_hat["a"], np.broadcast_to(alpha[:, None], (n, 2)), atol=1e-7)
        and np.allclose(
            x_hat["b"], np.broadcast_to(alpha[:, None, None], (n, 2, 2)), atol=1e-7
        )
        and len(np.unique(alpha)) > 0.95 * n
    )


def test_random_alpha_is_shared_by_the_tensors_of_a_sample():
    assert alpha_shared_by_tensors(recorded_dict_interpolation())


def test_shared_alpha_check_can_fail():
    # One independent alpha per tensor (instead of per sample) is caught.
    x_hat = recorded_dict_interpolation()
    n = len(x_hat["a"])
    own = np.random.default_rng(3).uniform(size=(n, 1, 1)).astype("float32")
    x_hat["b"] = np.broadcast_to(own, (n, 2, 2))
    assert not alpha_shared_by_tensors(x_hat)


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
