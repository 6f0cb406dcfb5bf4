"""Regression tests for the defect list of issue 9 (the per-model state redesign).

Each test states in its docstring what the code before commit 75356bb did and
asserts the opposite, or checks the result against an oracle the old code
violated (stock Keras on the same samples, or a hand-written
`tf.GradientTape` step run inside `tf.function`). Where the old behaviour can
be rebuilt from today's pieces (the unguarded window mean, the bare layer
name, the unmasked term value) a companion test rebuilds it and shows that
it fails the same check.

1. `accumulation_steps > 1` and windows of zero samples.
2. `where=<layer>` saved by its full path (nested towers sharing a name).
3. Thresholds and weights finite in float32; one validator module.
4. Unregistered callables and transforms refused at save time.
5. One empty batch among normal ones with loss terms: finite History.
6. NumPy scalars accepted and stored as plain Python numbers.
7. Optimizer clipping / gradient accumulation that would stack on ours.
8. Errors at compile(), the previous compilation kept.
"""

import json
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops import paths
from keras_tapeops import validation
from keras_tapeops.terms.base import TermContext
from oracle_utils import graph_step

PACKAGE = "tapeops_reliability"


# --------------------------------------------------------------------- helpers
def _layers():
    return [
        keras.Input((3,)),
        keras.layers.Dense(4, activation="tanh", name="hidden"),
        keras.layers.Dense(2, name="head"),
    ]


def make_net():
    """A tiny upgraded Sequential regression net: hidden (tanh) -> head."""
    return kt.upgrade(keras.Sequential(_layers(), name="net"))


def make_stock():
    """The stock twin of `make_net` (same layers, same variable order)."""
    return keras.Sequential(_layers(), name="net")


def make_data(n=12, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    return x, y


def batches_dataset(x, y, sizes):
    """A dataset yielding consecutive slices of `x, y` of the given sizes (0 allowed)."""
    assert sum(sizes) <= len(x)
    datasets, start = [], 0
    for size in sizes:
        datasets.append(
            tf.data.Dataset.from_tensors((x[start:start + size], y[start:start + size]))
        )
        start += size
    dataset = datasets[0]
    for more in datasets[1:]:
        dataset = dataset.concatenate(more)
    return dataset


def bit_identical(a, b):
    return len(a) == len(b) and all(
        u.shape == v.shape and np.array_equal(u, v) for u, v in zip(a, b)
    )


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def all_finite(weights):
    return all(np.all(np.isfinite(w)) for w in weights)


def iterations(model):
    return int(model.optimizer.iterations.numpy())


@keras.saving.register_keras_serializable(package=PACKAGE)
def mean_square_output(model, x, y, y_pred):
    """A registered LossTerm fn: mean of the squared outputs."""
    return keras.ops.mean(keras.ops.square(y_pred))


@keras.saving.register_keras_serializable(package=PACKAGE)
def halving_weight(step):
    """A registered weight schedule: 0.5 ** step (finite at every step)."""
    return keras.ops.power(0.5, keras.ops.cast(step, "float32"))


# ============================================================================
# 1. accumulation_steps > 1 with windows of zero samples
# ============================================================================
def _empty_batches(n_batches):
    x = np.zeros((0, 3), "float32")
    y = np.zeros((0, 2), "float32")
    return tf.data.Dataset.from_tensors((x, y)).repeat(n_batches)


def _empty_dataset():
    x = np.zeros((0, 3), "float32")
    y = np.zeros((0, 2), "float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(4)


@pytest.mark.parametrize(
    "steps, dataset",
    [
        (2, "four_empty_batches"),  # two full windows of zero samples
        (3, "four_empty_batches"),  # one full window + a partial one flushed
        (2, "no_batches"),  # an empty dataset: nothing at all to apply
    ],
)
def test_window_of_zero_samples_changes_nothing(steps, dataset):
    """Old: the window's mean gradient was `sum / samples` = 0/0 = NaN, and the
    optimizer wrote NaN into every weight (and counted a step). Stock Keras
    leaves the weights unchanged on zero samples. Now: bit-identical finite
    weights and `optimizer.iterations == 0`, also through the epoch-end flush.
    """
    model = make_net()
    model.compile(
        keras.optimizers.Adam(0.01), "mse", accumulation_steps=steps,
        gradient_transforms=[kt.ClipByNorm(1.0)],
    )
    before = model.get_weights()
    data = _empty_batches(4) if dataset == "four_empty_batches" else _empty_dataset()
    history = model.fit(data, epochs=2, shuffle=False, verbose=0)
    after = model.get_weights()
    assert bit_identical(before, after)
    assert all_finite(after)
    assert iterations(model) == 0
    for values in history.history.values():
        assert np.all(np.isfinite(values)), history.history
    assert model.tapeops_state.accumulator.pending_batches() == 0


def test_unguarded_window_mean_of_zero_samples_is_nan():
    """Companion: the old step applied the window unconditionally. Applying a
    zero-sample window through the accumulator's own apply (what the old code
    did, without today's `samples > 0` guard) writes NaN into the weights, so
    the test above fails without the fix.
    """
    model = make_net()
    model.compile(keras.optimizers.SGD(0.1), "mse", accumulation_steps=2)
    accumulator = model.tapeops_state.accumulator
    assert float(accumulator.samples.numpy()) == 0.0  # the empty window
    accumulator._apply(model, accumulator.samples.read_value(), accumulator.present)
    assert not any(np.any(np.isfinite(w)) for w in model.get_weights())


def test_window_mixing_empty_and_non_empty_batches_equals_stock():
    """Batches of sizes [0, 4, 0, 3, 0] with accumulation_steps=2 are the windows
    [0, 4], [0, 3] and a partial window [0] flushed at the epoch's end. Each
    window must equal the stock step on its non-empty samples
    (`train_on_batch` on the 4, then on the 3), and the all-empty partial
    window must not step. Old: the [0] flush applied 0/0 = NaN.
    """
    x, y = make_data(7)
    model = make_net()
    weights = model.get_weights()
    model.compile(keras.optimizers.Adam(0.01), "mse", accumulation_steps=2)
    history = model.fit(batches_dataset(x, y, [0, 4, 0, 3, 0]), epochs=1, shuffle=False,
                        verbose=0)

    stock = make_stock()
    stock.set_weights(weights)
    stock.compile(keras.optimizers.Adam(0.01), "mse")
    stock.train_on_batch(x[:4], y[:4])
    stock.train_on_batch(x[4:7], y[4:7])

    assert iterations(model) == 2
    assert all_finite(model.get_weights())
    assert max_diff(model.get_weights(), stock.get_weights()) < 1e-6

    # The logged loss is the sample-weighted mean of the 4 and 3 sample
    # batches (the empty ones weigh nothing), as stock fit without them.
    stock_fit = make_stock()
    stock_fit.set_weights(weights)
    stock_fit.compile(keras.optimizers.Adam(0.01), "mse")
    stock_history = stock_fit.fit(batches_dataset(x, y, [4, 3]), shuffle=False, verbose=0)
    np.testing.assert_allclose(
        history.history["loss"], stock_history.history["loss"], atol=1e-6
    )


def test_zero_sample_windows_under_mirrored_strategy(mirrored):
    """The distributed path decides in cross-replica context whether a full
    window has samples (old: it applied 0/0 = NaN on every replica). Empty
    windows take no step; a window [0, 4] equals the stock single-device step
    on its 4 samples.
    """
    x, y = make_data(8)
    with mirrored.scope():
        model = make_net()
        model.compile(
            keras.optimizers.Adam(0.01), "mse", accumulation_steps=2,
            gradient_transforms=[kt.ClipByNorm(1.0)],
        )
    weights = model.get_weights()
    # Windows [0, 0] (full, no samples: reset, no step), [0, 4] (one step on
    # the 4 samples) and [0] (partial, flushed at the epoch's end: no step).
    model.fit(batches_dataset(x, y, [0, 0, 0, 4, 0]), epochs=1, shuffle=False,
              verbose=0)
    stock = make_stock()
    stock.set_weights(weights)
    stock.compile(keras.optimizers.Adam(0.01), "mse")
    stock.train_on_batch(x[:4], y[:4])
    assert iterations(model) == 1
    assert all_finite(model.get_weights())
    assert max_diff(model.get_weights(), stock.get_weights()) < 1e-6


# ============================================================================
# 2. where=<layer object> is saved by its full path
# ============================================================================
def _tower_functional(name):
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", name="b1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden), name=name)


