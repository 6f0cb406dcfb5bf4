"""The worker script of tests/test_multi_worker.py (and its one-process oracle).

Every worker of a local `MultiWorkerMirroredStrategy` cluster runs this file
(`keras_tapeops.launch.launch` gives each its `TF_CONFIG`); the test module
also imports it and calls the same functions with no strategy, on the same
global batches, as the single-process reference.

Two commands, each writing `<out>/<name>.w<task index>.npz` (final weights
as `w0, w1, ...`, and `predict`) and `<out>/<name>.w<task index>.json`
(History, `evaluate()` results, whatever else the command records):

    features NAME[,NAME...]   trains one model per feature, one after the
                              other, under one strategy (a process may
                              hold one strategy: collective instance keys
                              are process-wide); also records how the
                              input pipeline shards the global batches
                              and how stock Keras (no mixin) fails,
                              and counts the collective ops of each
                              traced step (`count_collectives`).
    recover NAME[,NAME...]    trains with `keras.callbacks.BackupAndRestore`
                              (one backup directory per worker and
                              scenario); `--kill NAME:EPOCH:BATCH` makes
                              worker 1 exit (os._exit(3)) after that batch
                              of that scenario. A scenario whose outputs
                              exist is skipped, so a job that is killed and
                              restarted resumes where it stopped.

The data set: GLOBAL_BATCH=32 samples per step, 5 steps per epoch (the last
accumulation window of `accumulation_steps=2` is short and flushed at the
epoch's end), batched globally and sharded with `AutoShardPolicy.DATA`, so
worker i gets the i-th half of every global batch.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402

GLOBAL_BATCH = 32
SAMPLES = 5 * GLOBAL_BATCH
RECOVERY_SAMPLES = 6 * GLOBAL_BATCH
FEATURE_EPOCHS = 2
EVALUATED = ("plain", "terms")  # features also run through evaluate()/predict()
RECOVERY_EPOCHS = 2
# SkipNonFinite: the step that holds this sample gets a nan gradient (see
# `_nan_trigger`). Sample 83 is the 20th of global batch 2, so it is in the
# second half of the batch: only worker 1 sees it.
NAN_SAMPLE = 2 * GLOBAL_BATCH + GLOBAL_BATCH // 2 + 3


# -------------------------------------------------------------------- data
def arrays(n=SAMPLES):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    w = rng.normal(size=(8, 1))
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def dataset(*tensors):
    """Global batches of GLOBAL_BATCH, sharded by data (each worker: its half)."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    data = tensors[0] if len(tensors) == 1 else tensors
    return (
        tf.data.Dataset.from_tensor_slices(data)
        .batch(GLOBAL_BATCH)
        .with_options(options)
    )


def initial_weights():
    """The same starting point in every process (not drawn from a seed)."""
    rng = np.random.default_rng(42)
    return [
        (rng.normal(size=(8, 16)) / np.sqrt(8)).astype("float32"),
        np.zeros(16, "float32"),
        (rng.normal(size=(16, 1)) / 4).astype("float32"),
        np.zeros(1, "float32"),
    ]


# ------------------------------------------------------------------ models
def mlp(tapeops=True):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh", name="backbone")(inputs)
    outputs = keras.layers.Dense(1, name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model = kt.upgrade(model) if tapeops else model
    model.set_weights(initial_weights())
    return model


def smooth(model, x, y, y_pred):
    return tf.reduce_mean(tf.square(y_pred))


def _nan_trigger(model, x, y, y_pred):
    """0, with a nan gradient on the replica whose batch holds NAN_SAMPLE.

    d sqrt(u)/du is inf at u = 0 and du/dw is 0: their product is nan. The
    `tf.cond` keeps the other batches' gradients finite.
    """
    marker = arrays()[0][NAN_SAMPLE, 0]
    hit = tf.reduce_any(tf.equal(x[:, 0], marker))
    u = tf.reduce_sum(tf.square(y_pred - tf.stop_gradient(y_pred)))
    return tf.cond(hit, lambda: tf.sqrt(u), lambda: tf.zeros(()))


def sgd():
    return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)


