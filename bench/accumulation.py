"""Peak memory and time per sample: micro_batches vs stock fit vs Keras's accumulation.

Each configuration runs in its own subprocess, a small conv net on 64x64x3 inputs:
  stock-64     stock fit, batch 64 (the memory floor)
  stock-512    stock fit, batch 512
  micro-8      keras_tapeops micro_batches=8, batch 512
  keras-acc-8  stock fit, batch 64, optimizer gradient_accumulation_steps=8
Targets: micro-8's peak memory within 15% of the gap (stock-512 - stock-64)
above the floor, and its time per sample no worse than keras-acc-8's.

Memory is measured three ways, every configuration alike:
  peak RSS    the whole process (`resource.getrusage`): what `top` shows.
  fit peak    TensorFlow's allocator peak during the timed epoch, above what was
              resident before it: tensors only, input pipeline included.
  step peak   TensorFlow's allocator peak of one `train_on_batch` on a batch
              already in memory: the training step alone, no input pipeline.
The children use TensorFlow's BFC allocator on the CPU
(`TF_CPU_ALLOCATOR_USE_BFC=true`), which makes allocator statistics available
(`tf.config.experimental.get_memory_info`) and the RSS repeatable; with the
default malloc-based allocator RSS varies by about +-70 MiB between runs.

Run: python bench/accumulation.py [--rounds 3]   (about 4 minutes on 2 cores)
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CONFIGS = ["stock-64", "stock-512", "micro-8", "keras-acc-8"]
MEASURES = ["peak_rss_mib", "fit_peak_mib", "step_peak_mib"]
SAMPLES = 2048  # per timed epoch


def child(name):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # before TensorFlow loads
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_tapeops as kt

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64, 64, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(4),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 10, size=(SAMPLES,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batch = 64 if name in ("stock-64", "keras-acc-8") else 512
    if name == "micro-8":
        model = kt.upgrade(model)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss, micro_batches=8)
    elif name == "keras-acc-8":
        model.compile(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=8),
                      loss=loss)
    else:
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)

    def allocator_peak(fn):
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        fn()
        return (tf.config.experimental.get_memory_info("CPU:0")["peak"] - base) / 2**20

    # Warm-up (tracing) on one large batch's worth of data, then a timed epoch.
    model.fit(x[:512], y[:512], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    start = time.perf_counter()
    fit_peak = allocator_peak(
        lambda: model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    )
    seconds = time.perf_counter() - start
    xb, yb = tf.constant(x[:batch]), tf.constant(y[:batch])
    model.train_on_batch(xb, yb)  # traces the single-batch function
    step_peak = allocator_peak(lambda: model.train_on_batch(xb, yb))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"name": name, "peak_rss_mib": peak_rss, "fit_peak_mib": fit_peak,
                      "step_peak_mib": step_peak, "us_per_sample": 1e6 * seconds / SAMPLES}))


def run_one(name):
    out = subprocess.run([sys.executable, __file__, "--child", name],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    results = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name in CONFIGS:  # interleaved rounds
            results[name].append(run_one(name))
    keys = MEASURES + ["us_per_sample"]
    med = {name: {key: statistics.median(r[key] for r in runs) for key in keys}
           for name, runs in results.items()}
    print(f"median of {args.rounds} interleaved rounds, each configuration in its own process")
    print(f"{'config':12s} {'peak RSS MiB':>13s} {'fit peak MiB':>13s} "
          f"{'step peak MiB':>14s} {'us/sample':>10s}")
    for name in CONFIGS:
        m = med[name]
        print(f"{name:12s} {m['peak_rss_mib']:13.0f} {m['fit_peak_mib']:13.0f} "
              f"{m['step_peak_mib']:14.0f} {m['us_per_sample']:10.1f}")
    for key in MEASURES:
        floor, top = med["stock-64"][key], med["stock-512"][key]
        gap = top - floor
        over = (med["micro-8"][key] - floor) / gap if gap > 0 else float("nan")
        print(f"micro-8 {key[:-4].replace('_', ' ')} above the batch-64 floor: "
              f"{100 * over:.1f}% of the batch-512 gap ({gap:.0f} MiB); target <= 15%")
    ratio = med["micro-8"]["us_per_sample"] / med["keras-acc-8"]["us_per_sample"]
    print(f"micro-8 time per sample: {ratio:.2f}x keras gradient_accumulation_steps=8 "
          "(target <= 1.00x)")
    ratio = med["micro-8"]["us_per_sample"] / med["stock-512"]["us_per_sample"]
    print(f"micro-8 time per sample: {ratio:.2f}x stock fit at batch 512")


if __name__ == "__main__":
    main()