def _tower_sequential(name):
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="tanh", name="b1"),
            keras.layers.Dense(2, name="out"),
        ],
        name=name,
    )


def make_towers():
    """tower_a (functional) and tower_b (Sequential) both hold a layer 'b1'."""
    inputs = keras.Input((3,))
    a = _tower_functional("tower_a")(inputs)
    b = _tower_sequential("tower_b")(inputs)
    merged = keras.layers.Concatenate(name="merge")([a, b])
    outputs = keras.layers.Dense(1, name="head")(merged)
    return kt.upgrade(keras.Model(inputs, outputs, name="towers"))


def _selected_paths(model, transform_index=0):
    tree = paths.LayerTree(model)
    state = model.tapeops_state.transforms[transform_index][1]
    assert len(state.selected) == len(model.trainable_variables)
    return sorted(
        path
        for v, on in zip(model.trainable_variables, state.selected) if on
        for path in tree.variable_paths(v)
    )


def _clip_oracle(model, clip_norm, lr, clipped_prefix):
    """One SGD step in tf.function, clipping per tensor only under `clipped_prefix`."""
    tree = paths.LayerTree(model)
    variables = model.trainable_variables
    clipped = [
        any(p.startswith(clipped_prefix + "/") for p in tree.variable_paths(v))
        for v in variables
    ]
    assert sum(clipped) == 2

    @graph_step
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, variables)
        for g, v, on in zip(grads, variables, clipped):
            v.assign_sub(lr * (tf.clip_by_norm(g, clip_norm) if on else g))

    return step


