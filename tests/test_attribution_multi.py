"""`kt.attribution` on multi-input, multi-output models, and averaged baselines (issue 29 item 6).

Oracles first: every attribution is compared with an independent
`tf.GradientTape` computation, wrapped in a `tf.function`, that calls the
model positionally (`[image, meta]`), picks the output by hand and watches
the chosen input only; Integrated Gradients is keras.io's per-point loop
(one gradient per interpolation point, then the trapezoid), and its random
baselines keras.io's `random_baseline_integrated_gradients` (one run per
baseline, then the mean).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.attribution import compiled

pytestmark = pytest.mark.unit  # no fit; under 3 s each

TOL = 1e-6
OUTPUTS = {"logits": 0, "aux": 1}
TARGET = np.array([2, 0, 1])  # a unit of both outputs (aux has 2 units, logits 3)
AUX_TARGET = np.array([1, 0, 1])


def two_by_two():
    """Inputs `image` (4,) and `meta` (3,), outputs `logits` (3) and `aux` (2); they interact."""
    keras.utils.set_random_seed(0)
    image = keras.Input((4,), name="image")
    meta = keras.Input((3,), name="meta")
    hidden = keras.layers.Dense(6, activation="tanh")(keras.layers.Concatenate()([image, meta]))
    logits = keras.layers.Dense(3, name="logits")(hidden)
    aux = keras.layers.Dense(2, activation="tanh", name="aux")(hidden)
    return keras.Model([image, meta], [logits, aux])


def batch(seed=1):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(3, 4)).astype("float32"),
            rng.normal(size=(3, 3)).astype("float32"))


def hand_gradient(model, input_name, output_name, target):
    """`g(image, meta)`: d output[i, target[i]] / d chosen input, one tape, traced."""
    index = OUTPUTS[output_name]
    target = tf.constant(target, tf.int32)

    @tf.function
    def gradient(image, meta):
        with tf.GradientTape() as tape:
            tape.watch(image if input_name == "image" else meta)
            out = model([image, meta], training=False)[index]
            score = tf.reduce_sum(tf.gather(out, target, axis=1, batch_dims=1))
        return tape.gradient(score, image if input_name == "image" else meta)

    return gradient


def hand_integrated_gradients(model, inputs, input_name, output_name, target, baseline, steps):
    """keras.io's `get_integrated_gradients`: one gradient per point, the other input fixed."""
    gradient = hand_gradient(model, input_name, output_name, target)
    image, meta = inputs
    x = image if input_name == "image" else meta
    grads = []
    for k in range(steps + 1):
        point = tf.constant(baseline + (k / steps) * (x - baseline))
        args = (point, meta) if input_name == "image" else (image, point)
        grads.append(gradient(*args).numpy())
    grads = np.stack(grads)
    return (x - baseline) * ((grads[:-1] + grads[1:]) / 2.0).mean(axis=0)


@pytest.mark.parametrize("input_name", ["image", "meta"])
@pytest.mark.parametrize("output_name", ["logits", "aux"])
def test_saliency_of_the_chosen_input_and_output_equals_the_tape(input_name, output_name):
    model = two_by_two()
    image, meta = batch()
    target = TARGET if output_name == "logits" else AUX_TARGET
    expected = hand_gradient(model, input_name, output_name, target)(image, meta).numpy()
    assert np.abs(expected).max() > 1e-3
    for x in ([image, meta], (image, meta), {"image": image, "meta": meta}):
        actual = kt.attribution.saliency(model, x, target=target, absolute=False,
                                         input_name=input_name, output_name=output_name)
        np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL)
    by_index = kt.attribution.saliency(
        model, [image, meta], target=target, input_name=["image", "meta"].index(input_name),
        output_name=OUTPUTS[output_name])
    np.testing.assert_allclose(by_index, np.abs(expected), rtol=0, atol=TOL)


def test_the_check_can_fail_the_wrong_output_or_input_differs():
    model = two_by_two()
    image, meta = batch()
    expected = hand_gradient(model, "image", "logits", AUX_TARGET)(image, meta).numpy()
    wrong_output = kt.attribution.saliency(model, [image, meta], target=AUX_TARGET,
                                           absolute=False, input_name="image", output_name="aux")
    assert np.abs(wrong_output - expected).max() > 1e-3
    right = kt.attribution.saliency(model, [image, meta], target=AUX_TARGET, absolute=False,
                                    input_name="image", output_name="logits")
    np.testing.assert_allclose(right, expected, rtol=0, atol=TOL)
    wrong_input = kt.attribution.saliency(model, [image, meta], target=AUX_TARGET,
                                          absolute=False, input_name="meta", output_name="logits")
    assert wrong_input.shape == meta.shape != expected.shape


