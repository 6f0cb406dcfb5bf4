"""`kt.AdaptiveClip` and `kt.CentralizeGradients` against NumPy references.

Oracles: `agc_numpy` and `centralize_numpy` below, written in float64 from
the papers' definitions (Brock et al. 2021, eq. 3 with the NFNets
reference's `1e-6` floor; Yong et al. 2020, eq. 4) with Keras's kernel
layouts (the unit is the last axis). The `fit` tests compare against a hand
loop: a `tf.GradientTape` step run as a `tf.function` returns the true
gradients, the NumPy references transform them, and NumPy applies SGD.
Companion tests show that each comparison can fail.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.transforms.adaptive import AdaptiveClip
from keras_tapeops.transforms.adaptive import CentralizeGradients
from keras_tapeops.transforms.update_ratio import LogUpdateRatio

from oracle_utils import graph_step

LR = 0.1
BATCH = 16
EPOCHS = 2
N = 64
CLIPPING = 1.0
EPS = 1e-3


# ------------------------------------------------------------ the references
def unit_axes(array, pytorch_layout=False):
    """Axes of one unit: all but the last (Keras), or all but the first (PyTorch)."""
    if array.ndim <= 1:
        return None
    if pytorch_layout:
        return tuple(range(1, array.ndim))
    return tuple(range(array.ndim - 1))


def unit_norms(array, pytorch_layout=False):
    axes = unit_axes(array, pytorch_layout)
    return np.sqrt(np.sum(np.square(array), axis=axes, keepdims=axes is not None))


def agc_numpy(grad, weight, clipping=CLIPPING, eps=EPS, pytorch_layout=False):
    """AGC in float64: each unit's gradient scaled to `clipping * max(||w||, eps)` if above."""
    grad = np.asarray(grad, np.float64)
    weight = np.asarray(weight, np.float64)
    max_norm = clipping * np.maximum(unit_norms(weight, pytorch_layout), eps)
    grad_norm = unit_norms(grad, pytorch_layout)
    clipped = grad * (max_norm / np.maximum(grad_norm, 1e-6))
    return np.where(grad_norm < max_norm, grad, clipped)


def centralize_numpy(grad, pytorch_layout=False):
    grad = np.asarray(grad, np.float64)
    axes = unit_axes(grad, pytorch_layout)
    if axes is None:
        return grad
    return grad - grad.mean(axis=axes, keepdims=True)


def units_clipped(grad, weight, clipping=CLIPPING, eps=EPS):
    """(clipped, total) unit counts of one tensor."""
    max_norm = clipping * np.maximum(unit_norms(np.asarray(weight, np.float64)), eps)
    grad_norm = unit_norms(np.asarray(grad, np.float64))
    fired = np.broadcast_to(grad_norm >= max_norm, max_norm.shape)
    return int(fired.sum()), int(fired.size)


# ----------------------------------------------------------------- the model
def make_net():
    """conv (HWIO 3x3x3x4) -> dense (36, 8) -> head (8, 2): kernels of rank 4 and 2."""
    inputs = keras.Input((5, 5, 3))
    h = keras.layers.Conv2D(4, 3, activation="tanh", name="conv")(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(8, activation="tanh", name="dense")(h)
    outputs = keras.layers.Dense(2, name="head")(h)
    return kt.upgrade(keras.Model(inputs, outputs, name="net"))


def make_data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5, 5, 3)).astype("float32")
    y = (2.0 * rng.normal(size=(n, 2))).astype("float32")
    return x, y


def random_gradients(variables, seed=1, scale=1.0):
    """Gradients of mixed sizes: per unit, some far above and some below the AGC bound."""
    rng = np.random.default_rng(seed)
    grads = []
    for v in variables:
        g = rng.normal(size=v.shape)
        if g.ndim >= 2:  # unit j scaled by 10**(-3..0): some units clip, some not
            g = g * np.logspace(-3, 0, g.shape[-1])
        grads.append((scale * g).astype("float32"))
    return grads


def non_zero_biases(model, seed=2):
    """Random biases too (zero biases would only exercise the `eps` branch)."""
    rng = np.random.default_rng(seed)
    model.set_weights([
        w if w.ndim > 1 else rng.normal(scale=0.5, size=w.shape).astype("float32")
        for w in model.get_weights()
    ])


def assert_all_close(actual, expected, tol=1e-6):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(
            np.asarray(a, np.float64), e, rtol=tol, atol=tol, err_msg=f"tensor {i}"
        )


def as_numpy(grads):
    return [tf.convert_to_tensor(g).numpy() for g in grads]