def test_layer_selector_survives_save_and_load_by_full_path(tmp_path):
    """Old: `where=<layer>` was saved as the bare name "b1"; load_model then
    selected the first layer named "b1" (tower_a's), clipping the wrong tower.
    Now the saved config holds "tower_b/b1", the loaded model's state selects
    exactly tower_b/b1's kernel and bias, and one step of the loaded model
    equals a hand loop that clips tower_b/b1 (and differs from one that clips
    tower_a/b1, what the old load did).
    """
    model = make_towers()
    b1_of_b = model.get_layer("tower_b").get_layer("b1")
    model.compile(
        keras.optimizers.SGD(0.1), "mse",
        gradient_transforms=[kt.ClipByNorm(1e-3, where=b1_of_b)],
    )
    expected = ["tower_b/b1/bias", "tower_b/b1/kernel"]
    assert _selected_paths(model) == expected
    saved_where = model.get_compile_config()["gradient_transforms"][0]["config"]["where"]
    assert saved_where == {"layer_path": "tower_b/b1"}

    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, kt.TapeOpsMixin)
    assert _selected_paths(loaded) == expected

    # The bare name is ambiguous here, and its first layer is tower_a's: what
    # the old saved form resolved to.
    tree = paths.LayerTree(loaded)
    named_b1 = [path for path, layer in tree.entries if layer.name == "b1"]
    assert named_b1 == ["tower_a/b1", "tower_b/b1"]

    x, y = make_data(8, seed=3)
    y = y[:, :1]
    weights = loaded.get_weights()
    loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    oracles = {}
    for prefix in ("tower_b/b1", "tower_a/b1"):
        oracle = make_towers()
        oracle.set_weights(weights)
        _clip_oracle(oracle, 1e-3, 0.1, prefix)(tf.constant(x), tf.constant(y))
        oracles[prefix] = oracle.get_weights()
    assert max_diff(loaded.get_weights(), oracles["tower_b/b1"]) < 1e-6
    # The wrong tower's oracle is far away: the check above can tell them apart.
    assert max_diff(oracles["tower_a/b1"], oracles["tower_b/b1"]) > 1e-3


def test_old_bare_name_config_is_ambiguous_not_silently_tower_a():
    """Companion: a config saved the old way ({"layer_name": "b1"}) no longer
    picks the first "b1" silently: binding it raises and lists both paths.
    """
    model = make_towers()
    transform = kt.ClipByNorm.from_config(
        {"clip_norm": 1e-3, "where": {"layer_name": "b1"}}
    )
    with pytest.raises(ValueError, match="tower_a/b1.*tower_b/b1"):
        transform.bind(model, model.trainable_variables)


# ============================================================================
# 3. Thresholds and weights finite in float32; one validator module
# ============================================================================
def _gan_parts():
    generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    critic = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    return generator, critic


def fn_term(model, x, y, y_pred):
    return keras.ops.mean(y_pred)


NON_FINITE_CASES = [
    # (constructor, argument named in the message, value as shown)
    (lambda: kt.ClipByNorm(1e39), "clip_norm", "1e+39"),
    (lambda: kt.ClipByNorm(np.float64(1e39)), "clip_norm", None),
    (lambda: kt.ClipByValue(float("inf")), "clip_value", "inf"),
    (lambda: kt.ClipByGlobalNorm(float("nan")), "clip_norm", "nan"),
    (lambda: kt.ClipByGlobalNorm(3.5e38), "clip_norm", "3.5e+38"),
    (lambda: kt.LossTerm(fn_term, weight=float("nan")), "weight", "nan"),
    (lambda: kt.LossTerm(fn_term, weight=float("-inf")), "weight", "-inf"),
    (lambda: kt.LossTerm(fn_term, weight=np.float32("inf")), "weight", None),
    (lambda: kt.ActivationPenalty("hidden", l2=1e39), "l2", "1e+39"),
    (lambda: kt.ActivationPenalty("hidden", l1=float("nan")), "l1", "nan"),
    (lambda: kt.ActivationPenalty("hidden", l2=1.0, weight=float("inf")), "weight", "inf"),
    (lambda: kt.GradientPenalty(weight=float("nan")), "weight", "nan"),
    (lambda: kt.GradientPenalty(target=float("inf")), "target", "inf"),
    (lambda: kt.WGANGP(*_gan_parts(), latent_dim=2, gp_weight=float("inf")),
     "gp_weight", "inf"),
    (lambda: kt.WGANGP(*_gan_parts(), latent_dim=2, gp_weight=1e39),
     "gp_weight", "1e+39"),
]


@pytest.mark.parametrize("construct, argument, shown", NON_FINITE_CASES)
def test_non_finite_arguments_are_refused_naming_the_argument(construct, argument, shown):
    """Old: nan/inf thresholds and weights were accepted (a threshold of 1e39 is
    inf in float32: `clip_norm / max(norm, inf)` is 0 or nan, zeroing every
    gradient) and surfaced as NaN weights. Now: ValueError naming the argument
    and the received value.
    """
    with pytest.raises(ValueError) as info:
        construct()
    message = str(info.value)
    assert f"Received: {argument}=" in message, message
    if shown is not None:
        assert f"Received: {argument}={shown}" in message, message


def test_float32_overflow_is_why_1e39_is_refused():
    """Companion: 1e39 is finite as a Python float but inf in float32 (the step's
    dtype), so a float64 finiteness check (the old one) let it through;
    FLOAT32_MAX itself is accepted.
    """
    assert np.isfinite(1e39)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(1e39))
    assert kt.ClipByNorm(validation.FLOAT32_MAX).clip_norm == validation.FLOAT32_MAX
    with pytest.raises(ValueError, match=r"Received: clip_norm=1e\+39"):
        kt.ClipByNorm(1e39)


def _nan_schedule(step):
    return float("nan") * keras.ops.cast(step + 1, "float32")


