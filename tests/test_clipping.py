"""Unit and property tests of ClipByValue, ClipByNorm and ClipByGlobalNorm."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.selectors import LayerPath
from keras_tapeops.transforms.base import TransformState
from keras_tapeops.transforms.base import apply_in_order
from keras_tapeops.transforms.base import GradientTransform

SEEDS = range(8)
CLASSES = [kt.ClipByValue, kt.ClipByNorm, kt.ClipByGlobalNorm]
THRESHOLD = {
    kt.ClipByValue: "clip_value",
    kt.ClipByNorm: "clip_norm",
    kt.ClipByGlobalNorm: "clip_norm",
}


def random_grads(seed, scale=None):
    """A few gradients of mixed shapes and magnitudes (some big, some small)."""
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (4,), (2, 2, 3), ()]
    scale = scale if scale is not None else 10.0 ** rng.uniform(-2, 1, len(shapes))
    return [
        tf.constant(rng.normal(size=s) * k, "float32")
        for s, k in zip(shapes, np.broadcast_to(scale, len(shapes)))
    ]


def norm(g):
    return float(np.linalg.norm(np.asarray(tf.convert_to_tensor(g)).ravel()))


def global_norm(grads):
    return float(np.sqrt(sum(norm(g) ** 2 for g in grads)))


def fake_vars(grads):
    return [
        tf.Variable(0.0 if g is None else tf.zeros_like(tf.convert_to_tensor(g)))
        for g in grads
    ]


def apply(transform, grads):
    return transform(grads, fake_vars(grads))


def assert_all_close(actual, expected, tol=1e-6):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(
            np.asarray(tf.convert_to_tensor(a)),
            np.asarray(tf.convert_to_tensor(e)), rtol=tol, atol=tol,
        )


# ------------------------------------------------------------ against TF/NumPy
def test_matches_tf_and_numpy():
    for seed in SEEDS:
        grads = random_grads(seed)
        assert_all_close(
            apply(kt.ClipByNorm(0.7), grads),
            [tf.clip_by_norm(g, 0.7) for g in grads],
        )
        assert_all_close(
            apply(kt.ClipByGlobalNorm(0.7), grads),
            tf.clip_by_global_norm(grads, 0.7)[0],
        )
        assert_all_close(
            apply(kt.ClipByValue(0.3), grads),
            [np.clip(g.numpy(), -0.3, 0.3) for g in grads],
        )


def test_comparison_can_fail():
    grads = random_grads(0, scale=5.0)
    per_tensor = apply(kt.ClipByNorm(1.0), grads)
    together = apply(kt.ClipByGlobalNorm(1.0), grads)
    with pytest.raises(AssertionError):
        assert_all_close(per_tensor, together)


# ----------------------------------------------------------------- properties
def test_norm_after_clipping_is_within_bound():
    bound = 0.5
    for seed in SEEDS:
        grads = random_grads(seed)
        for g in apply(kt.ClipByNorm(bound), grads):
            assert norm(g) <= bound * (1 + 1e-6)
        clipped = apply(kt.ClipByGlobalNorm(bound), grads)
        assert global_norm(clipped) <= bound * (1 + 1e-6)
        for g in apply(kt.ClipByValue(bound), grads):
            assert np.max(np.abs(g.numpy())) <= bound


@pytest.mark.parametrize("cls", CLASSES)
def test_clipping_twice_changes_nothing(cls):
    transform = cls(0.5)
    for seed in SEEDS:
        once = apply(transform, random_grads(seed))
        assert_all_close(apply(transform, once), once)


@pytest.mark.parametrize("cls", CLASSES)
def test_under_the_bound_is_identity(cls):
    grads = random_grads(1, scale=1e-3)
    assert_all_close(apply(cls(10.0), grads), grads, tol=0)


def test_chain_equals_parts_applied_by_hand():
    model = kt.upgrade(keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)]))
    model.compile(
        optimizer="sgd", loss="mse",
        gradient_transforms=[
            kt.ClipByValue(0.8), kt.ClipByNorm(1.0), kt.ClipByGlobalNorm(0.6)
        ],
    )
    for seed in SEEDS:
        grads = random_grads(seed)
        # Each part written out in NumPy, applied in list order.
        expected = [np.clip(g.numpy(), -0.8, 0.8) for g in grads]
        expected = [e / max(np.linalg.norm(e), 1.0) for e in expected]
        total = np.sqrt(sum(np.sum(e * e) for e in expected))
        expected = [e * 0.6 / max(total, 0.6) for e in expected]
        # The compiled list, in order, on gradients of other variables
        # (where=None needs no model state).
        transforms = model.tapeops_options.gradient_transforms
        chained = apply_in_order([(t, None) for t in transforms], grads, fake_vars(grads))
        assert_all_close(chained, expected, tol=1e-5)


# ------------------------------------------------------------------ selection
def test_only_selected_gradients_change_and_none_passes_through():
    grads = random_grads(2, scale=5.0) + [None]
    transform = kt.ClipByGlobalNorm(0.1, where="ignored-when-bound")
    state = TransformState([True, False, True, False, True])
    out = transform(grads, fake_vars(grads), state)
    assert out[4] is None
    assert_all_close([out[1], out[3]], [grads[1], grads[3]], tol=0)
    assert global_norm([out[0], out[2]]) == pytest.approx(0.1, rel=1e-5)
    for cls in (kt.ClipByValue, kt.ClipByNorm):
        t = cls(0.1)
        out = t(grads, fake_vars(grads), TransformState([False, True, False, True, True]))
        assert_all_close([out[0], out[2]], [grads[0], grads[2]], tol=0)
        assert out[4] is None


def test_unbound_transform_with_selector_explains():
    with pytest.raises(ValueError, match="needs the state of a model"):
        apply(kt.ClipByNorm(1.0, where="head*"), random_grads(0))


def test_build_resolves_where_on_a_model():
    inputs = keras.Input((3,))
    h = keras.layers.Dense(2, name="body")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    transform = kt.ClipByNorm(1.0, where="head*")
    state = transform.bind(model, model.trainable_variables)
    assert state.selected == [False, False, True, True]
    assert transform.where == "head*"  # the transform itself is unchanged


# ------------------------------------------------------------- sparse grads
def sparse_with_repeats():
    values = tf.constant([[3.0, -4.0], [1.0, 1.0], [3.0, -4.0], [0.5, 0.0]])
    indices = tf.constant([2, 0, 2, 4])
    return tf.IndexedSlices(values, indices, tf.constant([6, 2]))


def test_sparse_norms_sum_repeated_rows_first():
    sparse = sparse_with_repeats()
    dense = tf.convert_to_tensor(sparse)
    var = tf.Variable(tf.zeros((6, 2)))
    for transform in (kt.ClipByNorm(2.0), kt.ClipByGlobalNorm(2.0)):
        [out] = transform([sparse], [var])
        assert isinstance(out, tf.IndexedSlices)
        np.testing.assert_allclose(
            tf.convert_to_tensor(out), tf.clip_by_norm(dense, 2.0), rtol=1e-6
        )
    # tf.clip_by_norm on the raw slices sees a smaller norm (repeats unsummed).
    naive = tf.convert_to_tensor(tf.clip_by_norm(sparse, 2.0))
    assert not np.allclose(naive, tf.clip_by_norm(dense, 2.0))


def test_sparse_value_clip_acts_on_summed_rows():
    sparse = sparse_with_repeats()
    [out] = kt.ClipByValue(2.5)([sparse], [tf.Variable(tf.zeros((6, 2)))])
    assert isinstance(out, tf.IndexedSlices)
    expected = np.clip(tf.convert_to_tensor(sparse).numpy(), -2.5, 2.5)
    np.testing.assert_allclose(tf.convert_to_tensor(out), expected, rtol=1e-6)


def test_sparse_mixed_with_dense_global_norm():
    sparse = sparse_with_repeats()
    dense_g = tf.constant([1.0, 2.0])
    vars_ = [tf.Variable(tf.zeros((6, 2))), tf.Variable(tf.zeros(2))]
    out = kt.ClipByGlobalNorm(1.0)([sparse, dense_g], vars_)
    expected = tf.clip_by_global_norm([tf.convert_to_tensor(sparse), dense_g], 1.0)[0]
    assert_all_close(out, expected)


# -------------------------------------------------------------- argument checks
# (bad value, error, what the message must show after "Received: <arg>="):
# the value as the user passed it (its repr), not a converted float.
BAD_THRESHOLDS = [
    (-1.0, ValueError, "-1.0"),
    (0, ValueError, "0"),
    (-3, ValueError, "-3"),
    (np.float64(-2.5), ValueError, repr(np.float64(-2.5))),
    (float("nan"), ValueError, "nan"),
    (float("inf"), ValueError, "inf"),
    ("1.0", TypeError, "'1.0' of type str"),
    (True, TypeError, "True of type bool"),
    (None, TypeError, "None of type NoneType"),
]


@pytest.mark.parametrize("cls, arg", [
    (kt.ClipByValue, "clip_value"),
    (kt.ClipByNorm, "clip_norm"),
    (kt.ClipByGlobalNorm, "clip_norm"),
])
def test_bad_threshold(cls, arg):
    for bad, error, shown in BAD_THRESHOLDS:
        # Anchored at the end: "clip_norm=0" must not read "clip_norm=0.0".
        with pytest.raises(error, match=rf"`{arg}`.*Received: {arg}={re.escape(shown)}$"):
            cls(bad)
    with pytest.raises(TypeError, match=r"Received: where=5 of type int"):
        cls(1.0, where=5)


def test_bad_threshold_check_can_fail():
    """The anchored pattern rejects the converted value ("0.0" for 0)."""
    with pytest.raises(ValueError) as info:
        kt.ClipByNorm(0)
    assert str(info.value).endswith("Received: clip_norm=0")
    with pytest.raises(AssertionError):
        with pytest.raises(ValueError, match=r"Received: clip_norm=0\.0$"):
            kt.ClipByNorm(0)


def test_numpy_and_int_thresholds_are_accepted():
    assert kt.ClipByNorm(np.float32(2.0)).clip_norm == 2.0
    assert kt.ClipByValue(1).clip_value == 1.0


# ------------------------------------------------------------------ config
@keras.saving.register_keras_serializable(package="tests_clipping")
def kernels_only(variable):
    return variable.path.endswith("kernel")


def head_layer():
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1, name="head")(inputs)
    return keras.Model(inputs, outputs).get_layer("head")


# (selector given to the constructor, what get_config stores for it)
SERIALIZABLE_SELECTORS = [
    (None, None),
    ("head*", "head*"),
    (["a", "*/bias"], ["a", "*/bias"]),
    (("a", "*/bias"), ["a", "*/bias"]),
    ("layer", {"layer_path": "head"}),
    (LayerPath("head"), {"layer_path": "head"}),
    (kernels_only, {"callable": keras.saving.serialize_keras_object(kernels_only)}),
]


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("where, stored", SERIALIZABLE_SELECTORS)
def test_config_round_trip(cls, where, stored):
    if where == "layer":
        where = head_layer()
    transform = cls(0.25, where=where)
    config = transform.get_config()
    assert config == {THRESHOLD[cls]: 0.25, "where": stored}
    restored = cls.from_config(config)
    assert type(restored) is cls
    assert getattr(restored, THRESHOLD[cls]) == 0.25
    assert restored.get_config() == config
    serialized = keras.saving.serialize_keras_object(transform)
    assert serialized["registered_name"] == f"keras_tapeops>{cls.__name__}"
    again = keras.saving.deserialize_keras_object(serialized)
    assert type(again) is cls
    assert again.get_config() == config


@pytest.mark.parametrize("cls", CLASSES)
def test_restored_selectors_select_the_same_variables(cls):
    inputs = keras.Input((3,))
    h = keras.layers.Dense(2, name="body")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    variables = model.trainable_variables
    for where in ("head*", ["body"], model.get_layer("head"), kernels_only):
        original = cls(0.25, where=where)
        restored = keras.saving.deserialize_keras_object(
            keras.saving.serialize_keras_object(original)
        )
        selected = original.bind(model, variables).selected
        assert restored.bind(model, variables).selected == selected
        assert any(selected) and not all(selected)


@pytest.mark.parametrize("cls", CLASSES)
def test_registered_names(cls):
    name = f"keras_tapeops>{cls.__name__}"
    assert keras.saving.get_registered_name(cls) == name
    assert keras.saving.get_registered_object(name) is cls


@pytest.mark.parametrize("cls", CLASSES)
def test_config_check_can_fail(cls):
    """The round trip notices a lost threshold, and a lambda cannot be saved."""
    config = cls(0.25).get_config()
    assert cls.from_config(config).get_config() != cls(0.5).get_config()
    with pytest.raises(ValueError, match="register_keras_serializable"):
        cls(0.25, where=lambda v: True).get_config()


def test_all_clippers_are_gradient_transforms():
    assert all(issubclass(cls, GradientTransform) for cls in CLASSES)
