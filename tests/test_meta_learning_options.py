"""`kt.MetaLearner`: saving, distribution, mixed precision, configuration and bad input."""

import copy

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.selectors import LayerPath
from test_meta_learning_oracle import HandMAML
from test_meta_learning_oracle import make_mlp
from test_meta_learning_oracle import max_difference
from test_meta_learning_oracle import sinusoid_tasks

INNER_LR, OUTER_LR = 0.02, 0.05


# ------------------------------------------------------------------ saving
def test_save_load_keeps_learner_options_rates_and_training_state(tmp_path):
    data = sinusoid_tasks(4, support=5, query=6)
    model = make_mlp()
    meta = kt.MetaLearner(model, inner_learning_rate=INNER_LR, inner_steps=2,
                          first_order=True, adapt=model.get_layer("head"),
                          learn_inner_learning_rate=True, name="meta")
    meta.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"],
                 steps_per_execution=2)
    checkpoint = str(tmp_path / "checkpoint.keras")
    history = meta.fit(
        data[:3], data[3], batch_size=2, epochs=3, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(checkpoint),
                   keras.callbacks.EarlyStopping(monitor="loss", patience=5)],
    )
    assert len(history.history["loss"]) == 3
    path = str(tmp_path / "meta.keras")
    meta.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is kt.MetaLearner
    assert (loaded.inner_learning_rate, loaded.inner_steps, loaded.first_order,
            loaded.algorithm, loaded.learn_inner_learning_rate) == (INNER_LR, 2, True, "maml", True)
    # A layer selector is saved as its path in the model.
    assert loaded.adapt_selector == LayerPath("head")
    assert loaded.steps_per_execution == 2
    assert max_difference(loaded.model.get_weights(), meta.model.get_weights()) == 0.0
    rates = [r.numpy() for r in meta.learned_rates]
    assert max_difference([r.numpy() for r in loaded.learned_rates], rates) == 0.0
    assert max_difference(rates, [np.full_like(r, INNER_LR) for r in rates]) > 1e-5
    assert int(loaded.optimizer.iterations) == int(meta.optimizer.iterations) == 6
    # The checkpoint written by the callback loads too (the last epoch's state).
    from_checkpoint = keras.models.load_model(checkpoint)
    assert max_difference(from_checkpoint.model.get_weights(), meta.model.get_weights()) == 0.0
    # Training resumes identically (Adam's moments and the rates were restored).
    meta.fit(data[:3], data[3], batch_size=2, shuffle=False, verbose=0)
    loaded.fit(data[:3], data[3], batch_size=2, shuffle=False, verbose=0)
    assert max_difference(loaded.model.get_weights(), meta.model.get_weights()) < 1e-6
    assert max_difference([r.numpy() for r in loaded.learned_rates],
                          [r.numpy() for r in meta.learned_rates]) < 1e-6


def test_get_config_round_trip():
    model = make_mlp()
    meta = kt.MetaLearner(model, inner_learning_rate=np.float32(0.5), inner_steps=np.int64(3),
                          algorithm="maml", adapt=["head/*"], learn_inner_learning_rate=True)
    assert keras.saving.get_registered_name(kt.MetaLearner) == "keras_tapeops>MetaLearner"
    config = meta.get_config()
    assert config["inner_learning_rate"] == 0.5 and config["inner_steps"] == 3
    assert config["adapt"] == ["head/*"]
    again = kt.MetaLearner.from_config(copy.deepcopy(config))
    assert again.get_config() == config
    assert len(again.learned_rates) == 2  # the head's kernel and bias
    reptile = kt.MetaLearner(make_mlp(), algorithm="reptile", inner_steps=2)
    again = kt.MetaLearner.from_config(copy.deepcopy(reptile.get_config()))
    assert (again.algorithm, again.inner_steps, again.adapt_selector) == ("reptile", 2, None)


