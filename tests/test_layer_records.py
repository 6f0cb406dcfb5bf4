"""`keras_tapeops.layer_records`: what DP-SGD's ghost norms and the multi-task
layerwise Gramian both read, checked on its own against tapes (no `fit`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_tapeops.layer_records import sites
from keras_tapeops.layer_records.dense import DenseRecording
from keras_tapeops.layer_records.dense import EinsumDenseRecording
from keras_tapeops.layer_records.forwards import stock_call
from keras_tapeops.layer_records.layouts import einsum_bias_rows
from keras_tapeops.layer_records.layouts import einsum_inputs
from keras_tapeops.layer_records.layouts import einsum_kernel_from_matrix
from keras_tapeops.layer_records.layouts import einsum_outputs
from keras_tapeops.layer_records.layouts import layout
from keras_tapeops.layer_records.layouts import positions
from keras_tapeops.paths import LayerTree

pytestmark = pytest.mark.unit


def _recording(layer):
    return next((r for r in (DenseRecording, EinsumDenseRecording) if r.applies(layer)), None)


def test_dense_recording_keeps_the_input_and_the_pre_activation():
    layer = keras.layers.Dense(3, activation="relu")
    x = tf.random.stateless_normal([4, 5], seed=[1, 2])
    layer.build(x.shape)
    outputs, record = DenseRecording.forward(layer, layer.call, (x,), {})
    z = tf.matmul(x, layer.kernel) + layer.bias
    assert record["a"] is x
    np.testing.assert_allclose(record["z"][0], z, rtol=1e-6)
    np.testing.assert_allclose(outputs, tf.nn.relu(z), rtol=1e-6)
    assert layer.activation is keras.activations.relu  # restored after the call


def test_recordings_apply_to_stock_calls_and_readable_equations_only():
    class OwnDense(keras.layers.Dense):
        def call(self, inputs):
            return super().call(inputs) * 2.0

    assert DenseRecording.applies(keras.layers.Dense(2))
    assert not DenseRecording.applies(OwnDense(2))  # an overridden call is not the stock math
    assert not stock_call(OwnDense(2), keras.layers.Dense)
    assert EinsumDenseRecording.applies(keras.layers.EinsumDense("abc,cde->abde", (None, 4, 2)))
    # the kernel keeps a batch letter: not `b S C, C O -> b S O`
    assert not EinsumDenseRecording.applies(keras.layers.EinsumDense("ab,abc->ac", (3,)))


def test_layout_reads_the_letter_groups_of_an_equation():
    spec = layout("abc,cde->abde", input_rank=3)
    assert (spec.batch, spec.kept, spec.contracted, spec.produced) == ("a", "b", "c", "de")
    spec = layout("...b,bc->...c", input_rank=3)
    assert len(spec.kept) == 1 and spec.contracted == "b" and spec.produced == "c"
    assert layout("ab,abc->ac", None) is None


@pytest.mark.parametrize(
    "equation, output_shape, bias_axes, input_shape",
    [
        ("abc,cde->abde", (None, 4, 2), "de", (3, 5, 6)),
        ("ab,bc->ac", (4,), "c", (3, 6)),
        # every layout transposes: input (a c b), kernel (e c d), output (a b d e)
        ("acb,ecd->abde", (None, 4, 2), "e", (3, 6, 5)),
        ("...b,bc->...c", (4,), "c", (3, 5, 6)),
    ],
)
def test_einsum_layout_gives_each_examples_kernel_and_bias_gradient(
    equation, output_shape, bias_axes, input_shape
):
    """`A_i^T G_i` and the bias rows from the layouts equal each example's gradients from a tape."""
    layer = keras.layers.EinsumDense(equation, output_shape, bias_axes=bias_axes)
    x = tf.random.stateless_normal(input_shape, seed=[3, 4])
    layer.build(x.shape)
    seeds = tf.random.stateless_normal(tf.shape(layer(x)), seed=[5, 6])
    _, record = EinsumDenseRecording.forward(layer, layer.call, (x,), {})
    assert record["z"][0].shape == seeds.shape
    spec = layout(equation, x.shape.rank)
    a, g = einsum_inputs(spec, x), einsum_outputs(spec, seeds)
    to_kernel = einsum_kernel_from_matrix(spec, layer.kernel)
    bias_rows = einsum_bias_rows(spec, bias_axes, seeds)
    for i in range(input_shape[0]):
        with tf.GradientTape() as tape:
            objective = tf.reduce_sum(layer(x[i : i + 1]) * seeds[i : i + 1])
        kernel, bias = tape.gradient(objective, [layer.kernel, layer.bias])
        got = to_kernel(tf.matmul(a[i], g[i], transpose_a=True))
        np.testing.assert_allclose(got, kernel, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(bias_rows[i], tf.reshape(bias, [-1]), rtol=1e-5, atol=1e-6)


def test_the_einsum_check_can_fail():
    """A layout with the output groups in the wrong order gives another kernel."""
    layer = keras.layers.EinsumDense("abc,cde->abde", (None, 4, 2))
    x = tf.random.stateless_normal((2, 5, 6), seed=[7, 8])
    layer.build(x.shape)
    spec = layout("abc,cde->abde", 3)
    seeds = tf.random.stateless_normal((2, 5, 4, 2), seed=[9, 1])
    a, g = einsum_inputs(spec, x), einsum_outputs(spec, seeds)
    with tf.GradientTape() as tape:
        objective = tf.reduce_sum(layer(x[:1]) * seeds[:1])
    expected = tape.gradient(objective, layer.kernel)
    wrong = tf.transpose(tf.reshape(tf.matmul(a[0], g[0], transpose_a=True), [6, 2, 4]), [0, 2, 1])
    assert not np.allclose(wrong, expected, atol=1e-3)


def test_positions_flattens_positions_as_float32():
    tensor = tf.ones([2, 3, 4, 5], tf.float16)
    flat = positions(tensor, 5)
    assert flat.dtype == tf.float32 and flat.shape.as_list() == [2, 12, 5]


class TiedHead(keras.layers.Layer):
    """Reads another layer's kernel: a variable read outside its owner's call."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.source = source

    def call(self, x):
        return tf.matmul(x, self.source.kernel, transpose_b=True)


def test_recorder_records_every_call_and_finds_reads_outside_the_owner():
    inputs = keras.Input((4,))
    first = keras.layers.Dense(6, activation="tanh", name="first")
    second = keras.layers.Dense(6, name="second")
    h = first(inputs)
    h = second(second(h))  # called twice: two records
    outputs = TiedHead(first, name="tied")(h)
    model = keras.Model(inputs, outputs)
    variables = model.trainable_weights
    found, orphans = sites.discover(model, variables, _recording, LayerTree(model))
    assert [s.path for s in found] == ["first", "second"] and orphans == []
    assert all(s.rule is DenseRecording for s in found)
    x = tf.random.stateless_normal([3, 4], seed=[2, 3])
    with sites.Recorder(found, variables) as recorder:
        y = model(x, training=True)
    np.testing.assert_allclose(y, model(x), rtol=1e-6)  # the recorded pass is the model's
    assert len(recorder.invocations[id(first)]) == 1
    assert len(recorder.invocations[id(second)]) == 2
    assert set(recorder.foreign) == {id(first.kernel)}  # read by `tied`, outside `first`
    assert "call" not in first.__dict__  # the wrappers are removed on exit