def test_default_target_is_the_arg_max_of_the_chosen_output():
    model = two_by_two()
    image, meta = batch()
    units = np.argmax(model([image, meta], training=False)[1].numpy(), axis=1)
    expected = hand_gradient(model, "meta", "aux", units)(image, meta).numpy()
    actual = kt.attribution.saliency(model, {"image": image, "meta": meta}, absolute=False,
                                     input_name="meta", output_name="aux")
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL)


@pytest.mark.parametrize("input_name,output_name,batch_size",
                         [("image", "logits", None), ("meta", "aux", 4)])
def test_integrated_gradients_of_the_chosen_input_and_output(input_name, output_name, batch_size):
    model = two_by_two()
    inputs = batch()
    target = TARGET if output_name == "logits" else AUX_TARGET
    x = inputs[0] if input_name == "image" else inputs[1]
    baseline = np.full(x.shape[1:], 0.3, "float32")
    expected = hand_integrated_gradients(model, inputs, input_name, output_name, target,
                                         baseline, steps=8)
    actual = kt.attribution.integrated_gradients(
        model, list(inputs), baseline=baseline, target=target, steps=8, batch_size=batch_size,
        input_name=input_name, output_name=output_name)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL)


def test_averaged_baselines_equal_the_mean_of_single_baseline_calls_and_keras_io():
    model = two_by_two()
    image, meta = batch()
    inputs = {"image": image, "meta": meta}
    options = dict(target=TARGET, steps=6, input_name="image", output_name="logits")
    count, seed, low, high = 3, 7, -1.0, 2.0
    # keras.io's random_baseline_integrated_gradients: num_runs runs, then the mean,
    # with the documented draws (one baseline shaped like one example per run).
    draws = np.random.default_rng(seed).uniform(low, high, (count, 4)).astype("float32")
    keras_io = np.mean([
        hand_integrated_gradients(model, (image, meta), "image", "logits", TARGET, b, steps=6)
        for b in draws], axis=0)
    singles = np.mean([kt.attribution.integrated_gradients(model, inputs, baseline=b, **options)
                       for b in draws], axis=0)
    np.testing.assert_allclose(singles, keras_io, rtol=0, atol=TOL)
    for batch_size in (None, 5):
        listed = kt.attribution.integrated_gradients(
            model, inputs, baselines=list(draws), batch_size=batch_size, **options)
        np.testing.assert_allclose(listed, keras_io, rtol=0, atol=TOL)
    stacked = kt.attribution.integrated_gradients(model, inputs, baselines=draws, **options)
    np.testing.assert_allclose(stacked, keras_io, rtol=0, atol=TOL)
    random = kt.attribution.integrated_gradients(
        model, inputs, num_random_baselines=count, seed=seed, random_baseline_range=(low, high),
        **options)
    np.testing.assert_allclose(random, keras_io, rtol=0, atol=TOL)
    # The check can fail: one baseline alone, or another seed, is another answer.
    first = kt.attribution.integrated_gradients(model, inputs, baseline=draws[0], **options)
    other = kt.attribution.integrated_gradients(
        model, inputs, num_random_baselines=count, seed=seed + 1,
        random_baseline_range=(low, high), **options)
    assert np.abs(first - keras_io).max() > 1e-3 and np.abs(other - keras_io).max() > 1e-3


def test_averaged_baselines_on_a_single_input_model():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(2)])
    x = np.random.default_rng(3).normal(size=(2, 5)).astype("float32")
    baselines = [0.0, np.full((5,), 0.5, "float32"), np.ones((2, 5), "float32")]
    singles = [kt.attribution.integrated_gradients(model, x, baseline=b, target=1, steps=4)
               for b in baselines]
    averaged = kt.attribution.integrated_gradients(model, x, baselines=baselines, target=1,
                                                   steps=4)
    np.testing.assert_allclose(averaged, np.mean(singles, axis=0), rtol=0, atol=TOL)


def two_output_cnn():
    keras.utils.set_random_seed(2)
    layers = {
        "conv": keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
        "pool": keras.layers.GlobalAveragePooling2D(),
        "concat": keras.layers.Concatenate(),
        "logits": keras.layers.Dense(3, name="logits"),
        "aux": keras.layers.Dense(2, name="aux"),
    }
    image = keras.Input((8, 8, 1), name="image")
    meta = keras.Input((2,), name="meta")
    hidden = layers["concat"]([layers["pool"](layers["conv"](image)), meta])
    outputs = {"logits": layers["logits"](hidden), "aux": layers["aux"](hidden)}
    return keras.Model({"image": image, "meta": meta}, outputs), layers