@pytest.mark.parametrize(
    "weight",
    [
        lambda step: float("nan"),
        _nan_schedule,
        keras.optimizers.schedules.ExponentialDecay(float("nan"), 10, 0.5),
        lambda step: float("inf"),
    ],
    ids=["lambda_nan", "tensor_nan", "schedule_nan", "lambda_inf"],
)
def test_schedule_weight_non_finite_at_step_zero_raises_at_compile(weight):
    """Old: a schedule giving nan was only evaluated inside the step, so fit
    wrote NaN into the weights. Now compile() evaluates it at step 0 and
    raises, naming `weight(0)`, and keeps the previous compilation.
    """
    model = make_net()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    optimizer, options = model.optimizer, model.tapeops_options
    with pytest.raises(ValueError, match=r"Received: weight\(0\)="):
        model.compile(
            keras.optimizers.Adam(), "mse",
            loss_terms=[kt.LossTerm(fn_term, weight=weight, name="bad")],
        )
    assert model.optimizer is optimizer
    assert model.tapeops_options is options


def test_finite_schedule_weight_is_accepted():
    """Companion: a finite schedule passes the same compile-time check."""
    model = make_net()
    model.compile(
        keras.optimizers.SGD(0.1), "mse",
        loss_terms=[kt.LossTerm(fn_term, weight=halving_weight, name="ok")],
    )
    assert model.tapeops_options.loss_terms[0].weight is halving_weight


class TestValidationModule:
    """keras_tapeops.validation directly: NumPy types, float32 finiteness, messages."""

    @pytest.mark.parametrize(
        "value", [2, np.int64(2), np.int32(2), np.uint8(2), np.int16(2)]
    )
    def test_positive_int_accepts_numpy_and_returns_int(self, value):
        out = validation.positive_int(value, "micro_batches")
        assert out == 2 and type(out) is int

    @pytest.mark.parametrize("value", [0, -1, np.int64(0), np.int32(-3)])
    def test_positive_int_below_one(self, value):
        with pytest.raises(ValueError, match=re.escape(f"Received: micro_batches={value!r}")):
            validation.positive_int(value, "micro_batches")

    @pytest.mark.parametrize(
        "value", [True, np.bool_(True), 2.0, np.float32(2.0), "2", None]
    )
    def test_positive_int_wrong_type(self, value):
        with pytest.raises(TypeError, match="Received: micro_batches="):
            validation.positive_int(value, "micro_batches")

    @pytest.mark.parametrize(
        "value",
        [0.5, np.float32(0.5), np.float64(0.5), np.float16(0.5), 1, np.int64(1),
         -2.0, validation.FLOAT32_MAX, -validation.FLOAT32_MAX],
    )
    def test_finite_number_accepts_and_returns_float(self, value):
        out = validation.finite_number(value, "x")
        assert type(out) is float and out == float(value)

    @pytest.mark.parametrize(
        "value",
        [float("nan"), float("inf"), -float("inf"), 1e39, -1e39, np.float64(1e39),
         np.float32("nan"), np.float16("inf"), np.float64(3.5e38)],
    )
    def test_finite_number_refuses_non_finite_in_float32(self, value):
        with pytest.raises(ValueError, match="finite number. Received: x="):
            validation.finite_number(value, "x")

    @pytest.mark.parametrize("value", [True, np.bool_(False), "1.0", None, [1.0], 1j])
    def test_finite_number_wrong_type(self, value):
        with pytest.raises(TypeError, match="Received: x="):
            validation.finite_number(value, "x")

    def test_positive_number(self):
        assert validation.positive_number(np.float32(0.25), "clip_norm") == 0.25
        assert type(validation.positive_number(np.int64(3), "clip_norm")) is float
        for bad in (0, 0.0, np.float32(0), -1e-30, np.float64(-2)):
            with pytest.raises(ValueError, match="positive finite number"):
                validation.positive_number(bad, "clip_norm")
        # The value is shown as passed (`0`, not `0.0`).
        with pytest.raises(ValueError, match=r"Received: clip_norm=0$"):
            validation.positive_number(0, "clip_norm")

    def test_non_negative_number(self):
        assert validation.non_negative_number(0, "l1") == 0.0
        assert type(validation.non_negative_number(np.int64(0), "l1")) is float
        assert validation.non_negative_number(np.float32(0.5), "l1") == 0.5
        for bad in (-1e-9, np.float32(-0.5), float("nan"), np.float64("inf")):
            with pytest.raises(ValueError, match="Received: l1="):
                validation.non_negative_number(bad, "l1")

    @pytest.mark.parametrize(
        "construct, validator, argument, value",
        [
            (lambda v: kt.ClipByNorm(v), validation.positive_number, "clip_norm", 0),
            (lambda v: kt.ClipByNorm(v), validation.positive_number, "clip_norm", 1e39),
            (lambda v: kt.ClipByValue(v), validation.positive_number, "clip_value", -1.0),
            (lambda v: kt.ClipByGlobalNorm(v), validation.positive_number,
             "clip_norm", float("nan")),
            (lambda v: kt.ActivationPenalty("h", l1=v, l2=1.0),
             validation.non_negative_number, "l1", -0.5),
            (lambda v: kt.GradientPenalty(target=v), validation.non_negative_number,
             "target", -1.0),
            (lambda v: kt.LossTerm(fn_term, weight=v), validation.finite_number,
             "weight", float("inf")),
            (lambda v: kt.WGANGP(*_gan_parts(), latent_dim=v),
             validation.positive_int, "latent_dim", 0),
            (lambda v: kt.WGANGP(*_gan_parts(), latent_dim=2, critic_steps=v),
             validation.positive_int, "critic_steps", np.int64(-1)),
            (lambda v: kt.WGANGP(*_gan_parts(), latent_dim=2, gp_weight=v),
             validation.non_negative_number, "gp_weight", -1.0),
            (lambda v: make_net().compile("sgd", "mse", micro_batches=v),
             validation.positive_int, "micro_batches", 0),
            (lambda v: make_net().compile("sgd", "mse", accumulation_steps=v),
             validation.positive_int, "accumulation_steps", np.int64(0)),
        ],
    )
    def test_public_classes_use_the_one_validator(self, construct, validator, argument, value):
        """Every public argument check gives exactly the validator's message:
        one module, one message style (old: each class had its own check,
        some missing float32 overflow or NumPy types).
        """
        with pytest.raises(ValueError) as expected:
            validator(value, argument)
        with pytest.raises(ValueError) as actual:
            construct(value)
        assert str(actual.value) == str(expected.value)


