"""Privacy promises under faults (issue 28): the budget is never exceeded, every
example's influence stays bounded, sampling is independent across epochs and
restarts, and bad input fails before any step.

Each test names the figure the code before the fix produced.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.privacy import noise as noise_lib

SIGMA = 0.8


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(n=32, features=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, features)).astype("float32"), rng.integers(0, 2, size=n)


def _dense_model(features=3, strategy=None):
    def build():
        keras.utils.set_random_seed(7)
        return kt.upgrade(keras.Sequential([keras.Input((features,)), keras.layers.Dense(2)]))

    if strategy is None:
        return build()
    with strategy.scope():
        return build()


def _compile(model, dp=None, strategy=None, **options):
    dp = dp or kt.DPSGD(1.0, SIGMA, seed=0)

    def run():
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=_loss(),
                      differential_privacy=dp, **options)

    if strategy is None:
        run()
    else:
        with strategy.scope():
            run()
    return model


def _rdp(steps, rate):
    return kt.privacy.epsilon(steps, rate, SIGMA, accountant="rdp")


def _between(steps, rate):
    """A target that `steps` steps meet and `steps + 1` exceed."""
    return (_rdp(steps, rate) + _rdp(steps + 1, rate)) / 2


# ------------------------------------------------------------------ item 1
def test_budget_refuses_a_target_no_step_meets_before_any_step():
    """Before the fix one step ran and spent 3.08 for a target of 2.47 (q = 1/4)."""
    x, y = _data()
    model = _compile(_dense_model())
    start = model.get_weights()
    one_step = _rdp(1, 0.25)
    budget = kt.callbacks.PrivacyBudget(32, target_epsilon=one_step * 0.8, sampling_rate=0.25,
                                        accountant="rdp")
    with pytest.raises(ValueError, match=(
        rf"target_epsilon.*Received: target_epsilon={one_step * 0.8:g} "
        rf"and a one-step epsilon of {one_step:g}"
    )):
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[budget], verbose=0)
    assert int(model.optimizer.iterations) == 0
    for before, after in zip(start, model.get_weights()):
        np.testing.assert_array_equal(before, after)


def test_budget_is_never_exceeded_across_fit_calls():
    """4 steps per fit, 6 allowed: before the fix every later fit ran one more
    step (7 after three fits, 10.07 for a target of 6 after twenty)."""
    x, y = _data()
    model = _compile(_dense_model())
    target = _between(6, 0.25)
    budget = kt.callbacks.PrivacyBudget(32, target_epsilon=target, sampling_rate=0.25,
                                        accountant="rdp")
    logged = []
    for _ in range(4):
        history = model.fit(x, y, batch_size=8, epochs=1, callbacks=[budget], verbose=0)
        logged += history.history["epsilon"]
    assert int(model.optimizer.iterations) == 6
    assert budget.epsilon() <= target
    np.testing.assert_allclose(logged, [_rdp(4, 0.25)] + [_rdp(6, 0.25)] * 3, rtol=1e-9)


@pytest.mark.parametrize("per_execution, expected", [(4, 4), (3, 6), (1, 7)])
def test_budget_with_steps_per_execution_stops_before_an_execution_that_could_exceed(
    per_execution, expected
):
    """7 steps allowed, 8 batches per epoch. A whole execution of k steps runs at
    once, so training stops at the last multiple of k within the budget.
    Before the fix k=4 ran 8 steps (6.255 for a target of 6)."""
    x, y = _data(64)
    model = _compile(_dense_model(), steps_per_execution=per_execution)
    target = _between(7, 0.125)
    budget = kt.callbacks.PrivacyBudget(64, target_epsilon=target, sampling_rate=0.125,
                                        accountant="rdp")
    model.fit(x, y, batch_size=8, epochs=3, callbacks=[budget], verbose=0)
    assert int(model.optimizer.iterations) == expected
    assert budget.epsilon() <= target


def test_budget_without_sampling_rate_refuses_a_target_it_cannot_check_first():
    """The inferred rate is known only after a step: a target below the worst
    case (rate 1) of the first step is refused before it runs."""
    x, y = _data()
    model = _compile(_dense_model())
    target = _rdp(1, 1.0) * 0.9
    budget = kt.callbacks.PrivacyBudget(32, target_epsilon=target, accountant="rdp")
    with pytest.raises(ValueError, match=r"Pass sampling_rate=.*Received: target_epsilon=.*sampling_rate=None"):
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[budget], verbose=0)
    assert int(model.optimizer.iterations) == 0


# ------------------------------------------------------------------ item 2
def test_budget_refuses_to_guess_the_rate_of_poisson_batches():
    """Before the fix it inferred padded rows / N (16 / 32 here) for q = 0.25:
    epsilon 1.34 where the true one is 0.94, with no warning."""
    x, y = _data()
    model = _compile(_dense_model())
    start = model.get_weights()
    batches = kt.privacy.poisson_batches((x, y), 0.25, seed=0, model=model)
    budget = kt.callbacks.PrivacyBudget(32, accountant="rdp")
    with pytest.raises(ValueError, match=(
        r"cannot infer the sampling rate of masked batches.*sampling_rate=q\). "
        r"Received: sampling_rate=None and batches with a boolean sample_weight mask"
    )):
        model.fit(batches, epochs=1, callbacks=[budget], verbose=0, shuffle=False)
    for before, after in zip(start, model.get_weights()):
        np.testing.assert_array_equal(before, after)
    # A later fit refuses in on_train_begin (the masked step is already traced).
    model.fit(batches, epochs=1, verbose=0, shuffle=False)
    with pytest.raises(ValueError, match="cannot infer the sampling rate"):
        model.fit(batches, epochs=1, callbacks=[kt.callbacks.PrivacyBudget(32)], verbose=0,
                  shuffle=False)
    given = kt.callbacks.PrivacyBudget(32, sampling_rate=0.25, accountant="rdp")
    history = model.fit(batches, epochs=1, callbacks=[given], verbose=0, shuffle=False)
    assert history.history["epsilon"] == [_rdp(8, 0.25)]


# ------------------------------------------------------------------ item 16
@pytest.mark.unit
@pytest.mark.parametrize("x_rows, y_rows", [(10, 9), (9, 10)])
def test_poisson_batches_checks_that_x_and_y_have_the_same_length(x_rows, y_rows):
    """Before the fix one order silently dropped labels, the other failed mid-iteration."""
    x = {"a": np.zeros((x_rows, 2), "float32"), "b": np.zeros((x_rows,), "float32")}
    with pytest.raises(ValueError, match=(
        rf"same number of examples.*Received: x has {x_rows} samples and y has {y_rows}"
    )):
        kt.privacy.poisson_batches((x, np.zeros(y_rows)), 0.5, seed=0)


def test_budget_without_dp_accounting_fails_before_any_step(monkeypatch):
    """Before the fix the ImportError came at the first epoch's end, after 4 steps."""
    x, y = _data()
    model = _compile(_dense_model())
    start = model.get_weights()
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # `import dp_accounting` fails
    budget = kt.callbacks.PrivacyBudget(32, sampling_rate=0.25)
    with pytest.raises(ImportError, match=r"pip install keras-tapeops\[privacy\]"):
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[budget], verbose=0)
    assert int(model.optimizer.iterations) == 0
    for before, after in zip(start, model.get_weights()):
        np.testing.assert_array_equal(before, after)


