"""`kt.AdversarialLoss` and `kt.TRADES` in `fit` against a hand-written adversarial training loop."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from adversarial_oracle import crossentropy
from adversarial_oracle import data
from adversarial_oracle import kl_objective
from adversarial_oracle import kl_per_example
from adversarial_oracle import loss_objective
from adversarial_oracle import max_weight_difference
from adversarial_oracle import mlp
from adversarial_oracle import oracle_attack
from adversarial_oracle import oracle_start
from oracle_utils import graph_step
from keras_tapeops import _compat

BATCH, LR, EPS, SEED = 16, 0.5, 0.1, 7
TOL = 1e-6


def fgsm():
    return kt.attacks.FGSM(EPS, clip=(0.0, 1.0), seed=SEED)


def pgd():
    return kt.attacks.PGD(EPS, step_size=0.04, steps=3, clip=(0.0, 1.0), seed=SEED)


def oracle_fit(model, x, y, sw, kind, attack, weight, epochs=1, loss_scale=False,
               clip_global_norm=None, batch=BATCH, jit_compile=False):
    """Hand-written adversarial training: attack at the current weights, then one SGD step.

    `kind` "adversarial": `CE(x) + weight * CE(x_adv)`, x_adv ascending the
    crossentropy; "trades": `CE(x) + weight * mean(sw * KL(p(x) || p(x_adv)))`,
    x_adv ascending the KL from the inference-mode clean predictions. The
    random start is keyed by the optimizer step. Returns History-style logs.
    With `jit_compile` the step is an XLA function like fit's (XLA draws
    other numbers than TensorFlow's kernels for the same stateless key).
    """
    optimizer = keras.optimizers.SGD(LR)
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(model.trainable_variables)
    loss = crossentropy()

    def step(xb, yb, swb, t):
        delta = None
        if attack.random_start:
            delta = oracle_start(xb.shape, attack.epsilon, attack.norm, attack.seed, t)
        if kind == "adversarial":
            objective = loss_objective(yb)
        else:
            objective = kl_objective(tf.cast(model(xb, training=False), tf.float32))
        x_adv = oracle_attack(
            model, objective, xb, attack.epsilon, attack.step_size, attack.steps,
            attack.norm, attack.clip, delta,
        )
        x_adv = tf.stop_gradient(x_adv)
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            clean = loss(yb, logits, sample_weight=swb)
            adv_logits = model(x_adv, training=True)
            if kind == "adversarial":
                term = loss(yb, adv_logits, sample_weight=swb)
            else:
                term = tf.reduce_mean(swb * kl_per_example(logits, adv_logits))
            total = clean + weight * term
            scaled = optimizer.scale_loss(total) if loss_scale else total
        grads = tape.gradient(scaled, model.trainable_variables)
        if clip_global_norm is not None:
            grads, _ = tf.clip_by_global_norm(grads, clip_global_norm)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return weight * term, total

    step = tf.function(step, jit_compile=True) if jit_compile else graph_step(step)
    logs = {"term": [], "loss": []}
    t = 0
    for _ in range(epochs):
        terms, totals, sizes = [], [], []
        for start in range(0, len(x), batch):
            sl = slice(start, start + batch)
            term, total = step(
                tf.constant(x[sl]), tf.constant(y[sl]), tf.constant(sw[sl]),
                tf.constant(t, tf.int64),
            )
            t += 1
            terms.append(float(term))
            totals.append(float(total))
            sizes.append(len(x[sl]))
        logs["term"].append(np.average(terms, weights=sizes))
        logs["loss"].append(np.average(totals, weights=sizes))
    return logs


def make_term(kind, attack, weight):
    if kind == "adversarial":
        return kt.AdversarialLoss(attack, weight=weight, name="term")
    return kt.TRADES(attack, beta=weight, name="term")


def compiled_model(initial, kind, attack, weight, strategy=None, **compile_kwargs):
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = mlp(upgrade=True)
        model.set_weights(initial)
        model.compile(
            optimizer=keras.optimizers.SGD(LR), loss=crossentropy(),
            loss_terms=[make_term(kind, attack, weight)], **compile_kwargs,
        )
    return model


def run_both(kind, attack, weight=1.0, epochs=1, strategy=None, oracle_kwargs=None,
             **compile_kwargs):
    x, y, sw = data()
    oracle = mlp()
    initial = oracle.get_weights()
    expected = oracle_fit(oracle, x, y, sw, kind, attack, weight, epochs,
                          **(oracle_kwargs or {}))
    model = compiled_model(initial, kind, attack, weight, strategy, **compile_kwargs)
    history = model.fit(x, y, sample_weight=sw, batch_size=BATCH, epochs=epochs,
                        shuffle=False, verbose=0)
    return model, oracle, history.history, expected


def assert_matches(model, oracle, history, expected, tol=TOL):
    for i, (u, v) in enumerate(zip(model.get_weights(), oracle.get_weights())):
        np.testing.assert_allclose(u, v, rtol=0, atol=tol, err_msg=f"weight {i}")
    np.testing.assert_allclose(history["term"], expected["term"], rtol=tol, atol=tol)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=tol, atol=tol)


@pytest.mark.parametrize("kind, attack", [
    ("adversarial", fgsm()), ("adversarial", pgd()), ("trades", pgd()),
    ("adversarial", kt.attacks.PGD(0.5, 0.2, steps=2, norm="l2", seed=SEED)),
])
def test_fit_equals_hand_written_adversarial_training(kind, attack):
    model, oracle, history, expected = run_both(kind, attack, weight=0.75, epochs=2)
    assert_matches(model, oracle, history, expected)
    assert expected["term"][0] > 1e-3


def test_comparison_fails_without_the_term():
    x, y, sw = data()
    oracle = mlp()
    initial = oracle.get_weights()
    oracle_fit(oracle, x, y, sw, "adversarial", fgsm(), 1.0)
    model = mlp(upgrade=True)
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss=crossentropy())
    model.fit(x, y, sample_weight=sw, batch_size=BATCH, shuffle=False, verbose=0)
    assert max_weight_difference(model, oracle) > 1e-3


def test_comparison_fails_with_another_random_start():
    # The seeded start matters: a different seed moves the weights apart.
    x, y, sw = data()
    oracle = mlp()
    initial = oracle.get_weights()
    oracle_fit(oracle, x, y, sw, "adversarial", fgsm(), 1.0)
    other = compiled_model(initial, "adversarial",
                           kt.attacks.FGSM(EPS, clip=(0.0, 1.0), seed=SEED + 1), 1.0)
    other.fit(x, y, sample_weight=sw, batch_size=BATCH, shuffle=False, verbose=0)
    assert max_weight_difference(other, oracle) > 1e-5


@pytest.mark.parametrize("kind, attack", [("adversarial", fgsm()), ("trades", pgd())])
def test_mirrored_strategy_equals_one_device(mirrored, kind, attack):
    model, oracle, history, expected = run_both(kind, attack, strategy=mirrored)
    assert_matches(model, oracle, history, expected)


@pytest.mark.parametrize("kind, attack", [("adversarial", fgsm()), ("trades", pgd())])
def test_mixed_float16_equals_hand_written_loop(kind, attack):
    keras.config.set_dtype_policy("mixed_float16")
    model, oracle, history, expected = run_both(
        kind, attack, oracle_kwargs={"loss_scale": True}
    )
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert int(model.optimizer.iterations) == 2
    assert_matches(model, oracle, history, expected)


@pytest.mark.parametrize("options", [{"jit_compile": True}, {"steps_per_execution": 2}])
def test_jit_compile_and_steps_per_execution(options):
    oracle_kwargs = {"jit_compile": options.get("jit_compile", False)}
    model, oracle, history, expected = run_both(
        "adversarial", pgd(), oracle_kwargs=oracle_kwargs, **options
    )
    assert_matches(model, oracle, history, expected)


def test_composes_with_gradient_clipping():
    model, oracle, history, expected = run_both(
        "adversarial", pgd(), oracle_kwargs={"clip_global_norm": 0.1},
        gradient_transforms=[kt.ClipByGlobalNorm(0.1)],
    )
    assert_matches(model, oracle, history, expected)


@pytest.mark.skipif(  # `make test-oldest` runs Keras 3.10
    _compat.multi_optimizer_class() is None,
    reason="kt.optimizer_groups needs keras.optimizers.MultiOptimizer (Keras 3.15)",
)
def test_composes_with_optimizer_groups_and_sam():
    # Two SGD groups with the same rate are plain SGD; SAM with rho=0 runs
    # the second pass (a second attack, same seeded start) at the same
    # weights: both equal the hand-written loop.
    x, y, sw = data()
    oracle = mlp()
    initial = oracle.get_weights()
    expected = oracle_fit(oracle, x, y, sw, "adversarial", fgsm(), 1.0)
    for option in ("groups", "sam"):
        model = mlp(upgrade=True)
        model.set_weights(initial)
        extra = {"sharpness_aware": kt.SAM(rho=0.0)} if option == "sam" else {}
        optimizer = keras.optimizers.SGD(LR) if option == "sam" else kt.optimizer_groups(
            model, [("hidden", keras.optimizers.SGD(LR, name="a")),
                    ("logits", keras.optimizers.SGD(LR, name="b"))])
        model.compile(optimizer=optimizer, loss=crossentropy(),
                      loss_terms=[make_term("adversarial", fgsm(), 1.0)], **extra)
        history = model.fit(x, y, sample_weight=sw, batch_size=BATCH, shuffle=False,
                            verbose=0).history
        assert_matches(model, oracle, history, expected)


@pytest.mark.parametrize("option, replicas", [
    ({"micro_batches": 2}, 1), ({"accumulation_steps": 2}, 1), ({"micro_batches": 2}, 2),
])
def test_micro_batches_and_accumulation_equal_the_large_batch(option, replicas, request):
    # Without a random start the attack of an example does not depend on
    # the rest of its batch (inference mode), so splitting a batch of 32
    # into two passes, or accumulating two batches of 16, equals one step
    # on the batch of 32 (also with two replicas, whose micro-batch passes
    # run in a loop body where no cross-replica call is allowed).
    strategy = request.getfixturevalue("mirrored") if replicas == 2 else None
    attack = kt.attacks.PGD(EPS, step_size=0.04, steps=2, random_start=False)
    x, y, sw = data()
    oracle = mlp()
    initial = oracle.get_weights()
    expected = oracle_fit(oracle, x, y, sw, "adversarial", attack, 1.0, batch=32)
    model = compiled_model(initial, "adversarial", attack, 1.0, strategy, **option)
    batch = 32 if "micro_batches" in option else 16
    history = model.fit(x, y, sample_weight=sw, batch_size=batch, shuffle=False,
                        verbose=0).history
    assert int(model.optimizer.iterations.numpy()) == 1
    assert_matches(model, oracle, history, expected)


def test_two_outputs_log_their_own_clean_losses(monkeypatch):
    # A multi-output model: the attack and the term call the compiled loss
    # again, which must not be logged as the per-output losses `a_loss` and
    # `b_loss` (one batch: the logs are the clean losses at the initial
    # weights, as stock Keras reports them).
    x, y, _ = data()
    targets = {"a": y, "b": (y + 1) % 3}

    def two_outputs():
        inputs = keras.Input((x.shape[1],))
        hidden = keras.layers.Dense(6, activation="tanh")(inputs)
        return keras.Model(inputs, {"a": keras.layers.Dense(3, name="a")(hidden),
                                    "b": keras.layers.Dense(3, name="b")(hidden)})

    def fit(model, terms=None):
        model.set_weights(initial)
        model.compile(optimizer="sgd", loss={"a": crossentropy(), "b": crossentropy()},
                      **({"loss_terms": terms} if terms else {}))
        return model.fit(x, targets, batch_size=len(x), verbose=0).history

    stock = two_outputs()
    initial = stock.get_weights()
    expected = fit(stock)
    term = kt.AdversarialLoss(kt.attacks.PGD(0.5, steps=2, random_start=False))
    logs = fit(kt.upgrade(two_outputs()), [term])
    for key in ("a_loss", "b_loss"):
        np.testing.assert_allclose(logs[key], expected[key], rtol=1e-6)
    assert logs["adversarial_loss"][0] > logs["a_loss"][0] + logs["b_loss"][0]

    # The check can fail: without muting, the extra calls are logged too.
    from keras_tapeops.attacks import objectives

    monkeypatch.setattr(objectives, "_per_output_trackers_muted",
                        lambda compiled: contextlib.nullcontext())
    logs = fit(kt.upgrade(two_outputs()), [term])
    assert abs(logs["a_loss"][0] - expected["a_loss"][0]) > 1e-3


def test_validation_skips_the_terms_by_default_and_logs_them_when_asked():
    x, y, sw = data()
    model = mlp(upgrade=True)
    model.compile(optimizer="sgd", loss=crossentropy(), loss_terms=[
        kt.AdversarialLoss(fgsm()), kt.TRADES(pgd(), in_validation=True)])
    history = model.fit(x, y, batch_size=BATCH, validation_data=(x, y), verbose=0).history
    assert "val_adversarial_loss" not in history and "adversarial_loss" in history
    assert history["val_trades"][0] > 0.0
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(logs) == {"loss", "trades"}


def test_save_and_load_restore_the_terms_and_resume_identically(tmp_path):
    x, y, sw = data()
    model = mlp(upgrade=True)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss=crossentropy(), loss_terms=[
        kt.AdversarialLoss(fgsm(), weight=0.5), kt.TRADES(pgd(), beta=2.0)])
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    path = str(tmp_path / "adversarial.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    adversarial, trades = loaded.tapeops_options.loss_terms
    assert adversarial.get_config() == model.tapeops_options.loss_terms[0].get_config()
    assert (trades.beta, trades.attack.steps, trades.attack.seed) == (2.0, 3, SEED)
    a = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    b = loaded.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    assert max_weight_difference(model, loaded) < 1e-6
    np.testing.assert_allclose(a["trades"], b["trades"], rtol=1e-6)


def test_config_round_trips_and_repr():
    for term in (kt.AdversarialLoss(fgsm(), weight=0.5, name="adv"),
                 kt.TRADES(pgd(), beta=3.0, from_logits=False)):
        config = keras.saving.serialize_keras_object(term)
        restored = keras.saving.deserialize_keras_object(config)
        assert type(restored) is type(term)
        assert restored.get_config() == term.get_config()
        assert "attack=" in repr(term)


def test_bad_arguments_raise_with_received():
    with pytest.raises(TypeError, match="Received: attack=0.1"):
        kt.AdversarialLoss(0.1)
    with pytest.raises(ValueError, match="random_start=True.*Received: attack="):
        kt.TRADES(kt.attacks.PGD(0.1, random_start=False))
    with pytest.raises(ValueError, match="Received: beta=-1"):
        kt.TRADES(pgd(), beta=-1)
    with pytest.raises(TypeError, match="Received: from_logits='yes'"):
        kt.TRADES(pgd(), from_logits="yes")


def test_trades_refuses_a_loss_that_reads_probabilities():
    x, y, _ = data()
    model = mlp(upgrade=True)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                  loss_terms=[kt.TRADES(pgd())])
    before = model.get_weights()
    with pytest.raises(ValueError, match="from_logits=False.*Received: from_logits=True"):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    assert max(float(np.abs(a - b).max()) for a, b in zip(before, model.get_weights())) == 0
