"""Step time of loss-based selection relative to stock `fit` and to the hand-written floor.

An MLP (Dense 256 -> 1024 -> 1024 -> 10, softmax cross-entropy from logits)
trained with SGD on in-memory random data, candidate batches of `--batch`
(320: RHO-LOSS's 10x candidate batch of 32) for `--steps` steps per round:

  stock            plain Keras `fit` on the whole candidate batch;
  TopLoss(0.25)    `fit` with `sample_selection=kt.TopLoss(0.25)`;
  ReducibleLoss(0.1) `fit` with `kt.ReducibleLoss(table, 0.1)`, ids in x;
  floor stock      hand-written `tf.function` step on all candidates (what
                   `fit`'s own per-step and per-call overhead adds to it);
  train_step top/rho  the same select-then-step hand-written in a Keras
                   `train_step` override run by `fit` (the floor with `fit`'s
                   own overhead: the fairest comparison for a `fit` option);
  floor top/rho    hand-written `tf.function` step: one forward pass of the
                   candidates (no tape), per-example losses (minus the
                   looked-up irreducible loss), top-k, gather, forward and
                   backward on the kept examples, SGD update; iterated over
                   the same `tf.data` batches as `fit`.

Each time is the median over interleaved rounds (all traced beforehand), and
the ratio is the median of the per-round ratios. Target (issue 20): the
selection `fit` <= 1.05x its floor.

`--clock cpu` reads the process's CPU time instead of wall time: steadier
when other jobs share the machine (use 15 or more rounds for a 1.05x target).

    python bench/selection.py [--rounds 7] [--steps 20] [--batch 320] [--clock wall|cpu]
"""

import argparse
import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras_tapeops as kt  # noqa: E402
from common import add_clock_argument, interleaved_on, report, without_autotune  # noqa: E402

LR = 0.01


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(10),
    ])


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def fit_runner(model, dataset):
    return lambda: model.fit(dataset, epochs=1, verbose=0)


class HandWritten(keras.Model):
    """A hand-written select-then-step `train_step` (the floor, run by `fit`)."""

    def __init__(self, fraction, table=None):
        super().__init__()
        self.net = mlp()
        self.fraction = fraction
        self.table = table
        self.ce = loss()

    def call(self, x, training=False):
        return self.net(x, training=training)

    def train_step(self, data):
        x, y = data
        ids = None
        if isinstance(x, dict):
            x, ids = x["x"], tf.cast(x["example_id"], "int32")
        logits = self(x, training=False)
        scores = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        if self.table is not None:
            scores = scores - tf.gather(self.table, ids)
        n = tf.shape(scores)[0]
        k = tf.cast(tf.math.ceil(self.fraction * tf.cast(n, "float32") - 1e-6), "int32")
        keep = tf.sort(tf.math.top_k(scores, k=k, sorted=False).indices)
        with tf.GradientTape() as tape:
            value = self.ce(tf.gather(y, keep), self(tf.gather(x, keep), training=True))
        self.optimizer.apply_gradients(zip(tape.gradient(value, self.trainable_weights),
                                           self.trainable_weights))
        return {"loss": value}


def hand_written_fit(fraction, dataset, table=None):
    model = HandWritten(fraction, table)
    model.compile(optimizer=keras.optimizers.SGD(LR))
    return fit_runner(model, dataset)


def floor_runner(model, dataset, fraction, table=None):
    """The hand-written select-then-step loop (the floor)."""
    variables = model.trainable_weights
    ce = loss()

    @tf.function
    def step(x, y, ids):
        if fraction is None:  # the stock step, hand-written
            with tf.GradientTape() as tape:
                value = ce(y, model(x, training=True))
            for v, g in zip(variables, tape.gradient(value, variables)):
                v.assign_sub(LR * g)
            return
        logits = model(x, training=False)
        scores = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        if table is not None:
            scores = scores - tf.gather(table, ids)
        n = tf.shape(scores)[0]
        k = tf.cast(tf.math.ceil(fraction * tf.cast(n, "float32") - 1e-6), "int32")
        keep = tf.sort(tf.math.top_k(scores, k=k, sorted=False).indices)
        with tf.GradientTape() as tape:
            value = ce(tf.gather(y, keep), model(tf.gather(x, keep), training=True))
        for v, g in zip(variables, tape.gradient(value, variables)):
            v.assign_sub(LR * g)

    def run():
        for x, y in dataset:
            if isinstance(x, dict):
                step(x["x"], y, tf.cast(x["example_id"], "int32"))
            else:
                step(x, y, tf.zeros([tf.shape(x)[0]], "int32"))
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=320)
    add_clock_argument(parser)
    args = parser.parse_args()

    n = args.steps * args.batch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 256)).astype("float32")
    y = rng.integers(0, 10, size=n).astype("int32")
    table = rng.uniform(0.0, 2.0, size=n).astype("float32")
    plain = without_autotune(tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).cache())
    with_ids = without_autotune(
        tf.data.Dataset.from_tensor_slices(
            ({"x": x, "example_id": np.arange(n, dtype="int32")}, y)
        ).batch(args.batch).cache()
    )

    def compiled(selection=None, upgrade=True):
        model = kt.upgrade(mlp()) if upgrade else mlp()
        options = {} if selection is None else {"sample_selection": selection}
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss(), **options)
        return model

    candidates = {
        "stock fit (all candidates)": fit_runner(compiled(upgrade=False), plain),
        "floor stock": floor_runner(mlp(), plain, None),
        "TopLoss(0.25) fit": fit_runner(compiled(kt.TopLoss(0.25)), plain),
        "floor top-0.25": floor_runner(mlp(), plain, 0.25),
        "train_step top-0.25": hand_written_fit(0.25, plain),
        "ReducibleLoss(0.1) fit": fit_runner(compiled(kt.ReducibleLoss(table, 0.1)), with_ids),
        "floor reducible-0.1": floor_runner(mlp(), with_ids, 0.1, tf.constant(table)),
        "train_step reducible-0.1": hand_written_fit(0.1, with_ids, tf.constant(table)),
    }
    for run in candidates.values():  # trace and warm up
        run()
        run()
    times = interleaved_on(args.clock, candidates, args.rounds)
    print(f"{args.clock} time, {args.steps} steps of candidate batch {args.batch} "
          f"(kept: {math.ceil(0.25 * args.batch)} and {math.ceil(0.1 * args.batch)}), "
          f"{args.rounds} rounds; machine: {os.cpu_count()} cores")
    report(times, "stock fit (all candidates)", "of stock fit")
    print()
    report({k: times[k] for k in ("floor stock", "stock fit (all candidates)")},
           "floor stock", "of its floor")
    report({k: times[k] for k in ("floor top-0.25", "train_step top-0.25", "TopLoss(0.25) fit")},
           "floor top-0.25", "of its floor")
    report({k: times[k] for k in ("floor reducible-0.1", "train_step reducible-0.1",
                                  "ReducibleLoss(0.1) fit")},
           "floor reducible-0.1", "of its floor")
    print()
    report({k: times[k] for k in ("train_step top-0.25", "TopLoss(0.25) fit")},
           "train_step top-0.25", "of the hand-written train_step")
    report({k: times[k] for k in ("train_step reducible-0.1", "ReducibleLoss(0.1) fit")},
           "train_step reducible-0.1", "of the hand-written train_step")


if __name__ == "__main__":
    main()