# ------------------------------------------------------------------ item 3
def _masks(batches):
    return [m.numpy() for _, _, m in batches]


@pytest.mark.unit
def test_poisson_batches_draw_by_the_models_step_and_differ_between_epochs():
    x, y = _data(40)
    model = _compile(_dense_model())
    batches = kt.privacy.poisson_batches((x, y), 0.25, seed=3, model=model)
    first = _masks(batches)
    again = _masks(batches)  # same step: the same draw
    model.optimizer.iterations.assign(4)  # after a 4-step epoch
    second = _masks(batches)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert all(not np.array_equal(a, b) for a, b in zip(first, second))
    # Without a model, each pass over the dataset draws anew.
    plain = kt.privacy.poisson_batches((x, y), 0.25, seed=3)
    assert any(not np.array_equal(a, b) for a, b in zip(_masks(plain), _masks(plain)))


class _Crash(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("crash")


def test_poisson_batches_resume_after_a_crash_equals_the_uninterrupted_run(tmp_path):
    """BackupAndRestore, a crash at the start of epoch 2, a fresh model resumed.
    Before the fix (no `model=`, epochs counted per process) the resumed epoch
    replayed epoch 0's batches: weights 1.26e-2 off the uninterrupted run."""
    x, y = _data(40)
    keras.utils.set_random_seed(7)
    initial = _dense_model().get_weights()

    def run(callbacks, epochs=3):
        model = _dense_model()
        model.set_weights(initial)
        _compile(model, dp=kt.DPSGD(1.0, 0.5, seed=1))
        batches = kt.privacy.poisson_batches((x, y), 0.25, seed=3, model=model)
        model.fit(batches, epochs=epochs, callbacks=callbacks, verbose=0, shuffle=False)
        return model

    uninterrupted = run([])
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="crash"):
        run([keras.callbacks.BackupAndRestore(backup), _Crash(epoch=2)])
    resumed = run([keras.callbacks.BackupAndRestore(backup)])
    assert int(resumed.optimizer.iterations) == int(uninterrupted.optimizer.iterations) == 12
    for a, b in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    two_epochs = run([], epochs=2)  # the resumed epoch did train: it moved the weights
    assert max(np.abs(a - b).max() for a, b in
               zip(two_epochs.get_weights(), resumed.get_weights())) > 1e-3


