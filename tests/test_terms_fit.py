"""End-to-end tests of loss terms under `fit`, against a hand-written GradientTape loop.

The oracle: a stock Keras model with the same initial weights, trained by a
hand-written loop (each step a `tf.function`, like fit's) that adds
`beta * mean(square(hidden_output))` to a sparse categorical cross-entropy,
batch by batch in the same order (Adam, 2 epochs).
100 samples in batches of 16 leave a last batch of 4, so the sample weighting
of the logged epoch mean matters.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

from oracle_utils import graph_step

N, BATCH, EPOCHS, BETA = 100, 16, 2, 0.5


def make_data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    return x, y


def make_stock_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="out", dtype="float32")(hidden)
    return keras.Model(inputs, outputs)


def penalty_value(hidden):
    return BETA * tf.reduce_mean(tf.square(tf.cast(hidden, "float32")))


def oracle_fit(
    weights, x, y, weight_fn=None, mixed=False, with_term=True, term_fn=None
):
    """Hand-written loop; returns (final weights, per-epoch term means, losses).

    The term is `weight_fn(step) * term_fn(hidden, logits)`, by default
    `BETA * mean(square(hidden))`. Each step runs as a `tf.function`, like
    fit's (see `oracle_utils`: under mixed_float16 an eager step differs).
    """
    term_fn = term_fn or (lambda hidden, logits: penalty_value(hidden))
    model = make_stock_model()
    model.set_weights(weights)
    optimizer = keras.optimizers.Adam(0.01)
    if mixed:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(model.trainable_weights)  # before tracing: see graph_step
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    hidden_layer, out_layer = model.get_layer("hidden"), model.get_layer("out")

    @graph_step
    def step(xb, yb, weight):
        with tf.GradientTape() as tape:
            hidden = hidden_layer(xb, training=True)
            logits = out_layer(hidden, training=True)
            term = (weight / BETA) * term_fn(hidden, logits)
            loss = loss_fn(yb, logits) + (term if with_term else 0.0)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return term, loss

    term_means, loss_means = [], []
    for _ in range(EPOCHS):
        term_sum = loss_sum = 0.0
        for start in range(0, len(x), BATCH):
            xb, yb = x[start : start + BATCH], y[start : start + BATCH]
            weight = BETA if weight_fn is None else BETA * weight_fn(
                optimizer.iterations
            )
            term, loss = step(
                tf.constant(xb), tf.constant(yb), tf.constant(weight, "float32")
            )
            term_sum += float(term) * len(xb)
            loss_sum += float(loss) * len(xb)
        term_means.append(term_sum / len(x))
        loss_means.append(loss_sum / len(x))
    return model.get_weights(), term_means, loss_means


def tapeops_fit(weights, x, y, term=None, strategy=None, **compile_kwargs):
    scope = strategy.scope() if strategy is not None else _null_scope()
    with scope:
        model = kt.upgrade(make_stock_model())
        model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            loss_terms=[term or kt.ActivationPenalty("hidden", l2=BETA, name="act")],
            **compile_kwargs,
        )
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    )
    return model, history.history


class _null_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_weights_close(actual, expected, atol):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, atol=atol, rtol=0)


def initial_weights():
    return make_stock_model().get_weights()


@pytest.mark.parametrize(
    "variant",
    ["plain", "jit_compile", "steps_per_execution", "mirrored", "micro_batches"],
)
def test_activation_penalty_matches_hand_written_loop(variant, request):
    x, y = make_data()
    weights = initial_weights()
    expected, term_means, loss_means = oracle_fit(weights, x, y)
    kwargs, strategy = {}, None
    if variant == "jit_compile":
        kwargs["jit_compile"] = True
    elif variant == "steps_per_execution":
        kwargs["steps_per_execution"] = 3
    elif variant == "micro_batches":
        kwargs["micro_batches"] = 2
    elif variant == "mirrored":
        strategy = request.getfixturevalue("mirrored")
    model, history = tapeops_fit(weights, x, y, strategy=strategy, **kwargs)
    assert_weights_close(model.get_weights(), expected, atol=1e-5)
    np.testing.assert_allclose(history["act"], term_means, rtol=1e-5)
    np.testing.assert_allclose(history["loss"], loss_means, rtol=1e-5)


def test_comparison_fails_without_the_term():
    x, y = make_data()
    weights = initial_weights()
    without, _, _ = oracle_fit(weights, x, y, with_term=False)
    model, _ = tapeops_fit(weights, x, y)
    diffs = [np.max(np.abs(a - b)) for a, b in zip(model.get_weights(), without)]
    assert max(diffs) > 1e-3


def test_logged_value_is_sample_weighted_not_batch_mean():
    x, y = make_data()
    weights = initial_weights()
    model = kt.upgrade(make_stock_model())
    model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        loss_terms=[kt.ActivationPenalty("hidden", l2=BETA, name="act")],
    )
    logged = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history[
        "act"
    ][0]
    hidden = model.get_layer("hidden")(x)
    per_batch = [
        float(penalty_value(hidden[i : i + BATCH])) for i in range(0, N, BATCH)
    ]
    sizes = [min(BATCH, N - i) for i in range(0, N, BATCH)]
    weighted = np.average(per_batch, weights=sizes)
    np.testing.assert_allclose(logged, weighted, rtol=1e-5)
    assert abs(weighted - np.mean(per_batch)) > 1e-4 * abs(weighted)


def test_mirrored_equals_single_device(mirrored):
    x, y = make_data()
    weights = initial_weights()
    single, single_history = tapeops_fit(weights, x, y)
    multi, multi_history = tapeops_fit(weights, x, y, strategy=mirrored)
    assert_weights_close(multi.get_weights(), single.get_weights(), atol=1e-5)
    np.testing.assert_allclose(multi_history["act"], single_history["act"], rtol=1e-5)
    np.testing.assert_allclose(
        multi_history["loss"], single_history["loss"], rtol=1e-5
    )


def test_mixed_float16_matches_hand_written_loop():
    x, y = make_data()
    weights = initial_weights()
    keras.config.set_dtype_policy("mixed_float16")
    expected, term_means, _ = oracle_fit(weights, x, y, mixed=True)
    model, history = tapeops_fit(weights, x, y)
    assert model.get_layer("hidden").compute_dtype == "float16"
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_weights_close(model.get_weights(), expected, atol=1e-5)
    np.testing.assert_allclose(history["act"], term_means, rtol=1e-5)


@pytest.mark.parametrize("term", ["activation", "loss_term"])
def test_mixed_float16_comparison_fails_without_the_term(term):
    """Companion of the mixed_float16 comparisons: the term moves the weights
    under mixed_float16 far beyond their tolerance (1e-5)."""
    x, y = make_data()
    weights = initial_weights()
    keras.config.set_dtype_policy("mixed_float16")
    without, _, _ = oracle_fit(weights, x, y, mixed=True, with_term=False)
    if term == "activation":
        model, _ = tapeops_fit(weights, x, y)
    else:
        model, _ = tapeops_fit(
            weights, x, y, term=kt.LossTerm(mean_square_logits, name="logits_sq")
        )
    diffs = [np.max(np.abs(a - b)) for a, b in zip(model.get_weights(), without)]
    assert max(diffs) > 1e-3


def test_schedule_weight_follows_optimizer_step():
    x, y = make_data()
    weights = initial_weights()
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([4, 9], [0.0, 1.0, 3.0])

    def weight_fn(step):
        return float(schedule(step))

    expected, term_means, _ = oracle_fit(weights, x, y, weight_fn=weight_fn)
    term = kt.ActivationPenalty("hidden", l2=BETA, name="act", weight=schedule)
    model, history = tapeops_fit(weights, x, y, term=term)
    assert_weights_close(model.get_weights(), expected, atol=1e-5)
    np.testing.assert_allclose(history["act"], term_means, rtol=1e-5)
    # Steps 0-4 have weight 0, so the first epoch's mean is below a constant
    # weight of 1 would give, and the second epoch (steps 7-13) sees 1 then 3.
    constant, constant_means, _ = oracle_fit(weights, x, y)
    assert history["act"][0] < constant_means[0]
    assert history["act"][1] > constant_means[1]


def test_validation_reports_and_counts_terms():
    x, y = make_data()
    xv, yv = make_data(36, seed=1)
    weights = initial_weights()
    model = kt.upgrade(make_stock_model())
    model.set_weights(weights)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=loss_fn,
        loss_terms=[
            kt.ActivationPenalty("hidden", l2=BETA, name="act"),
            kt.ActivationPenalty("out", l1=0.1, name="train_only", in_validation=False),
        ],
    )
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
        validation_data=(xv, yv), validation_batch_size=36,
    ).history
    assert "val_act" in history and "train_only" in history
    # A training-only term is neither computed nor reported in validation.
    assert "val_train_only" not in history
    assert sorted(history) == sorted(
        ["loss", "act", "train_only", "val_loss", "val_act"]
    )
    hidden = model.get_layer("hidden")(xv)
    expected_act = float(penalty_value(hidden))
    expected_loss = float(loss_fn(yv, model(xv))) + expected_act
    np.testing.assert_allclose(history["val_act"][0], expected_act, rtol=1e-5)
    np.testing.assert_allclose(history["val_loss"][0], expected_loss, rtol=1e-5)
    logs = model.evaluate(xv, yv, batch_size=36, verbose=0, return_dict=True)
    np.testing.assert_allclose(logs["act"], expected_act, rtol=1e-5)
    assert sorted(logs) == ["act", "loss"]
    as_list = model.evaluate(xv, yv, batch_size=36, verbose=0)
    np.testing.assert_allclose(as_list, [logs["loss"], logs["act"]], rtol=1e-6)
    on_batch = model.test_on_batch(xv, yv, return_dict=True)
    assert sorted(on_batch) == ["act", "loss"]
    # Training still reports the term after evaluating.
    again = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0).history
    assert "train_only" in again


NV, VAL_BATCH = 35, 10  # validation batches 10, 10, 10, 5 (split 3/2 on two replicas)


class EpochEndWeights(keras.callbacks.Callback):
    """The weights validation ran with: those at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(self.model.get_weights())