# ============================================================================
# 4. Unregistered callables and transforms refused at save time
# ============================================================================
def test_unregistered_callable_weight_refused_at_save(tmp_path):
    """Old: the model saved (the weight written by name) and load_model failed
    later, or the term silently lost its schedule. Now get_compile_config and
    model.save raise a ValueError that says how to register it.
    """
    def local_schedule(step):  # a local function cannot be registered/loaded
        return 0.1

    for weight in (lambda step: 0.1, local_schedule):
        model = make_net()
        model.compile(
            "sgd", "mse", loss_terms=[kt.LossTerm(mean_square_output, weight=weight)]
        )
        for save in (model.get_compile_config, lambda: model.save(tmp_path / "u.keras")):
            with pytest.raises(ValueError) as info:
                save()
            message = str(info.value)
            assert "register_keras_serializable" in message, message
            assert "Received: weight=" in message, message


def test_unregistered_transform_subclass_refused_at_save(tmp_path):
    """Old: an unregistered GradientTransform subclass was saved under a class
    name load_model could not find. Now saving refuses and names the class.
    """

    class HalveGradients(kt.GradientTransform):
        def transform(self, grads, variables, state):
            return [
                g * 0.5 if on and g is not None else g
                for g, on in zip(grads, state.selected)
            ]

    model = make_net()
    model.compile("sgd", "mse", gradient_transforms=[HalveGradients()])
    for save in (model.get_compile_config, lambda: model.save(tmp_path / "t.keras")):
        with pytest.raises(ValueError) as info:
            save()
        message = str(info.value)
        assert "HalveGradients" in message, message
        assert "register_keras_serializable" in message, message


def test_refused_save_leaves_an_existing_file_intact(tmp_path):
    """The refusal must come before Keras opens the target file: saving a
    model recompiled with an unregistered weight over an earlier good file
    (a ModelCheckpoint path, say) must not truncate it to an empty file
    ("Nothing is half-applied"). Oracle: the earlier file still loads, with
    its weights.
    """
    path = tmp_path / "ckpt.keras"
    model = make_net()
    model.compile("sgd", "mse")
    model.save(path)
    saved = model.get_weights()
    model.compile("sgd", "mse",
                  loss_terms=[kt.LossTerm(mean_square_output, weight=lambda step: 0.1)])
    with pytest.raises(ValueError, match="register_keras_serializable"):
        model.save(path)
    assert path.stat().st_size > 0
    restored = keras.models.load_model(path)
    assert bit_identical(restored.get_weights(), saved)


def test_registered_weight_and_schedule_round_trip_and_train_equal(tmp_path):
    """Registered callables and LearningRateSchedules as term weights save, load
    with the same values at every step, and the loaded model keeps training
    exactly like the original (the schedule continues from the saved step).
    """
    x, y = make_data(16, seed=5)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, 2, 0.5)
    model = make_net()
    model.compile(
        keras.optimizers.SGD(0.05), "mse",
        loss_terms=[
            kt.LossTerm(mean_square_output, weight=schedule, name="decayed"),
            kt.ActivationPenalty("hidden", l2=0.1, weight=halving_weight, name="act"),
        ],
    )
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)  # 4 steps
    model.save(tmp_path / "s.keras")
    loaded = keras.models.load_model(tmp_path / "s.keras")

    terms = loaded.tapeops_options.loss_terms
    assert isinstance(terms[0].weight, keras.optimizers.schedules.ExponentialDecay)
    assert terms[0].weight.get_config() == schedule.get_config()
    assert terms[1].weight is halving_weight
    for step in range(8):
        for new, old in zip(terms, model.tapeops_options.loss_terms):
            np.testing.assert_allclose(
                float(new.weight_at(step)), float(old.weight_at(step)), rtol=1e-7
            )
    assert iterations(loaded) == iterations(model) == 4
    assert bit_identical(loaded.get_weights(), model.get_weights())

    h_model = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    h_loaded = loaded.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_diff(model.get_weights(), loaded.get_weights()) < 1e-6
    for key in ("loss", "decayed", "act"):
        np.testing.assert_allclose(h_model.history[key], h_loaded.history[key], atol=1e-6)