# ------------------------------------------------------------------ item 8
def _oracle_step(oracle, bx, by, keep, clip, sigma, seed, step):
    """Per-example tapes on the stock model, clip, sum the kept rows, add the
    step's noise, divide by the batch's rows; one SGD step."""
    variables = oracle.trainable_variables

    @tf.function
    def clipped(xi, yi):
        with tf.GradientTape() as tape:
            loss = oracle.compute_loss(x=xi, y=yi, y_pred=oracle(xi, training=True))
        grads = tape.gradient(loss, variables)
        return [g * tf.minimum(1.0, clip / tf.linalg.global_norm(grads)) for g in grads]

    total = [np.zeros(v.shape, "float32") for v in variables]
    for i in np.flatnonzero(keep):
        for t, g in zip(total, clipped(bx[i:i + 1], by[i:i + 1])):
            t += g.numpy()
    key = tf.constant(noise_lib.seed_halves(seed), tf.int64)
    update = [
        (t + noise_lib.gaussian(t.shape, key, step, index, clip * sigma).numpy()) / len(bx)
        for index, t in enumerate(total)
    ]
    oracle.optimizer.apply_gradients(zip([tf.constant(u) for u in update], variables))


@pytest.mark.parametrize("fault, method", [
    ("nan_input", "auto"), ("inf_input", "auto"), ("nan_target", "auto"),
    ("nan_input", "vectorized"),
])
def test_a_non_finite_example_contributes_zero_and_is_counted(fault, method):
    """Before the fix one NaN example made every weight NaN."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    bad = 5
    if fault == "nan_input":
        x[bad, 1] = np.nan
    elif fault == "inf_input":
        x[bad, 0] = np.inf
    else:
        y[bad, 0] = np.nan
    keras.utils.set_random_seed(7)
    layers = [keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)]
    model = kt.upgrade(keras.Sequential(layers))
    start = model.get_weights()
    clip, sigma, seed = 0.3, 0.7, 4
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse",
                  differential_privacy=kt.DPSGD(clip, sigma, seed=seed, method=method))
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert history.history["dp_nonfinite_examples"] == [1.0]

    oracle = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                               keras.layers.Dense(2)])
    _assert_equals_the_oracle_without(model, oracle, start, x, y, bad, 8, (clip, sigma, seed))


def _assert_equals_the_oracle_without(model, oracle, start, x, y, bad, batch, dp):
    """`model`'s weights equal the per-example oracle's (from `start`, SGD 0.5,
    mse) over batches of `batch` rows with example `bad` left out; `dp` is
    `(clip, sigma, seed)`."""
    oracle.set_weights(start)
    oracle.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    keep = np.ones(len(x), bool)
    keep[bad] = False
    for step in range(len(x) // batch):
        rows = slice(batch * step, batch * step + batch)
        _oracle_step(oracle, x[rows], y[rows], keep[rows], *dp, step)
    for a, b in zip(model.get_weights(), oracle.get_weights()):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fault", ["overflow_inside", "nan_input"])
def test_a_non_finite_example_inside_a_cnn_contributes_zero(fault):
    """Convolutions, depthwise and GroupNormalization: an example whose
    activations overflow inside the network (finite input, infinite loss and
    norms) or whose input is NaN is zeroed, the others clipped as usual
    (the rules run again on zeroed records only for such a batch)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    bad = 2
    x[bad, 0, 0, 0] = 1e3 if fault == "overflow_inside" else np.nan  # exp(~300) = inf

    def cnn():
        return keras.Sequential([
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(4, 3, padding="same", activation="exponential"),
            keras.layers.GroupNormalization(2),
            keras.layers.DepthwiseConv2D(3, strides=2, padding="same"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ])

    model = _fit_equals_the_oracle_without(cnn, x, y, bad)
    methods = {m for _, _, m in model.tapeops_state.engine.report()}
    assert not any("vectorized" in m for m in methods), methods


def _fit_equals_the_oracle_without(build, x, y, bad):
    """A DP-SGD `fit` (batches of 4) of `kt.upgrade(build())` counts example
    `bad` as non-finite and equals the per-example oracle without it."""
    keras.utils.set_random_seed(3)
    model = kt.upgrade(build())
    start = model.get_weights()
    clip, sigma, seed = 0.3, 0.7, 4
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse",
                  differential_privacy=kt.DPSGD(clip, sigma, seed=seed))
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert history.history["dp_nonfinite_examples"] == [1.0]
    _assert_equals_the_oracle_without(model, build(), start, x, y, bad, 4, (clip, sigma, seed))
    return model