def numpy_validation(weights, xv, yv, beta=BETA, train_only=0.0):
    """NumPy `(val_act, val_loss)`: sample-weighted means over validation batches.

    `train_only` is the coefficient of a wrong oracle that also counts the
    training-only `0.1 * mean(|logits|)` term in `val_loss`.
    """
    w1, b1, w2, b2 = [w.astype("float64") for w in weights]
    acts, losses, sizes = [], [], []
    for start in range(0, len(xv), VAL_BATCH):
        xb, yb = xv[start : start + VAL_BATCH], yv[start : start + VAL_BATCH]
        hidden = np.maximum(xb @ w1 + b1, 0.0)
        logits = hidden @ w2 + b2
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        cross_entropy = -np.mean(log_probs[np.arange(len(yb)), yb])
        act = beta * np.mean(np.square(hidden))
        acts.append(act)
        losses.append(cross_entropy + act + train_only * np.mean(np.abs(logits)))
        sizes.append(len(xb))
    return np.average(acts, weights=sizes), np.average(losses, weights=sizes)


def fit_with_validation(weights, strategy=None):
    x, y = make_data()
    xv, yv = make_data(NV, seed=1)
    with strategy.scope() if strategy is not None else _null_scope():
        model = kt.upgrade(make_stock_model())
        model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            loss_terms=[
                kt.ActivationPenalty("hidden", l2=BETA, name="act"),
                kt.ActivationPenalty(
                    "out", l1=0.1, name="train_only", in_validation=False
                ),
            ],
        )
    recorder = EpochEndWeights()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
        validation_data=(xv, yv), validation_batch_size=VAL_BATCH,
        callbacks=[recorder],
    ).history
    return history, recorder.weights


