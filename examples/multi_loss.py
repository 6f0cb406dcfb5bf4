"""Multi-objective training with `fit()`: task loss + activation sparsity + a custom term.

A small classifier on generated data is trained with
  - the task loss (sparse categorical cross-entropy),
  - an L1 sparsity penalty on the hidden features (`kt.ActivationPenalty`),
    read from the same forward pass (the layer is not run again),
  - a confidence penalty (`kt.LossTerm`) whose weight ramps up over the first
    optimizer steps (a `LearningRateSchedule` of the optimizer step).
Each term is logged in History and the progress bar under its name; `loss`
is the total. The model is then saved and loaded with its terms.

Run: python examples/multi_loss.py   (a few seconds on CPU)
"""

import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_tapeops as kt  # noqa: E402


@keras.saving.register_keras_serializable(package="multi_loss_example")
def negative_entropy(model, x, y, y_pred):
    """Confidence penalty: mean negative entropy of the predicted classes."""
    probs = ops.softmax(ops.cast(y_pred, "float32"))
    return ops.mean(ops.sum(probs * ops.log(probs + 1e-7), axis=-1))


class LinearRamp(keras.optimizers.schedules.LearningRateSchedule):
    """0 at step 0, rising linearly to `top` at `steps`, then constant."""

    def __init__(self, top, steps):
        self.top = top
        self.steps = steps

    def __call__(self, step):
        return self.top * ops.minimum(ops.cast(step, "float32") / self.steps, 1.0)

    def get_config(self):
        return {"top": self.top, "steps": self.steps}


keras.saving.register_keras_serializable(package="multi_loss_example")(LinearRamp)


def make_data(n=1024, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    y = (x[:, :3].sum(axis=1) > 0).astype("int32") + (x[:, 3] > 1).astype("int32")
    return x, y


def main():
    keras.utils.set_random_seed(0)
    x, y = make_data()
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu", name="features"),
            keras.layers.Dense(3, name="logits"),
        ]
    )
    model = kt.upgrade(model)  # same layers and weights, keras_tapeops step
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        loss_terms=[
            kt.ActivationPenalty("features", l1=1e-2, name="sparsity"),
            kt.LossTerm(
                negative_entropy, weight=LinearRamp(0.1, steps=40), name="confidence"
            ),
        ],
    )
    history = model.fit(
        x, y, batch_size=64, epochs=4, validation_split=0.25, verbose=2
    )
    print("logged keys:", sorted(history.history))

    features = model.get_layer("features")(x).numpy()
    print(f"fraction of zero features: {np.mean(features == 0):.2f}")

    path = os.path.join(tempfile.mkdtemp(), "multi_loss.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    print("terms after load:", [t.name for t in loaded.tapeops_options.terms])
    logs = loaded.evaluate(x, y, batch_size=256, verbose=0, return_dict=True)
    print("evaluate after load:", {k: round(v, 4) for k, v in logs.items()})


if __name__ == "__main__":
    main()