# ------------------------------------------------------------ distribution
@pytest.mark.parametrize("variant", ["maml", "meta_sgd"])
def test_mirrored_strategy_equals_one_device(mirrored, variant):
    # 5 tasks in meta-batches of 4: replicas get 2 + 2 tasks, then 1 + 0.
    # (Keras's own first-batch build needs an even split of the first batch,
    # for stock models too.)
    data = sinusoid_tasks(5, support=5, query=6)
    meta_sgd = variant == "meta_sgd"
    outer_lr = 0.002 if meta_sgd else OUTER_LR
    oracle = HandMAML(make_mlp().get_weights(), INNER_LR, 2, outer_lr, meta_sgd=meta_sgd)
    expected_history = oracle.fit(data, batch_size=4, epochs=1)
    with mirrored.scope():
        meta = kt.MetaLearner(make_mlp(), inner_learning_rate=INNER_LR, inner_steps=2,
                              learn_inner_learning_rate=meta_sgd)
        # A Loss object (Keras divides its mean by the number of replicas; the
        # learner multiplies that back) and a loss name (reduced by the learner).
        loss = keras.losses.MeanSquaredError() if meta_sgd else "mse"
        meta.compile(optimizer=keras.optimizers.SGD(outer_lr), loss=loss)
    history = meta.fit(data[:3], data[3], batch_size=4, shuffle=False, verbose=0)
    assert max_difference(meta.model.get_weights(), oracle.weights()) < 1e-6
    np.testing.assert_allclose(history.history["loss"], expected_history, rtol=1e-6)
    if meta_sgd:
        assert max_difference([r.numpy() for r in meta.learned_rates],
                              [r.numpy() for r in oracle.rates]) < 1e-6
    result = meta.evaluate(data[:3], data[3], batch_size=4, verbose=0, return_dict=True)
    np.testing.assert_allclose(result["loss"], oracle.evaluate(data, steps=2)[0], rtol=1e-5)


# ---------------------------------------------------------- mixed precision
def test_mixed_precision_trains_close_to_float32():
    data = sinusoid_tasks(4, support=5, query=6)
    oracle = HandMAML(make_mlp().get_weights(), INNER_LR, 2, OUTER_LR)
    oracle.fit(data, batch_size=2)
    first = HandMAML(make_mlp().get_weights(), INNER_LR, 2, OUTER_LR, first_order=True)
    first.fit(data, batch_size=2)
    keras.config.set_dtype_policy("mixed_float16")
    model = make_mlp()
    meta = kt.MetaLearner(model, inner_learning_rate=INNER_LR, inner_steps=2)
    meta.compile(optimizer=keras.optimizers.SGD(OUTER_LR), loss="mse")
    assert isinstance(meta.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.layers[0].compute_dtype == "float16"
    history = meta.fit(data[:3], data[3], batch_size=2, shuffle=False, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    distance = max_difference(meta.model.get_weights(), oracle.weights())
    # float16 rounding stays well below the second-order terms.
    assert distance < 0.25 * max_difference(first.weights(), oracle.weights())
    assert int(meta.optimizer.iterations) == 2  # no step skipped
    adapted = meta.adapt(data[0][0], data[1][0])
    assert np.all(np.isfinite(adapted.predict(data[2][0], verbose=0)))


# ------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, error, message", [
    ({"inner_steps": 0}, ValueError, "Received: inner_steps=0"),
    ({"inner_steps": 1.5}, TypeError, "Received: inner_steps=1.5"),
    ({"inner_learning_rate": -0.1}, ValueError, "Received: inner_learning_rate=-0.1"),
    ({"inner_learning_rate": 0}, ValueError, "Received: inner_learning_rate=0"),
    ({"algorithm": "fomaml"}, ValueError, "Received: algorithm='fomaml'"),
    ({"first_order": "yes"}, TypeError, "Received: first_order='yes'"),
    ({"algorithm": "reptile", "adapt": "head"}, ValueError,
     "Received: adapt='head', algorithm='reptile'"),
    ({"algorithm": "reptile", "learn_inner_learning_rate": True}, ValueError,
     "Received: learn_inner_learning_rate=True, algorithm='reptile'"),
    ({"adapt": "neck"}, ValueError, "Received: where='neck'"),
])
def test_bad_options_raise(kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        kt.MetaLearner(make_mlp(), **kwargs)


def test_bad_models_and_compile_raise():
    with pytest.raises(TypeError, match="Received: model="):
        kt.MetaLearner(keras.layers.Dense(1))
    with pytest.raises(ValueError, match="must be built.*Received: an unbuilt model"):
        kt.MetaLearner(keras.Sequential([keras.layers.Dense(1)]))
    meta = kt.MetaLearner(make_mlp())
    data = sinusoid_tasks(2, 3, 3)
    with pytest.raises(ValueError, match="must be compiled.*Received: an uncompiled"):
        meta.adapt(data[0][0], data[1][0])
    with pytest.raises(ValueError, match="Received: loss=None"):
        meta.compile(optimizer="sgd")
    with pytest.raises(ValueError, match="one output and one loss. Received: loss="):
        meta.compile(optimizer="sgd", loss={"head": "mse"})
    meta.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="Received: steps=0"):
        meta.adapt(data[0][0], data[1][0], steps=0)
    with pytest.raises(ValueError, match="same number of examples. Received: support_x with 3"):
        meta.adapt(data[0][0], data[1][0][:2])


