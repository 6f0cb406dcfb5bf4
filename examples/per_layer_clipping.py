"""Fine-tuning with per-layer clipping: a tight clip on a new head, a loose one on the backbone.

A "pretrained" backbone (a nested sub-model) gets a new classification head.
Two clip rules keep the large early gradients of the randomly initialized
head from wrecking the backbone, without writing a GradientTape loop:

- `ClipByNorm(1.0, where="head")`: each head tensor clipped to norm 1.0;
- `ClipByGlobalNorm(5.0, where=backbone)`: one norm over all backbone weights.

Run: python examples/per_layer_clipping.py   (about 10 s on a laptop CPU)
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
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(64, activation="relu", name="block_1"),
            keras.layers.Dense(64, activation="relu", name="block_2"),
        ],
        name="backbone",
    )


def main():
    x, y = make_data()
    backbone = make_backbone()
    # Stand-in for pretraining: a short fit of the backbone with a throwaway head.
    pretrain = keras.Sequential([backbone, keras.layers.Dense(4)])
    pretrain.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    pretrain.fit(x, y, epochs=2, batch_size=64, verbose=0)

    inputs = keras.Input((16,))
    outputs = keras.layers.Dense(4, name="head")(backbone(inputs))
    model = kt.upgrade(keras.Model(inputs, outputs))
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        gradient_transforms=[
            kt.ClipByNorm(1.0, where="head"),
            kt.ClipByGlobalNorm(5.0, where=backbone),
        ],
    )
    history = model.fit(
        x, y, epochs=5, batch_size=64, validation_split=0.2, verbose=2
    )
    print(f"final val_accuracy: {history.history['val_accuracy'][-1]:.3f}")

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "per_layer_clipping.keras")
        model.save(path)
        restored = keras.models.load_model(path)
    print("restored transforms:", [
        type(t).__name__ + str(t.get_config())
        for t in restored.tapeops_options.transforms
    ])


if __name__ == "__main__":
    main()
