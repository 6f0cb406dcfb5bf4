"""Benchmark: optimizer groups and gradual unfreezing.

Part 1, the cost of groups: the same MLP (backbone_1 -> backbone_2 -> head)
trained with Adam, one epoch per round:
  - stock fit, one Adam for every variable;
  - stock fit, `kt.optimizer_groups`: two Adams (backbone, head) in a
    `keras.optimizers.MultiOptimizer`;
  - keras_tapeops fit (upgraded model), one Adam and the same two groups.
Target: two groups <= 1.05x one optimizer (each fit against its own).

Part 2, what freezing saves: a wider backbone (4 x Dense 512) and a small
head, two groups (backbone SGD, head Adam), keras_tapeops fit:
  - all trainable (full backward, both groups step);
  - backbone gradients computed and discarded (backbone group at
    learning rate 0: the full backward, a negligible update);
  - backbone frozen by `kt.callbacks.GradualUnfreezing` (no backbone
    gradient is computed: the backward pass stops at the head).
plus the backward pass alone (a `tf.function` taking the gradient with
respect to every variable vs the head's only).

Rounds are interleaved in one process; prints the median time and the
median ratio to the reference of each part.

Run: python bench/groups.py   (about three minutes on 2 CPU cores)
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import common  # noqa: E402  (sets the TF log level before TensorFlow loads)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402
from keras_tapeops.callbacks.gradual_unfreezing import GradualUnfreezing  # noqa: E402
from keras_tapeops.callbacks.gradual_unfreezing import sync_multi_optimizer  # noqa: E402
from keras_tapeops.groups import optimizer_groups  # noqa: E402

ROUNDS = 25
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ------------------------------------------------------------ part 1: groups
N1, FEATURES1, CLASSES, BATCH1 = 8192, 64, 10, 128


def mlp():
    inputs = keras.Input((FEATURES1,))
    h = keras.layers.Dense(256, activation="relu", name="backbone_1")(inputs)
    h = keras.layers.Dense(256, activation="relu", name="backbone_2")(h)
    outputs = keras.layers.Dense(CLASSES, name="head")(h)
    return keras.Model(inputs, outputs)


def two_adams(model):
    return optimizer_groups(model, [
        (["backbone_1", "backbone_2"], keras.optimizers.Adam(1e-4, name="backbone")),
        ("head", keras.optimizers.Adam(1e-3, name="head")),
    ])


def part1():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N1, FEATURES1)).astype("float32")
    y = rng.integers(0, CLASSES, size=(N1,))
    weights = mlp().get_weights()

    def build(tapeops, groups):
        model = kt.upgrade(mlp()) if tapeops else mlp()
        model.set_weights(weights)
        optimizer = two_adams(model) if groups else keras.optimizers.Adam(1e-3)
        model.compile(optimizer=optimizer, loss=LOSS)
        return model

    models = {
        "stock fit, one Adam": build(False, False),
        "stock fit, two groups": build(False, True),
        "keras_tapeops fit, one Adam": build(True, False),
        "keras_tapeops fit, two groups": build(True, True),
    }
    candidates = {
        name: (lambda m=model: m.fit(x, y, batch_size=BATCH1, epochs=1, verbose=0))
        for name, model in models.items()
    }
    for run in candidates.values():  # warm up: trace and compile
        run()
    print(f"Part 1: MLP {FEATURES1}-256-256-{CLASSES}, {N1} samples, batch {BATCH1}, "
          f"{ROUNDS} interleaved rounds of one epoch each")
    times = common.interleaved(candidates, ROUNDS)
    stock = {k: v for k, v in times.items() if k.startswith("stock")}
    ours = {k: v for k, v in times.items() if k.startswith("keras_tapeops")}
    common.report(stock, "stock fit, one Adam", "one Adam (stock fit)")
    common.report(ours, "keras_tapeops fit, one Adam", "one Adam (keras_tapeops fit)")


# ------------------------------------------------------ part 2: unfreezing
N2, FEATURES2, WIDTH, DEPTH, BATCH2 = 8192, 256, 512, 4, 256


def wide():
    inputs = keras.Input((FEATURES2,))
    h = inputs
    for i in range(DEPTH):
        h = keras.layers.Dense(WIDTH, activation="relu", name=f"backbone_{i}")(h)
    outputs = keras.layers.Dense(CLASSES, name="head")(h)
    return kt.upgrade(keras.Model(inputs, outputs))


def part2():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N2, FEATURES2)).astype("float32")
    y = rng.integers(0, CLASSES, size=(N2,))
    weights = wide().get_weights()

    def build(backbone_rate):
        model = wide()
        model.set_weights(weights)
        model.compile(loss=LOSS, optimizer=optimizer_groups(model, [
            ("backbone_*", keras.optimizers.SGD(backbone_rate, name="backbone")),
            ("head", keras.optimizers.Adam(1e-3, name="head")),
        ]))
        return model

    trained, discarded, frozen = build(1e-3), build(0.0), build(1e-3)

    def epoch(model, callbacks=()):
        return lambda: model.fit(x, y, batch_size=BATCH2, epochs=1, verbose=0,
                                 callbacks=list(callbacks))

    # One epoch with the callback (it freezes at the start: one new trace),
    # then the frozen state it sets is kept for the timed rounds (the
    # callback itself puts the flags back at the end of every fit, which
    # would re-trace every round).
    first = common.time_call(epoch(frozen, [GradualUnfreezing([("backbone_*", 10**9)])]))
    for v in frozen.trainable_variables:
        if v.path.startswith("backbone_"):
            v.trainable = False
    sync_multi_optimizer(frozen, frozen.trainable_variables)
    frozen.make_train_function(force=True)
    candidates = {
        "all trainable": epoch(trained),
        "backbone grads discarded (lr 0)": epoch(discarded),
        "backbone frozen (GradualUnfreezing)": epoch(frozen),
    }
    for run in candidates.values():
        run()
    print(f"\nPart 2: backbone {DEPTH} x Dense {WIDTH} + head, {N2} samples, "
          f"batch {BATCH2}, {ROUNDS} interleaved rounds of one fit epoch each")
    times = common.interleaved(candidates, ROUNDS)
    common.report(times, "backbone grads discarded (lr 0)", "computing and discarding")
    steady = sorted(times["backbone frozen (GradualUnfreezing)"])[ROUNDS // 2]
    print(f"first frozen epoch (freeze + one new trace): {first * 1000:.1f} ms, "
          f"{(first - steady) * 1000:.1f} ms more than a steady epoch")

    # The backward pass alone, on one batch.
    model = wide()
    xb, yb = tf.constant(x[:BATCH2]), tf.constant(y[:BATCH2])
    head = model.get_layer("head").trainable_variables
    everything = model.trainable_variables

    def gradient(variables):
        @tf.function
        def run():
            with tf.GradientTape() as tape:
                loss = LOSS(yb, model(xb, training=True))
            return tape.gradient(loss, variables)

        return run

    all_grads, head_grads = gradient(everything), gradient(head)
    steps = 20

    def repeat(fn):
        def run():
            for _ in range(steps):
                out = fn()
            float(tf.reduce_sum(out[-1]))  # wait for the result
        return run

    backward = {"forward+backward, all variables": repeat(all_grads),
                "forward+backward, head only": repeat(head_grads)}
    for run in backward.values():
        run()
    print(f"\nForward + backward pass alone ({steps} batches per round)")
    times = common.interleaved(backward, ROUNDS)
    common.report(times, "forward+backward, all variables", "all variables")


if __name__ == "__main__":
    part1()
    part2()