def test_row_local_layers_are_not_clipped_again_for_a_non_finite_batch(monkeypatch):
    """The non-finite branch cleans the per-example rows of row-local parts
    (`Part.sanitized`) instead of running their rule again on zeroed records,
    which kept every layer's inputs and output gradients alive until the
    branch (the bench's transformer: 41 -> 30 MiB step peak). The Conv2D
    (per-example rows: 18 x 4 per example against 36 x 4 output gradients)
    and GroupNormalization rules run once per trace; the ghost Dense head
    runs again. Its weights equal the per-example oracle's without the NaN
    example."""
    from keras_tapeops.privacy import ghost_conv
    from keras_tapeops.privacy import ghost_dense
    from keras_tapeops.privacy import ghost_group_norm

    calls = {"Conv": 0, "GroupNormalization": 0, "Dense": 0}
    for rule in (ghost_conv.ConvRule, ghost_group_norm.GroupNormRule, ghost_dense.DenseRule):
        original = rule.clip

        def counted(site, records, grads, context, original=original, family=rule.family):
            calls[family] += 1
            return original(site, records, grads, context)

        monkeypatch.setattr(rule, "clip", staticmethod(counted))
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    bad = 2
    x[bad, 1, 1, 1] = np.nan

    def cnn():
        return keras.Sequential([
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(4, 3, padding="same", activation="tanh"),
            keras.layers.GroupNormalization(2),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ])

    _fit_equals_the_oracle_without(cnn, x, y, bad)
    assert calls == {"Conv": 1, "GroupNormalization": 1, "Dense": 2}, calls


@pytest.mark.unit
def test_jacobian_rows_are_not_row_local_but_rule_rows_are():
    """A per-example Jacobian over the whole batch puts one example's NaN
    into every row (`A^T (e_i G)`: NaN times 0), so the vectorized parts
    must be computed again from zeroed records, not cleaned row by row; the
    rules' `A_i^T G_i` rows keep it in its own row."""
    from keras_tapeops import rows as rows_lib
    from keras_tapeops.privacy import vectorized

    kernel = tf.Variable(tf.random.normal([3, 2], seed=1))
    a = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    a[1, 0] = np.nan
    g = tf.ones([4, 2])

    @tf.function
    def jacobian_parts(a):
        with tf.GradientTape(persistent=True) as tape:
            objectives = tf.reduce_sum((a @ kernel) * g, 1)
        matrix = rows_lib.jacobian_rows(tape, objectives, [kernel], method="pfor")
        parts = vectorized.rows_parts(tape, objectives, [kernel], 1.0, "vectorized")
        part = parts[id(kernel)]
        return matrix, part.row_local, part.sanitized() is None

    matrix, row_local, not_cleaned = jacobian_parts(tf.constant(a))
    assert not np.isfinite(matrix.numpy()).all(axis=1).any()  # every row is NaN
    assert not row_local and not_cleaned
    local = kt.privacy.per_example_part(tf.einsum("bp,bo->bpo", a, g), 1.0, [3, 2])
    assert local.rows is not None
    assert np.isfinite(local.rows.numpy()).all(axis=1).tolist() == [True, False, True, True]
    rows, clean = local.rows.numpy(), local.sanitized().rows.numpy()
    finite = np.isfinite(rows)
    np.testing.assert_array_equal(clean[finite], rows[finite])  # the rest is 0
    np.testing.assert_array_equal(clean[~finite], np.zeros((~finite).sum()))