def features():
    """name -> compile() keyword arguments of keras_tapeops options."""
    return {
        "plain": {},
        "clip": {"gradient_transforms": [
            kt.ClipByGlobalNorm(0.3, where="backbone"),
            kt.ClipByNorm(0.1, where="head"),
        ]},
        "terms": {"loss_terms": [
            kt.ActivationPenalty("backbone", l2=1e-2, name="act_l2"),
            kt.LossTerm(smooth, weight=0.1, name="smooth"),
        ]},
        "gradient_penalty": {"loss_terms": [
            kt.GradientPenalty(weight=0.5, target=1.0),
        ]},
        "micro_batches": {"micro_batches": 2},
        "accumulation": {"accumulation_steps": 2},
        "finite": {
            "gradient_transforms": [
                kt.SkipNonFinite(),
                kt.LogGradientNorm(name="grad_norm"),
                kt.ClipByGlobalNorm(0.3),
            ],
            "loss_terms": [kt.LossTerm(_nan_trigger, name="nan_trigger")],
        },
        "adaptive": {"gradient_transforms": [
            kt.AdaptiveClip(0.01, where="backbone"),
            kt.CentralizeGradients(),
            kt.ClipByGlobalNorm(0.3),
            kt.LogUpdateRatio(where="head"),
        ]},
        "sam": {"sharpness_aware": kt.SAM(rho=0.05)},
        "combined": {
            "gradient_transforms": [kt.ClipByGlobalNorm(0.3, where="backbone")],
            "loss_terms": [kt.ActivationPenalty("backbone", l2=1e-2, name="act_l2")],
            "micro_batches": 2,
            "accumulation_steps": 2,
        },
    }


def recovery_scenarios():
    """name -> (compile options, BackupAndRestore save_freq)."""
    return {
        # A backup at every epoch's end: resuming is exact.
        "epoch_clip": (features()["clip"], "epoch"),
        # Windows never straddle an epoch (the last one is flushed at its
        # end), so epoch backups are exact with accumulation too.
        "epoch_accumulation": (
            {"accumulation_steps": 2,
             "gradient_transforms": [kt.ClipByGlobalNorm(0.3)]},
            "epoch",
        ),
        # A backup every 3 batches lands mid-window (the pending batch's
        # gradient is not saved) and Keras restarts the saved epoch from its
        # first batch: resuming equals a one-process interrupt-and-resume,
        # not the uninterrupted run.
        "steps_accumulation": ({"accumulation_steps": 2}, 3),
    }


def compiled(options, strategy=None, tapeops=True):
    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = mlp(tapeops)
        model.compile(optimizer=sgd(), loss="mse", **options)
    return model


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- training
def train_feature(name, strategy=None):
    """Trains feature `name`; returns `(weights, predictions, record)`.

    `evaluate()` and `predict()` (whose steps do not depend on the training
    options except for loss terms) run for the features in EVALUATED only:
    every step of a local two-worker job costs ~0.1 s of collective latency.
    """
    model = compiled(features()[name], strategy)
    x, y = arrays()
    batches = BatchLogs()
    history = model.fit(dataset(x, y), epochs=FEATURE_EPOCHS, verbose=0,
                        callbacks=[batches])
    record = {
        "history": _floats(history.history),
        "batch_logs": batches.logs,
        "iterations": int(model.optimizer.iterations.numpy()),
    }
    predictions = None
    if name in EVALUATED:
        evaluation = model.evaluate(dataset(x, y), verbose=0, return_dict=True)
        record["evaluate"] = _floats(evaluation)
        predictions = model.predict(dataset(x), verbose=0)
    if strategy is not None:
        record["collectives"] = count_collectives(model, dataset(x, y))
    return [w.copy() for w in model.get_weights()], predictions, record


