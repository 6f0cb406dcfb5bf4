"""Path selectors on a real keras.applications model, and the two-phase fine-tuning recipe.

- Selection counts on `keras.applications.MobileNetV2(weights=None)` nested as
  "backbone" in an outer functional model. The expected sets come from an
  independent walk of `model.layers` written here (not `keras_tapeops.paths`).
- The two-phase recipe (phase 1 backbone frozen, phase 2 unfrozen and
  recompiled with a lower learning rate, the SAME transform list, BatchNorm in
  inference mode) on a small functional backbone, against a hand-written
  `tf.GradientTape` loop inside `tf.function` (plain SGD written out, clipping
  with `tf.clip_by_global_norm` / `tf.clip_by_norm`), at atol 1e-6.
"""

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt


# ------------------------------------------------------------ MobileNetV2 selection
def walk(layer, prefix=""):
    """(path, layer) for every layer below `layer`, from `model.layers` recursion."""
    found = []
    for child in getattr(layer, "layers", None) or []:
        if isinstance(child, keras.layers.InputLayer):
            continue
        path = prefix + child.name
        found.append((path, child))
        found.extend(walk(child, path + "/"))
    return found


@pytest.fixture(scope="module")
def mobilenet():
    keras.utils.set_random_seed(0)
    backbone = keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, include_top=False, weights=None,
        name="backbone",
    )
    inputs = keras.Input((32, 32, 3))
    h = backbone(inputs, training=False)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    outputs = keras.layers.Dense(5, name="head")(h)
    return kt.upgrade(keras.Model(inputs, outputs, name="classifier"))


def selected(where, model):
    variables = model.trainable_variables
    state = kt.ClipByNorm(1.0, where=where).bind(model, variables)
    return {id(v) for v, on in zip(variables, state.selected) if on}


def trainable_ids(layers):
    return {id(v) for layer in layers for v in layer.trainable_weights}


def test_keras_variable_paths_leave_the_backbone_out(mobilenet):
    """Why the grammar walks layers: Keras's variable.path has no "backbone/"."""
    project = mobilenet.get_layer("backbone").get_layer("block_16_project")
    assert project.kernel.path == "block_16_project/kernel"


def test_backbone_glob_selects_every_backbone_trainable_variable(mobilenet):
    backbone_layers = [l for p, l in walk(mobilenet) if p.startswith("backbone/")]
    expected = trainable_ids(backbone_layers)
    assert expected == {id(v) for v in mobilenet.get_layer("backbone").trainable_variables}
    assert len(expected) > 100
    assert selected("backbone/*", mobilenet) == expected


@pytest.mark.parametrize("where, pattern", [
    ("backbone/block_16*", r"backbone/block_16"),
    ("backbone/block_1[0-6]_project", r"backbone/block_1[0-6]_project$"),
    ("backbone/*_BN", r"backbone/.*_BN$"),         # case-sensitive: not Conv_1_bn
    ("backbone/expanded_conv_*", r"backbone/expanded_conv_"),
])
def test_globs_select_exactly_the_layers_whose_paths_match(mobilenet, where, pattern):
    layers = [l for p, l in walk(mobilenet) if re.match(pattern, p)]
    expected = trainable_ids(layers)
    assert expected, pattern
    assert selected(where, mobilenet) == expected


def test_block_16_selects_its_named_layers(mobilenet):
    names = sorted(p for p, l in walk(mobilenet)
                   if p.startswith("backbone/block_16") and l.trainable_weights)
    assert names == ["backbone/block_16_depthwise", "backbone/block_16_depthwise_BN",
                     "backbone/block_16_expand", "backbone/block_16_expand_BN",
                     "backbone/block_16_project", "backbone/block_16_project_BN"]
    # Three convolution kernels (no biases) and three (gamma, beta) pairs.
    assert len(selected("backbone/block_16*", mobilenet)) == 9


@pytest.mark.parametrize("where, count", [
    ("backbone/*", 156), ("backbone", 156), ("backbone/block_16*", 9),
    ("backbone/block_16_project", 1), ("block_16_project", 1),
    ("backbone/block_16_project/kernel", 1), ("*/kernel", 53), ("backbone/*_BN", 100),
    ("head", 2), (["backbone/Conv_1", "head"], 3),
])
def test_the_counts_in_docs_transforms_md(mobilenet, where, count):
    assert len(selected(where, mobilenet)) == count


def test_head_and_exact_paths(mobilenet):
    head = mobilenet.get_layer("head")
    assert selected("head", mobilenet) == {id(head.kernel), id(head.bias)}
    project = mobilenet.get_layer("backbone").get_layer("block_16_project")
    assert selected("backbone/block_16_project", mobilenet) == {id(project.kernel)}
    assert selected("backbone/block_16_project/kernel", mobilenet) == {id(project.kernel)}
    assert selected("block_16_project", mobilenet) == {id(project.kernel)}  # unique bare name