@pytest.fixture(scope="module")
def validation_runs(mirrored):
    """One single-device and one MirroredStrategy x2 fit with validation."""
    weights = initial_weights()
    single, _ = fit_with_validation(weights)
    multi, multi_weights = fit_with_validation(weights, strategy=mirrored)
    keras.backend.clear_session()
    return single, multi, multi_weights


def test_mirrored_validation_terms_equal_single_device_and_numpy(validation_runs):
    single, multi, multi_weights = validation_runs
    expected_keys = ["act", "loss", "train_only", "val_act", "val_loss"]
    assert sorted(single) == sorted(multi) == expected_keys
    for key in ("val_act", "val_loss", "act", "loss"):
        np.testing.assert_allclose(multi[key], single[key], rtol=1e-5, err_msg=key)
    xv, yv = make_data(NV, seed=1)
    expected = np.array([numpy_validation(w, xv, yv) for w in multi_weights])
    np.testing.assert_allclose(multi["val_act"], expected[:, 0], rtol=1e-5)
    np.testing.assert_allclose(multi["val_loss"], expected[:, 1], rtol=1e-5)


@pytest.mark.parametrize(
    "wrong",
    ["term_not_counted", "summed_over_replicas", "training_only_term_counted"],
)
def test_mirrored_validation_check_can_fail(validation_runs, wrong):
    """Companion: oracles of plausible mistakes are outside the tolerance."""
    _, multi, multi_weights = validation_runs
    xv, yv = make_data(NV, seed=1)
    kwargs = {
        "term_not_counted": {"beta": 0.0},
        "summed_over_replicas": {"beta": 2 * BETA},
        "training_only_term_counted": {"train_only": 0.1},
    }[wrong]
    expected = np.array([numpy_validation(w, xv, yv, **kwargs) for w in multi_weights])
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(multi["val_loss"], expected[:, 1], rtol=1e-5)


