"""End-to-end `fit()` tests of micro_batches and accumulation_steps against oracles.

Oracles: stock Keras on the large batch (`train_on_batch`), a hand-written
`tf.GradientTape` loop that accumulates `loss * n_micro / n` gradients over the
micro-batches and applies once, and NumPy for BatchNormalization statistics.
Same initial weights, same batches (shuffle=False).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops import accumulation

TOL = 2e-5


def make_net(bn=False):
    layers = [keras.Input((5,))]
    if bn:
        layers.append(keras.layers.BatchNormalization(momentum=0.9, name="bn"))
    layers += [keras.layers.Dense(6, activation="tanh", name="hidden"),
               keras.layers.Dense(2, name="head")]
    return kt.upgrade(keras.Sequential(layers))


def make_data(n=100, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    sw = rng.uniform(0.2, 2.0, size=(n,)).astype("float32")
    return x, y, sw


@pytest.fixture(scope="module")
def initial_weights():
    keras.utils.set_random_seed(7)
    return make_net().get_weights()


def assert_close(actual, expected, tol=TOL):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, atol=tol, rtol=tol)


def max_diff(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a, b))


def to_int(variable):
    return int(keras.ops.convert_to_numpy(variable))


def stock_on_batches(weights, x, y, sw, bounds, optimizer=None, strategy=None):
    """Stock Keras, one `train_on_batch` per [start, end) bound."""
    with strategy.scope() if strategy else _null():
        model = make_net()
        model.set_weights(weights)
        model.compile(optimizer or keras.optimizers.Adam(0.01), "mse")
    for start, end in bounds:
        model.train_on_batch(x[start:end], y[start:end],
                             sample_weight=None if sw is None else sw[start:end])
    return model


def fit_ours(weights, x, y, sw, batch_size, epochs=1, strategy=None, optimizer=None,
             **compile_kwargs):
    with strategy.scope() if strategy else _null():
        model = make_net()
        model.set_weights(weights)
        model.compile(optimizer or keras.optimizers.Adam(0.01), "mse", **compile_kwargs)
    history = model.fit(x, y, sample_weight=sw, batch_size=batch_size, epochs=epochs,
                        shuffle=False, verbose=0)
    return model, history


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def tape_micro_batch_loop(weights, x, y, sw, batch_size, k, lr=0.05):
    """Hand-written: per batch, sum grads of `loss_j * n_j / n` over micro-batches, SGD once."""
    model = make_net()
    model.set_weights(weights)
    variables = model.trainable_variables
    for start in range(0, len(x), batch_size):
        xb, yb, wb = x[start:start + batch_size], y[start:start + batch_size], sw[start:start + batch_size]
        n = len(xb)
        sums = [tf.zeros_like(v) for v in variables]
        offset = 0
        for size in accumulation.micro_batch_sizes(n, k):
            sl = slice(offset, offset + size)
            offset += size
            with tf.GradientTape() as tape:
                pred = model(xb[sl], training=True)
                per_sample = tf.reduce_mean(tf.square(pred - yb[sl]), axis=-1)
                loss = tf.reduce_sum(per_sample * wb[sl]) / size  # sum_over_batch_size
                loss = loss * size / n
            sums = [s + g for s, g in zip(sums, tape.gradient(loss, variables))]
        for v, g in zip(variables, sums):
            v.assign_sub(lr * g)
    return model.get_weights()


# ------------------------------------------------------------ micro_batches
@pytest.mark.parametrize("batch_size, k", [(64, 4), (50, 7)])
def test_micro_batches_equal_stock_large_batch(initial_weights, batch_size, k):
    x, y, sw = make_data()
    bounds = [(s, min(s + batch_size, 100)) for s in range(0, 100, batch_size)]
    stock = stock_on_batches(initial_weights, x, y, sw, bounds)
    ours, history = fit_ours(initial_weights, x, y, sw, batch_size, micro_batches=k)
    assert_close(ours.get_weights(), stock.get_weights())
    assert to_int(ours.optimizer.iterations) == len(bounds)
    # The logged loss equals stock fit's on the same batches.
    plain = make_net()
    plain.set_weights(initial_weights)
    plain.compile(keras.optimizers.Adam(0.01), "mse")
    stock_history = plain.fit(x, y, sample_weight=sw, batch_size=batch_size, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], stock_history.history["loss"], rtol=1e-5)


@pytest.mark.parametrize("k", [4, 3])
def test_micro_batches_equal_hand_written_accumulation_loop(initial_weights, k):
    x, y, sw = make_data(64)
    expected = tape_micro_batch_loop(initial_weights, x, y, sw, 32, k)
    ours, _ = fit_ours(initial_weights, x, y, sw, 32, optimizer=keras.optimizers.SGD(0.05),
                       micro_batches=k)
    assert_close(ours.get_weights(), expected)


def test_micro_batch_oracle_can_fail(initial_weights):
    """Averaging the micro-batch gradients with 1/k instead of n_j/n is detected."""
    x, y, sw = make_data(64)
    expected = tape_micro_batch_loop(initial_weights, x, y, sw, 32, 3)
    model = make_net()
    model.set_weights(initial_weights)
    for start in range(0, 64, 32):
        xb, yb, wb = x[start:start + 32], y[start:start + 32], sw[start:start + 32]
        grads, offset = None, 0
        for size in accumulation.micro_batch_sizes(32, 3):  # 10, 11, 11
            sl = slice(offset, offset + size)
            offset += size
            with tf.GradientTape() as tape:
                pred = model(xb[sl], training=True)
                loss = tf.reduce_sum(tf.reduce_mean(tf.square(pred - yb[sl]), -1) * wb[sl]) / size / 3
            g = tape.gradient(loss, model.trainable_variables)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for v, g in zip(model.trainable_variables, grads):
            v.assign_sub(0.05 * g)
    assert max_diff(model.get_weights(), expected) > 1e-4


def test_micro_batches_with_class_weight_equal_stock(initial_weights):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(48, 5)).astype("float32")
    labels = rng.integers(0, 2, size=(48,))
    class_weight = {0: 0.3, 1: 2.0}

    def run(**kwargs):
        model = make_net()
        model.set_weights(initial_weights)
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], **kwargs)
        h = model.fit(x, labels, class_weight=class_weight, batch_size=24, shuffle=False, verbose=0)
        return model.get_weights(), h.history

    w_stock, h_stock = run()
    w_ours, h_ours = run(micro_batches=5)
    assert_close(w_ours, w_stock)
    np.testing.assert_allclose(h_ours["loss"], h_stock["loss"], rtol=1e-5)
    assert h_ours["accuracy"] == h_stock["accuracy"]


def test_micro_batches_under_jit_with_steps_per_execution(initial_weights):
    x, y, sw = make_data()
    bounds = [(s, min(s + 40, 100)) for s in range(0, 100, 40)]
    stock = stock_on_batches(initial_weights, x, y, sw, bounds)
    ours, _ = fit_ours(initial_weights, x, y, sw, 40, micro_batches=3,
                       jit_compile=True, steps_per_execution=2)
    assert_close(ours.get_weights(), stock.get_weights())


def test_micro_batches_under_jit_with_an_even_split(initial_weights):
    """Every batch splits evenly: the loop over the empty group must still compile."""
    x, y, sw = make_data()
    bounds = [(s, min(s + 40, 100)) for s in range(0, 100, 40)]
    stock = stock_on_batches(initial_weights, x, y, sw, bounds)
    ours, _ = fit_ours(initial_weights, x, y, sw, 40, micro_batches=4, jit_compile=True)
    assert_close(ours.get_weights(), stock.get_weights())


def test_micro_batches_with_transform_and_term_see_the_accumulated_gradient(initial_weights):
    """ClipByGlobalNorm acts on the summed gradient: equal to the clipped large batch."""
    x, y, sw = make_data(64)
    kwargs = dict(gradient_transforms=[kt.ClipByGlobalNorm(0.05)])
    stock, _ = fit_ours(initial_weights, x, y, sw, 32, optimizer=keras.optimizers.SGD(0.5), **kwargs)
    ours, _ = fit_ours(initial_weights, x, y, sw, 32, optimizer=keras.optimizers.SGD(0.5),
                       micro_batches=4, **kwargs)
    assert_close(ours.get_weights(), stock.get_weights())
    # Clipping each micro-batch separately would not give this result.
    unclipped, _ = fit_ours(initial_weights, x, y, sw, 32, optimizer=keras.optimizers.SGD(0.5))
    assert max_diff(unclipped.get_weights(), stock.get_weights()) > 1e-3


# ------------------------------------------------------- accumulation_steps
def test_accumulation_steps_equal_large_batches_and_count_applied_steps(initial_weights):
    x, y, _ = make_data()
    stock = stock_on_batches(initial_weights, x, y, None, [(0, 64), (64, 100)])
    ours, _ = fit_ours(initial_weights, x, y, None, 16, accumulation_steps=4)
    assert_close(ours.get_weights(), stock.get_weights())
    assert to_int(ours.optimizer.iterations) == 2
    # The comparison can fail: stock fit on the batches of 16 is different.
    small, _ = fit_ours(initial_weights, x, y, None, 16)
    assert max_diff(small.get_weights(), stock.get_weights()) > 1e-3


def test_accumulation_two_epochs_restart_windows(initial_weights):
    x, y, sw = make_data()
    bounds = [(0, 64), (64, 100)] * 2
    stock = stock_on_batches(initial_weights, x, y, sw, bounds)
    ours, _ = fit_ours(initial_weights, x, y, sw, 16, epochs=2, accumulation_steps=4)
    assert_close(ours.get_weights(), stock.get_weights())
    assert to_int(ours.optimizer.iterations) == 4
    # A window spanning the epoch boundary (64, 36+28, ...) would differ.
    spanning = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 100), (0, 64), (64, 100)][:2])
    assert max_diff(spanning.get_weights(), stock.get_weights()) > 1e-3


def test_learning_rate_schedule_counts_applied_steps(initial_weights):
    x, y, _ = make_data()
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1], [0.1, 0.01])
    stock = stock_on_batches(initial_weights, x, y, None, [(0, 64), (64, 100)],
                             optimizer=keras.optimizers.SGD(schedule))
    ours, _ = fit_ours(initial_weights, x, y, None, 16, accumulation_steps=4,
                       optimizer=keras.optimizers.SGD(
                           keras.optimizers.schedules.PiecewiseConstantDecay([1], [0.1, 0.01])))
    assert_close(ours.get_weights(), stock.get_weights())


def test_accumulation_under_jit_with_steps_per_execution(initial_weights):
    x, y, sw = make_data()
    stock = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 100)])
    ours, _ = fit_ours(initial_weights, x, y, sw, 16, accumulation_steps=4,
                       jit_compile=True, steps_per_execution=3)
    assert_close(ours.get_weights(), stock.get_weights())
    assert to_int(ours.optimizer.iterations) == 2


def test_partial_window_is_applied_before_validation(initial_weights):
    x, y, _ = make_data()
    seen = {}

    class Spy(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            seen["weights"] = self.model.get_weights()
            seen["iterations"] = to_int(self.model.optimizer.iterations)

    model = make_net()
    model.set_weights(initial_weights)
    model.compile(keras.optimizers.Adam(0.01), "mse", accumulation_steps=4)
    history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0,
                        validation_data=(x[:20], y[:20]), callbacks=[Spy()])
    stock = stock_on_batches(initial_weights, x, y, None, [(0, 64), (64, 100)])
    assert seen["iterations"] == 2
    assert_close(seen["weights"], stock.get_weights())
    val = stock.evaluate(x[:20], y[:20], verbose=0)
    np.testing.assert_allclose(history.history["val_loss"][0], val, rtol=1e-5)


def test_micro_batches_and_accumulation_steps_combine(initial_weights):
    x, y, sw = make_data()
    stock = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 100)])
    ours, _ = fit_ours(initial_weights, x, y, sw, 32, accumulation_steps=2, micro_batches=3)
    assert_close(ours.get_weights(), stock.get_weights())


# ------------------------------------------------------------- distribution
def test_micro_batches_under_mirrored_strategy_equal_single_device(initial_weights, mirrored):
    x, y, sw = make_data(96)
    stock = stock_on_batches(initial_weights, x, y, sw, [(0, 48), (48, 96)])
    ours, _ = fit_ours(initial_weights, x, y, sw, 48, strategy=mirrored, micro_batches=3)
    assert_close(ours.get_weights(), stock.get_weights())


def test_accumulation_under_mirrored_strategy_equal_single_device(initial_weights, mirrored):
    # steps_per_execution > 1 is not combined with MirroredStrategy here: stock
    # Keras 3.15 / TF 2.21 fails on that combination (placeholder error).
    x, y, sw = make_data(96)
    stock = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 96)] * 2)
    ours, _ = fit_ours(initial_weights, x, y, sw, 16, epochs=2, strategy=mirrored,
                       accumulation_steps=4)
    assert_close(ours.get_weights(), stock.get_weights())
    assert to_int(ours.optimizer.iterations) == 4


def test_accumulation_all_reduces_once_per_applied_step(initial_weights, mirrored):
    """Counts the gradient all-reduces traced into the train function."""
    calls = []
    with mirrored.scope():
        model = make_net()
        model.set_weights(initial_weights)
        model.compile(keras.optimizers.SGD(0.1), "mse", accumulation_steps=4, micro_batches=2)
    original = type(model.optimizer)._all_reduce_sum_gradients

    def counting(self, grads_and_vars):
        calls.append(len(list(grads_and_vars)))
        return original(self, grads_and_vars)

    model.optimizer._all_reduce_sum_gradients = counting.__get__(model.optimizer)
    x, y, _ = make_data(64)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    # One traced apply inside the step (two replicas trace it once each)
    # plus none per micro-batch or per batch; the flush traced nothing (64 = 4 x 16).
    assert calls and len(calls) == mirrored.num_replicas_in_sync


# ---------------------------------------------------------- mixed precision
def test_micro_batches_and_accumulation_under_mixed_float16(initial_weights):
    keras.config.set_dtype_policy("mixed_float16")
    x, y, sw = make_data()
    stock = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 100)])
    micro, _ = fit_ours(initial_weights, x, y, sw, 64, micro_batches=4)
    accum, _ = fit_ours(initial_weights, x, y, sw, 16, accumulation_steps=4)
    assert_close(micro.get_weights(), stock.get_weights(), tol=2e-3)
    assert_close(accum.get_weights(), stock.get_weights(), tol=2e-3)
    assert to_int(accum.optimizer.iterations) == 2


@pytest.mark.parametrize("mode", ["micro", "window"])
def test_non_finite_micro_batch_skips_the_whole_window(initial_weights, mode):
    keras.config.set_dtype_policy("mixed_float16")
    x, y, _ = make_data(64)
    y = y.copy()
    y[40] = np.inf  # one bad sample: its micro-batch / batch is non-finite
    model = make_net()
    model.set_weights(initial_weights)
    kwargs = {"micro_batches": 4} if mode == "micro" else {"accumulation_steps": 4}
    model.compile(keras.optimizers.SGD(0.1), "mse", **kwargs)
    scale = 2.0 ** 15  # LossScaleOptimizer's initial scale
    model.fit(x, y, batch_size=64 if mode == "micro" else 16, shuffle=False, verbose=0)
    assert_close(model.get_weights(), initial_weights, tol=0)
    assert float(model.optimizer.scale_loss(tf.constant(1.0))) == scale / 2
    assert to_int(model.optimizer.iterations) == 0
    # Without the bad sample the same run moves the weights (the check can fail).
    y[40] = 0.0
    model.fit(x, y, batch_size=64 if mode == "micro" else 16, shuffle=False, verbose=0)
    assert max_diff(model.get_weights(), initial_weights) > 1e-4


# ------------------------------------------------------- BatchNormalization
def bn_oracle(x, batch, k, mode, momentum=0.9):
    mean, var = np.zeros(x.shape[1]), np.ones(x.shape[1])
    for start in range(0, len(x), batch):
        xb = x[start:start + batch].astype("float64")
        if mode == "large_batch":
            pieces = [xb]
        else:
            sizes = accumulation.micro_batch_sizes(len(xb), k)
            pieces = np.split(xb, np.cumsum(sizes)[:-1])
        for p in pieces:
            mean = mean * momentum + p.mean(0) * (1 - momentum)
            var = var * momentum + p.var(0) * (1 - momentum)
    return mean, var


@pytest.mark.parametrize("mode", ["large_batch", "per_micro_batch"])
def test_batch_norm_moving_statistics_follow_the_chosen_mode(mode):
    """BN is the first layer, so its statistics depend on x only: NumPy is exact."""
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(90, 5)) * [1, 2, 3, 4, 5] + [0, 1, -1, 2, 5]).astype("float32")
    y = rng.normal(size=(90, 2)).astype("float32")
    model = make_net(bn=True)
    model.compile(keras.optimizers.SGD(0.01), "mse", micro_batches=4, batch_norm_updates=mode)
    model.fit(x, y, batch_size=45, shuffle=False, verbose=0)
    bn = model.get_layer("bn")
    mean, var = bn_oracle(x, 45, 4, mode)
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), var, atol=1e-4, rtol=1e-5)
    other = "per_micro_batch" if mode == "large_batch" else "large_batch"
    other_mean, _ = bn_oracle(x, 45, 4, other)
    assert np.abs(other_mean - mean).max() > 1e-3  # the two modes differ
    assert bn.momentum == 0.9  # restored after tracing


def test_batch_norm_large_batch_mode_equals_stock_moving_statistics(initial_weights):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(64, 5)).astype("float32") * 3 + 1
    y = rng.normal(size=(64, 2)).astype("float32")
    stock = make_net(bn=True)
    stock.compile(keras.optimizers.SGD(0.01), "mse")
    stock.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    ours = make_net(bn=True)
    ours.compile(keras.optimizers.SGD(0.01), "mse", micro_batches=2, jit_compile=True)
    ours.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(getattr(ours.get_layer("bn"), name).numpy(),
                                   getattr(stock.get_layer("bn"), name).numpy(), atol=1e-5)


# ------------------------------------------------------------ saving, backup
def test_save_and_load_keep_the_options_and_training_continues_identically(initial_weights, tmp_path):
    x, y, sw = make_data()
    model, _ = fit_ours(initial_weights, x, y, sw, 16, micro_batches=2, accumulation_steps=4,
                        batch_norm_updates="per_micro_batch", optimizer=keras.optimizers.SGD(0.1))
    path = str(tmp_path / "acc.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    options = loaded.tapeops_options
    assert (options.micro_batches, options.accumulation_steps, options.batch_norm_updates) == (
        2, 4, "per_micro_batch")
    assert_close(loaded.get_weights(), model.get_weights(), tol=0)
    model.fit(x, y, sample_weight=sw, batch_size=16, shuffle=False, verbose=0)
    loaded.fit(x, y, sample_weight=sw, batch_size=16, shuffle=False, verbose=0)
    assert_close(loaded.get_weights(), model.get_weights())
    assert to_int(loaded.optimizer.iterations) == 4


def test_backup_and_restore_resumes_with_fresh_windows(initial_weights, tmp_path):
    """Windows are flushed before the epoch's backup, so a resumed run is identical."""
    x, y, _ = make_data()

    class StopAt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    def new_model():
        model = make_net()
        model.set_weights(initial_weights)
        model.compile(keras.optimizers.Adam(0.01), "mse", accumulation_steps=4)
        return model

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model = new_model()
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[backup, StopAt()])
    resumed = new_model()
    resumed.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    straight = new_model()
    straight.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_close(resumed.get_weights(), straight.get_weights())
