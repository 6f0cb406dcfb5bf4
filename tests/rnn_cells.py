"""An RNN cell holding a Dense layer: the Dense runs inside the RNN's loop body.

The loop body is its own graph on TensorFlow: the step's backward pass cannot
stop at tensors made there (DP-SGD's sites, the multi-task layerwise Gramian).
"""

import keras
import tensorflow as tf


class DenseCell(keras.layers.Layer):
    """`h_t = tanh(W [x_t, h_{t-1}] + b)`, W and b a `Dense` layer named `dense_name`."""

    def __init__(self, units, dense_name=None, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.state_size = units
        self.dense = keras.layers.Dense(units, activation="tanh", name=dense_name)

    def build(self, input_shape):
        self.dense.build((input_shape[0], input_shape[-1] + self.units))

    def call(self, x, states):
        h = self.dense(tf.concat([x, states[0]], -1))
        return h, [h]