def test_unknown_layer_fails_at_compile_before_any_weight_change():
    model = kt.upgrade(make_stock_model())
    before = model.get_weights()
    with pytest.raises(
        ValueError, match=r"No layer 'hiden'.*Available layer paths: \['hidden', 'out'\]"
    ):
        model.compile(
            optimizer="adam", loss="sparse_categorical_crossentropy",
            loss_terms=[kt.ActivationPenalty("hiden", l2=1.0)],
        )
    assert model.tapeops_options is None  # no compilation was half-applied
    assert_weights_close(model.get_weights(), before, atol=0)


def test_nested_layer_by_path_matches_loop():
    x, y = make_data()
    backbone = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="hidden")],
        name="backbone",
    )
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3, name="out")(backbone(inputs))
    model = kt.upgrade(keras.Model(inputs, outputs))
    stock = make_stock_model()
    stock.set_weights(model.get_weights())
    expected, term_means, _ = oracle_fit(stock.get_weights(), x, y)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        loss_terms=[kt.ActivationPenalty("backbone/hidden", l2=BETA, name="act")],
    )
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    ).history
    assert_weights_close(model.get_weights(), expected, atol=1e-5)
    np.testing.assert_allclose(history["act"], term_means, rtol=1e-5)


class SubclassedNet(kt.TapeOpsMixin, keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu", name="hidden")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, x):
        return self.out(self.hidden(x))


def test_subclassed_model_matches_loop():
    x, y = make_data()
    weights = initial_weights()
    expected, term_means, _ = oracle_fit(weights, x, y)
    model = SubclassedNet()
    model(x[:1])
    model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        loss_terms=[kt.ActivationPenalty(model.hidden, l2=BETA, name="act")],
    )
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    ).history
    assert_weights_close(model.get_weights(), expected, atol=1e-5)
    np.testing.assert_allclose(history["act"], term_means, rtol=1e-5)


def test_unbuilt_subclassed_model_resolves_the_layer_by_name():
    x, y = make_data()
    model = SubclassedNet()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        loss_terms=[kt.ActivationPenalty("hidden", l2=BETA, name="act")],
    )
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    hidden = model.hidden(x)
    assert history.history["act"][0] > 0
    logs = model.evaluate(x, y, batch_size=N, verbose=0, return_dict=True)
    np.testing.assert_allclose(logs["act"], float(penalty_value(hidden)), rtol=1e-5)


class CountingDense(keras.layers.Dense):
    """Dense that counts how often its `call` runs (at trace time in fit)."""

    calls = 0

    def call(self, inputs):
        CountingDense.calls += 1
        return super().call(inputs)


def count_calls_in_fit(terms):
    x, y = make_data(32)
    inputs = keras.Input((4,))
    hidden = CountingDense(8, name="hidden")(inputs)
    model = kt.upgrade(keras.Model(inputs, keras.layers.Dense(3)(hidden)))
    model.compile(optimizer="adam", loss="mse", loss_terms=terms)
    CountingDense.calls = 0
    model.fit(x, np.zeros((32, 3)), batch_size=32, epochs=1, verbose=0)
    return CountingDense.calls