class BatchLogs(keras.callbacks.Callback):
    """The logs of every training batch (what the progress bar shows)."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(_floats(logs or {}))


class KillAt(keras.callbacks.Callback):
    """Ends this process abruptly after batch `batch` of epoch `epoch`."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.kill_epoch, self.kill_batch, self.epoch = epoch, batch, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (self.kill_epoch, self.kill_batch):
            print(f"killing this worker after epoch {self.epoch} batch {batch}",
                  flush=True)
            os._exit(3)


class InterruptAt(KillAt):
    """The one-process stand-in for `KillAt`: raises instead of exiting."""

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (self.kill_epoch, self.kill_batch):
            raise Interrupted(f"epoch {self.epoch} batch {batch}")


class Interrupted(Exception):
    pass


def train_recovery(name, backup_dir, strategy=None, interrupt=None):
    """Fits scenario `name` with BackupAndRestore(backup_dir).

    Args:
        interrupt: None, or a callback (KillAt / InterruptAt) added last.

    Returns:
        `(weights, record)` once the fit completes.
    """
    options, save_freq = recovery_scenarios()[name]
    model = compiled(options, strategy)
    x, y = arrays(RECOVERY_SAMPLES)
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq)]
    if interrupt is not None:
        callbacks.append(interrupt)
    history = model.fit(dataset(x, y), epochs=RECOVERY_EPOCHS, verbose=0,
                        callbacks=callbacks)
    record = {
        "history": _floats(history.history),
        "epochs_run": len(history.epoch),
        "first_epoch": history.epoch[0] if history.epoch else None,
        "iterations": int(model.optimizer.iterations.numpy()),
    }
    return [w.copy() for w in model.get_weights()], record