def hand_grad_cam(layers, image, meta, output_name, target):
    """Conv, then the rest of the model on the watched activations; one traced tape."""
    target = tf.constant(target, tf.int32)

    @tf.function
    def cam(image, meta):
        with tf.GradientTape() as tape:
            a = layers["conv"](image)
            tape.watch(a)
            out = layers[output_name](layers["concat"]([layers["pool"](a), meta]))
            score = tf.reduce_sum(tf.gather(out, target, axis=1, batch_dims=1))
        weights = tf.reduce_mean(tape.gradient(score, a), axis=[1, 2], keepdims=True)
        return tf.nn.relu(tf.reduce_sum(weights * a, axis=-1))

    return cam(tf.constant(image), tf.constant(meta)).numpy()


def test_grad_cam_of_the_chosen_output_of_a_two_output_cnn():
    model, layers = two_output_cnn()
    rng = np.random.default_rng(4)
    image = rng.uniform(size=(3, 8, 8, 1)).astype("float32")
    meta = rng.normal(size=(3, 2)).astype("float32")
    inputs = {"image": image, "meta": meta}
    expected = hand_grad_cam(layers, image, meta, "aux", AUX_TARGET)
    assert expected.max() > 0
    cam = kt.attribution.grad_cam(model, inputs, layer="conv", target=AUX_TARGET,
                                  output_name="aux")
    assert cam.shape == (3, 6, 6)
    np.testing.assert_allclose(cam, expected, rtol=0, atol=TOL)
    # The check can fail: the other output gives another map.
    logits = kt.attribution.grad_cam(model, inputs, layer="conv", target=AUX_TARGET,
                                     output_name="logits")
    np.testing.assert_allclose(
        logits, hand_grad_cam(layers, image, meta, "logits", AUX_TARGET), rtol=0, atol=TOL)
    assert np.abs(logits - expected).max() > 1e-4
    # Upsampling needs the image input named.
    upsampled = kt.attribution.grad_cam(model, inputs, layer="conv", target=AUX_TARGET,
                                        output_name="aux", upsample=True, input_name="image")
    resized = tf.image.resize(expected[..., None], (8, 8)).numpy()[..., 0]
    np.testing.assert_allclose(upsampled, resized, rtol=0, atol=TOL)
    with pytest.raises(ValueError, match=r"several inputs \(\['image', 'meta'\]\)"):
        kt.attribution.grad_cam(model, inputs, layer="conv", output_name="aux", upsample=True)


def test_single_input_single_output_defaults_are_unchanged():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, name="head")])
    x = np.random.default_rng(5).normal(size=(2, 5)).astype("float32")
    plain = kt.attribution.saliency(model, x, target=1)
    for input_name, output_name in ((0, 0), (None, "head"), (-1, None)):
        chosen = kt.attribution.saliency(model, x, target=1, input_name=input_name,
                                         output_name=output_name)
        np.testing.assert_allclose(chosen, plain, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"`output_name`.*\['head'\].*Received: output_name='x'"):
        kt.attribution.saliency(model, x, output_name="x")
    with pytest.raises(ValueError, match="`input_name`.*Received: input_name=1"):
        kt.attribution.saliency(model, x, input_name=1)


def test_errors_name_the_argument_and_list_the_names():
    model = two_by_two()
    image, meta = batch()
    listed = [image, meta]
    with pytest.raises(ValueError, match=(
            r"several inputs \(\['image', 'meta'\]\).*`input_name=`.*"
            r"Received: input_name=None")):
        kt.attribution.saliency(model, listed, output_name="logits")
    with pytest.raises(ValueError, match=(
            r"`input_name` must be one of the model's inputs \['image', 'meta'\].*"
            r"Received: input_name='img'")):
        kt.attribution.integrated_gradients(model, listed, input_name="img", output_name="aux")
    with pytest.raises(ValueError, match="index below 2. Received: input_name=2"):
        kt.attribution.saliency(model, listed, input_name=2, output_name="aux")
    with pytest.raises(ValueError, match=(
            r"several outputs \(\['logits', 'aux'\]\).*`output_name=`.*"
            r"Received: output_name=None")):
        kt.attribution.saliency(model, listed, input_name="image")
    with pytest.raises(ValueError, match=(
            r"`output_name` must be one of the model's outputs \['logits', 'aux'\].*"
            r"Received: output_name='probs'")):
        kt.attribution.smoothgrad(model, {"image": image, "meta": meta}, input_name="image",
                                  output_name="probs", samples=2)
    with pytest.raises(ValueError, match=r"inputs \['image', 'meta'\].*input_name='x'"):
        kt.attribution.saliency(model, {"image": image, "meta": meta}, input_name="x",
                                output_name="aux")
    with pytest.raises(ValueError, match="batch size 3.*input_name='image'"):
        kt.attribution.saliency(model, [image, meta[:2]], input_name="image", output_name="aux")


