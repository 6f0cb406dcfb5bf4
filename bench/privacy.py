"""DP-SGD step time and peak memory relative to stock non-private `fit`.

Three models, each trained on in-memory random data with batch size 64:

  mlp          Dense 256 -> 512 -> 512 -> 10
  cnn          Conv2D 32 (32x32x3) -> Conv2D 64 /2 -> Conv2D 64 /2 -> pool -> Dense 10
  transformer  Embedding (1000 x 64, length 64) -> MultiHeadAttention (4 heads)
               -> LayerNormalization -> Dense 128 -> Dense 64 -> LayerNormalization
               -> pool -> Dense 10

and four configurations: `stock` (plain Keras model, no keras_tapeops),
`auto` (`kt.DPSGD(1.0, 1.0)`: ghost norms where a rule exists), `auto-clip`
(the same with `noise_multiplier=0`: the clipping alone, without drawing a
model-sized Gaussian each step) and `vectorized`
(`kt.DPSGD(1.0, 1.0, method="vectorized")`: per-example Jacobians for every
layer, TF Privacy's vectorized approach).

  time    median over interleaved rounds of the time of `STEPS` training
          steps (`fit` on `STEPS` batches, traced beforehand), and the
          median of the per-round ratios to stock.
  memory  TensorFlow's CPU allocator peak during one `train_on_batch`:
          `total` includes what was allocated before it (weights, optimizer
          slots, the batch: what Opacus's GPU figures count), `step` only
          what the step allocates above that.

Targets (issue 19) for `auto`: <= 1.3x time on the MLP and the transformer,
<= 1.6x on the CNN, <= 1.2x peak memory on each.

    python bench/privacy.py [--rounds 5] [--models mlp,cnn,transformer]
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # allocator statistics; before TensorFlow loads

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved  # noqa: E402

import keras_tapeops as kt  # noqa: E402

BATCH = 64
STEPS = 10
TIME_TARGETS = {"mlp": 1.3, "cnn": 1.6, "transformer": 1.3}
MEMORY_TARGET = 1.2
CONFIGS = ("stock", "auto", "auto-clip", "vectorized")


def mlp():
    return keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ]), np.random.default_rng(0).normal(size=(BATCH * STEPS, 256)).astype("float32")


def cnn():
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ]), np.random.default_rng(0).normal(size=(BATCH * STEPS, 32, 32, 3)).astype("float32")


def transformer():
    inputs = keras.Input((64,), dtype="int32")
    h = keras.layers.Embedding(1000, 64)(inputs)
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(4, 16)(h, h))
    ffn = keras.layers.Dense(64)(keras.layers.Dense(128, activation="relu")(h))
    h = keras.layers.LayerNormalization()(h + ffn)
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h))
    x = np.random.default_rng(0).integers(0, 1000, size=(BATCH * STEPS, 64)).astype("int32")
    return keras.Model(inputs, outputs), x


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def build(kind, config):
    keras.utils.set_random_seed(0)
    model, x = MODELS[kind]()
    y = np.random.default_rng(1).integers(0, 10, size=(len(x),))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if config == "stock":
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    else:
        model = kt.upgrade(model)
        sigma = 0.0 if config == "auto-clip" else 1.0
        method = "vectorized" if config == "vectorized" else "auto"
        dp = kt.DPSGD(1.0, sigma, seed=0, method=method)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss, differential_privacy=dp)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # trace
    return model, x, y


def allocator_peak(fn):
    """`(total, step)` MiB: the allocator's peak during `fn`, and that peak above the start."""
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    fn()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return peak / 2**20, (peak - base) / 2**20


def measure(kind, rounds):
    built = {config: build(kind, config) for config in CONFIGS}
    memory = {}
    for config, (model, x, y) in built.items():
        xb, yb = tf.constant(x[:BATCH]), tf.constant(y[:BATCH])
        model.train_on_batch(xb, yb)  # traces the single-batch function
        memory[config] = allocator_peak(lambda: model.train_on_batch(xb, yb))

    def run(config):
        model, x, y = built[config]
        return lambda: model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    times = interleaved({config: run(config) for config in built}, rounds)
    report = built["auto"][0].tapeops_state.engine.report()
    return times, memory, report


def main():
    parser = argparse.ArgumentParser(description="DP-SGD vs stock fit: time and memory")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="mlp,cnn,transformer")
    args = parser.parse_args()
    print(f"batch {BATCH}, {STEPS} steps per timed fit, {args.rounds} interleaved rounds")
    rows = []
    for kind in args.models.split(","):
        times, memory, report = measure(kind, args.rounds)
        methods = sorted({m for _, _, m in report})
        print(f"\n{kind}: per-variable methods (auto): {', '.join(methods)}")
        base = times["stock"]
        for config in CONFIGS:
            ratio = statistics.median(t / b for t, b in zip(times[config], base))
            total, step = memory[config]
            memory_ratio = total / memory["stock"][0]
            step_ratio = step / memory["stock"][1]
            rows.append((kind, config, statistics.median(times[config]) / STEPS * 1000,
                         ratio, total, memory_ratio, step, step_ratio))
    print(f"\n{'model':<12} {'config':<11} {'ms/step':>8} {'time x':>7} {'total MiB':>10} "
          f"{'memory x':>9} {'step MiB':>9} {'step x':>7}  target (auto: time, total memory)")
    for kind, config, ms, ratio, mib, memory_ratio, step, step_ratio in rows:
        target = ""
        if config == "auto":
            ok_time = ratio <= TIME_TARGETS[kind]
            ok_memory = memory_ratio <= MEMORY_TARGET
            target = (f"time <= {TIME_TARGETS[kind]}x: {'met' if ok_time else 'MISSED'}; "
                      f"memory <= {MEMORY_TARGET}x: {'met' if ok_memory else 'MISSED'}")
        print(f"{kind:<12} {config:<11} {ms:8.2f} {ratio:7.2f} {mib:10.1f} {memory_ratio:9.2f} "
              f"{step:9.1f} {step_ratio:7.2f}  {target}")


if __name__ == "__main__":
    main()
