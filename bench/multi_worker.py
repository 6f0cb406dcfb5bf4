"""Two local MultiWorkerMirroredStrategy workers vs one process, same global batch.

    python bench/multi_worker.py [--steps 32] [--rounds 9]

A small MLP (32 -> 256 -> 256 -> 10, SGD) trained on global batches of 256
(each of the two workers gets 128 of every batch). Prints training steps per
second (median over interleaved one-epoch rounds after a warm-up epoch that
traces):

- one process, no strategy: stock Keras, and keras_tapeops with no option
  (stock-equivalent) and with ClipByGlobalNorm;
- two worker processes on 127.0.0.1 (started with keras_tapeops.launch):
  keras_tapeops with no option, with ClipByGlobalNorm, and with
  accumulation_steps=2 (a step here is a batch; an update every 2). Stock
  Keras cannot be measured there: it fails (keras-team/keras#20585).

and, for every two-worker configuration, the gradient all-reduces in the step
`fit()` traced: CollectiveReduceV2 ops whose payload is every trainable
parameter (TensorFlow packs the gradients of one all_reduce call into one
collective). Target: 1 per applied step. The other collectives are scalars
(the logs, the input pipeline's end-of-data check, the accumulated sample
count).

The two workers share this machine's cores: on a 2-core machine they compete
with each other for CPU and every step waits for a collective over gRPC on
localhost, so they are slower than one process. The figure measures the
overhead of the distribution, not the speed-up of real hosts.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GLOBAL_BATCH = 256
FEATURES = 32
CLASSES = 10


def configurations(kt):
    """name -> compile() keyword arguments of keras_tapeops options."""
    return {
        "no option": {},
        "ClipByGlobalNorm(1.0)": {"gradient_transforms": [kt.ClipByGlobalNorm(1.0)]},
        "accumulation_steps=2": {"accumulation_steps": 2},
    }


def data(steps):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    n = steps * GLOBAL_BATCH
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=n)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    from common import without_autotune

    return without_autotune(
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(GLOBAL_BATCH)
        .cache()
        .with_options(options)
    )


def build(options, strategy=None, tapeops=True):
    import contextlib

    import keras

    import keras_tapeops as kt

    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(CLASSES),
        ])
        if tapeops:
            model = kt.upgrade(model)
            model.compile(
                optimizer=keras.optimizers.SGD(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                **options,
            )
        else:
            model.compile(
                optimizer=keras.optimizers.SGD(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
    return model


# ------------------------------------------------------------- collectives
def gradient_all_reduces(model, dataset):
    """Collectives in the step `fit()` traced (call after `fit()`).

    Returns:
        `(gradient, other)`: the CollectiveReduceV2 ops whose payload holds
        every trainable parameter, and the number of other collective ops.
    """
    import numpy as np

    function = _tf_function_named(model.train_function, "multi_step_on_iterator")
    iterator = iter(model.distribute_strategy.experimental_distribute_dataset(dataset))
    graph_def = function.get_concrete_function(iterator).graph.as_graph_def(
        add_shapes=True
    )
    nodes = list(graph_def.node)
    for fn in graph_def.library.function:
        nodes.extend(fn.node_def)
    parameters = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    gradient = other = 0
    for node in nodes:
        if not node.op.startswith("Collective"):
            continue
        shapes = node.attr.get("_output_shapes")
        dims = [d.size for d in shapes.list.shape[0].dim] if shapes else []
        if node.op == "CollectiveReduceV2" and int(np.prod(dims)) == parameters:
            gradient += 1
        else:
            other += 1
    return gradient, other


def _tf_function_named(function, name):
    """The `tf.function` called `name` in the closures reachable from `function`.

    Keras keeps its traced step (`multi_step_on_iterator`) in the closure of
    `model.train_function`; keras_tapeops wraps that under a multi-worker
    strategy.
    """
    pending, seen = [function], set()
    while pending:
        candidate = pending.pop()
        if id(candidate) in seen:
            continue
        seen.add(id(candidate))
        python = getattr(candidate, "python_function", None)
        if python is not None and python.__name__ == name:
            return candidate
        for inner in (candidate, python):
            for cell in getattr(inner, "__closure__", None) or ():
                try:
                    contents = cell.cell_contents
                except ValueError:
                    continue
                if callable(contents):
                    pending.append(contents)
    raise RuntimeError(f"no tf.function {name!r} behind {function!r}")


# ------------------------------------------------------------------ modes
def worker(out, steps, rounds):
    """One of the two workers (TF_CONFIG set by the launcher)."""
    import tensorflow as tf

    import keras_tapeops as kt

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    import common

    dataset = data(steps)
    models = {name: build(options, strategy)
              for name, options in configurations(kt).items()}
    for model in models.values():
        model.fit(dataset, epochs=1, verbose=0)  # warm-up: traces the step
    # Both workers run the same interleaved sequence (their collectives pair).
    times = common.interleaved(
        {name: (lambda m=model: m.fit(dataset, epochs=1, verbose=0))
         for name, model in models.items()},
        rounds,
    )
    results = {}
    for name, model in models.items():
        gradient, other = gradient_all_reduces(model, dataset)
        results[name] = {"steps_per_second": steps / statistics.median(times[name]),
                         "gradient_all_reduces": gradient, "other_collectives": other}
    with open(os.path.join(out, f"worker{index}.json"), "w") as f:
        json.dump(results, f)


def one_process(steps, rounds):
    """Steps per second of one process: interleaved one-epoch rounds, median."""
    import common

    import keras_tapeops as kt

    dataset = data(steps)
    models = {"stock Keras": build({}, tapeops=False)}
    for name, options in list(configurations(kt).items())[:2]:
        models[name] = build(options)
    for model in models.values():
        model.fit(dataset, epochs=1, verbose=0)  # warm-up: traces the step
    times = common.interleaved(
        {name: (lambda m=model: m.fit(dataset, epochs=1, verbose=0))
         for name, model in models.items()},
        rounds,
    )
    return {name: steps / statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32, help="steps per epoch")
    parser.add_argument("--rounds", type=int, default=9, help="timed epochs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # output dir
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.rounds)
        return 0

    # The two workers first, while this process has not loaded TensorFlow.
    from keras_tapeops.launch import launch

    with tempfile.TemporaryDirectory() as out:
        log = open(os.path.join(out, "log.txt"), "w")
        code = launch(
            [sys.executable, os.path.abspath(__file__), "--worker", out,
             "--steps", str(args.steps), "--rounds", str(args.rounds)],
            workers=2, timeout=540, out=log,
        )
        log.close()
        if code != 0:
            print(open(os.path.join(out, "log.txt")).read()[-5000:])
            raise SystemExit(f"the workers failed with code {code}")
        workers = [json.load(open(os.path.join(out, f"worker{i}.json"))) for i in (0, 1)]
    single = one_process(args.steps, args.rounds)

    cores = os.cpu_count()
    print(f"multi_worker: global batch {GLOBAL_BATCH}, {args.steps} steps per epoch, "
          f"median of {args.rounds} interleaved epochs after a warm-up, "
          f"{cores} CPU cores")
    base = single["stock Keras"]
    for name, rate in single.items():
        print(f"  1 process   {name:<24} {rate:8.1f} steps/s   {rate / base:.2f}x stock")
    for name in workers[0]:
        rate = min(w[name]["steps_per_second"] for w in workers)  # the job's pace
        reduces = [w[name]["gradient_all_reduces"] for w in workers]
        other = workers[0][name]["other_collectives"]
        print(f"  2 workers   {name:<24} {rate:8.1f} steps/s   {rate / base:.2f}x stock"
              f"   gradient all-reduces per applied step: {reduces[0]} (workers: {reduces}),"
              f" scalar collectives: {other}")
    if cores is not None and cores <= 4:
        print(f"  note: the two workers share {cores} cores on one machine and "
              "synchronize over localhost gRPC every step: slower than one "
              "process here by construction.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
