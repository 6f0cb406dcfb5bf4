"""`kt.MetaLearner` against a hand-written nested-tape MAML loop (`test_meta_learning_oracle`).

Same initial weights, same meta-batches (`shuffle=False`), outer SGD: the
final weights, the Meta-SGD rates and History's `loss` (mean query loss at
the adapted weights) must equal the oracle's at 1e-6, for second-order MAML,
first-order MAML, Reptile, ANIL and Meta-SGD. A companion shows that the
comparison separates first from second order.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from test_meta_learning_oracle import HandMAML
from test_meta_learning_oracle import forward
from test_meta_learning_oracle import make_mlp
from test_meta_learning_oracle import max_difference
from test_meta_learning_oracle import sinusoid_tasks

INNER_LR, OUTER_LR, TASKS, BATCH = 0.02, 0.05, 4, 2
ATOL = 1e-6

VARIANTS = {
    "maml": dict(learner={}, oracle={}),
    "first_order": dict(learner={"first_order": True}, oracle={"first_order": True}),
    "reptile": dict(learner={"algorithm": "reptile"}, oracle={"reptile": True}),
    "anil": dict(learner={"adapt": "head"}, oracle={"adapted": (2, 3)}),
    # Meta-SGD's rate gradients are large: a smaller outer step keeps it finite.
    "meta_sgd": dict(learner={"learn_inner_learning_rate": True}, oracle={"meta_sgd": True},
                     outer_lr=0.002),
}


def run_pair(variant, steps=2, epochs=1, compile_kwargs=None, data=None):
    """Fits the MetaLearner and the oracle from the same start; returns both."""
    data = data or sinusoid_tasks(TASKS, support=5, query=6)
    model = make_mlp()
    outer_lr = VARIANTS[variant].get("outer_lr", OUTER_LR)
    oracle = HandMAML(model.get_weights(), INNER_LR, steps, outer_lr,
                      **VARIANTS[variant]["oracle"])
    meta = kt.MetaLearner(model, inner_learning_rate=INNER_LR, inner_steps=steps,
                          **VARIANTS[variant]["learner"])
    meta.compile(optimizer=keras.optimizers.SGD(outer_lr), loss="mse",
                 **(compile_kwargs or {}))
    history = meta.fit(data[:3], data[3], batch_size=BATCH, epochs=epochs,
                       shuffle=False, verbose=0)
    expected_history = oracle.fit(data, BATCH, epochs)
    return meta, oracle, history, expected_history


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fit_equals_hand_written_loop(variant):
    meta, oracle, history, expected = run_pair(variant, epochs=2)
    assert max_difference(meta.model.get_weights(), oracle.weights()) < ATOL
    np.testing.assert_allclose(history.history["loss"], expected, rtol=1e-6)
    assert sorted(history.history) == ["loss"]
    # Training moved the weights well beyond the tolerance.
    assert max_difference(meta.model.get_weights(), make_mlp().get_weights()) > 1e-3
    if variant == "meta_sgd":
        rates = [r.numpy() for r in meta.learned_rates]
        assert max_difference(rates, [r.numpy() for r in oracle.rates]) < ATOL
        assert max_difference(rates, [np.full_like(r, INNER_LR) for r in rates]) > 1e-4


@pytest.mark.parametrize(
    "compile_kwargs", [{"jit_compile": True}, {"steps_per_execution": 2}],
    ids=["jit_compile", "steps_per_execution"],
)
def test_fit_equals_hand_written_loop_compiled_variants(compile_kwargs):
    meta, oracle, history, expected = run_pair("maml", compile_kwargs=compile_kwargs)
    assert max_difference(meta.model.get_weights(), oracle.weights()) < ATOL
    np.testing.assert_allclose(history.history["loss"], expected, rtol=1e-6)


def test_first_and_second_order_differ():
    """Companion: the 1e-6 comparison tells first- from second-order MAML apart."""
    first, _, _, _ = run_pair("first_order")
    second, oracle, _, _ = run_pair("maml")
    assert max_difference(second.model.get_weights(), oracle.weights()) < ATOL
    assert max_difference(first.model.get_weights(), oracle.weights()) > 1e-4


def test_three_inner_steps_and_adam():
    """More inner steps and a stateful outer optimizer (Adam), against the oracle's gradients."""
    data = sinusoid_tasks(2, support=4, query=4, seed=3)
    model = make_mlp(seed=2)
    oracle = HandMAML(model.get_weights(), INNER_LR, 3, 0.0)
    meta = kt.MetaLearner(model, inner_learning_rate=INNER_LR, inner_steps=3)
    meta.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    meta.fit(data[:3], data[3], batch_size=2, epochs=2, shuffle=False, verbose=0)
    # The oracle's meta-gradient through Keras's Adam (on Keras variables).
    variables = [keras.Variable(w) for w in oracle.weights()]
    adam = keras.optimizers.Adam(1e-2)
    batch = [tf.constant(a) for a in data]
    for _ in range(2):
        for p, v in zip(oracle.params, variables):
            p.assign(v.value)
        with tf.GradientTape() as tape:
            losses = [
                tf.reduce_mean(tf.square(
                    forward(oracle.inner(oracle.params, batch[0][t], batch[1][t], 3),
                            batch[2][t]) - batch[3][t]))
                for t in range(2)
            ]
            loss = tf.add_n(losses) / 2
        adam.apply_gradients(zip(tape.gradient(loss, oracle.params), variables))
    assert max_difference(meta.model.get_weights(), [v.numpy() for v in variables]) < ATOL


