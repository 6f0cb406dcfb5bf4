"""Two-phase fine-tuning of a keras.applications backbone with one transform list.

The recipe from Keras's transfer-learning guide, with per-group gradient
clipping that stays the same in both phases:

- a `keras.applications.MobileNetV2` backbone named "backbone" (random
  weights, so nothing is downloaded; one pass sets its BatchNormalization
  statistics from the data, standing in for pretrained ones) plus a new head;
- BatchNormalization in inference mode throughout. The backbone is called
  with `training=False` in the functional graph, as the guide does; but with
  Keras 3 `fit` calls the outer model with `training=True`, which overrides
  the `training=False` written in the graph (keras-team/keras#20285). So the
  BatchNormalization layers also stay frozen when the rest is unfrozen (the
  guide's other way: a frozen BatchNormalization layer runs in inference mode
  whatever `training` says). The script checks that the moving statistics
  never change;
- phase 1: `backbone.trainable = False`, train the head. The backbone rule
  `ClipByGlobalNorm(1.0, where="backbone/*")` names only frozen layers: it
  acts on nothing, and `compile` warns once, naming the selector;
- phase 2: `backbone.trainable = True` (BatchNormalization layers kept
  frozen), recompile with a 100x lower learning rate and the SAME
  `gradient_transforms` list: now the backbone rule clips one global norm
  over every trainable backbone gradient, the head rule each head tensor.

Paths name layers from the outer model down through nested models
("backbone/block_16_project"); see docs/transforms.md.

Runs on CPU in well under a minute. Usage: `python examples/finetune_applications.py`
"""

import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402

NUM_CLASSES = 3


def make_data(n, seed):
    """Images whose class is the brightest colour channel (learnable from scratch)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, NUM_CLASSES, size=n)
    x = rng.normal(0.0, 1.0, size=(n, 32, 32, 3)).astype("float32")
    x[np.arange(n), :, :, y] += 1.5
    return x, y.astype("int32")


def build_model():
    backbone = keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, include_top=False, weights=None,
        name="backbone",
    )
    inputs = keras.Input((32, 32, 3))
    # training=False, as Keras's transfer-learning guide writes it. Keras 3's
    # fit overrides it (keras-team/keras#20285), so main() also keeps the
    # BatchNormalization layers frozen when it unfreezes the backbone.
    features = backbone(inputs, training=False)
    features = keras.layers.GlobalAveragePooling2D(name="pool")(features)
    outputs = keras.layers.Dense(NUM_CLASSES, activation="softmax", name="head")(features)
    return kt.upgrade(keras.Model(inputs, outputs, name="classifier"))


def calibrate_batch_norm(backbone, x):
    """Stands in for pretrained weights: BatchNormalization statistics from `x`.

    With `weights=None` every moving mean is 0 and every moving variance 1, and
    in inference mode the features at the top of a random MobileNetV2 vanish
    (about 1e-11). Pretrained weights bring their own statistics; here one
    pass in training mode with momentum 0 sets them to those of `x`.
    """
    layers = [l for l in backbone.layers if isinstance(l, keras.layers.BatchNormalization)]
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.momentum = 0.0
    backbone(x, training=True)
    for layer, momentum in zip(layers, momenta):
        layer.momentum = momentum


def snapshot(layer):
    return [np.array(w) for w in layer.get_weights()]


def max_change(layer, before):
    return max(float(np.max(np.abs(np.array(w) - b))) for w, b in zip(layer.get_weights(), before))


def moving_statistics(backbone):
    return [
        keras.ops.convert_to_numpy(v) for layer in backbone.layers
        if isinstance(layer, keras.layers.BatchNormalization)
        for v in (layer.moving_mean, layer.moving_variance)
    ]


def gradient_norms(model, x, y):
    """Global norm of the backbone's and of the head's gradients on one batch."""
    parts = {part: model.get_layer(part).trainable_variables for part in ("backbone", "head")}
    with tf.GradientTape() as tape:
        loss = keras.losses.sparse_categorical_crossentropy(y, model(x, training=True))
        loss = tf.reduce_mean(loss)
    grads = tape.gradient(loss, parts)
    return {
        part: f"{float(tf.linalg.global_norm(g)):.3f}" if g else "(frozen)"
        for part, g in grads.items()
    }


def run_phase(name, model, transforms, learning_rate, x, y):
    backbone, head = model.get_layer("backbone"), model.get_layer("head")
    norms = gradient_norms(model, x[:32], y[:32])
    print(
        f"{name}: gradient global norm on the first batch: backbone "
        f"{norms['backbone']}, head {norms['head']}"
    )
    before = {"backbone": snapshot(backbone), "head": snapshot(head)}
    statistics = moving_statistics(backbone)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            gradient_transforms=transforms,
        )
        history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    for warning in caught:
        if "frozen" in str(warning.message):
            print(f"{name}: warning: {warning.message}")
    for transform, state in model.tapeops_state.transforms:
        print(f"{name}: {transform!r} acts on {sum(state.selected)} variables")
    print(
        f"{name}: trainable variables {len(model.trainable_variables)}, "
        f"loss {history.history['loss'][0]:.4f} -> {history.history['loss'][-1]:.4f}"
    )
    for part, layer in (("backbone", backbone), ("head", head)):
        print(f"{name}: max |dw| {part} = {max_change(layer, before[part]):.3e}")
    unchanged = all(
        np.array_equal(a, b) for a, b in zip(statistics, moving_statistics(backbone))
    )
    print(f"{name}: BatchNormalization moving statistics unchanged: {unchanged}")


def main():
    keras.utils.set_random_seed(0)
    x, y = make_data(256, seed=0)
    model = build_model()
    backbone = model.get_layer("backbone")
    calibrate_batch_norm(backbone, x[:128])

    # One list, compiled in both phases.
    transforms = [
        kt.ClipByGlobalNorm(1.0, where="backbone/*"),   # one norm over the backbone
        kt.ClipByNorm(0.5, where="head"),               # each head tensor on its own
    ]

    backbone.trainable = False
    run_phase("phase 1", model, transforms, 1e-2, x, y)

    backbone.trainable = True
    for layer in backbone.layers:  # BatchNormalization stays in inference mode
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False
    run_phase("phase 2", model, transforms, 1e-4, x, y)


if __name__ == "__main__":
    main()