def train_uninterrupted(name):
    """Scenario `name` in one process, without backups or interruption."""
    options, _ = recovery_scenarios()[name]
    model = compiled(options)
    x, y = arrays(RECOVERY_SAMPLES)
    history = model.fit(dataset(x, y), epochs=RECOVERY_EPOCHS, verbose=0)
    return [w.copy() for w in model.get_weights()], {
        "history": _floats(history.history),
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def train_interrupted_and_resumed(name, backup_dir, epoch, batch):
    """Scenario `name` in one process: interrupted at (epoch, batch), resumed."""
    try:
        train_recovery(name, backup_dir, interrupt=InterruptAt(epoch, batch))
    except Interrupted:
        pass
    else:
        raise AssertionError("the interruption did not happen")
    return train_recovery(name, backup_dir)


def stock_failure(strategy):
    """The error stock Keras (no mixin) raises in `fit()` under `strategy`."""
    model = compiled({}, strategy, tapeops=False)
    x, y = arrays()
    try:
        model.fit(dataset(x, y), epochs=1, verbose=0)
    except Exception as error:  # noqa: BLE001 - recorded for the test
        return f"{type(error).__name__}: {error}"[:2000]
    return None


def shards(strategy, steps=3):
    """Sample ids of this worker's part of the first global batches."""
    ids = np.arange(SAMPLES, dtype="int64")
    distributed = strategy.experimental_distribute_dataset(dataset(ids))
    seen = []
    for step, batch in enumerate(distributed):
        if step == steps:
            break
        local = strategy.experimental_local_results(batch)
        seen.append([int(i) for part in local for i in part.numpy()])
    return seen


# ------------------------------------------------------------- collectives
def count_collectives(model, data):
    """Collective ops in `model`'s traced train step, by kind.

    Call after `fit()` (under a multi-worker strategy): takes the step
    `fit()` traced (Keras's `multi_step_on_iterator` tf.function, found in
    the closures of `model.train_function`) and walks its graph and every
    function in its library (`tf.cond` branches, nested `tf.function`s).

    Returns:
        A dict: `gradient_reduces`, the CollectiveReduceV2 ops whose payload
        holds every trainable parameter (TensorFlow packs the gradients of
        one `all_reduce` call into one flat collective), `parameters`, and
        `other`, the payload sizes of the remaining CollectiveReduceV2 ops
        (the scalar logs, packed) and the names of other collective ops.
    """
    function = _tf_function_named(model.train_function, "multi_step_on_iterator")
    strategy = model.distribute_strategy
    iterator = iter(strategy.experimental_distribute_dataset(data))
    graph = function.get_concrete_function(iterator).graph
    graph_def = graph.as_graph_def(add_shapes=True)
    nodes = list(graph_def.node)
    for fn in graph_def.library.function:
        nodes.extend(fn.node_def)
    parameters = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    gradient, other = 0, []
    for node in nodes:
        if not node.op.startswith("Collective"):
            continue
        size = _payload_size(node)
        if node.op == "CollectiveReduceV2" and size == parameters:
            gradient += 1
        else:
            other.append(size if node.op == "CollectiveReduceV2" else node.op)
    return {"gradient_reduces": gradient, "parameters": parameters, "other": other}


def _tf_function_named(function, name):
    """The `tf.function` called `name` in the closures reachable from `function`."""
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
                except ValueError:  # an empty cell
                    continue
                if callable(contents):
                    pending.append(contents)
    raise RuntimeError(f"no tf.function {name!r} behind {function!r}")


def _payload_size(node):
    """Number of elements a collective op reduces (None if unknown)."""
    shapes = node.attr.get("_output_shapes")
    if shapes is None or not shapes.list.shape:
        return None
    dims = [d.size for d in shapes.list.shape[0].dim]
    return None if any(d < 0 for d in dims) else int(np.prod(dims))


# ------------------------------------------------------------------ output
def _floats(logs):
    return {
        k: ([float(x) for x in v] if isinstance(v, (list, tuple)) else float(v))
        for k, v in logs.items()
    }


def save(out, name, index, weights=None, predictions=None, record=None):
    if weights is not None:
        arrays_ = {f"w{i}": w for i, w in enumerate(weights)}
        if predictions is not None:
            arrays_["predict"] = predictions
        np.savez(os.path.join(out, f"{name}.w{index}.npz"), **arrays_)
    if record is not None:
        path = os.path.join(out, f"{name}.w{index}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)  # present only once complete


def task_index():
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    return int(config.get("task", {}).get("index", 0))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["features", "recover"])
    parser.add_argument("names", help="comma-separated features or scenarios")
    parser.add_argument("--out", required=True)
    parser.add_argument("--backup", help="recover: root of the backup dirs")
    parser.add_argument("--kill", help="recover: NAME:EPOCH:BATCH (worker 1)")
    parser.add_argument("--stock", action="store_true",
                        help="features: also record stock Keras's failure")
    args = parser.parse_args(argv)
    names = [n for n in args.names.split(",") if n]
    os.makedirs(args.out, exist_ok=True)
    index = task_index()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    print(f"worker {index}: {strategy.num_replicas_in_sync} replicas", flush=True)

    if args.command == "features":
        save(args.out, "shards", index, record={"shards": shards(strategy)})
        if args.stock:
            save(args.out, "stock", index, record={"error": stock_failure(strategy)})
        for name in names:
            start = time.monotonic()
            weights, predictions, record = train_feature(name, strategy)
            save(args.out, name, index, weights, predictions, record)
            print(f"worker {index}: {name} done in "
                  f"{time.monotonic() - start:.1f} s", flush=True)
    else:
        kill = (args.kill or "::").split(":")
        for name in names:
            if os.path.exists(os.path.join(args.out, f"{name}.w{index}.json")):
                continue  # finished before the restart
            interrupt = None
            if kill[0] == name and index == 1:
                interrupt = KillAt(int(kill[1]), int(kill[2]))
            backup = os.path.join(args.backup, name, f"worker_{index}")
            weights, record = train_recovery(name, backup, strategy, interrupt)
            save(args.out, name, index, weights, record=record)
            print(f"worker {index}: {name} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