# -------------------------------------------------- direct calls vs NumPy
@pytest.fixture
def net():
    model = make_net()
    non_zero_biases(model)
    return model


def test_agc_equals_numpy_on_dense_and_conv_kernels(net):
    variables = net.trainable_variables
    assert [len(v.shape) for v in variables] == [4, 1, 2, 1, 2, 1]
    grads = random_gradients(variables)
    got = as_numpy(kt_agc()(grads, variables))
    weights = [v.numpy() for v in variables]
    assert_all_close(got, [agc_numpy(g, w) for g, w in zip(grads, weights)])
    # The scenario has units on both sides of the bound, in every kernel.
    for g, w in zip(grads, weights):
        clipped, total = units_clipped(g, w)
        if g.ndim >= 2:
            assert 0 < clipped < total, (clipped, total)


def kt_agc(**kwargs):
    kwargs.setdefault("clipping", CLIPPING)
    kwargs.setdefault("eps", EPS)
    return AdaptiveClip(**kwargs)


def test_agc_properties(net):
    """Unit norms end <= clipping * max(unit weight norm, eps); small units untouched; idempotent."""
    variables = net.trainable_variables
    grads = random_gradients(variables, scale=10.0)
    agc = kt_agc()
    once = as_numpy(agc(grads, variables))
    for g_in, g, v in zip(grads, once, variables):
        w = v.numpy().astype(np.float64)
        bound = CLIPPING * np.maximum(unit_norms(w), EPS)
        assert np.all(unit_norms(g.astype(np.float64)) <= bound * (1 + 1e-6))
        below = unit_norms(g_in.astype(np.float64)) < bound
        below = np.broadcast_to(below, g_in.shape)
        np.testing.assert_array_equal(g[below], g_in[below])  # bit-identical
    twice = as_numpy(agc(once, variables))
    assert_all_close(twice, once, tol=1e-6)


def test_agc_eps_lets_zero_weights_move():
    """Zero weights (fresh biases): the bound is clipping * eps, not 0."""
    v = keras.Variable(np.zeros((3,), "float32"))
    g = np.array([3.0, 4.0, 0.0], "float32")  # norm 5
    (got,) = as_numpy(kt_agc(clipping=0.1, eps=1e-2)([g], [v]))
    np.testing.assert_allclose(got, g * (0.1 * 1e-2 / 5.0), rtol=1e-6)


def test_agc_vectors_are_one_unit():
    """A bias is clipped by its whole norm, not entry by entry (optax/NFNets rule)."""
    w = np.array([1.0, 0.0, 0.0, 0.0], "float32")
    g = np.array([0.03, 0.03, 0.0, 0.0], "float32")  # norm 0.0424 > 0.01 * 1
    v = keras.Variable(w)
    (got,) = as_numpy(kt_agc(clipping=0.01)([g], [v]))
    np.testing.assert_allclose(got, agc_numpy(g, w, clipping=0.01), rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got), 0.01, rtol=1e-6)
    per_entry = np.minimum(np.abs(g), 0.01 * np.maximum(np.abs(w), EPS)) * np.sign(g)
    assert not np.allclose(got, per_entry, rtol=1e-3)


def test_agc_check_can_fail(net):
    """The PyTorch unit layout (out first), no clipping, or another bound all differ."""
    variables = net.trainable_variables
    grads = random_gradients(variables)
    weights = [v.numpy() for v in variables]
    got = as_numpy(kt_agc()(grads, variables))
    for wrong in (
        [agc_numpy(g, w, pytorch_layout=True) for g, w in zip(grads, weights)],
        [np.asarray(g, np.float64) for g in grads],
        [agc_numpy(g, w, clipping=2 * CLIPPING) for g, w in zip(grads, weights)],
    ):
        with pytest.raises(AssertionError):
            assert_all_close(got, wrong)


def test_centralize_equals_numpy_and_properties(net):
    variables = net.trainable_variables
    grads = random_gradients(variables)
    once = as_numpy(CentralizeGradients()(grads, variables))
    assert_all_close(once, [centralize_numpy(g) for g in grads])
    for g_in, g in zip(grads, once):
        if g.ndim > 1:  # zero mean over the reduced axes, per output unit
            mean = g.astype(np.float64).mean(axis=unit_axes(g))
            np.testing.assert_allclose(mean, 0.0, atol=1e-7)
            assert np.abs(g_in.mean(axis=unit_axes(g_in))).max() > 1e-3
        else:  # vectors unchanged, bit for bit
            np.testing.assert_array_equal(g, g_in)
    twice = as_numpy(CentralizeGradients()(once, variables))
    assert_all_close(twice, once, tol=1e-6)