# ============================================================================
# 5. One zero-sample batch with loss terms: finite History
# ============================================================================
def _term_model():
    model = make_net()
    model.compile(
        keras.optimizers.SGD(0.05), "mse",
        loss_terms=[
            kt.ActivationPenalty("hidden", l1=0.01, l2=0.1, name="act"),
            kt.LossTerm(mean_square_output, weight=0.2, name="out_sq"),
        ],
    )
    return model


def test_empty_batch_with_loss_terms_logs_finite_history():
    """Old: a term's mean over zero samples is nan, and the epoch's logged
    `loss` and term became NaN (TerminateOnNaN stopped a healthy run). Stock
    Keras logs a finite loss. Now the History (training and validation) equals
    the same fit without the empty batch, and so do the weights (plain SGD: a
    zero-gradient step changes nothing).
    """
    x, y = make_data(11, seed=1)
    with_empty = batches_dataset(x, y, [4, 0, 4, 3])
    without = batches_dataset(x, y, [4, 4, 3])

    weights = make_net().get_weights()
    results = []
    for dataset in (with_empty, without):
        model = _term_model()
        model.set_weights(weights)
        history = model.fit(
            dataset, validation_data=dataset, epochs=2, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.TerminateOnNaN()],
        )
        results.append((model, history.history))
    (m_empty, h_empty), (m_plain, h_plain) = results

    assert len(h_empty["loss"]) == 2  # TerminateOnNaN did not stop the run
    assert set(h_empty) == set(h_plain)
    for key in ("loss", "act", "out_sq", "val_loss", "val_act", "val_out_sq"):
        assert np.all(np.isfinite(h_empty[key])), (key, h_empty[key])
        np.testing.assert_allclose(h_empty[key], h_plain[key], atol=1e-6, err_msg=key)
    assert max_diff(m_empty.get_weights(), m_plain.get_weights()) < 1e-6


def test_unmasked_term_on_zero_samples_is_nan():
    """Companion: the term values themselves are nan on an empty batch (a mean
    over nothing), so without the step's zero-sample mask they would reach the
    logged `loss` and term as NaN.
    """
    model = make_net()
    hidden = model.get_layer("hidden")
    term = kt.ActivationPenalty("hidden", l2=0.1)
    empty = tf.zeros((0, 4))
    context = TermContext(
        model, tf.zeros((0, 3)), tf.zeros((0, 2)), tf.zeros((0, 2)), None, True,
        {id(hidden): [empty]},
    )
    context.state = term.bind(model)
    assert np.isnan(float(term.call(context)))
    assert np.isnan(float(mean_square_output(model, None, None, tf.zeros((0, 2)))))


# ============================================================================
# 6. NumPy scalars accepted, stored as Python numbers
# ============================================================================
def test_numpy_scalars_accepted_and_stored_as_python_numbers():
    """Old: np.int64 was refused for micro_batches/accumulation_steps (not an
    `int`), and NumPy floats were stored as given, so
    `json.dumps(model.get_compile_config())` failed ("Object of type float32
    is not JSON serializable"). Now they are accepted and stored as int/float.
    """
    model = make_net()
    model.compile(
        keras.optimizers.SGD(0.05), "mse",
        micro_batches=np.int64(2),
        accumulation_steps=np.int64(2),
        gradient_transforms=[
            kt.ClipByNorm(np.float32(1.0), where="head"),
            kt.ClipByValue(np.float32(0.5)),
            kt.ClipByGlobalNorm(np.float64(2.0)),
        ],
        loss_terms=[
            kt.ActivationPenalty("hidden", l1=np.float32(0.01), l2=np.float32(0.02),
                                 weight=np.float32(0.5), name="act"),
            kt.LossTerm(mean_square_output, weight=np.float64(0.1), name="out_sq"),
            kt.GradientPenalty(weight=np.float32(0.3), target=np.float32(1.0)),
        ],
    )
    options = model.tapeops_options
    assert type(options.micro_batches) is int and options.micro_batches == 2
    assert type(options.accumulation_steps) is int and options.accumulation_steps == 2
    clip_norm, clip_value, global_norm = options.gradient_transforms
    assert type(clip_norm.clip_norm) is float and clip_norm.clip_norm == 1.0
    assert type(clip_value.clip_value) is float and clip_value.clip_value == 0.5
    assert type(global_norm.clip_norm) is float and global_norm.clip_norm == 2.0
    act, out_sq, penalty = options.loss_terms
    for value, expected in [
        (act.l1, np.float32(0.01)), (act.l2, np.float32(0.02)),
        (act.weight, np.float32(0.5)), (out_sq.weight, np.float64(0.1)),
        (penalty.weight, np.float32(0.3)), (penalty.target, np.float32(1.0)),
    ]:
        assert type(value) is float and value == float(expected)

    config = model.get_compile_config()
    json.loads(json.dumps(config))  # plain JSON, no NumPy scalar left

    x, y = make_data(8)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert all_finite(model.get_weights())
    assert iterations(model) == 1  # 2 batches / accumulation_steps=2


def test_numpy_scalars_for_wgangp():
    """WGANGP's latent_dim and critic_steps take np.int64, gp_weight np.float32;
    all stored as Python numbers (JSON-serializable config)."""
    gan = kt.WGANGP(*_gan_parts(), latent_dim=np.int64(2), critic_steps=np.int64(2),
                    gp_weight=np.float32(10.0))
    assert type(gan.latent_dim) is int and gan.latent_dim == 2
    assert type(gan.critic_steps) is int and gan.critic_steps == 2
    assert type(gan.gp_weight) is float and gan.gp_weight == 10.0
    json.dumps(gan.get_config())


