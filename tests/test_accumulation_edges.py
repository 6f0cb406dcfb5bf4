"""Edge cases of `micro_batches` and `accumulation_steps` against stock Keras.

Covers what the other accumulation tests leave open: a masked output under
`micro_batches` with a loss weight, sample weights and every reduction
(`"mean_with_sample_weight"` normalizes by the unmasked weights, `"sum"` by
nothing), with the logged total and per-output losses, and a one-output
masked model's logged loss, on one device and two replicas; `"mean_with_sample_weight"`
without sample weights; per-output logged losses under MirroredStrategy;
`accumulation_steps` under MirroredStrategy with SGD (Adam, which the other
distribution tests use, hides a wrong gradient scale); one sample-weight
vector shared by two weighted-mean outputs in a window; frozen
BatchNormalization statistics under `micro_batches`; and the refusals of a
`"sum"` loss next to a regularizer or a loss term in a window.

Oracle: stock Keras with the same initial weights on the large batches
(`fit`/`train_on_batch`, SGD, `shuffle=False`), compared at float32
tolerances; NumPy for the frozen statistics.
"""

import keras
import numpy as np
import pytest

import keras_tapeops as kt

TOL = 1e-6


def weights_of(model):
    return [v.numpy() for layer in model.layers for v in layer.weights]


def assert_weights_close(ours, stock, tol=TOL):
    for a, b in zip(weights_of(ours), weights_of(stock), strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def fit_both(build, compile_kwargs, fit_kwargs, options, strategy=None, lr=0.1):
    """Stock Keras and ours from the same start, same batches; returns both and histories."""
    keras.utils.set_random_seed(5)
    start = build().get_weights()
    runs = []
    for ours in (False, True):
        scope = strategy.scope() if strategy is not None else _no_scope()
        with scope:
            model = build()
            model.set_weights(start)
            if ours:
                model = kt.upgrade(model)
            model.compile(keras.optimizers.SGD(lr), **compile_kwargs, **(options if ours else {}))
        history = model.fit(shuffle=False, verbose=0, **fit_kwargs)
        runs.append((model, history.history))
    (stock, stock_history), (ours, history) = runs
    assert max(float(np.abs(a - b).max()) for a, b in zip(weights_of(stock), start)) > 1e-3
    return stock, stock_history, ours, history


class _no_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_histories_close(history, stock_history, tol=1e-6, names=None):
    assert history.keys() == stock_history.keys()
    for name in names or stock_history:
        values = stock_history[name]
        np.testing.assert_allclose(history[name], values, rtol=tol, atol=tol, err_msg=name)


# ------------------------------------------------------ masked, multi-output
def masked_two_head_net():
    """A masked sequence output ("seq", per timestep) and a pooled one ("vec")."""
    inputs = keras.Input((5,), dtype="int32")
    embedded = keras.layers.Embedding(6, 3, mask_zero=True, name="embed")(inputs)
    seq = keras.layers.Dense(2, name="seq")(embedded)
    vec = keras.layers.Dense(1, name="vec")(keras.layers.GlobalAveragePooling1D()(embedded))
    return keras.Model(inputs, {"seq": seq, "vec": vec})


def masked_data(n=16):
    rng = np.random.default_rng(2)
    x = rng.integers(1, 6, size=(n, 5)).astype("int32")
    x[:5, 1:] = 0  # the first micro-batches are mostly masked: uneven unmasked counts
    x[9:11, 3:] = 0
    y = {
        "seq": rng.normal(size=(n, 5, 2)).astype("float32"),
        "vec": rng.normal(size=(n, 1)).astype("float32"),
    }
    # Per-timestep weights for the sequence (Keras multiplies them by its mask).
    sw = {
        "seq": rng.uniform(0.2, 3.0, size=(n, 5)).astype("float32"),
        "vec": rng.uniform(0.2, 3.0, size=(n,)).astype("float32"),
    }
    return x, y, sw


@pytest.mark.parametrize("reduction", ["mean_with_sample_weight", "sum", "sum_over_batch_size"])
def test_masked_output_with_loss_and_sample_weights_equals_the_large_batch(reduction):
    """Batches of 8 split 2+3+3: the weights, the logged total and each output's
    logged loss equal stock Keras's (the masked output's share of the total
    is the whole batch's, not the micro-batches' means by sample counts)."""
    x, y, sw = masked_data()
    compile_kwargs = dict(
        loss={"seq": keras.losses.MeanSquaredError(reduction=reduction), "vec": "mse"},
        loss_weights={"seq": 0.7, "vec": 1.3},
    )
    fit_kwargs = dict(x=x, y=y, sample_weight=sw, batch_size=8, epochs=2)
    stock, stock_history, ours, history = fit_both(
        masked_two_head_net,
        compile_kwargs,
        fit_kwargs,
        {"micro_batches": 3},
        lr=0.01 if reduction == "sum" else 0.1,
    )
    assert_weights_close(ours, stock)
    assert set(history) == {"loss", "seq_loss", "vec_loss"}
    assert_histories_close(history, stock_history)


def masked_sequence_net():
    """One masked sequence output (mask_zero), per-timestep mse."""
    inputs = keras.Input((5,), dtype="int32")
    embedded = keras.layers.Embedding(6, 3, mask_zero=True, name="embed")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="seq")(embedded))


