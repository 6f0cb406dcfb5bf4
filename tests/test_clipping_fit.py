"""End-to-end `fit()` tests of the clipping transforms against independent oracles.

Oracles: a hand-written `tf.GradientTape` loop clipping each variable with
`tf.clip_by_norm`, and a NumPy two-layer linear network with group global-norm
clipping. Same initial weights, same batches (shuffle=False), plain SGD.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

LR = 0.05
BATCH = 16
EPOCHS = 2
HEAD_CLIP = 1.0
BACKBONE_CLIP = 5.0


def make_data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (3.0 * rng.normal(size=(n, 2))).astype("float32")
    return x, y


def make_net(activation="tanh"):
    """backbone_1 -> backbone_2 -> head, functional and upgraded."""
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation=activation, name="backbone_1")(inputs)
    h = keras.layers.Dense(8, activation=activation, name="backbone_2")(h)
    outputs = keras.layers.Dense(2, name="head")(h)
    return kt.upgrade(keras.Model(inputs, outputs, name="net"))


def is_head(variable):
    return "head" in variable.path


def tape_oracle(weights, x, y, clip_of, activation="tanh"):
    """Hand-written loop: per-variable `tf.clip_by_norm`, SGD. Returns weights, #clips."""
    model = make_net(activation)
    model.set_weights(weights)
    clipped = 0
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            xb, yb = x[start:start + BATCH], y[start:start + BATCH]
            with tf.GradientTape() as tape:
                pred = tf.cast(model(xb, training=True), "float32")
                loss = tf.reduce_mean(tf.square(pred - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            for v, g in zip(model.trainable_variables, grads):
                bound = clip_of(v)
                if bound is not None:
                    clipped += int(tf.norm(g).numpy() > bound)
                    g = tf.clip_by_norm(g, bound)
                v.assign_sub(LR * g)
    return model.get_weights(), clipped


def per_layer_bound(variable):
    return HEAD_CLIP if is_head(variable) else BACKBONE_CLIP


def fit_weights(model, x, y, **compile_kwargs):
    compile_kwargs.setdefault("optimizer", keras.optimizers.SGD(LR))
    model.compile(loss="mse", **compile_kwargs)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


def assert_weights_close(actual, expected, atol=1e-5):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, atol=atol, rtol=atol)


@pytest.fixture(scope="module")
def oracle():
    """Initial weights and the tape-loop result with head 1.0 / backbone 5.0."""
    keras.utils.set_random_seed(7)
    x, y = make_data()
    weights = make_net().get_weights()
    expected, clipped = tape_oracle(weights, x, y, per_layer_bound)
    assert clipped > 0, "thresholds must make clipping active"
    keras.backend.clear_session()
    return {"x": x, "y": y, "weights": weights, "expected": expected}


def two_rules(head_where, backbone_where):
    return [
        kt.ClipByNorm(HEAD_CLIP, where=head_where),
        kt.ClipByNorm(BACKBONE_CLIP, where=backbone_where),
    ]


def test_per_layer_norm_matches_tape_loop_with_globs(oracle):
    model = make_net()
    model.set_weights(oracle["weights"])
    got = fit_weights(
        model, oracle["x"], oracle["y"],
        gradient_transforms=two_rules("head*", "backbone*"),
    )
    assert_weights_close(got, oracle["expected"])


def test_per_layer_norm_matches_with_list_layer_and_callable(oracle):
    model = make_net()
    model.set_weights(oracle["weights"])
    got = fit_weights(
        model, oracle["x"], oracle["y"],
        gradient_transforms=[
            kt.ClipByNorm(HEAD_CLIP, where=model.get_layer("head")),
            kt.ClipByNorm(BACKBONE_CLIP, where=["backbone_1", "backbone_2"]),
        ],
    )
    assert_weights_close(got, oracle["expected"])

    model = make_net()
    model.set_weights(oracle["weights"])
    got = fit_weights(
        model, oracle["x"], oracle["y"],
        gradient_transforms=two_rules(is_head, lambda v: not is_head(v)),
    )
    assert_weights_close(got, oracle["expected"])


def test_comparison_can_fail(oracle):
    """Without the transforms, or with the rules swapped, the weights differ."""
    model = make_net()
    model.set_weights(oracle["weights"])
    unclipped = fit_weights(model, oracle["x"], oracle["y"])
    assert not all(
        np.allclose(a, e, atol=1e-5) for a, e in zip(unclipped, oracle["expected"])
    )
    model = make_net()
    model.set_weights(oracle["weights"])
    swapped = fit_weights(
        model, oracle["x"], oracle["y"],
        gradient_transforms=two_rules("backbone*", "head*"),
    )
    assert not all(
        np.allclose(a, e, atol=1e-5) for a, e in zip(swapped, oracle["expected"])
    )


def numpy_group_oracle(weights, x, y, head_clip, backbone_clip):
    """Two linear layers in NumPy, one global norm per group, SGD."""
    w1, b1, w2, b2, w3, b3 = [w.astype("float64") for w in weights]
    clipped = 0
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            xb, yb = x[start:start + BATCH], y[start:start + BATCH]
            h1 = xb @ w1 + b1
            h2 = h1 @ w2 + b2
            out = h2 @ w3 + b3
            d_out = 2.0 * (out - yb) / out.size
            g_w3, g_b3 = h2.T @ d_out, d_out.sum(0)
            d_h2 = d_out @ w3.T
            g_w2, g_b2 = h1.T @ d_h2, d_h2.sum(0)
            d_h1 = d_h2 @ w2.T
            g_w1, g_b1 = xb.T @ d_h1, d_h1.sum(0)
            backbone = [g_w1, g_b1, g_w2, g_b2]
            head = [g_w3, g_b3]
            for group, bound in ((backbone, backbone_clip), (head, head_clip)):
                norm = np.sqrt(sum(np.sum(g * g) for g in group))
                clipped += int(norm > bound)
                factor = bound / max(norm, bound)
                group[:] = [g * factor for g in group]
            grads = backbone + head
            w1, b1, w2, b2, w3, b3 = [
                w - LR * g for w, g in zip((w1, b1, w2, b2, w3, b3), grads)
            ]
    return [w1, b1, w2, b2, w3, b3], clipped


def test_group_global_norm_matches_numpy():
    x, y = make_data()
    model = make_net(activation=None)
    weights = model.get_weights()
    expected, clipped = numpy_group_oracle(weights, x, y, 0.5, 2.0)
    assert clipped > 0
    got = fit_weights(
        model, x, y,
        gradient_transforms=[
            kt.ClipByGlobalNorm(2.0, where="backbone*"),
            kt.ClipByGlobalNorm(0.5, where="head*"),
        ],
    )
    assert_weights_close(got, expected)
    # The same NumPy computation without clipping is far from it.
    unclipped, _ = numpy_group_oracle(weights, x, y, 1e9, 1e9)
    assert not np.allclose(unclipped[4], expected[4], atol=1e-5)


def test_mirrored_two_replicas_equals_single_device(oracle, mirrored):
    with mirrored.scope():
        model = make_net()
        model.set_weights(oracle["weights"])
        got = fit_weights(
            model, oracle["x"], oracle["y"],
            gradient_transforms=two_rules("head*", "backbone*"),
        )
    assert_weights_close(got, oracle["expected"])


def test_mirrored_global_norm_equals_single_device(mirrored):
    """Group clipping sees the replica-summed gradient, not each replica's."""
    x, y = make_data()
    model = make_net(activation=None)
    weights = model.get_weights()
    expected, _ = numpy_group_oracle(weights, x, y, 0.5, 2.0)
    with mirrored.scope():
        model = make_net(activation=None)
        model.set_weights(weights)
        got = fit_weights(
            model, x, y,
            gradient_transforms=[
                kt.ClipByGlobalNorm(2.0, where="backbone*"),
                kt.ClipByGlobalNorm(0.5, where="head*"),
            ],
        )
    assert_weights_close(got, expected)


def test_one_all_reduce_per_optimizer_step(oracle, mirrored, monkeypatch):
    calls = []
    original = tf.distribute.ReplicaContext.all_reduce

    def counting(self, reduce_op, value, options=None):
        calls.append(len(tf.nest.flatten(value)))
        return original(self, reduce_op, value, options)

    monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", counting)
    x, y = oracle["x"][:BATCH], oracle["y"][:BATCH]
    with mirrored.scope():
        model = make_net()
        model.compile(
            optimizer=keras.optimizers.SGD(LR), loss="mse",
            gradient_transforms=two_rules("head*", "backbone*"),
        )
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    # The step is traced once; each replica's trace calls all_reduce once,
    # on all six gradients together (the optimizer's own call is disabled).
    n_replicas = mirrored.num_replicas_in_sync
    assert calls == [6] * n_replicas


def test_mixed_float16_clips_unscaled_gradients(oracle):
    keras.config.set_dtype_policy("mixed_float16")
    x, y = oracle["x"], oracle["y"]
    expected, clipped = tape_oracle(oracle["weights"], x, y, per_layer_bound)
    assert clipped > 0
    model = make_net()
    model.set_weights(oracle["weights"])
    got = fit_weights(
        model, x, y, gradient_transforms=two_rules("head*", "backbone*")
    )
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_weights_close(got, expected)
    # Clipping the loss-scaled gradients instead would be far off.
    far, _ = tape_oracle(
        oracle["weights"], x, y, lambda v: per_layer_bound(v) / 2.0**15
    )
    assert not np.allclose(far[-2], expected[-2], atol=1e-5)


def test_mirrored_and_mixed_float16_together(oracle, mirrored):
    """LossScaleOptimizer's merge_call path under two replicas, with transforms.

    Tolerance 2e-4: float16 forward/backward on half batches rounds
    differently from the single-device float16 oracle (clipping the
    loss-scaled gradients instead would be off by ~1e-1).
    """
    keras.config.set_dtype_policy("mixed_float16")
    x, y = oracle["x"], oracle["y"]
    expected, _ = tape_oracle(oracle["weights"], x, y, per_layer_bound)
    with mirrored.scope():
        model = make_net()
        model.set_weights(oracle["weights"])
        got = fit_weights(
            model, x, y, gradient_transforms=two_rules("head*", "backbone*")
        )
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_weights_close(got, expected, atol=2e-4)


def test_mixed_float16_non_finite_step_is_skipped_and_scale_halves():
    keras.config.set_dtype_policy("mixed_float16")
    x, y = make_data(n=16)
    x[3, 0] = np.inf
    model = make_net()
    before = model.get_weights()
    model.compile(
        optimizer=keras.optimizers.SGD(LR), loss="mse",
        # A value clip would turn an inf gradient into a finite one.
        gradient_transforms=[kt.ClipByValue(0.1), kt.ClipByGlobalNorm(1.0)],
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert_weights_close(model.get_weights(), before, atol=0)
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**14
    assert int(model.optimizer.iterations.numpy()) == 0


def test_jit_compile_and_steps_per_execution(oracle):
    for options in ({"jit_compile": True}, {"steps_per_execution": 3}):
        model = make_net()
        model.set_weights(oracle["weights"])
        got = fit_weights(
            model, oracle["x"], oracle["y"],
            gradient_transforms=two_rules("head*", "backbone*"),
            **options,
        )
        assert_weights_close(got, oracle["expected"])


def test_save_load_keeps_transforms(oracle, tmp_path):
    model = make_net()
    model.set_weights(oracle["weights"])
    model.compile(
        optimizer=keras.optimizers.SGD(LR), loss="mse",
        gradient_transforms=[
            kt.ClipByNorm(HEAD_CLIP, where=model.get_layer("head")),
            kt.ClipByNorm(BACKBONE_CLIP, where="backbone*"),
        ],
    )
    path = tmp_path / "clip.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    transforms = loaded.tapeops_options.transforms
    assert [type(t) for t in transforms] == [kt.ClipByNorm, kt.ClipByNorm]
    assert [t.clip_norm for t in transforms] == [HEAD_CLIP, BACKBONE_CLIP]
    loaded.fit(
        oracle["x"], oracle["y"], batch_size=BATCH, epochs=EPOCHS,
        shuffle=False, verbose=0,
    )
    assert_weights_close(loaded.get_weights(), oracle["expected"])


def test_selector_matching_nothing_fails_before_weights_change(oracle):
    model = make_net()
    before = model.get_weights()
    model.compile(
        optimizer="sgd", loss="mse",
        gradient_transforms=[kt.ClipByNorm(1.0, where="haed*")],
    )
    with pytest.raises(ValueError, match=r"where='haed\*'.*backbone_1.*head"):
        model.fit(oracle["x"], oracle["y"], verbose=0)
    assert_weights_close(model.get_weights(), before, atol=0)


def test_embedding_sparse_gradients_clip_like_dense():
    """IndexedSlices with repeated rows give the dense-gradient result."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 5, size=(32, 4)).astype("int32")  # many repeats
    y = rng.normal(size=(32, 1)).astype("float32") * 5

    def build():
        inputs = keras.Input((4,), dtype="int32")
        h = keras.layers.Embedding(5, 3, name="emb")(inputs)
        h = keras.layers.Flatten()(h)
        return kt.upgrade(keras.Model(inputs, keras.layers.Dense(1, name="head")(h)))

    model = build()
    weights = model.get_weights()
    reference = build()
    reference.set_weights(weights)
    for _ in range(EPOCHS):
        for start in range(0, 32, BATCH):
            with tf.GradientTape() as tape:
                pred = reference(tokens[start:start + BATCH])
                loss = tf.reduce_mean(tf.square(pred - y[start:start + BATCH]))
            grads = tape.gradient(loss, reference.trainable_variables)
            grads = [tf.convert_to_tensor(g) for g in grads]  # densify
            grads[0] = tf.clip_by_value(grads[0], -0.01, 0.01)
            grads, _ = tf.clip_by_global_norm(grads, 0.05)
            for v, g in zip(reference.trainable_variables, grads):
                v.assign_sub(LR * g)
    got = fit_weights(
        model, tokens, y,
        gradient_transforms=[
            kt.ClipByValue(0.01, where="emb"),
            kt.ClipByGlobalNorm(0.05),
        ],
    )
    assert_weights_close(got, reference.get_weights())