def test_activation_penalty_never_runs_the_layer_twice():
    without = count_calls_in_fit(None)
    with_term = count_calls_in_fit([kt.ActivationPenalty("hidden", l2=1.0)])
    assert without >= 1
    assert with_term == without


@keras.saving.register_keras_serializable(package="keras_tapeops_tests")
def mean_square_logits(model, x, y, y_pred):
    """A registered LossTerm function: BETA * mean(square(y_pred)) in float32."""
    return BETA * tf.reduce_mean(tf.square(tf.cast(y_pred, "float32")))


def logits_term(hidden, logits):
    return BETA * tf.reduce_mean(tf.square(tf.cast(logits, "float32")))


@pytest.mark.parametrize("variant", ["plain", "mirrored", "mixed_float16", "jit_spe"])
def test_loss_term_matches_hand_written_loop(variant, request):
    x, y = make_data()
    weights = initial_weights()
    strategy, kwargs = None, {}
    if variant == "mixed_float16":
        keras.config.set_dtype_policy("mixed_float16")
    elif variant == "mirrored":
        strategy = request.getfixturevalue("mirrored")
    elif variant == "jit_spe":
        kwargs = {"jit_compile": True, "steps_per_execution": 2}
    expected, term_means, loss_means = oracle_fit(
        weights, x, y, term_fn=logits_term, mixed=variant == "mixed_float16"
    )
    term = kt.LossTerm(mean_square_logits, name="logits_sq")
    model, history = tapeops_fit(weights, x, y, term=term, strategy=strategy, **kwargs)
    assert_weights_close(model.get_weights(), expected, atol=1e-5)
    np.testing.assert_allclose(history["logits_sq"], term_means, rtol=1e-5)
    np.testing.assert_allclose(history["loss"], loss_means, rtol=1e-5)


def compile_with_terms(model):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        loss_terms=[
            kt.ActivationPenalty(
                "hidden", l2=BETA, name="act",
                weight=keras.optimizers.schedules.ExponentialDecay(1.0, 5, 0.5),
            ),
            kt.LossTerm(mean_square_logits, weight=0.1, name="logits_sq",
                        in_validation=False),
        ],
    )


def test_save_and_load_keep_the_terms(tmp_path):
    x, y = make_data()
    model = kt.upgrade(make_stock_model())
    compile_with_terms(model)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    path = str(tmp_path / "terms.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, kt.TapeOpsFunctional)
    terms = loaded.tapeops_options.terms
    assert [type(t) for t in terms] == [kt.ActivationPenalty, kt.LossTerm]
    assert [t.get_config() for t in terms] == [
        t.get_config() for t in model.tapeops_options.terms
    ]
    assert terms[1].fn is mean_square_logits
    # Both continue identically: same weights, optimizer state and terms.
    h1 = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    h2 = loaded.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    assert_weights_close(loaded.get_weights(), model.get_weights(), atol=1e-6)
    assert h1.keys() == h2.keys()
    for key in ("act", "logits_sq", "loss"):
        np.testing.assert_allclose(h2[key], h1[key], rtol=1e-6)


def test_saving_an_unregistered_fn_fails_clearly(tmp_path):
    model = kt.upgrade(make_stock_model())
    model.compile(
        optimizer="adam", loss="mse",
        loss_terms=[kt.LossTerm(lambda m, x, y, p: tf.reduce_mean(p), name="lam")],
    )
    with pytest.raises(ValueError, match=r"'lam' cannot be saved.*register_keras_serializable.*Received: fn="):
        model.save(str(tmp_path / "lam.keras"))


class ExtraTermNet(SubclassedNet):
    """Adds a term through the `compute_terms` hook, without a Term class."""

    def compute_terms(self, terms, context):
        values = super().compute_terms(terms, context)
        return values + [logits_term(None, context.y_pred)]


def test_compute_terms_hook_adds_an_unlogged_term():
    x, y = make_data()
    weights = initial_weights()
    expected, _, loss_means = oracle_fit(weights, x, y, term_fn=logits_term)
    model = ExtraTermNet()
    model(x[:1])
    model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    ).history
    assert sorted(history) == ["loss"]
    assert_weights_close(model.get_weights(), expected, atol=1e-5)
    np.testing.assert_allclose(history["loss"], loss_means, rtol=1e-5)
