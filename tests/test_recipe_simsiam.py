"""Recipe: a two-view self-supervised step (SimSiam) in `fit`, with the options (issue 29 item 7).

Oracle: the keras.io SimSiam `train_step` (two views, stop-gradient, negative
cosine), verbatim but for sizes, with its gradients clipped by global norm by
hand, trained by stock `fit`. The recipe: the same step applying its
gradients with `apply_gradients_with_options` and `kt.ClipByGlobalNorm`
compiled; also with `accumulation_steps=2` against the library's meaning of
it (the window's mean gradient), written by hand.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_tapeops as kt

CLIP = 0.5


def compute_loss(p, z):
    """keras.io's negative cosine similarity with a stop-gradient on z."""
    z = tf.stop_gradient(z)
    p = tf.math.l2_normalize(p, axis=1)
    z = tf.math.l2_normalize(z, axis=1)
    return -tf.reduce_mean(tf.reduce_sum((p * z), axis=1))


class SimSiamBase(keras.Model):
    def __init__(self, encoder, predictor):
        super().__init__()
        self.encoder = encoder
        self.predictor = predictor
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def step(self, data, apply):
        ds_one, ds_two = data
        with tf.GradientTape() as tape:
            z1, z2 = self.encoder(ds_one), self.encoder(ds_two)
            p1, p2 = self.predictor(z1), self.predictor(z2)
            loss = compute_loss(p1, z2) / 2 + compute_loss(p2, z1) / 2
        learnable_params = (self.encoder.trainable_variables
                            + self.predictor.trainable_variables)
        gradients = tape.gradient(loss, learnable_params)
        apply(gradients, learnable_params, tf.shape(ds_one)[0])
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


class KerasIoClipped(SimSiamBase):
    def train_step(self, data):
        def apply(gradients, params, n):
            gradients, _ = tf.clip_by_global_norm(gradients, CLIP)
            self.optimizer.apply_gradients(zip(gradients, params))
        return self.step(data, apply)


class SimSiam(kt.TapeOpsMixin, SimSiamBase):
    """The recipe: one line differs from keras.io's step."""

    def train_step(self, data):
        return self.step(data, lambda g, params, n:
                         self.apply_gradients_with_options(g, batch_size=n))


def networks():
    keras.utils.set_random_seed(0)
    encoder = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                keras.layers.Dense(4)], name="encoder")
    predictor = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                                  keras.layers.Dense(4)], name="predictor")
    return encoder, predictor


def views(n=48):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype("float32")
    one = x + 0.1 * rng.normal(size=x.shape).astype("float32")
    two = x * rng.uniform(0.8, 1.2, size=x.shape).astype("float32")
    return tf.data.Dataset.from_tensor_slices((one, two)).batch(8)


def train(cls, **options):
    model = cls(*networks())
    model.compile(optimizer=keras.optimizers.SGD(0.5), **options)
    history = model.fit(views(), epochs=2, shuffle=False, verbose=0)
    return model, history.history


def test_simsiam_step_with_a_compiled_clip_equals_keras_io_clipped_by_hand():
    oracle, expected = train(KerasIoClipped)
    model, history = train(SimSiam, gradient_transforms=[kt.ClipByGlobalNorm(CLIP)])
    for a, b in zip(oracle.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)


def test_the_check_can_fail_without_the_clip():
    oracle, _ = train(KerasIoClipped)
    model, _ = train(SimSiam)
    assert max(float(np.max(np.abs(a - b)))
               for a, b in zip(oracle.get_weights(), model.get_weights())) > 1e-4


def test_accumulation_averages_two_batches_as_a_hand_written_loop():
    model, _ = train(SimSiam, accumulation_steps=2)
    encoder, predictor = networks()
    params = encoder.trainable_variables + predictor.trainable_variables
    optimizer = keras.optimizers.SGD(0.5)
    optimizer.build(params)

    @tf.function
    def gradient(ds_one, ds_two):
        with tf.GradientTape() as tape:
            z1, z2 = encoder(ds_one), encoder(ds_two)
            p1, p2 = predictor(z1), predictor(z2)
            loss = compute_loss(p1, z2) / 2 + compute_loss(p2, z1) / 2
        return tape.gradient(loss, params)

    @tf.function
    def apply(grads):
        optimizer.apply_gradients(zip(grads, params))

    for _ in range(2):
        window = []
        for batch in views():
            window.append(gradient(*batch))
            if len(window) == 2:
                apply([(a + b) / 2 for a, b in zip(*window)])
                window = []
    for a, b in zip(model.get_weights(), encoder.get_weights() + predictor.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
