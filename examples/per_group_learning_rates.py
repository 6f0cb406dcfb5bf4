"""Fine-tuning with per-group learning rates, gradual unfreezing and layer-wise decay.

A "pretrained" backbone (a nested sub-model) gets a new head. The usual recipe,
without writing a GradientTape loop and without recompiling:

1. `kt.optimizer_groups`: the backbone trains with a small learning rate, the
   new head with a large one (two Adams in one stock Keras MultiOptimizer).
2. `kt.callbacks.GradualUnfreezing`: the backbone stays frozen for the first
   epoch (no backbone gradient is computed), then trains; its Adam starts
   counting steps when it starts.
3. `kt.callbacks.GroupLearningRateScheduler`: the head's rate decays per
   epoch; `log=True` puts every group's rate in History ("lr/<group>").
4. `model.save` / `load_model`: the groups and their state come back.
5. `kt.layerwise_lr_decay`: the alternative for deep stacks: each block
   trains at `decay` times the rate of the block above it.

Run: python examples/per_group_learning_rates.py   (about 15 s on a laptop CPU)
"""

import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402


def make_data(n=1024, features=16, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, classes))
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(n, classes)), axis=1)
    return x, y


def make_backbone(features=16):
    inputs = keras.Input((features,))
    h = keras.layers.Dense(64, activation="relu", name="block_1")(inputs)
    h = keras.layers.Dense(64, activation="relu", name="block_2")(h)
    h = keras.layers.Dense(64, activation="relu", name="block_3")(h)
    return keras.Model(inputs, h, name="backbone")


def make_model(backbone):
    inputs = keras.Input((16,))
    outputs = keras.layers.Dense(4, name="head")(backbone(inputs))
    return kt.upgrade(keras.Model(inputs, outputs, name="classifier"))


@keras.saving.register_keras_serializable(package="examples")
def head_decay(epoch, lr):
    return 1e-2 * 0.5**epoch


def main():
    keras.utils.set_random_seed(0)
    x, y = make_data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    backbone = make_backbone()
    # Stand-in for pretraining: a short fit of the backbone with a throwaway head.
    pretrain = keras.Sequential([backbone, keras.layers.Dense(4)])
    pretrain.compile(optimizer="adam", loss=loss)
    pretrain.fit(x, y, epochs=2, batch_size=64, verbose=0)

    # 1. One optimizer per group.
    model = make_model(backbone)
    optimizer = kt.optimizer_groups(model, [
        ("backbone/*", keras.optimizers.Adam(1e-4, name="backbone")),
        ("head", keras.optimizers.Adam(1e-2, name="head")),
    ])
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"],
                  gradient_transforms=[kt.ClipByGlobalNorm(5.0)])
    print("groups:", [o.name for o in model.optimizer.optimizers])

    # 2 + 3. Backbone frozen for epoch 0; head rate halves every epoch.
    history = model.fit(x, y, epochs=3, batch_size=64, verbose=0, callbacks=[
        kt.callbacks.GradualUnfreezing([("backbone/*", 1)], verbose=1),
        kt.callbacks.GroupLearningRateScheduler({"head": head_decay}, log=True),
    ])
    for epoch in range(3):
        print(f"epoch {epoch}: lr/backbone={history.history['lr/backbone'][epoch]:.0e} "
              f"lr/head={history.history['lr/head'][epoch]:.1e} "
              f"accuracy={history.history['accuracy'][epoch]:.3f}")
    steps = {o.name: int(o.iterations.numpy()) for o in model.optimizer.optimizers}
    print(f"optimizer steps per group: {steps} (the backbone started at epoch 1)")

    # 4. Save and load: the groups and every sub-optimizer's state come back.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "classifier.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    same = all(
        np.array_equal(a.numpy(), b.numpy())
        for a, b in zip(model.optimizer.variables, loaded.optimizer.variables)
    )
    print("groups after load:", [o.name for o in loaded.optimizer.optimizers],
          "same optimizer state:", same)

    # 5. Layer-wise decay: head at the base rate, each block below 0.5x.
    decayed = make_model(make_backbone())
    optimizer = kt.layerwise_lr_decay(
        decayed, keras.optimizers.AdamW(1e-3, name="lw"), decay=0.5,
        layers=["backbone/block_1", "backbone/block_2", "backbone/block_3", "head"],
    )
    rates = {o.name: float(o.learning_rate) for o in optimizer.optimizers}
    print("layer-wise rates:", {k: f"{v:.2e}" for k, v in rates.items()})
    decayed.compile(optimizer=optimizer, loss=loss)
    decayed.fit(x, y, epochs=1, batch_size=64, verbose=0)
    print("layer-wise fit done")


if __name__ == "__main__":
    main()
