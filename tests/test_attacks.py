"""`kt.attacks.FGSM` and `kt.attacks.PGD` against the hand-written `tape.watch` loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from adversarial_oracle import crossentropy
from adversarial_oracle import data
from adversarial_oracle import loss_objective
from adversarial_oracle import mlp
from adversarial_oracle import oracle_attack
from adversarial_oracle import oracle_start
from adversarial_oracle import per_example_norm

TOL = 1e-6


@pytest.fixture
def model():
    net = mlp()
    net.compile(loss=crossentropy())
    return net


def oracle_for(attack, model, x, y, seed_step=0):
    delta = None
    if attack.random_start:
        delta = oracle_start(x.shape, attack.epsilon, attack.norm, attack.seed, seed_step)
    return oracle_attack(
        model, loss_objective(y), x, attack.epsilon, attack.step_size, attack.steps,
        attack.norm, attack.clip, delta,
    ).numpy()


ATTACKS = [
    kt.attacks.FGSM(0.1, random_start=False),
    kt.attacks.FGSM(0.1, seed=3, clip=(0.0, 1.0)),
    kt.attacks.FGSM(0.5, random_start=False, norm="l2"),
    kt.attacks.FGSM(0.5, seed=3, norm="l2", clip=(0.0, 1.0)),
    kt.attacks.PGD(0.1, step_size=0.03, steps=5, random_start=False),
    kt.attacks.PGD(0.1, step_size=0.03, steps=5, seed=3, clip=(0.0, 1.0)),
    kt.attacks.PGD(0.5, step_size=0.2, steps=4, norm="l2", random_start=False),
    kt.attacks.PGD(0.5, step_size=0.2, steps=4, norm="l2", seed=3, clip=(0.0, 1.0)),
]


@pytest.mark.parametrize("attack", ATTACKS, ids=repr)
def test_equals_the_hand_written_loop(model, attack):
    x, y, _ = data()
    expected = oracle_for(attack, model, x, y)
    actual = attack(model, x, y)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL)
    assert np.abs(actual - x).max() > attack.epsilon / 4


def test_pgd_equals_the_loop_step_for_step(model):
    # Every prefix of the loop: PGD with k steps equals the oracle's k steps.
    x, y, _ = data()
    for steps in (1, 2, 3):
        attack = kt.attacks.PGD(0.1, step_size=0.03, steps=steps, seed=5)
        np.testing.assert_allclose(attack(model, x, y), oracle_for(attack, model, x, y),
                                   rtol=0, atol=TOL)


def test_the_comparison_can_fail(model):
    # One step more, or another seed, is far from the oracle.
    x, y, _ = data()
    attack = kt.attacks.PGD(0.1, step_size=0.03, steps=3, seed=5)
    expected = oracle_for(attack, model, x, y)
    longer = kt.attacks.PGD(0.1, step_size=0.03, steps=4, seed=5)
    reseeded = kt.attacks.PGD(0.1, step_size=0.03, steps=3, seed=6)
    assert np.abs(longer(model, x, y) - expected).max() > 1e-3
    assert np.abs(reseeded(model, x, y) - expected).max() > 1e-3


@pytest.mark.parametrize("norm, epsilon", [("inf", 0.1), ("l2", 0.5)])
def test_stays_in_the_ball_and_the_clip_range_and_raises_the_loss(model, norm, epsilon):
    x, y, _ = data()
    loss = crossentropy("none")
    attack = kt.attacks.PGD(epsilon, steps=5, norm=norm, clip=(0.0, 1.0), seed=0)
    x_adv = attack(model, x, y).numpy()
    delta = x_adv - x
    size = np.abs(delta).max(axis=1) if norm == "inf" else np.linalg.norm(delta, axis=1)
    assert size.max() <= epsilon + 1e-6
    assert x_adv.min() >= 0.0 and x_adv.max() <= 1.0
    clean = loss(y, model(x)).numpy()
    adversarial = loss(y, model(x_adv)).numpy()
    noise = kt.attacks.noise.random_start([tf.constant(x)], epsilon, norm, seed=1, step=0)[0]
    random = loss(y, model(np.clip(x + noise, 0.0, 1.0))).numpy()
    assert (adversarial > clean).all()
    assert adversarial.mean() > random.mean()


def test_runs_in_inference_mode():
    # BatchNormalization keeps its moving statistics and dropout is off:
    # without a random start the attack is deterministic.
    model = keras.Sequential([
        keras.Input((8,)), keras.layers.BatchNormalization(), keras.layers.Dropout(0.5),
        keras.layers.Dense(3),
    ])
    model.compile(loss=crossentropy())
    x, y = np.random.default_rng(0).normal(size=(16, 8)).astype("float32"), np.arange(16) % 3
    before = [v.numpy() for v in model.non_trainable_variables]
    attack = kt.attacks.PGD(0.1, steps=3, random_start=False)
    first, second = attack(model, x, y), attack(model, x, y)
    np.testing.assert_array_equal(first, second)
    for a, b in zip(before, model.non_trainable_variables):
        np.testing.assert_array_equal(a, b.numpy())


def test_own_loss_replaces_the_compiled_loss():
    model = mlp()  # not compiled
    x, y, _ = data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    attack = kt.attacks.PGD(0.1, step_size=0.03, steps=3, random_start=False, loss=loss)
    expected = oracle_attack(model, loss_objective(y, loss), x, 0.1, 0.03, 3, "inf").numpy()
    np.testing.assert_allclose(attack(model, x, y), expected, rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="not compiled with a loss.*Received: loss=None"):
        kt.attacks.FGSM(0.1)(model, x, y)


def test_inputs_selects_what_is_perturbed():
    rng = np.random.default_rng(0)
    image = keras.Input((4,), name="image")
    extra = keras.Input((2,), name="extra")
    token = keras.Input((1,), dtype="int32", name="token")
    merged = keras.layers.Concatenate()([image, extra, keras.ops.cast(token, "float32")])
    model = keras.Model([image, extra, token], keras.layers.Dense(3)(merged))
    model.compile(loss=crossentropy())
    x = [rng.uniform(size=(8, 4)).astype("float32"), rng.uniform(size=(8, 2)).astype("float32"),
         rng.integers(0, 5, size=(8, 1)).astype("int32")]
    y = np.arange(8) % 3
    x_adv = kt.attacks.FGSM(0.1, random_start=False, inputs="extra")(model, x, y)
    np.testing.assert_array_equal(x_adv[0], x[0])
    np.testing.assert_array_equal(x_adv[2], x[2])
    assert np.abs(x_adv[1] - x[1]).max() > 0.05
    both = kt.attacks.FGSM(0.1, random_start=False)(model, x, y)  # every float input
    assert np.abs(both[0] - x[0]).max() > 0.05 and both[2].dtype == tf.int32
    with pytest.raises(ValueError, match="only floating-point inputs.*Received: inputs=2"):
        kt.attacks.FGSM(0.1, inputs=2)(model, x, y)
    with pytest.raises(ValueError, match="names no input.*Received: inputs='nope'"):
        kt.attacks.FGSM(0.1, inputs="nope")(model, x, y)


def test_joint_l2_ball_over_several_inputs():
    a, b = keras.Input((3,), name="a"), keras.Input((5,), name="b")
    outputs = keras.layers.Dense(3)(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, outputs)
    model.compile(loss=crossentropy())
    rng = np.random.default_rng(1)
    x = {"a": rng.normal(size=(6, 3)).astype("float32"),
         "b": rng.normal(size=(6, 5)).astype("float32")}
    x_adv = kt.attacks.PGD(0.3, steps=3, norm="l2", seed=0)(model, x, np.arange(6) % 3)
    squared = sum(np.sum((x_adv[k] - x[k]) ** 2, axis=1) for k in x)
    assert np.sqrt(squared).max() <= 0.3 + 1e-6
    assert np.sqrt(squared).min() > 0.2


def test_mixed_float16_perturbs_in_float32(model):
    keras.config.set_dtype_policy("mixed_float16")
    half = mlp()
    half.compile(loss=crossentropy())
    half.set_weights(model.get_weights())
    x, y, _ = data()
    attack = kt.attacks.PGD(0.1, step_size=0.03, steps=3, random_start=False, clip=(0.0, 1.0))
    x_adv = attack(half, x, y)
    assert x_adv.dtype == tf.float32
    assert np.abs(x_adv.numpy() - x).max() <= 0.1 + 1e-6
    # Steps of 0.03 in float32 (float16 would round 0.03 to 0.029998779).
    full = attack(model, x, y).numpy()
    agree = np.isclose(x_adv.numpy(), full, atol=1e-6).mean()
    assert agree > 0.95


def test_works_inside_a_tf_function(model):
    x, y, _ = data()
    attack = kt.attacks.PGD(0.1, step_size=0.03, steps=4, seed=2)
    traced = tf.function(lambda x, y: attack(model, x, y))
    np.testing.assert_allclose(traced(x, y), attack(model, x, y), rtol=0, atol=TOL)


@pytest.mark.parametrize("attack", [
    kt.attacks.FGSM(0.1),
    kt.attacks.PGD(0.2, 0.05, 7, norm="l2", random_start=False, clip=(-1.0, 1.0),
                   inputs=["a", 1], loss=keras.losses.CategoricalCrossentropy(), seed=3),
    kt.attacks.PGD(0.2, loss="sparse_categorical_crossentropy"),
], ids=["fgsm", "pgd-full", "pgd-loss-name"])
def test_config_round_trip(attack):
    config = keras.saving.serialize_keras_object(attack)
    restored = keras.saving.deserialize_keras_object(config)
    assert type(restored) is type(attack)
    assert restored.get_config() == attack.get_config()
    assert repr(restored) == repr(attack)


@pytest.mark.parametrize("make, message", [
    (lambda: kt.attacks.FGSM(-1), "Received: epsilon=-1"),
    (lambda: kt.attacks.PGD(0.1, steps=0), "Received: steps=0"),
    (lambda: kt.attacks.PGD(0.1, norm="l1"), "Received: norm='l1'"),
    (lambda: kt.attacks.PGD(0.1, step_size=0), "Received: step_size=0"),
    (lambda: kt.attacks.FGSM(0.1, clip=(1.0, 0.0)), r"Received: clip=\(1.0, 0.0\)"),
    (lambda: kt.attacks.FGSM(0.1, clip=(0.5, 0.5)), r"Received: clip=\(0.5, 0.5\)"),
    (lambda: kt.attacks.FGSM(0.1, clip=0.5), "Received: clip=0.5"),
    (lambda: kt.attacks.FGSM(0.1, inputs=[0, 0]), r"Received: inputs=\[0, 0\]"),
    (lambda: kt.attacks.FGSM(0.1, inputs=-1), "Received: inputs=-1"),
    (lambda: kt.attacks.FGSM(0.1, seed=-2), "Received: seed=-2"),
    (lambda: kt.attacks.FGSM(0.1, random_start="yes"), "Received: random_start='yes'"),
    (lambda: kt.attacks.FGSM(0.1, loss="no_such_loss"), "Received: loss='no_such_loss'"),
    (lambda: kt.attacks.FGSM(0.1, loss=3), "Received: loss=3"),
])
def test_bad_arguments_raise_with_received(make, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make()


def test_norm_of_a_random_l2_start_is_uniform_in_the_ball():
    # Radius ~ epsilon * u ** (1 / d): in 64 dimensions almost all mass is
    # near the sphere, never outside.
    start = kt.attacks.noise.random_start(
        [tf.zeros((2000, 64))], 1.0, "l2", seed=0, step=0)[0]
    norms = per_example_norm(start).numpy().ravel()
    assert norms.max() <= 1.0 + 1e-6 and np.median(norms) > 0.98
    box = kt.attacks.noise.random_start([tf.zeros((2000, 4))], 0.5, "inf", seed=0, step=0)[0]
    assert np.abs(box).max() <= 0.5 and abs(float(np.mean(box))) < 0.02
