"""Benchmark: `kt.ActivationPenalty` vs a hand-written `train_step` adding the same penalty.

Both sides train the same MLP with `fit()` on the same data, adding
`BETA * mean(square(hidden))` to a cross-entropy loss and logging it:
  - hand-written: the keras.io "customize what happens in fit()" pattern, a
    subclassed model whose `train_step` runs the layers and adds the penalty;
  - keras_tapeops: the same model with `kt.ActivationPenalty`.
Rounds are interleaved in one process; the median ratio of epoch times is
printed. Also prints how many times the penalized layer's `call` runs in one
traced training step (must be 1: the activation comes from the same forward
pass).

Run: python bench/terms.py   (about a minute on 2 CPU cores)
"""

import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402

BETA = 1e-3
N, FEATURES, CLASSES, BATCH = 8192, 64, 10, 128
ROUNDS, EPOCHS = 7, 2


class Net(keras.Model):
    """The MLP both sides train."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(256, activation="relu", name="hidden")
        self.middle = keras.layers.Dense(256, activation="relu", name="middle")
        self.head = keras.layers.Dense(CLASSES, name="head")

    def call(self, x):
        return self.head(self.middle(self.hidden(x)))


class HandWrittenNet(Net):
    """keras.io pattern: override `train_step`, add the penalty, track it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.penalty_tracker = keras.metrics.Mean(name="act")

    @property
    def metrics(self):
        return [self.loss_tracker, self.penalty_tracker]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            hidden = self.hidden(x, training=True)
            y_pred = self.head(self.middle(hidden, training=True), training=True)
            penalty = BETA * tf.reduce_mean(tf.square(tf.cast(hidden, "float32")))
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred) + penalty
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        n = tf.shape(x)[0]
        self.loss_tracker.update_state(loss, sample_weight=n)
        self.penalty_tracker.update_state(penalty, sample_weight=n)
        return {m.name: m.result() for m in self.metrics}


class TapeOpsNet(kt.TapeOpsMixin, Net):
    pass


def compile_kwargs():
    return dict(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def make_models(x):
    hand = HandWrittenNet()
    hand(x[:1])
    hand.compile(**compile_kwargs())
    tape = TapeOpsNet()
    tape(x[:1])
    tape.set_weights(hand.get_weights())
    tape.compile(
        **compile_kwargs(),
        loss_terms=[kt.ActivationPenalty(tape.hidden, l2=BETA, name="act")],
    )
    return hand, tape


def timed_fit(model, x, y):
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return time.perf_counter() - start, history.history


def calls_per_traced_step(model, x, y):
    """Runs of `model.hidden.call` while tracing one training step."""
    count = [0]
    original = model.hidden.call

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    model.hidden.call = counting
    try:
        data = (tf.constant(x[:BATCH]), tf.constant(y[:BATCH]))
        tf.function(model.train_step).get_concrete_function(data)
    finally:
        del model.hidden.call
    return count[0]


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(N,)).astype("int32")
    hand, tape = make_models(x)
    # Warm-up (tracing) outside the timed rounds; same start, same batches.
    _, h_hist = timed_fit(hand, x, y)
    _, t_hist = timed_fit(tape, x, y)
    drift = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(hand.get_weights(), tape.get_weights())
    )
    print(f"after warm-up: max |weight difference| = {drift:.2e}, "
          f"act logged {h_hist['act'][-1]:.6f} (hand) vs {t_hist['act'][-1]:.6f} (kt)")
    hand_times, tape_times = [], []
    for i in range(ROUNDS):
        sides = [(hand, hand_times), (tape, tape_times)]
        if i % 2:
            sides.reverse()
        for model, times in sides:
            times.append(timed_fit(model, x, y)[0])
    ratios = [t / h for t, h in zip(tape_times, hand_times)]
    steps = EPOCHS * -(-N // BATCH)
    print(f"hand-written train_step: median {statistics.median(hand_times) / steps * 1e3:.2f} ms/step")
    print(f"kt.ActivationPenalty:    median {statistics.median(tape_times) / steps * 1e3:.2f} ms/step")
    print(f"ActivationPenalty: {statistics.median(ratios):.2f}x hand-written train_step "
          f"(median of {ROUNDS} interleaved rounds; min {min(ratios):.2f}x, max {max(ratios):.2f}x)")
    print(f"forward passes per step (calls of the penalized layer in one traced "
          f"step): kt {calls_per_traced_step(tape, x, y)}, "
          f"hand-written {calls_per_traced_step(hand, x, y)}")


if __name__ == "__main__":
    main()