def _bad_batches():
    sx, sy, qx, qy = sinusoid_tasks(2, support=3, query=4)
    wide = np.concatenate([qx, qx], axis=-1)
    return {
        "query_x per-example shape": (((sx, sy, wide), qy),
                                      "same per-example shape.*Received: support_x with shape"),
        "support_y structure": (((sx, {"y": sy}, qx), qy),
                                "`support_y` and `query_y` must have the same structure. Received:"),
        "x not a triple": (((sx, sy), qy), "x=\\(support_x, support_y, query_x\\).*Received: x="),
        "task counts": (((sx, sy, qx[:1]), qy[:1]), "same number of tasks.*Received:"),
        "sample weights": (((sx, sy, qx), qy, np.ones((2,), "float32")),
                           "sample weights.*Received: sample_weight="),
        "no targets": (((sx, sy, qx),), "Received: y=None"),
        "no example axis": (((sx[:, 0, 0], sy[:, 0, 0], qx[:, 0, 0]), qy[:, 0, 0]),
                            "task axis and an example axis.*Received: support_x with shape"),
    }


@pytest.mark.parametrize("case", list(_bad_batches()))
def test_bad_meta_batches_raise_before_any_weight_changes(case):
    batch, message = _bad_batches()[case]
    meta = kt.MetaLearner(make_mlp())
    meta.compile(optimizer="sgd", loss="mse")
    before = meta.model.get_weights()
    dataset = tf.data.Dataset.from_tensors(batch)
    with pytest.raises((ValueError, TypeError), match=message):
        meta.fit(dataset, verbose=0, shuffle=False)
    assert max_difference(meta.model.get_weights(), before) == 0.0


def test_state_layers_are_read_never_written_and_random_layers_warn():
    keras.utils.set_random_seed(0)
    net = keras.Sequential([
        keras.Input((1,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dropout(0.2), keras.layers.BatchNormalization(), keras.layers.Dense(1),
    ])
    state = [v.numpy().copy() for v in net.non_trainable_variables]
    with pytest.warns(UserWarning, match=r"layers \['dropout'\].*same random masks"):
        meta = kt.MetaLearner(net, inner_steps=2)
    meta.compile(optimizer="sgd", loss="mse")
    data = sinusoid_tasks(2, support=3, query=3)
    history = meta.fit(data[:3], data[3], batch_size=2, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    # Moving statistics and the seed state: read by the functional passes, never updated.
    assert max_difference([v.numpy() for v in net.non_trainable_variables], state) == 0.0
