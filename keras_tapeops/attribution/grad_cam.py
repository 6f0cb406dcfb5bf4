"""`grad_cam`: gradient-weighted class activation maps (Selvaraju et al. 2017)."""

from __future__ import annotations

from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops import capture
from keras_tapeops import paths
from keras_tapeops import validation
from keras_tapeops.attribution import compiled
from keras_tapeops.attribution import targets
from keras_tapeops.typing_aliases import Array
from keras_tapeops.typing_aliases import Nested


def grad_cam(
    model: keras.Model,
    x: Nested,
    layer: str | keras.layers.Layer,
    target: int | Sequence[int] | Array | None = None,
    upsample: bool = False,
    input_name: str | int | None = None,
    output_name: str | int | None = None,
) -> np.ndarray:
    """Grad-CAM: `relu(sum_c w_c * A_c)`, `w_c` the spatial mean of `d score / d A_c`.

    `A` is the output of `layer` (channels last) in the same forward pass as
    the score, recorded without re-running or rebuilding the model, so it
    works on Sequential, functional and subclassed models and on layers of
    nested backbones (`"backbone/Conv_1"`).

    Args:
        model: a Keras model; called with `training=False`.
        x: a batch of inputs; for a model with several inputs, all of them as
            a list/tuple or dict.
        layer: the layer's path from the outer model (the grammar of
            `keras_tapeops.paths`, e.g. `"mobilenetv2_0.35_32/Conv_1"`), a
            bare name found at any depth, or the layer object. It must run
            once per forward pass and output `(batch, *spatial, channels)`.
        target: None (each example's predicted unit), an int, or one int per
            example.
        upsample: False: the map at the layer's spatial resolution; True:
            resized (bilinear) to the input's spatial size (image inputs
            `(batch, height, width, channels)`).
        input_name: for a model with several inputs, the one whose spatial
            size `upsample` resizes to (a name or an index; see `saliency`);
            the map itself is of `layer`, whatever input feeds it. None: the
            only input, or the first with several inputs and `upsample=False`.
        output_name: the output to explain when the model has several (a
            name or an index; see `saliency`).

    Returns:
        A NumPy float32 array `(batch, *spatial)`, not normalized (divide by
        each map's maximum to display it).

    Example:
    ```python
    import keras, numpy as np
    import keras_tapeops as kt
    model = keras.Sequential([keras.Input((8, 8, 1)),
                              keras.layers.Conv2D(4, 3, name="conv"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
    cam = kt.attribution.grad_cam(model, np.random.rand(2, 8, 8, 1), layer="conv")
    cam.shape   # (2, 6, 6)
    ```
    """
    targets.check_model(model)
    upsample = validation.boolean(upsample, "upsample")
    # The map does not depend on which input is chosen (the others are held
    # fixed, all feed the layer as given); only upsampling reads it.
    default = input_name is None and not upsample and isinstance(x, (dict, list, tuple))
    x, rest, position = targets.split_inputs(
        model, x, 0 if default and len(x) else input_name, floating=not default
    )
    targets.check_output_name(model, output_name)
    if upsample and x.shape.rank != 4:
        raise ValueError(
            "`upsample=True` needs image inputs (batch, height, width, channels). "
            f"Received: x of shape {x.shape}"
        )
    found = _find_layer(model, layer)
    wanted = targets.target_tensor(target, x.shape[0])

    def build(ref):
        def run(x, rest, wanted):
            forward = targets.Forward(ref(), rest, position, output_name)
            with capture.recording_outputs([found]) as records:
                with tf.GradientTape() as tape:
                    if x.dtype.is_floating:
                        tape.watch(x)
                    scores, resolved, units = targets.selected(forward(x), wanted)
            activations = records[id(found)]
            if len(activations) != 1 or activations[0].shape.rank < 3:
                raise ValueError(
                    f"Grad-CAM needs one spatial output (batch, *spatial, "
                    f"channels) of layer {found.name!r} per forward pass; it "
                    f"produced {[tuple(a.shape) for a in activations]}. "
                    f"Received: layer={layer!r}"
                )
            a = activations[0]
            grads = tf.cast(tape.gradient(scores, a), tf.float32)
            a = tf.cast(a, tf.float32)
            spatial = list(range(1, a.shape.rank - 1))
            weights = tf.reduce_mean(grads, axis=spatial, keepdims=True)
            cam = tf.nn.relu(tf.reduce_sum(weights * a, axis=-1))
            if upsample:
                cam = tf.image.resize(cam[..., None], tf.shape(x)[1:3])[..., 0]
            return cam, resolved, units

        return run

    key = ("grad_cam", id(found), upsample) + targets.choice_key(position, output_name)
    cam, resolved, units = compiled.traced(model, key, build)(x, rest, wanted)
    targets.check_resolved(target, resolved, units)
    return np.asarray(cam, np.float32)


def _find_layer(model, layer):
    if not isinstance(layer, keras.layers.Layer) and (
        not isinstance(layer, str) or not layer.strip("/") or paths.is_glob(layer)
    ):
        raise ValueError(
            "`layer` must be one layer's path (e.g. 'backbone/Conv_1'), name, or "
            f"the layer object. Received: layer={layer!r}"
        )
    try:
        return paths.LayerTree(model).resolve_layer(layer)
    except ValueError as error:
        raise ValueError(f"{error}. Received: layer={layer!r}") from None