def test_centralize_check_can_fail(net):
    variables = net.trainable_variables
    grads = random_gradients(variables)
    got = as_numpy(CentralizeGradients()(grads, variables))
    for wrong in (
        [centralize_numpy(g, pytorch_layout=True) for g in grads],  # optax's axes
        [np.asarray(g, np.float64) for g in grads],
        [g - g.mean() for g in grads],  # one mean per tensor, vectors too
    ):
        with pytest.raises(AssertionError):
            assert_all_close(got, wrong)


def test_where_selects_what_is_transformed(net):
    variables = net.trainable_variables
    grads = random_gradients(variables)
    weights = [v.numpy() for v in variables]
    for transform, reference, selected in (
        (AdaptiveClip(CLIPPING, EPS, where=["conv", "dense"]), agc_numpy,
         [True, True, True, True, False, False]),
        (CentralizeGradients(where="*/kernel"), lambda g, w: centralize_numpy(g),
         [True, False, True, False, True, False]),
    ):
        state = transform.bind(net, variables)
        got = as_numpy(transform(grads, variables, state))
        expected = [
            reference(g, w) if on else np.asarray(g, np.float64)
            for g, w, on in zip(grads, weights, state.selected)
        ]
        assert state.selected == selected
        assert_all_close(got, expected)


def test_none_gradients_pass_through(net):
    variables = net.trainable_variables
    grads = random_gradients(variables)
    grads[1] = None
    for transform in (kt_agc(), CentralizeGradients()):
        out = transform(grads, variables)
        assert out[1] is None


def test_embedding_sparse_gradients_equal_the_dense_reference():
    """IndexedSlices with repeated rows: AGC stays sparse, centralization is dense."""
    model = kt.upgrade(keras.Sequential([
        keras.Input((4,), dtype="int32"),
        keras.layers.Embedding(6, 3, name="embed"),
        keras.layers.Flatten(),
        keras.layers.Dense(1, name="head"),
    ]))
    tokens = tf.constant([[1, 1, 2, 5], [1, 2, 2, 0]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(tokens) - 10.0))
    grads = tape.gradient(loss, model.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices)
    dense = [tf.convert_to_tensor(g).numpy() for g in grads]
    weights = [v.numpy() for v in model.trainable_variables]

    clipped = kt_agc(clipping=0.01)(grads, model.trainable_variables)
    assert isinstance(clipped[0], tf.IndexedSlices)
    expected = [agc_numpy(g, w, clipping=0.01) for g, w in zip(dense, weights)]
    assert_all_close(as_numpy(clipped), expected, tol=1e-5)
    assert units_clipped(dense[0], weights[0], clipping=0.01)[0] > 0

    centered = CentralizeGradients()(grads, model.trainable_variables)
    assert not isinstance(centered[0], tf.IndexedSlices)
    assert_all_close(as_numpy(centered), [centralize_numpy(g) for g in dense], tol=1e-5)


# ----------------------------------------------------------------- in fit()
def hand_loop(weights, x, y, transforms, replicas=1, loss_scale=None, epochs=EPOCHS):
    """Tape step as a tf.function -> true gradients -> NumPy transforms -> NumPy SGD.

    `transforms` is a list of `(reference, selects)`; `reference(g, w)` gets
    the float64 gradient and the weights before the step. `replicas > 1`
    sums the gradients of equal shares of each batch (MirroredStrategy's
    arithmetic). `loss_scale` multiplies the loss inside the tape and
    divides the gradients after (a fixed scale; the LossScaleOptimizer's
    scale does not change in these short runs).

    Returns the final weights and, per step, the (clipped, total) unit
    counts of the first reference that reports them.
    """
    model = make_net()
    model.set_weights(weights)
    variables = model.trainable_variables
    scale = tf.constant(1.0 if loss_scale is None else loss_scale, "float32")

    @graph_step
    def step(xb, yb):
        shares = zip(tf.split(xb, replicas), tf.split(yb, replicas))
        total = None
        for xr, yr in shares:
            with tf.GradientTape() as tape:
                pred = tf.cast(model(xr, training=True), "float32")
                loss = tf.reduce_mean(tf.square(pred - yr)) / replicas
                loss = loss * scale
            grads = [g / scale for g in tape.gradient(loss, variables)]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        return total

    counts = []
    for _ in range(epochs):
        for start in range(0, len(x), BATCH):
            grads = [
                g.numpy().astype(np.float64)
                for g in step(tf.constant(x[start:start + BATCH]),
                              tf.constant(y[start:start + BATCH]))
            ]
            current = [v.numpy().astype(np.float64) for v in variables]
            fired = [0, 0]
            for reference, selects in transforms:
                for i, v in enumerate(variables):
                    if selects(v):
                        if reference is agc_numpy and grads[i].ndim >= 2:
                            c, t = units_clipped(grads[i], current[i])
                            fired = [fired[0] + c, fired[1] + t]
                        grads[i] = reference(grads[i], current[i])
            counts.append(fired)
            for v, w, g in zip(variables, current, grads):
                v.assign((w - LR * g).astype("float32"))
    return [v.numpy() for v in variables], counts