def test_evaluate_predict_and_validation_report_post_adaptation_metrics():
    data = sinusoid_tasks(TASKS, support=5, query=6)
    val = sinusoid_tasks(3, support=5, query=6, seed=7)
    model = make_mlp()
    oracle = HandMAML(model.get_weights(), INNER_LR, 2, OUTER_LR)
    meta = kt.MetaLearner(model, inner_learning_rate=INNER_LR, inner_steps=2)
    meta.compile(optimizer=keras.optimizers.SGD(OUTER_LR), loss="mse", metrics=["mae"])
    history = meta.fit(data[:3], data[3], batch_size=BATCH, shuffle=False, verbose=0,
                       validation_data=(val[:3], val[3]))
    oracle.fit(data, BATCH)
    expected_loss, expected_mae = oracle.evaluate(val, steps=2)
    np.testing.assert_allclose(history.history["val_loss"], [expected_loss], rtol=1e-5)
    np.testing.assert_allclose(history.history["val_mae"], [expected_mae], rtol=1e-5)
    result = meta.evaluate(val[:3], val[3], batch_size=2, verbose=0, return_dict=True)
    np.testing.assert_allclose(result["loss"], expected_loss, rtol=1e-5)
    np.testing.assert_allclose(result["mae"], expected_mae, rtol=1e-5)
    # Without adaptation the query loss is far from it (the check can fail).
    unadapted = np.mean([np.mean((forward(oracle.params, val[2][t]) - val[3][t]) ** 2)
                         for t in range(3)])
    assert abs(unadapted - expected_loss) > 1e-3
    predictions = meta.predict(val[:3], batch_size=2, verbose=0)
    assert predictions.shape == (3, 6, 1)
    for t in range(3):
        adapted = oracle.adapt(val[0][t], val[1][t], steps=2)
        np.testing.assert_allclose(predictions[t], forward(adapted, val[2][t]), atol=1e-5)


@pytest.mark.parametrize("variant", ["maml", "anil", "meta_sgd"])
def test_adapt_equals_hand_adaptation_and_keeps_the_weights(variant):
    meta, oracle, _, _ = run_pair(variant)
    data = sinusoid_tasks(1, support=5, query=6, seed=11)
    learned = meta.model.get_weights()
    rates = [r.numpy() for r in meta.learned_rates]
    adapted = meta.adapt(data[0][0], data[1][0], steps=3)
    expected = oracle.adapt(data[0][0], data[1][0], steps=3)
    assert adapted is not meta.model
    assert max_difference(adapted.get_weights(), [e.numpy() for e in expected]) < ATOL
    # The learned weights (and rates) are unchanged.
    assert max_difference(meta.model.get_weights(), learned) == 0.0
    assert max_difference([r.numpy() for r in meta.learned_rates] or [0], rates or [0]) == 0.0
    assert max_difference(adapted.get_weights(), learned) > 1e-4
    np.testing.assert_allclose(
        adapted.predict(data[2][0], verbose=0), forward(expected, data[2][0]), atol=1e-5
    )
    if variant == "anil":  # only the head moved
        assert max_difference(adapted.get_weights()[:2], learned[:2]) == 0.0
    # The default is inner_steps (2).
    default = meta.adapt(data[0][0], data[1][0])
    two = oracle.adapt(data[0][0], data[1][0], steps=2)
    assert max_difference(default.get_weights(), [e.numpy() for e in two]) < ATOL


class MapFnLearner(kt.MetaLearner):
    """Tasks one after another (`tf.map_fn`) instead of vectorized."""

    def map_tasks(self, fn, elements):
        first = fn(tf.nest.map_structure(lambda t: t[0], elements))
        signature = tf.nest.map_structure(
            lambda t: tf.TensorSpec(t.shape, t.dtype), first)
        return tf.map_fn(fn, elements, fn_output_signature=signature)


def test_map_tasks_hook_sequential_tasks_equal_the_oracle():
    data = sinusoid_tasks(TASKS, support=5, query=6)
    model = make_mlp()
    oracle = HandMAML(model.get_weights(), INNER_LR, 2, OUTER_LR)
    meta = MapFnLearner(model, inner_learning_rate=INNER_LR, inner_steps=2)
    meta.compile(optimizer=keras.optimizers.SGD(OUTER_LR), loss="mse")
    meta.fit(data[:3], data[3], batch_size=BATCH, shuffle=False, verbose=0)
    oracle.fit(data, BATCH)
    assert max_difference(meta.model.get_weights(), oracle.weights()) < ATOL
