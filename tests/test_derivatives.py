"""`kt.input_derivatives` against closed forms, forward mode against reverse mode."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops import derivatives

MODES = ["forward", "reverse"]


def two_outputs(x):
    """y0 = sin(a) b^2 + c^3, y1 = exp(a b) c."""
    a, b, c = x[:, 0], x[:, 1], x[:, 2]
    return tf.stack([tf.sin(a) * b**2 + c**3, tf.exp(a * b) * c], axis=1)


def closed_forms(x):
    a, b, c = x[:, 0], x[:, 1], x[:, 2]
    e = np.exp(a * b)
    y = np.stack([np.sin(a) * b**2 + c**3, e * c], 1)
    first = np.stack([
        np.stack([np.cos(a) * b**2, 2 * b * np.sin(a), 3 * c**2], -1),
        np.stack([b * e * c, a * e * c, e], -1),
    ], 1)
    second = np.stack([
        np.stack([-np.sin(a) * b**2, 2 * np.sin(a), 6 * c], -1),
        np.stack([b * b * e * c, a * a * e * c, np.zeros_like(c)], -1),
    ], 1)
    # Mixed pairs (0, 1), (1, 2), (2, 0).
    mixed = np.stack([
        np.stack([2 * b * np.cos(a), np.zeros_like(a), np.zeros_like(a)], -1),
        np.stack([(1 + a * b) * e * c, a * e, b * e], -1),
    ], 1)
    return y, first, second, mixed


def points(n=6, dim=3, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, (n, dim)).astype("float32")


@pytest.mark.parametrize("mode", MODES)
def test_closed_forms_first_second_and_mixed(mode):
    x = points()
    y, first, second, mixed = closed_forms(x.astype("float64"))
    got = kt.input_derivatives(two_outputs, x, order=2, mode=mode,
                               mixed=[(0, 1), (1, 2), (2, 0)])
    for name, value, expected in zip(("y", "first", "second", "mixed"), got,
                                     (y, first, second, mixed)):
        assert value.dtype == tf.float32
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5, err_msg=name)
    y1, first1 = kt.input_derivatives(two_outputs, x, order=1, mode=mode)
    np.testing.assert_allclose(first1, first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y1, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_diagonal_subset_computes_only_what_is_asked(mode):
    x = points()
    _, first, second, mixed = closed_forms(x.astype("float64"))
    y, d1, d2 = kt.input_derivatives(two_outputs, x, order=2, mode=mode, diagonal=[2, 0])
    np.testing.assert_allclose(d1, first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tf.gather(d2, [0, 2], axis=2), second[:, :, [0, 2]],
                               rtol=1e-5, atol=1e-5)
    assert np.isnan(d2[:, :, 1]).all()   # not asked for: NaN, never a silent value
    *_, d2_none, d2_mixed = kt.input_derivatives(two_outputs, x, order=2, mode=mode,
                                                 diagonal=[], mixed=[(1, 2)])
    assert np.isnan(d2_none).all()
    np.testing.assert_allclose(d2_mixed[:, :, 0], mixed[:, :, 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_one_input_rank_one_output(mode):
    x = points(5, 1)
    y, d1, d2 = kt.input_derivatives(lambda t: t[:, 0] ** 3, x, order=2, mode=mode)
    assert y.shape == (5, 1) and d1.shape == (5, 1, 1) and d2.shape == (5, 1, 1)
    np.testing.assert_allclose(d1[:, 0, 0], 3 * x[:, 0] ** 2, rtol=1e-6)
    np.testing.assert_allclose(d2[:, 0, 0], 6 * x[:, 0], rtol=1e-5, atol=1e-6)


def test_a_coordinate_the_output_ignores_has_zero_derivatives():
    x = points(4, 2)
    for mode in MODES:
        _, d1, d2 = kt.input_derivatives(lambda t: t[:, :1] ** 2, x, order=2, mode=mode)
        np.testing.assert_array_equal(d1[:, 0, 1], 0.0)
        np.testing.assert_array_equal(d2[:, 0, 1], 0.0)


def net(n_in, n_out):
    return keras.Sequential([
        keras.Input((n_in,)),
        keras.layers.Dense(7, activation="tanh"),
        keras.layers.Dense(5, activation="softplus"),
        keras.layers.Dense(n_out),
    ])


@pytest.mark.parametrize("n_in, n_out", [(1, 1), (2, 1), (3, 2)])
def test_forward_and_reverse_agree_on_values_and_weight_gradients(n_in, n_out):
    # Inside a tf.function, as in a training step: the derivatives are
    # differentiated again w.r.t. the weights.
    model = net(n_in, n_out)
    x = tf.constant(points(8, n_in))
    pairs = [(0, n_in - 1)]

    def step(mode):
        @tf.function
        def run(x):
            with tf.GradientTape() as tape:
                out = kt.input_derivatives(model, x, order=2, mode=mode, mixed=pairs)
                loss = sum(tf.reduce_sum(t ** 2) for t in out[1:])
            grads = tape.gradient(loss, model.trainable_variables)
            return list(out), [g if g is not None else tf.zeros(v.shape)
                               for g, v in zip(grads, model.trainable_variables)]
        return run(x)

    (fwd, fwd_grads), (rev, rev_grads) = step("forward"), step("reverse")
    for a, b in zip(fwd + fwd_grads, rev + rev_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert max(float(tf.reduce_max(tf.abs(g))) for g in rev_grads) > 1e-3


def test_comparison_can_fail():
    # The agreement above is not vacuous: a different function's derivatives
    # differ at that tolerance.
    model, other = net(2, 1), net(2, 1)
    x = points(8, 2)
    _, _, a = kt.input_derivatives(model, x, order=2, mode="forward")
    _, _, b = kt.input_derivatives(other, x, order=2, mode="reverse")
    assert float(tf.reduce_max(tf.abs(a - b))) > 1e-3


def test_jit_compile_equals_eager():
    # Forward mode here; reverse mode runs under XLA in the fit tests
    # (tests/test_physics_fit.py, jit_compile=True).
    model = net(2, 3)
    x = tf.constant(points(6, 2))
    compiled = tf.function(
        lambda x: kt.input_derivatives(model, x, order=2, mode="forward"), jit_compile=True
    )
    for a, b in zip(compiled(x), kt.input_derivatives(model, x, order=2, mode="forward")):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mixed_float16_model_gives_float32_derivatives():
    x = points(6, 2)
    reference = net(2, 1)
    weights = reference.get_weights()
    expected = kt.input_derivatives(reference, x, order=2)
    keras.config.set_dtype_policy("mixed_float16")
    half = net(2, 1)
    half.set_weights(weights)
    got = kt.input_derivatives(half, x, order=2)
    assert half(x).dtype == "float16"
    for a, b in zip(got, expected):
        assert a.dtype == tf.float32
        # float16 activations: about 3 significant digits.
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)


def test_auto_mode_choice():
    assert derivatives.resolve_mode("auto", order=2, n_in=1, n_out=4) == "reverse"
    assert derivatives.resolve_mode("auto", order=1, n_in=3, n_out=1) == "reverse"
    assert derivatives.resolve_mode("auto", order=1, n_in=1, n_out=4) == "forward"
    assert derivatives.resolve_mode("auto", order=1, n_in=2, n_out=4) == "reverse"
    assert derivatives.resolve_mode("forward", order=2, n_in=3) == "forward"
    x = tf.constant(points(2, 1))
    assert derivatives._known_outputs(net(1, 4), x) == 4
    assert derivatives._known_outputs(lambda t: t, x) == 1


@pytest.mark.parametrize("kwargs, error, message", [
    ({"order": 3}, ValueError, "Received: order=3"),
    ({"order": 2.0}, TypeError, "Received: order=2.0"),
    ({"order": True}, TypeError, "Received: order=True"),
    ({"mode": "sideways"}, ValueError, "Received: mode='sideways'"),
    ({"mixed": [(0, 1)]}, ValueError, "Received: order=1, mixed=[(0, 1)]"),
    ({"order": 2, "mixed": [(0, 3)]}, ValueError, "below n_in=3. Received: mixed=[(0, 3)]"),
    ({"order": 2, "mixed": []}, ValueError, "Received: mixed=[]"),
    ({"order": 2, "mixed": [0, 1]}, ValueError, "Received: mixed=[0, 1]"),
    ({"order": 2, "diagonal": [3]}, ValueError, "in [0, 3). Received: diagonal=[3]"),
    ({"order": 2, "diagonal": 0}, ValueError, "Received: diagonal=0"),
    ({"diagonal": [0]}, ValueError, "Received: order=1, diagonal=[0]"),
    ({"order": 2, "diagonal": []}, ValueError, "Received: diagonal=[], mixed=None"),
])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error) as info:
        kt.input_derivatives(two_outputs, points(), **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("x, error, message", [
    (np.arange(6).reshape(3, 2), TypeError, "Received: x of dtype int64"),
    (tf.constant([[1, 2]]), TypeError, "Received: x of dtype int32"),
    (np.zeros((2, 3, 1), "float32"), ValueError, "Received: x of shape (2, 3, 1)"),
    (np.zeros((3,), "float32"), ValueError, "Received: x of shape (3,)"),
])
def test_bad_points(x, error, message):
    with pytest.raises(error) as info:
        kt.input_derivatives(two_outputs, x)
    assert message in str(info.value)


def test_bad_functions():
    with pytest.raises(TypeError, match="Received: fn=3"):
        kt.input_derivatives(3, points())
    with pytest.raises(TypeError, match="Received: list"):
        kt.input_derivatives(lambda t: [t, t], points())
    with pytest.raises(TypeError, match="Received: dtype int32"):
        kt.input_derivatives(lambda t: tf.cast(t, "int32"), points())
    with pytest.raises(ValueError, match=r"Received: a tensor of shape \(6, 3, 1\)"):
        kt.input_derivatives(lambda t: t[:, :, None], points())
