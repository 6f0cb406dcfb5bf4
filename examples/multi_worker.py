"""Multi-worker training with keras_tapeops: the same script on every worker.

Run two local workers (each a process with its own TF_CONFIG on 127.0.0.1):

    python -m keras_tapeops.launch --workers 2 examples/multi_worker.py

or run it alone (one worker). Every worker builds the same model under
`tf.distribute.MultiWorkerMirroredStrategy`, trains with per-group clipping
on the true (all-worker) gradient, a loss term and accumulation, and prints a
checksum of its final weights: the workers print the same one, equal to a
single process on the same global batches.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402

GLOBAL_BATCH = 32


def main():
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(512, 1))).astype("float32")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)

    keras.utils.set_random_seed(1)
    with strategy.scope():
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="tanh", name="backbone")(inputs)
        model = kt.upgrade(keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden)))
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2), loss="mse",
            gradient_transforms=[kt.ClipByGlobalNorm(1.0, where="backbone"),
                                 kt.ClipByNorm(0.5, where="head")],
            loss_terms=[kt.ActivationPenalty("backbone", l2=1e-3, name="act_l2")],
            accumulation_steps=2,
        )
    history = model.fit(data, epochs=3, verbose=0)
    checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
    print(f"worker {task.get('index', 0)} of {strategy.num_replicas_in_sync}: "
          f"loss {history.history['loss'][-1]:.5f}, act_l2 "
          f"{history.history['act_l2'][-1]:.6f}, weights checksum {checksum:.6f}")


if __name__ == "__main__":
    main()