def not_head(variable):
    return not variable.path.startswith("head/")


CHAIN = [
    (lambda g, w: centralize_numpy(g), lambda v: True),
    (agc_numpy, not_head),
]


def chain_transforms():
    return [
        CentralizeGradients(),
        AdaptiveClip(CLIPPING, EPS, where=["conv", "dense"]),
    ]


@pytest.fixture(scope="module")
def oracle():
    keras.utils.set_random_seed(3)
    x, y = make_data()
    model = make_net()
    non_zero_biases(model)
    weights = model.get_weights()
    expected, counts = hand_loop(weights, x, y, CHAIN)
    keras.backend.clear_session()
    return {"x": x, "y": y, "weights": weights, "expected": expected, "counts": counts}


def fit_weights(weights, x, y, transforms, strategy=None, **compile_kwargs):
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = make_net()
        model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.SGD(LR), loss="mse",
            gradient_transforms=transforms, **compile_kwargs,
        )
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


def assert_weights_close(actual, expected, atol=1e-5):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, atol=atol, rtol=atol, err_msg=f"weight {i}")


def test_the_fit_scenario_clips_some_units_on_every_step(oracle):
    for clipped, total in oracle["counts"]:
        assert 0 < clipped < total, oracle["counts"]


@pytest.mark.parametrize("variant", ["single", "jit_compile", "steps_per_execution"])
def test_fit_equals_hand_loop(oracle, variant):
    kwargs = {"jit_compile": {"jit_compile": True},
              "steps_per_execution": {"steps_per_execution": 3}}.get(variant, {})
    got = fit_weights(oracle["weights"], oracle["x"], oracle["y"], chain_transforms(), **kwargs)
    assert_weights_close(got, oracle["expected"])


def test_mirrored_equals_single_device(oracle, mirrored):
    """AGC acts on the gradient summed over replicas: two replicas = one device."""
    got = fit_weights(
        oracle["weights"], oracle["x"], oracle["y"], chain_transforms(), strategy=mirrored,
    )
    assert_weights_close(got, oracle["expected"])
    split, _ = hand_loop(oracle["weights"], oracle["x"], oracle["y"], CHAIN, replicas=2)
    assert_weights_close(split, oracle["expected"])


