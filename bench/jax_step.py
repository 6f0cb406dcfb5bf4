"""Benchmark: the keras_tapeops step on the JAX backend (issue 32).

On JAX (this process, `KERAS_BACKEND=jax`), one epoch per round, rounds
interleaved, median ratio to stock JAX `fit` on the same MLP (backbone_1 ->
backbone_2 -> head, SGD) and the same data:
  - no options (`kt.upgrade`, nothing compiled): target <= 1.02x;
  - three clip groups (`ClipByNorm(1.0, where="head")`,
    `ClipByGlobalNorm(5.0, where="backbone_1")`,
    `ClipByValue(0.5, where="backbone_2")`): target <= 1.05x.
Then `micro_batches` on JAX: the compiled step's temporary memory (XLA's
memory analysis of the jitted `train_step`: buffers other than its arguments
and outputs) at batch 512 and 1024 split in micro-batches of 64, against
stock `fit` on the whole batch and on one micro-batch of 64 (target: near one
micro-batch; the micro step also holds one gradient-sized sum, which stock
SGD fuses into its update), and its time per epoch against stock.
Then the JAX step against the TensorFlow step: the same models (the MLP and a
small CNN) with the three clip groups, timed on each backend (TensorFlow in a
child process: one process holds one backend); printed as JAX time / TF
time per epoch (no target: which backend is faster for you).

Run: python bench/jax_step.py   (about two minutes on 2 CPU cores)
"""

import json
import os
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import common  # noqa: E402  (sets the TF log level before TensorFlow loads)
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402

N, FEATURES, CLASSES, BATCH = 8192, 64, 10, 128
IMAGES, SIZE = 2048, 16
ROUNDS = 11
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_mlp():
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(256, activation="relu", name="backbone_1")(inputs)
    h = keras.layers.Dense(256, activation="relu", name="backbone_2")(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(h))


def make_cnn():
    inputs = keras.Input((SIZE, SIZE, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="backbone_1")(inputs)
    h = keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu", name="backbone_2")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(h))


def three_groups():
    return [
        kt.ClipByNorm(1.0, where="head"),
        kt.ClipByGlobalNorm(5.0, where="backbone_1"),
        kt.ClipByValue(0.5, where="backbone_2"),
    ]


def data(kind):
    rng = np.random.default_rng(0)
    if kind == "mlp":
        x = rng.normal(size=(N, FEATURES)).astype("float32")
        return x, rng.integers(0, CLASSES, size=N)
    x = rng.normal(size=(IMAGES, SIZE, SIZE, 3)).astype("float32")
    return x, rng.integers(0, CLASSES, size=IMAGES)


def compiled(make, upgrade, transforms=None):
    keras.utils.set_random_seed(0)
    model = make()
    if upgrade:
        model = kt.upgrade(model)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS,
                      gradient_transforms=transforms)
    else:
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS)
    return model


def epoch_function(model, x, y, batch=BATCH):
    def run():
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)

    run()  # traces and compiles
    return run


def step_temp_mib(batch, micro_batches=1, upgrade=True):
    """XLA's temporary memory of the jitted train_step at `batch` (MiB)."""
    import jax

    keras.utils.set_random_seed(0)
    model = make_mlp()
    if upgrade:
        model = kt.upgrade(model)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS, micro_batches=micro_batches)
    else:
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS)
    x, y = np.zeros((batch, FEATURES), "float32"), np.zeros((batch,), "int32")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # builds every variable
    state = tuple(
        [v.value for v in variables]
        for variables in (model.trainable_variables, model.non_trainable_variables,
                          model.optimizer.variables, model.metrics_variables)
    )
    compiled_step = jax.jit(model.train_step).lower(state, (x, y)).compile()
    return compiled_step.memory_analysis().temp_size_in_bytes / 2**20


def micro_batch_report():
    """Step memory and epoch time of micro_batches on JAX, micro-batches of 64."""
    one = step_temp_mib(64, upgrade=False)
    gradient = sum(int(np.prod(w.shape)) for w in make_mlp().get_weights()) * 4 / 2**20
    print(f"micro_batches on JAX: step temporary memory (stock, one micro-batch of 64: {one:.2f} MiB; "
          f"one gradient: {gradient:.2f} MiB)")
    for batch in (512, 1024):
        stock = step_temp_mib(batch, upgrade=False)
        micro = step_temp_mib(batch, micro_batches=batch // 64)
        print(f"batch {batch:5d}: stock {stock:6.2f} MiB   micro_batches={batch // 64:<3d} "
              f"{micro:5.2f} MiB   ({(micro - one) / (stock - one):.1%} of the gap to one micro-batch)")
    x, y = data("mlp")
    candidates = {
        "stock JAX fit, batch 512": epoch_function(compiled(make_mlp, False), x, y, batch=512),
        "kt, micro_batches=8": epoch_function(
            _micro_model(8), x, y, batch=512),
    }
    common.report(common.interleaved(candidates, ROUNDS), "stock JAX fit, batch 512",
                  "stock JAX fit, batch 512")


def _micro_model(micro_batches):
    keras.utils.set_random_seed(0)
    model = kt.upgrade(make_mlp())
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS, micro_batches=micro_batches)
    return model


def backend_times(rounds):
    """Median seconds per epoch of the three-group step on this backend, per model."""
    out = {}
    for kind, make in (("mlp", make_mlp), ("cnn", make_cnn)):
        x, y = data(kind)
        run = epoch_function(compiled(make, True, three_groups()), x, y)
        times = common.interleaved({kind: run}, rounds)[kind]
        out[kind] = float(np.median(times))
    return out


def main():
    if "--times" in sys.argv:  # the child: this backend's times, as JSON
        print(json.dumps(backend_times(ROUNDS // 2 + 1)))
        return
    x, y = data("mlp")
    candidates = {
        "stock JAX fit": epoch_function(compiled(make_mlp, False), x, y),
        "kt, no options": epoch_function(compiled(make_mlp, True), x, y),
        "kt, 3 clip groups": epoch_function(compiled(make_mlp, True, three_groups()), x, y),
    }
    print(f"JAX backend, MLP {FEATURES}-256-256-{CLASSES}, {N // BATCH} steps of batch {BATCH}, "
          f"{ROUNDS} interleaved rounds (targets: no options <= 1.02x, 3 groups <= 1.05x)")
    common.report(common.interleaved(candidates, ROUNDS), "stock JAX fit", "stock JAX fit")
    micro_batch_report()

    jax_times = backend_times(ROUNDS // 2 + 1)
    child = subprocess.run(
        [sys.executable, __file__, "--times"],
        env=dict(os.environ, KERAS_BACKEND="tensorflow"),
        capture_output=True, text=True, check=True,
    )
    tf_times = json.loads(child.stdout.strip().splitlines()[-1])
    print("JAX step vs TensorFlow step, 3 clip groups, median per epoch (no target):")
    for kind in ("mlp", "cnn"):
        print(f"{kind:<6} JAX {jax_times[kind] * 1000:8.1f} ms   TF {tf_times[kind] * 1000:8.1f} ms   "
              f"{jax_times[kind] / tf_times[kind]:.3f}x TF")


if __name__ == "__main__":
    main()
