"""keras_tapeops showcase: upgrade an existing model in one line and keep `fit`.

Trains a small classifier on generated data three ways from the same start:
stock Keras, the upgraded model with no options (identical results), and the
upgraded model with per-layer gradient clipping and an activation penalty,
all with callbacks. Run with `make demo`.
"""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402


def make_data(n=2048, features=20, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=2.0, size=(classes, features))
    y = rng.integers(0, classes, size=n)
    x = centers[y] + rng.normal(size=(n, features))
    return x.astype("float32"), y.astype("int32")


def make_model(features=20, classes=4):
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(64, activation="relu", name="backbone_1"),
            keras.layers.Dense(64, activation="relu", name="backbone_2"),
            keras.layers.Dense(classes, name="head"),
        ],
        name="classifier",
    )


def train(model, x, y, **options):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **options,
    )
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2),
        keras.callbacks.ModelCheckpoint(os.path.join(tempfile.mkdtemp(), "best.keras")),
    ]
    return model.fit(
        x, y, validation_split=0.2, batch_size=64, epochs=4, shuffle=False,
        callbacks=callbacks, verbose=2,
    ).history


def main():
    keras.utils.set_random_seed(0)
    x, y = make_data()
    stock = make_model()
    start = stock.get_weights()

    print("== stock Keras")
    stock_history = train(stock, x, y)

    print("== kt.upgrade(model), no options: trains exactly like stock")
    upgraded = kt.upgrade(make_model())
    upgraded.set_weights(start)
    upgraded_history = train(upgraded, x, y)
    same = all(
        np.array_equal(a, b) for a, b in zip(stock.get_weights(), upgraded.get_weights())
    )
    print(f"same final weights as stock: {same}; "
          f"same val_loss: {stock_history['val_loss'] == upgraded_history['val_loss']}")

    print("== kt.upgrade(model) with keras_tapeops options")
    tuned = kt.upgrade(make_model())
    tuned.set_weights(start)
    options = {
        "gradient_transforms": [
            kt.ClipByNorm(0.5, where="head*"),
            kt.ClipByGlobalNorm(5.0, where="backbone*"),
        ],
        "loss_terms": [kt.ActivationPenalty("backbone_2", l1=1e-3, name="sparsity")],
    }
    history = train(tuned, x, y, **options)
    print("logged keys:", sorted(history))
    path = os.path.join(tempfile.mkdtemp(), "tuned.keras")
    tuned.save(path)
    restored = keras.models.load_model(path)
    opts = restored.tapeops_options
    print(f"saved and restored as {type(restored).__name__} with "
          f"gradient_transforms={[type(t).__name__ for t in opts.transforms]} and "
          f"loss_terms={[t.name for t in opts.terms]}")


if __name__ == "__main__":
    main()