def test_numpy_scalars_left_as_numpy_would_break_json():
    """Companion: storing the NumPy scalar as given (the old behaviour for the
    numbers it accepted) makes the compile config unserializable."""
    for value in (np.int64(2), np.float32(0.5)):
        with pytest.raises(TypeError, match="not JSON serializable"):
            json.dumps({"micro_batches": value})


# ============================================================================
# 7. Optimizer options that would stack on keras_tapeops options
# ============================================================================
def _fit_and_weights(model, x, y):
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


GOOD_OPTIONS = dict(gradient_transforms=[kt.ClipByNorm(0.05, where="head")])


def _reference_weights(weights, x, y):
    """A fresh model compiled with GOOD_OPTIONS and SGD(0.1): the old compilation's result."""
    model = make_net()
    model.set_weights(weights)
    model.compile(keras.optimizers.SGD(0.1), "mse", **GOOD_OPTIONS)
    return _fit_and_weights(model, x, y)


@pytest.mark.parametrize(
    "optimizer_kwargs, ours, named",
    [
        ({"clipnorm": 1.0}, {"gradient_transforms": [kt.ClipByNorm(1.0)]}, "clipnorm"),
        ({"clipvalue": 0.5}, {"gradient_transforms": [kt.ClipByValue(0.5)]}, "clipvalue"),
        ({"global_clipnorm": 1.0}, {"gradient_transforms": [kt.ClipByGlobalNorm(1.0)]},
         "global_clipnorm"),
        ({"gradient_accumulation_steps": 2}, {"micro_batches": 2},
         "gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": 2}, {"accumulation_steps": 2},
         "gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": 2},
         {"gradient_transforms": [kt.ClipByNorm(1.0)]}, "gradient_accumulation_steps"),
    ],
)
@pytest.mark.parametrize("loss_scale", [False, True], ids=["plain", "loss_scale"])
def test_optimizer_conflicts_refused_and_previous_compilation_kept(
    optimizer_kwargs, ours, named, loss_scale
):
    """Old: the optimizer's clipnorm clipped again after our transforms (on
    scaled, per-replica gradients), and its gradient_accumulation_steps
    multiplied our windows (2 x 2 = 4 batches per step). Now compile()
    refuses, naming which option replaces which, and the previous
    compilation stays in force (same optimizer and options; fit equals a
    fresh model compiled with them).
    """
    x, y = make_data(8)
    model = make_net()
    weights = model.get_weights()
    model.compile(keras.optimizers.SGD(0.1), "mse", **GOOD_OPTIONS)
    optimizer, options, state = model.optimizer, model.tapeops_options, model.tapeops_state

    bad = keras.optimizers.SGD(0.1, **optimizer_kwargs)
    if loss_scale:
        bad = keras.optimizers.LossScaleOptimizer(bad)
    with pytest.raises(ValueError) as info:
        model.compile(bad, "mae", **ours)
    message = str(info.value)
    assert f"`{named}`" in message and f"Received: {named}=" in message, message
    if named == "gradient_accumulation_steps":
        assert "accumulation_steps=k) replaces it" in message, message
    else:
        assert "kt.ClipByNorm, kt.ClipByValue or kt.ClipByGlobalNorm replace" in message
        assert "gradient_transforms" in message

    assert model.optimizer is optimizer
    assert model.tapeops_options is options
    assert model.tapeops_state is state
    assert model.loss == "mse"
    fitted = _fit_and_weights(model, x, y)
    assert max_diff(fitted, _reference_weights(weights, x, y)) < 1e-6


def test_optimizer_clipnorm_with_only_loss_terms_is_accepted():
    """Companion: with no gradient transform there is nothing to stack on, so
    an optimizer clipnorm plus loss terms compiles and trains; the result
    equals a hand loop that adds the term and clips with the optimizer's rule.
    """
    x, y = make_data(8, seed=2)
    model = make_net()
    weights = model.get_weights()
    model.compile(
        keras.optimizers.SGD(0.1, clipnorm=1e-2), "mse",
        loss_terms=[kt.LossTerm(mean_square_output, weight=0.5, name="out_sq")],
    )
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)

    oracle = make_stock()
    oracle.set_weights(weights)
    variables = oracle.trainable_variables

    @graph_step
    def step(xb, yb):
        with tf.GradientTape() as tape:
            pred = oracle(xb, training=True)
            loss = tf.reduce_mean(tf.square(pred - yb)) + 0.5 * tf.reduce_mean(tf.square(pred))
        for g, v in zip(tape.gradient(loss, variables), variables):
            v.assign_sub(0.1 * tf.clip_by_norm(g, 1e-2))

    step(tf.constant(x), tf.constant(y))
    assert max_diff(model.get_weights(), oracle.get_weights()) < 1e-6


def test_optimizer_gradient_accumulation_alone_is_accepted_and_stock():
    """Companion: gradient_accumulation_steps with no keras_tapeops option is
    the stock step (parity with the stock model)."""
    x, y = make_data(16, seed=4)
    model, stock = make_net(), make_stock()
    stock.set_weights(model.get_weights())
    model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
    stock.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
    assert max_diff(_fit_and_weights(model, x, y), _fit_and_weights(stock, x, y)) < 1e-6