def test_per_replica_agc_would_differ(oracle):
    """Companion: clipping each replica's half-batch gradient is another result."""
    x, y = oracle["x"], oracle["y"]
    # Each half batch's gradient transformed on its own, then summed.
    model = make_net()
    model.set_weights(oracle["weights"])
    variables = model.trainable_variables

    @graph_step
    def half_grads(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb)) / 2
        return tape.gradient(loss, variables)

    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            current = [v.numpy().astype(np.float64) for v in variables]
            total = [0.0] * len(variables)
            for half in (0, 1):
                lo = start + half * BATCH // 2
                grads = [g.numpy().astype(np.float64) for g in half_grads(
                    tf.constant(x[lo:lo + BATCH // 2]), tf.constant(y[lo:lo + BATCH // 2]))]
                for reference, selects in CHAIN:
                    grads = [reference(g, w) if selects(v) else g
                             for g, w, v in zip(grads, current, variables)]
                total = [t + g for t, g in zip(total, grads)]
            for v, w, g in zip(variables, current, total):
                v.assign((w - LR * g).astype("float32"))
    with pytest.raises(AssertionError):
        assert_weights_close([v.numpy() for v in variables], oracle["expected"])


def test_fit_comparison_can_fail(oracle):
    """No transforms, the other order, or AGC on the head too: all differ from the oracle."""
    x, y, weights = oracle["x"], oracle["y"], oracle["weights"]
    for transforms in (
        [kt.ClipByValue(1e6)],
        [AdaptiveClip(CLIPPING, EPS, where=["conv", "dense"]), CentralizeGradients()],
        [CentralizeGradients(), AdaptiveClip(CLIPPING, EPS)],
    ):
        got = fit_weights(weights, x, y, transforms)
        with pytest.raises(AssertionError):
            assert_weights_close(got, oracle["expected"])


def test_mixed_float16_acts_on_unscaled_gradients(oracle):
    """Under mixed_float16 the bound applies to the gradient divided by the loss scale."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y, weights = oracle["x"], oracle["y"], oracle["weights"]
    transforms = [AdaptiveClip(CLIPPING, EPS, where=["conv", "dense"])]
    model = make_net()
    model.set_weights(weights)
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(LR), initial_scale=2.0**10, dynamic_growth_steps=1000,
    )
    model.compile(optimizer=optimizer, loss="mse", gradient_transforms=transforms)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**10  # no overflow, no growth
    agc_only = [(agc_numpy, not_head)]
    expected, counts = hand_loop(weights, x, y, agc_only, loss_scale=2.0**10)
    assert all(0 < c < t for c, t in counts)
    assert_weights_close(model.get_weights(), expected, atol=2e-5)
    # Companion: the bound applied to the loss-scaled gradient gives another result.
    scaled = [(lambda g, w: agc_numpy(g * 2.0**10, w) / 2.0**10, not_head)]
    wrong, _ = hand_loop(weights, x, y, scaled, loss_scale=2.0**10)
    with pytest.raises(AssertionError):
        assert_weights_close(model.get_weights(), wrong, atol=2e-5)


def test_save_load_keeps_the_transforms(oracle, tmp_path):
    model = make_net()
    model.set_weights(oracle["weights"])
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse",
                  gradient_transforms=chain_transforms())
    model.save(tmp_path / "agc.keras")
    loaded = keras.models.load_model(tmp_path / "agc.keras")
    assert [repr(t) for t in loaded.tapeops_options.gradient_transforms] == [
        repr(t) for t in chain_transforms()
    ]
    loaded.fit(oracle["x"], oracle["y"], batch_size=BATCH, epochs=EPOCHS,
               shuffle=False, verbose=0)
    assert_weights_close(loaded.get_weights(), oracle["expected"])


# ----------------------------------------------------- configuration checks
NEW_OBJECTS = [
    AdaptiveClip(clipping=np.float32(0.02), eps=1e-4, where="dense*"),
    CentralizeGradients(where=["conv", "*/kernel"]),
    LogUpdateRatio(where="head", name="head_update"),
]


@pytest.mark.parametrize("obj", NEW_OBJECTS, ids=lambda o: type(o).__name__)
def test_get_config_round_trip(obj):
    config = obj.get_config()
    again = type(obj).from_config(dict(config))
    assert type(again) is type(obj)
    assert again.get_config() == config
    assert repr(again) == repr(obj)
    name = keras.saving.get_registered_name(type(obj))
    assert name == f"keras_tapeops>{type(obj).__name__}"
    via_keras = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(obj))
    assert via_keras.get_config() == config


def test_round_trip_behaves_the_same(net):
    variables = net.trainable_variables
    grads = random_gradients(variables)
    for obj in NEW_OBJECTS[:2]:
        again = type(obj).from_config(obj.get_config())
        a = as_numpy(obj(grads, variables, obj.bind(net, variables)))
        b = as_numpy(again(grads, variables, again.bind(net, variables)))
        for u, w in zip(a, b):
            np.testing.assert_array_equal(u, w)


def test_config_values_are_plain_python():
    config = AdaptiveClip(np.float32(0.5), np.float64(0.01)).get_config()
    assert config == {"clipping": 0.5, "eps": 0.01, "where": None}
    assert type(config["clipping"]) is float


@pytest.mark.parametrize("kwargs, error, match", [
    ({"clipping": 0}, ValueError, r"`clipping` must be a positive.*Received: clipping=0"),
    ({"clipping": -0.1}, ValueError, r"Received: clipping=-0.1"),
    ({"clipping": float("nan")}, ValueError, r"Received: clipping=nan"),
    ({"clipping": True}, TypeError, r"Received: clipping=True"),
    ({"eps": 0.0}, ValueError, r"`eps` must be a positive.*Received: eps=0.0"),
    ({"eps": "1e-3"}, TypeError, r"Received: eps='1e-3'"),
    ({"where": 5}, TypeError, r"where=5"),
])
def test_adaptive_clip_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        AdaptiveClip(**kwargs)


def test_bad_selector_fails_at_compile_naming_it(oracle):
    model = make_net()
    model.set_weights(oracle["weights"])
    before = model.get_weights()
    for transform in (AdaptiveClip(where="dnese"), CentralizeGradients(where="dnese")):
        with pytest.raises(ValueError, match=r"dnese.*conv.*dense.*head"):
            model.compile(optimizer="sgd", loss="mse", gradient_transforms=[transform])
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