@pytest.mark.parametrize("distributed", [False, True], ids=["one_device", "mirrored"])
def test_masked_single_output_logs_the_whole_batch_loss(distributed, request):
    """A one-output sequence model with uneven masks, batches of 8 split in 3:
    History's `loss` is stock's (the micro-batches' means weighted by their
    sample counts read 3% lower), also on two replicas (4 + 4, each split)."""
    strategy = request.getfixturevalue("mirrored") if distributed else None
    x, y, _ = masked_data()
    stock, stock_history, ours, history = fit_both(
        masked_sequence_net,
        dict(loss="mse"),
        dict(x=x, y=y["seq"], batch_size=8, epochs=2),
        {"micro_batches": 2 if distributed else 3},
        strategy=strategy,
    )
    assert_weights_close(ours, stock)
    assert_histories_close(history, stock_history)


def two_head_net(regularized=False):
    inputs = keras.Input((3,))
    reg = keras.regularizers.L2(0.01) if regularized else None
    h = keras.layers.Dense(4, activation="tanh", kernel_regularizer=reg, name="trunk")(inputs)
    return keras.Model(
        inputs, {"a": keras.layers.Dense(2, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)}
    )


def two_head_data(n=24, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = {
        "a": rng.normal(size=(n, 2)).astype("float32"),
        "b": rng.normal(size=(n, 1)).astype("float32"),
    }
    sw = rng.uniform(0.2, 3.0, size=(n,)).astype("float32")
    return x, y, sw


def test_per_output_logged_losses_under_mirrored_equal_stock(mirrored):
    x, y, sw = two_head_data()
    compile_kwargs = dict(loss={"a": "mse", "b": "mae"})
    fit_kwargs = dict(x=x, y=y, sample_weight=sw, batch_size=12)
    stock, stock_history, ours, history = fit_both(
        two_head_net, compile_kwargs, fit_kwargs, {"micro_batches": 2}, strategy=mirrored
    )
    assert_weights_close(ours, stock)
    assert set(history) == {"loss", "a_loss", "b_loss"}
    assert_histories_close(history, stock_history)


# ------------------------------------------------------ weighted mean
def dense_net(regularized=False):
    reg = keras.regularizers.L2(0.01) if regularized else None
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="tanh", kernel_regularizer=reg, name="hidden"),
            keras.layers.Dense(2, name="head"),
        ]
    )