def test_kernel_glob_selects_every_kernel(mobilenet):
    expected = {id(v) for _, l in walk(mobilenet) for v in l.trainable_weights
                if v.name == "kernel"}
    assert len(expected) == 52 + 1  # 52 backbone convolutions and the head
    assert selected("*/kernel", mobilenet) == expected
    backbone_kernels = {id(v) for p, l in walk(mobilenet) if p.startswith("backbone/")
                        for v in l.trainable_weights if v.name == "kernel"}
    assert selected("backbone/*/kernel", mobilenet) == backbone_kernels


def test_activation_penalty_resolves_the_layer_the_selector_names(mobilenet):
    path = "backbone/block_16_project"
    bound = kt.ActivationPenalty(path, l2=1e-3).bind(mobilenet)
    assert bound is dict(walk(mobilenet))[path]
    assert selected(path, mobilenet) == {id(v) for v in bound.trainable_weights}


def test_frozen_backbone_selector_warns_and_selects_nothing(mobilenet):
    backbone = mobilenet.get_layer("backbone")
    backbone.trainable = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert selected("backbone/*", mobilenet) == set()
        messages = [str(w.message) for w in caught]
        assert len([m for m in messages if "'backbone/*'" in m and "frozen" in m]) == 1, messages
        assert selected("head", mobilenet) == {id(v) for v in mobilenet.get_layer("head").weights}
        with pytest.raises(ValueError, match="backbone/block_99"):
            selected("backbone/block_99*", mobilenet)
    finally:
        backbone.trainable = True


# ----------------------------------------------------- the two-phase recipe, numerically
BACKBONE_CLIP = 0.5   # ClipByGlobalNorm over the backbone
HEAD_CLIP = 0.3       # ClipByNorm on each head tensor
LEARNING_RATES = (0.1, 0.02)
BATCH, EPOCHS = 16, 2


def small_model():
    """A functional backbone with BatchNormalization, called with training=False."""
    inner = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu", name="b_dense1")(inner)
    h = keras.layers.BatchNormalization(name="b_bn")(h)
    h = keras.layers.Dense(8, activation="tanh", name="b_dense2")(h)
    backbone = keras.Model(inner, h, name="backbone")
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3, name="head")(backbone(inputs, training=False))
    return keras.Model(inputs, outputs, name="net")


def recipe_data():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(64, 6)) * 2.0).astype("float32")
    y = rng.integers(0, 3, size=64).astype("int32")
    return x, y


def start_weights():
    """Random weights in `small_model().weights` order; BatchNorm statistics not (0, 1)."""
    rng = np.random.default_rng(1)
    weights = []
    for v in small_model().weights:
        shape = tuple(v.shape)
        if v.name == "moving_variance":
            weights.append(rng.uniform(0.5, 2.0, shape).astype("float32"))
        else:
            weights.append(rng.normal(0.0, 0.5, shape).astype("float32"))
    return weights


def freeze(model, phase):
    """Phase 1: backbone frozen. Phase 2: unfrozen, BatchNorm kept frozen (inference mode).

    Keras 3 overrides the graph's training=False with fit's training=True
    (keras-team/keras#20285); a frozen BatchNormalization runs in inference mode.
    """
    backbone = model.get_layer("backbone")
    backbone.trainable = phase == 2
    backbone.get_layer("b_bn").trainable = False


def transforms():
    return [kt.ClipByGlobalNorm(BACKBONE_CLIP, where="backbone/*"),
            kt.ClipByNorm(HEAD_CLIP, where="head")]


def fit_recipe(weights, transform_list):
    model = kt.upgrade(small_model())
    model.set_weights(weights)
    x, y = recipe_data()
    history = []
    for phase, lr in zip((1, 2), LEARNING_RATES):
        freeze(model, phase)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.compile(optimizer=keras.optimizers.SGD(lr),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          gradient_transforms=transform_list)
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        history.append(([str(w.message) for w in caught], [np.array(w) for w in model.get_weights()]))
    return model, history