def test_baseline_argument_errors():
    model = two_by_two()
    inputs = list(batch())
    options = dict(input_name="image", output_name="logits", steps=2)
    ig = kt.attribution.integrated_gradients
    with pytest.raises(ValueError, match="at most one of.*Received: baseline=0.5, baselines"):
        ig(model, inputs, baseline=0.5, baselines=[0.0, 1.0], **options)
    with pytest.raises(ValueError, match=r"Received: baselines=\.\.\., num_random_baselines=2"):
        ig(model, inputs, baselines=[0.0], num_random_baselines=2, **options)
    with pytest.raises(ValueError, match="Received: num_random_baselines=0"):
        ig(model, inputs, num_random_baselines=0, **options)
    with pytest.raises(ValueError, match="needs `num_random_baselines`. Received: seed=3"):
        ig(model, inputs, seed=3, **options)
    with pytest.raises(ValueError, match="at least one baseline. Received: baselines=\\[\\]"):
        ig(model, inputs, baselines=[], **options)
    with pytest.raises(ValueError, match=r"Received: baselines\[i\] of shape \(3,\)"):
        ig(model, inputs, baselines=[np.zeros(4), np.zeros(3)], **options)
    with pytest.raises(ValueError, match=r"Received: random_baseline_range=\(1.0, 0.0\)"):
        ig(model, inputs, num_random_baselines=2, random_baseline_range=(1.0, 0.0), **options)


def test_a_subclassed_two_input_model_is_chosen_by_index():
    class TwoInputs(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2, activation="tanh")

        def call(self, inputs):
            a, b = inputs
            return self.dense(a * b)

    model = TwoInputs()
    rng = np.random.default_rng(6)
    a, b = rng.normal(size=(2, 3)).astype("float32"), rng.normal(size=(2, 3)).astype("float32")
    model([a, b])

    @tf.function
    def hand(a, b):
        with tf.GradientTape() as tape:
            tape.watch(b)
            score = tf.reduce_sum(model([a, b], training=False)[:, 1])
        return tape.gradient(score, b)

    actual = kt.attribution.saliency(model, [a, b], target=1, absolute=False, input_name=1)
    np.testing.assert_allclose(actual, hand(a, b).numpy(), rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="2 unnamed inputs or an index below 2. "
                                         "Received: input_name='b'"):
        kt.attribution.saliency(model, [a, b], input_name="b")


def test_smoothgrad_adds_noise_to_the_chosen_input_only():
    model = two_by_two()
    image, meta = batch()
    samples, level, seed = 4, 0.2, 5
    spread = (meta.max(axis=1) - meta.min(axis=1)).reshape(1, 3, 1)
    draws = tf.random.stateless_normal((samples,) + meta.shape, [seed, 0]).numpy()
    noisy = meta[None] + level * spread * draws
    units = np.argmax(model([image, meta], training=False)[1].numpy(), axis=1)
    gradient = hand_gradient(model, "meta", "aux", units)
    expected = np.mean([gradient(image, point).numpy() for point in noisy], axis=0)
    actual = kt.attribution.smoothgrad(model, [image, meta], samples=samples, noise=level,
                                       seed=seed, absolute=False, input_name="meta",
                                       output_name="aux")
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL)


def test_each_choice_is_traced_once():
    model = two_by_two()
    image, meta = batch()
    for _ in range(3):
        for name in ("image", "meta"):
            kt.attribution.saliency(model, [image, meta], target=TARGET, input_name=name,
                                    output_name="logits")
            kt.attribution.integrated_gradients(model, [image, meta], target=TARGET, steps=2,
                                                num_random_baselines=2, seed=0,
                                                input_name=name, output_name="logits")
    functions = compiled._FUNCTIONS[model]
    assert len(functions) == 4
    assert all(f.experimental_get_tracing_count() == 1 for f in functions.values())


def test_one_tensor_for_a_multi_input_model_is_refused():
    model = two_by_two()
    with pytest.raises(TypeError, match=r"several inputs \(\['image', 'meta'\]\).*"
                                        r"Received: x of type ndarray"):
        kt.attribution.saliency(model, batch()[0], output_name="logits")


def test_a_subclassed_dict_output_model_is_chosen_by_key():
    class TwoHeads(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(2)
            self.b = keras.layers.Dense(3, activation="tanh")

        def call(self, x):
            return {"a": self.a(x), "b": self.b(x)}

    model = TwoHeads()
    x = np.random.default_rng(7).normal(size=(2, 4)).astype("float32")
    model(x)

    @tf.function
    def hand(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            score = tf.reduce_sum(model(x, training=False)["b"][:, 2])
        return tape.gradient(score, x)

    actual = kt.attribution.saliency(model, x, target=2, absolute=False, output_name="b")
    np.testing.assert_allclose(actual, hand(tf.constant(x)).numpy(), rtol=0, atol=TOL)
    with pytest.raises(ValueError, match=r"outputs \['a', 'b'\].*Received: output_name='c'"):
        kt.attribution.saliency(model, x, output_name="c")
