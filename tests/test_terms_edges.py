"""Edge cases of the loss-term base and `kt.GradientPenalty`, called directly (no `fit`).

Covers what the other term tests leave open: a term's weight must be a
finite non-bool number (a schedule must give one at step 0); a custom
term's default name is its class name in snake case (the logged name); and
`kt.GradientPenalty` on a two-output model differentiates the sum of every
output, not just the first.

Oracle for the penalty: a hand-written `tf.GradientTape` (the input gradient
of the summed outputs) and NumPy for the per-sample norms and their mean.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

pytestmark = pytest.mark.unit


def output_mean(model, x, y, y_pred):
    return keras.ops.mean(y_pred)


# ------------------------------------------------------------ the weight
@pytest.mark.parametrize("weight", [True, np.bool_(False)])
def test_a_bool_weight_is_refused(weight):
    with pytest.raises(TypeError, match=r"`weight` must be a number"):
        kt.LossTerm(output_mean, weight=weight)


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -float("inf"), 1e39])
def test_a_non_finite_weight_is_refused(weight):
    with pytest.raises(ValueError, match=r"weight"):
        kt.LossTerm(output_mean, weight=weight)


def test_a_schedule_weight_must_be_finite_at_step_zero():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    term = kt.LossTerm(output_mean, weight=lambda step: float("nan"))
    with pytest.raises(ValueError, match=r"weight schedule must give a finite number"):
        term.bind(model)
    kt.LossTerm(output_mean, weight=lambda step: 0.5).bind(model)  # a finite one binds


def test_a_custom_terms_default_name_is_its_class_name_in_snake_case():
    class MeanOutput(kt.Term):
        def call(self, context):
            return keras.ops.mean(context.y_pred)

    assert MeanOutput().name == "mean_output"
    assert MeanOutput(name="mine").name == "mine"


# ---------------------------------------------------------- GradientPenalty
def test_gradient_penalty_differentiates_the_sum_of_every_output():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh", name="trunk")(inputs)
    model = keras.Model(
        inputs, [keras.layers.Dense(2, name="a")(h), keras.layers.Dense(1, name="b")(h)]
    )
    x = tf.constant(np.random.default_rng(0).normal(size=(5, 3)).astype("float32"))
    target = 0.3
    with tf.GradientTape() as tape:
        tape.watch(x)
        y_pred = model(x, training=True)
    context = kt.TermContext(
        model, x, None, y_pred, None, True, {}, input_tape=tape, watched_inputs=[True]
    )
    value = kt.GradientPenalty(target=target).call(context)

    with tf.GradientTape() as oracle_tape:
        oracle_tape.watch(x)
        a, b = model(x, training=True)
        total = tf.reduce_sum(a) + tf.reduce_sum(b)
    grad = oracle_tape.gradient(total, x).numpy().astype(np.float64)
    expected = np.mean((np.linalg.norm(grad, axis=1) - target) ** 2)
    np.testing.assert_allclose(float(value), expected, rtol=1e-6)
    # The first output alone gives another value (the check can fail).
    with tf.GradientTape() as first_tape:
        first_tape.watch(x)
        first = tf.reduce_sum(model(x, training=True)[0])
    only_first = np.linalg.norm(first_tape.gradient(first, x).numpy(), axis=1)
    assert abs(np.mean((only_first - target) ** 2) - expected) > 1e-3


# ------------------------------------------------- AdversarialLoss / TRADES
class _FlagRecorder(keras.layers.Layer):
    """An identity layer that records the `training` flag of every call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.flags = []

    def call(self, x, training=None):
        self.flags.append(training)
        return x


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize(
    "term, attack_passes",
    [
        (kt.AdversarialLoss(kt.attacks.FGSM(0.1)), 1),
        # the clean predictions, then two PGD steps
        (kt.TRADES(kt.attacks.PGD(0.1, 0.05, steps=2, random_start=True, seed=0)), 3),
    ],
    ids=["AdversarialLoss", "TRADES"],
)
def test_attack_passes_run_in_inference_mode_and_the_adversarial_pass_in_the_steps(
    term, attack_passes, training
):
    """docs/adversarial.md: the attack (TRADES's clean predictions included)
    runs in inference mode; the forward pass on x_adv with the step's flag
    (dropout, BatchNormalization batch statistics in `train_step`)."""
    recorder = _FlagRecorder()
    inputs = keras.Input((4,))
    model = kt.upgrade(keras.Model(inputs, keras.layers.Dense(3)(recorder(inputs))))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x = tf.constant(np.random.default_rng(0).random((6, 4)).astype("float32"))
    y = tf.constant([0, 1, 2, 0, 1, 2])
    y_pred = model(x, training=training)
    recorder.flags.clear()
    term.call(kt.TermContext(model, x, y, y_pred, None, training, activations={}))
    assert recorder.flags == [False] * attack_passes + [training]