def tape_recipe(weights, clip=True):
    """The recipe by hand: tf.function steps, explicit SGD, tf.clip_by_* per group."""
    model = small_model()
    model.set_weights(weights)
    x, y = recipe_data()
    snapshots, clipped = [], []
    for phase, lr in zip((1, 2), LEARNING_RATES):
        freeze(model, phase)
        backbone_vars = list(model.get_layer("backbone").trainable_weights)
        head_vars = list(model.get_layer("head").trainable_weights)
        assert len(backbone_vars) == (0 if phase == 1 else 4)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                logits = model(xb, training=False)  # the whole model in inference mode
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits))
            g_backbone, g_head = tape.gradient(loss, [backbone_vars, head_vars])
            backbone_norm = tf.linalg.global_norm(g_backbone) if g_backbone else tf.constant(0.0)
            head_norms = tf.stack([tf.norm(g) for g in g_head])
            if clip:
                if g_backbone:
                    g_backbone, _ = tf.clip_by_global_norm(g_backbone, BACKBONE_CLIP)
                g_head = [tf.clip_by_norm(g, HEAD_CLIP) for g in g_head]
            for v, g in zip(backbone_vars + head_vars, list(g_backbone) + list(g_head)):
                v.assign_sub(lr * g)
            return backbone_norm, head_norms

        norms = []
        for _ in range(EPOCHS):
            for start in range(0, len(x), BATCH):
                b, h = step(x[start:start + BATCH], y[start:start + BATCH])
                norms.append((float(b), np.array(h)))
        clipped.append(norms)
        snapshots.append([np.array(w) for w in model.get_weights()])
    return snapshots, clipped


def max_diff(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))


def test_two_phase_recipe_equals_the_tape_loop_in_both_phases():
    model, history = fit_recipe(start_weights(), transforms())
    expected, norms = tape_recipe(start_weights())
    names = [v.path for v in model.weights]
    backbone_ids = {id(v) for v in model.get_layer("backbone").weights}
    is_backbone = [id(v) in backbone_ids for v in model.weights]
    start = start_weights()

    # Both rules clip on some steps of the phase where they act (the oracle is not vacuous).
    phase1, phase2 = norms
    assert any((h > HEAD_CLIP).any() for _, h in phase1)
    assert any(b > BACKBONE_CLIP for b, _ in phase2)
    assert any((h > HEAD_CLIP).any() for _, h in phase2)

    (warnings1, after1), (warnings2, after2) = history
    frozen1 = [m for m in warnings1 if "'backbone/*'" in m and "frozen" in m]
    assert len(frozen1) == 1, warnings1
    assert not [m for m in warnings2 if "frozen" in m], warnings2

    # Phase 1: the backbone (BatchNorm statistics included) is untouched.
    for name, on, w0, w1 in zip(names, is_backbone, start, after1):
        if on:
            assert np.array_equal(w0, w1), name
    assert max_diff(after1, expected[0]) < 1e-6
    # Phase 2: everything but BatchNorm moved, as the tape loop moved it.
    assert max_diff(after2, expected[1]) < 1e-6
    bn = model.get_layer("backbone").get_layer("b_bn")
    for v in bn.weights:
        i = [id(w) for w in model.weights].index(id(v))
        assert np.array_equal(after2[i], start[i]), v.name
    dense1 = [id(w) for w in model.weights].index(id(model.get_layer("backbone").get_layer("b_dense1").kernel))
    assert not np.allclose(after2[dense1], start[dense1])


def test_companion_the_recipe_oracle_sees_missing_clipping():
    """Without transforms, or without the frozen-phase selector, fit differs from the oracle."""
    start = start_weights()
    expected, _ = tape_recipe(start)
    _, history = fit_recipe(start, [])
    assert max_diff(history[0][1], expected[0]) > 1e-3   # head clipping matters in phase 1
    assert max_diff(history[1][1], expected[1]) > 1e-3
    _, history = fit_recipe(start, [kt.ClipByNorm(HEAD_CLIP, where="head")])
    assert max_diff(history[0][1], expected[0]) < 1e-6   # phase 1 needs only the head rule
    assert max_diff(history[1][1], expected[1]) > 1e-3   # phase 2 needs the backbone rule too
    unclipped, _ = tape_recipe(start, clip=False)
    assert max_diff(unclipped[1], expected[1]) > 1e-3


def test_keras_fit_overrides_training_false_so_the_recipe_freezes_batch_norm():
    """Why `freeze` keeps BatchNorm frozen in phase 2 (documented in docs/transforms.md).

    With the backbone trainable, `fit` (stock Keras, no keras_tapeops) updates
    BatchNorm statistics although the graph calls `backbone(x, training=False)`
    (keras-team/keras#20285); a frozen BatchNormalization layer does not.
    """
    x, y = recipe_data()
    moved = {}
    for bn_frozen in (False, True):
        model = small_model()
        model.set_weights(start_weights())
        bn = model.get_layer("backbone").get_layer("b_bn")
        bn.trainable = not bn_frozen
        before = np.array(bn.moving_mean)
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        moved[bn_frozen] = not np.array_equal(before, np.array(bn.moving_mean))
    assert moved == {False: True, True: False}