# ============================================================================
# 8. Errors at compile(), not fit()
# ============================================================================
BAD_COMPILES = {
    "selector_typo": (
        dict(gradient_transforms=[kt.ClipByNorm(0.5, where="haed")]),
        ["Received: where='haed'", "'head'"],
    ),
    "unknown_activation_layer": (
        dict(loss_terms=[kt.ActivationPenalty("hiden", l2=0.1)]),
        ["Received: layer='hiden'", "'hidden'"],
    ),
    "term_name_clashes_with_metric": (
        dict(loss_terms=[kt.LossTerm(mean_square_output, name="accuracy")],
             metrics=["accuracy"]),
        ["Received: name='accuracy'"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_COMPILES))
def test_bad_option_of_built_model_raises_in_compile_and_keeps_previous(case):
    """Old: a selector typo, an unknown ActivationPenalty layer or a term named
    like a metric raised in the first fit step, after compile() had already
    replaced the optimizer and options (a half-applied configuration). Now
    compile() raises and the previous compilation stays in force: same
    optimizer, options and loss, and fit trains with the old options exactly.
    """
    kwargs, fragments = BAD_COMPILES[case]
    x, y = make_data(8)
    model = make_net()
    weights = model.get_weights()
    model.compile(keras.optimizers.SGD(0.1), "mse", **GOOD_OPTIONS)
    optimizer, options, state = model.optimizer, model.tapeops_options, model.tapeops_state

    with pytest.raises(ValueError) as info:
        model.compile(keras.optimizers.Adam(0.5), "mae", **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)

    assert model.optimizer is optimizer
    assert model.tapeops_options is options
    assert model.tapeops_state is state
    assert model.loss == "mse"
    assert bit_identical(model.get_weights(), weights)
    fitted = _fit_and_weights(model, x, y)
    assert max_diff(fitted, _reference_weights(weights, x, y)) < 1e-6


class LazyNet(kt.TapeOpsMixin, keras.Model):
    """A subclassed model built only by its first call (seeded initializers)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(
            4, activation="tanh", name="hidden",
            kernel_initializer=keras.initializers.GlorotUniform(seed=11),
        )
        self.head = keras.layers.Dense(
            2, name="head", kernel_initializer=keras.initializers.GlorotUniform(seed=12),
        )

    def call(self, x):
        return self.head(self.hidden(x))


def _lazy_oracle_steps(twin, x, y, batch_size=4, clip_norm=0.05, lr=0.1):
    """Hand-written SGD steps on `twin` clipping only head's tensors (tf.function)."""
    variables = twin.trainable_variables
    tree = paths.LayerTree(twin)
    clipped = ["head" in tree.owner_paths(v) for v in variables]
    assert sum(clipped) == 2

    @graph_step
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(twin(xb, training=True) - yb))
        for g, v, on in zip(tape.gradient(loss, variables), variables, clipped):
            v.assign_sub(lr * (tf.clip_by_norm(g, clip_norm) if on else g))

    for start in range(0, len(x), batch_size):
        step(tf.constant(x[start:start + batch_size]), tf.constant(y[start:start + batch_size]))


def test_unbuilt_model_bad_selector_fails_first_step_without_touching_weights():
    """An unbuilt subclassed model has no variables at compile(), so a selector
    typo can only fail in the first fit step. Then no weight moved (they equal
    a freshly built twin's) and no step was counted; compiling again with the
    fixed selector makes fit work and equal the fixed option's oracle.
    """
    x, y = make_data(8)
    model = LazyNet()
    assert not model.built
    model.compile(keras.optimizers.SGD(0.1), "mse",
                  gradient_transforms=[kt.ClipByNorm(0.05, where="haed")])
    with pytest.raises(ValueError, match="Received: where='haed'"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)

    twin = LazyNet()
    twin(x[:1])
    assert bit_identical(model.get_weights(), twin.get_weights())
    assert iterations(model) == 0

    model.compile(keras.optimizers.SGD(0.1), "mse",
                  gradient_transforms=[kt.ClipByNorm(0.05, where="head")])
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert iterations(model) == 2
    _lazy_oracle_steps(twin, x, y)
    assert max_diff(model.get_weights(), twin.get_weights()) < 1e-6


def test_unbuilt_model_unknown_activation_layer_raises_in_compile():
    """Layers exist before a subclassed model is built, so an unknown
    ActivationPenalty layer is refused by compile() even for an unbuilt model
    (old: in the first fit step), keeping the previous compilation, with
    which fit then trains exactly.
    """
    x, y = make_data(8)
    model = LazyNet()
    model.compile(keras.optimizers.SGD(0.1), "mse",
                  gradient_transforms=[kt.ClipByNorm(0.05, where="head")])
    optimizer, options = model.optimizer, model.tapeops_options
    with pytest.raises(ValueError, match="Received: layer='hiden'"):
        model.compile(keras.optimizers.Adam(0.5), "mae",
                      loss_terms=[kt.ActivationPenalty("hiden", l2=0.1)])
    assert not model.built
    assert model.optimizer is optimizer and model.tapeops_options is options

    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    twin = LazyNet()
    twin(x[:1])
    _lazy_oracle_steps(twin, x, y)
    assert max_diff(model.get_weights(), twin.get_weights()) < 1e-6