def test_a_non_finite_example_under_jit_equals_the_graph_step():
    """XLA: the same zeroing (noise 0: XLA draws other noise than the graph)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 3)).astype("float32")
    x[3, 2] = np.nan
    y = rng.integers(0, 2, size=8)
    weights = []
    for jit in (False, True):
        model = _compile(_dense_model(), dp=kt.DPSGD(0.2, 0.0), jit_compile=jit)
        history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        assert history.history["dp_nonfinite_examples"] == [1.0]
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ item 12
def _poisson_run(strategy=None):
    x, y = _data(40)
    model = _compile(_dense_model(strategy=strategy), dp=kt.DPSGD(1.0, 0.5, seed=2),
                     strategy=strategy)
    batches = kt.privacy.poisson_batches((x, y), 0.25, seed=5, model=model, max_batch_size=16)
    history = model.fit(batches, epochs=2, verbose=0, shuffle=False)
    return model.get_weights(), history.history["loss"]


def test_poisson_batches_train_under_mirrored_strategy(mirrored):
    """Before the fix: "Value for attr 'T' of bool is not in the list of allowed
    values" (Keras's build reduces the boolean mask across replicas)."""
    weights, loss = _poisson_run(mirrored)
    assert len(loss) == 2 and np.all(np.isfinite(loss))
    assert all(np.isfinite(w).all() for w in weights)


def test_poisson_batches_under_mirrored_strategy_equal_one_device(mirrored):
    """Before the fix: the pass key (optimizer.iterations) was read when tf.data
    ran the pass's first element, sometimes after the epoch's first step, so the
    batches (and the run) depended on thread timing."""
    single_weights, single_loss = _poisson_run()
    mirrored_weights, mirrored_loss = _poisson_run(mirrored)
    for a, b in zip(mirrored_weights, single_weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mirrored_loss, single_loss, rtol=1e-5)


def test_poisson_pass_key_is_the_step_count_when_the_epoch_began():
    """fit() adds the dataset's epoch clock first; a late read of the key sees
    the step count of the epoch's start, not the current one."""
    from keras_tapeops import fit_callbacks
    from keras_tapeops.privacy.poisson import _EpochClock

    x, y = _data(16)
    model = _compile(_dense_model(), dp=kt.DPSGD(1.0, 0.0, seed=0))
    batches = kt.privacy.poisson_batches((x, y), 0.5, seed=1, model=model, max_batch_size=16)
    [clock_callback] = fit_callbacks.requested_by(batches)
    assert isinstance(clock_callback, _EpochClock)
    clock = clock_callback._clock
    model.optimizer.build(model.trainable_variables)
    model.optimizer.iterations.assign(6)
    clock_callback.on_epoch_begin(0)
    model.optimizer.iterations.assign(7)  # a step ran before tf.data read the key
    assert int(clock.next_key()) == 6
    clock_callback.on_train_end()
    assert int(clock.next_key()) == 7  # outside fit: the counter itself
    seen = []

    class Keys(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append((clock.epoch_key, int(self.model.optimizer.iterations)))

    model.fit(batches, epochs=2, verbose=0, callbacks=[Keys()])
    assert seen == [(7, 7), (9, 9)]  # the clock ran first, each epoch (2 steps an epoch)
    assert clock.epoch_key is None


# ------------------------------------------------------------------ item 14
def test_ragged_ids_to_an_embedding_equal_the_per_example_oracle():
    """Before the fix: a raw "Input to reshape is a tensor with ..." error."""
    sequences = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 1], [2, 2, 5], [3]]
    labels = np.array([0, 1, 0, 1, 1, 0])

    class Bag(kt.TapeOpsMixin, keras.Model):
        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(10, 4)
            self.head = keras.layers.Dense(2)

        def call(self, ids):
            return self.head(tf.reduce_mean(self.embed(ids), axis=1))

    keras.utils.set_random_seed(7)
    model = Bag()
    model(tf.ragged.constant(sequences[:2]))
    start = model.get_weights()
    clip = 0.05  # every example is clipped
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=_loss(),
                  differential_privacy=kt.DPSGD(clip, 0.0, seed=0))
    ragged = tf.ragged.constant(sequences, dtype=tf.int32)
    data = tf.data.Dataset.from_tensor_slices((ragged, labels)).batch(3)
    model.fit(data, epochs=1, shuffle=False, verbose=0)

    oracle = Bag()
    oracle(tf.ragged.constant(sequences[:2]))
    oracle.set_weights(start)
    variables = oracle.trainable_variables
    for batch in (range(0, 3), range(3, 6)):
        total = [np.zeros(v.shape, "float32") for v in variables]
        for i in batch:
            ids = tf.constant([sequences[i]], tf.int32)
            with tf.GradientTape() as tape:
                loss = _loss()(labels[i:i + 1], oracle(ids))
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
            scale = min(1.0, clip / float(tf.linalg.global_norm(grads)))
            for t, g in zip(total, grads):
                t += g.numpy() * scale
        for v, t in zip(variables, total):
            v.assign(v - 0.5 * t / 3)
    for a, b in zip(model.get_weights(), oracle.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