def test_weighted_mean_reduction_without_sample_weights_equals_the_large_batch():
    """Batches of 10 split 3+3+4; `"mean_with_sample_weight"` then divides by the count."""
    x, y, _ = two_head_data(20)
    compile_kwargs = dict(loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
    fit_kwargs = dict(x=x, y=y["a"], batch_size=10)
    stock, stock_history, ours, history = fit_both(
        dense_net, compile_kwargs, fit_kwargs, {"micro_batches": 3}
    )
    assert_weights_close(ours, stock)
    assert_histories_close(history, stock_history)


def test_one_sample_weight_vector_for_two_weighted_outputs_under_accumulation_steps():
    """Both outputs normalized by the same weights: one window normalizer, not a refusal.

    Windows of 2 batches of 4 are stock's batches of 8."""
    x, y, sw = two_head_data(16)
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    keras.utils.set_random_seed(5)
    start = two_head_net().get_weights()
    stock = two_head_net()
    stock.set_weights(start)
    stock.compile(keras.optimizers.SGD(0.1), {"a": loss, "b": loss})
    for i in (0, 8):
        stock.train_on_batch(
            x[i : i + 8], {k: v[i : i + 8] for k, v in y.items()}, sample_weight=sw[i : i + 8]
        )
    ours = kt.upgrade(two_head_net())
    ours.set_weights(start)
    ours.compile(keras.optimizers.SGD(0.1), {"a": loss, "b": loss}, accumulation_steps=2)
    ours.fit(x, y, sample_weight=sw, batch_size=4, shuffle=False, verbose=0)
    assert_weights_close(ours, stock)
    assert int(ours.optimizer.iterations.numpy()) == 2


def test_accumulation_steps_under_mirrored_with_sgd_equal_the_large_batch(mirrored):
    """SGD applies the gradient's scale (Adam would not show a wrong one).

    4 batches of 6 per window over 2 replicas; 24 samples: one window."""
    x, y, sw = two_head_data(48)
    keras.utils.set_random_seed(5)
    start = dense_net().get_weights()
    stock = dense_net()
    stock.set_weights(start)
    stock.compile(keras.optimizers.SGD(0.1), "mse")
    for i in (0, 24):
        stock.train_on_batch(x[i : i + 24], y["a"][i : i + 24], sample_weight=sw[i : i + 24])
    with mirrored.scope():
        ours = kt.upgrade(dense_net())
        ours.set_weights(start)
        ours.compile(keras.optimizers.SGD(0.1), "mse", accumulation_steps=4)
    ours.fit(x, y["a"], sample_weight=sw, batch_size=6, shuffle=False, verbose=0)
    assert_weights_close(ours, stock, tol=2e-6)
    assert int(ours.optimizer.iterations.numpy()) == 2


# ------------------------------------------------------ BatchNormalization
def test_frozen_batch_norm_statistics_stay_bit_identical_under_micro_batches():
    """A frozen BatchNormalization layer runs in inference mode: stock Keras
    leaves its moving statistics untouched, and so must the merge."""
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(30, 3)) * 3 + 1).astype("float32")
    y = rng.normal(size=(30, 2)).astype("float32")
    model = kt.upgrade(
        keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.BatchNormalization(momentum=0.9, name="bn"),
                keras.layers.Dense(2, name="head"),
            ]
        )
    )
    bn = model.get_layer("bn")
    bn.moving_mean.assign(rng.normal(size=3).astype("float32"))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, size=3).astype("float32"))
    bn.trainable = False
    before = [bn.moving_mean.numpy(), bn.moving_variance.numpy()]
    head = model.get_layer("head").kernel.numpy()
    model.compile(keras.optimizers.SGD(0.1), "mse", micro_batches=4)
    model.fit(x, y, batch_size=15, shuffle=False, verbose=0)
    np.testing.assert_array_equal(bn.moving_mean.numpy(), before[0])
    np.testing.assert_array_equal(bn.moving_variance.numpy(), before[1])
    assert np.abs(model.get_layer("head").kernel.numpy() - head).max() > 1e-3  # it trained


# ------------------------------------------------------ refusals
def test_sum_loss_with_a_regularizer_is_refused_before_any_step():
    """A "sum" window sums its batches' gradients but the regularizer counts
    once per step: no exact window exists, so fit refuses on the first batch."""
    x, y, _ = two_head_data(16)
    model = kt.upgrade(dense_net(regularized=True))
    model.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.MeanSquaredError(reduction="sum"),
        accumulation_steps=2,
    )
    before = weights_of(model)
    with pytest.raises(ValueError, match=r"accumulation_steps=2.*regularization losses"):
        model.fit(x, y["a"], batch_size=4, shuffle=False, verbose=0)
    for a, b in zip(weights_of(model), before, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.unit
def test_sum_loss_with_a_loss_term_is_refused_at_compile():
    model = kt.upgrade(dense_net())
    with pytest.raises(ValueError, match=r"accumulation_steps=2.*loss terms.*Received: reduction="):
        model.compile(
            keras.optimizers.SGD(0.1),
            keras.losses.MeanSquaredError(reduction="sum"),
            loss_terms=[kt.ActivationPenalty("hidden", l2=0.1)],
            accumulation_steps=2,
        )


def test_a_replica_left_without_samples_equals_stock(mirrored):
    """9 samples in batches of 4 over 2 replicas: the last batch of 1 leaves one
    replica an empty batch, which `micro_batches` must split into one empty
    micro-batch (not divide by zero)."""
    x, y, _ = two_head_data(9)
    fit_kwargs = dict(x=x, y=y["b"], batch_size=4)

    def build():
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="head")])

    stock, stock_history, ours, history = fit_both(
        build, dict(loss="mse"), fit_kwargs, {"micro_batches": 2}, strategy=mirrored
    )
    assert_weights_close(ours, stock)
    assert_histories_close(history, stock_history)
