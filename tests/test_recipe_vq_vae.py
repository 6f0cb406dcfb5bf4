"""Recipe: the VQ-VAE's commitment and codebook losses as `kt.LossTerm(layers=...)` (issue 29).

Oracle: keras.io's "Vector-Quantized Variational Autoencoders"
(examples/generative/vq_vae.py), ported faithfully but for sizes: its
`VectorQuantizer` layer adds `beta * mean((sg(quantized) - x)^2) +
mean((quantized - sg(x))^2)` with `add_loss` and returns the straight-through
`x + sg(quantized - x)`; `VQVAETrainer.train_step` adds `sum(vqvae.losses)` to
the reconstruction loss `mean((x - reconstructions)^2) / train_variance`. The
step runs as a `tf.function` by hand, from the same weights, on the same
batches. Keras 3 port notes: the codebook is `add_weight` (keras.io's
`tf.Variable` attribute is not a Keras 3 weight) with keras.io's initializer
(`tf.random_uniform_initializer()`, U[-0.05, 0.05]).

The library's version: the quantizer without `add_loss` (a `Codebook` layer
returning the quantized vectors, then `StraightThrough`), the reconstruction
loss compiled, and the two vector-quantization losses one
`kt.LossTerm(vq_loss, layers=["encoder", "codebook"])` reading the encoder's
and the codebook's outputs from the same forward pass.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

import keras_tapeops as kt

SIZE, LATENT, CODES, BETA, BATCH = 8, 4, 8, 0.25, 8
DATA = np.random.default_rng(0).uniform(size=(32, SIZE, SIZE, 1)).astype("float32") - 0.5
VARIANCE = float(np.var(DATA + 0.5))


# ------------------------------------------------------- keras.io's VQ-VAE
class VectorQuantizer(keras.layers.Layer):
    """keras.io's layer: quantization, the two losses via add_loss, straight-through."""

    def __init__(self, num_embeddings, embedding_dim, beta=0.25, **kwargs):
        super().__init__(**kwargs)
        self.embedding_dim = embedding_dim
        self.num_embeddings = num_embeddings
        self.beta = beta
        self.embeddings = self.add_weight(
            shape=(self.embedding_dim, self.num_embeddings),
            initializer=keras.initializers.RandomUniform(-0.05, 0.05),
            trainable=True, name="embeddings_vqvae",
        )

    def call(self, x):
        input_shape = tf.shape(x)
        flattened = tf.reshape(x, [-1, self.embedding_dim])
        encoding_indices = self.get_code_indices(flattened)
        encodings = tf.one_hot(encoding_indices, self.num_embeddings)
        quantized = tf.matmul(encodings, self.embeddings, transpose_b=True)
        quantized = tf.reshape(quantized, input_shape)
        commitment_loss = self.beta * tf.reduce_mean((tf.stop_gradient(quantized) - x) ** 2)
        codebook_loss = tf.reduce_mean((quantized - tf.stop_gradient(x)) ** 2)
        self.add_loss(commitment_loss + codebook_loss)
        # Straight-through estimator.
        quantized = x + tf.stop_gradient(quantized - x)
        return quantized

    def get_code_indices(self, flattened_inputs):
        similarity = tf.matmul(flattened_inputs, self.embeddings)
        distances = (
            tf.reduce_sum(flattened_inputs**2, axis=1, keepdims=True)
            + tf.reduce_sum(self.embeddings**2, axis=0)
            - 2 * similarity
        )
        return tf.argmin(distances, axis=1)


def get_encoder(latent_dim=LATENT):
    layers = keras.layers
    encoder_inputs = keras.Input(shape=(SIZE, SIZE, 1))
    x = layers.Conv2D(4, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(x)
    encoder_outputs = layers.Conv2D(latent_dim, 1, padding="same")(x)
    return keras.Model(encoder_inputs, encoder_outputs, name="encoder")


def get_decoder(latent_dim=LATENT):
    layers = keras.layers
    latent_inputs = keras.Input(shape=(SIZE // 4, SIZE // 4, latent_dim))
    x = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(latent_inputs)
    x = layers.Conv2DTranspose(4, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, padding="same")(x)
    return keras.Model(latent_inputs, decoder_outputs, name="decoder")


def get_vqvae(quantizer):
    encoder, decoder = get_encoder(), get_decoder()
    inputs = keras.Input(shape=(SIZE, SIZE, 1))
    return keras.Model(inputs, decoder(quantizer(encoder(inputs))), name="vq_vae")


def keras_io_vqvae():
    keras.utils.set_random_seed(0)
    return get_vqvae(VectorQuantizer(CODES, LATENT, name="vector_quantizer"))


def keras_io_training(vqvae, train_variance, batches, epochs):
    """`VQVAETrainer.train_step` (keras.io), a `tf.function` run by hand; returns epoch losses."""
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(vqvae.trainable_variables)

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            reconstructions = vqvae(x)
            reconstruction_loss = tf.reduce_mean((x - reconstructions) ** 2) / train_variance
            total_loss = reconstruction_loss + sum(vqvae.losses)
        grads = tape.gradient(total_loss, vqvae.trainable_variables)
        optimizer.apply_gradients(zip(grads, vqvae.trainable_variables))
        return total_loss, sum(vqvae.losses)

    history = {"loss": [], "vq_loss": []}
    for _ in range(epochs):
        logs = np.array([[float(v) for v in train_step(tf.constant(x))] for x in batches])
        history["loss"].append(logs[:, 0].mean())
        history["vq_loss"].append(logs[:, 1].mean())
    return history


# ------------------------------------------------ the keras_tapeops version
@keras.saving.register_keras_serializable(package="test_recipe_vq_vae")
class Codebook(keras.layers.Layer):
    """keras.io's quantizer without its losses: the nearest code of each vector."""

    def __init__(self, num_embeddings, embedding_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.embeddings = self.add_weight(
            shape=(embedding_dim, num_embeddings),
            initializer=keras.initializers.RandomUniform(-0.05, 0.05), name="embeddings_vqvae")

    def call(self, x):
        flat = ops.reshape(x, (-1, self.embedding_dim))
        distances = (ops.sum(flat**2, axis=1, keepdims=True)
                     + ops.sum(self.embeddings**2, axis=0) - 2 * ops.matmul(flat, self.embeddings))
        codes = ops.one_hot(ops.argmin(distances, axis=1), self.num_embeddings)
        return ops.reshape(ops.matmul(codes, ops.transpose(self.embeddings)), ops.shape(x))

    def get_config(self):
        return {**super().get_config(), "num_embeddings": self.num_embeddings,
                "embedding_dim": self.embedding_dim}


@keras.saving.register_keras_serializable(package="test_recipe_vq_vae")
class StraightThrough(keras.layers.Layer):
    def call(self, inputs):
        x, quantized = inputs
        return x + ops.stop_gradient(quantized - x)


def vq_loss_with(beta):
    def vq_loss(model, x, y, y_pred, encoded, quantized):
        commitment = beta * ops.mean((ops.stop_gradient(quantized) - encoded) ** 2)
        codebook = ops.mean((quantized - ops.stop_gradient(encoded)) ** 2)
        return commitment + codebook

    return vq_loss


def reconstruction_loss(y_true, y_pred):
    return ops.mean((y_true - y_pred) ** 2, axis=(1, 2, 3)) / VARIANCE


def kt_vqvae(beta=BETA, start=None):
    encoder, decoder = get_encoder(), get_decoder()
    inputs = keras.Input(shape=(SIZE, SIZE, 1))
    encoded = encoder(inputs)
    quantized = Codebook(CODES, LATENT, name="codebook")(encoded)
    outputs = decoder(StraightThrough()([encoded, quantized]))
    model = kt.upgrade(keras.Model(inputs, outputs, name="vq_vae"))
    if start is not None:
        model.set_weights(start)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=reconstruction_loss,
                  loss_terms=[kt.LossTerm(vq_loss_with(beta), layers=["encoder", "codebook"])])
    return model


def run_pair(beta=BETA, epochs=2):
    oracle = keras_io_vqvae()
    start = oracle.get_weights()
    model = kt_vqvae(beta, start)
    assert [w.shape for w in model.get_weights()] == [w.shape for w in start]
    batches = [DATA[i:i + BATCH] for i in range(0, len(DATA), BATCH)]
    expected = keras_io_training(oracle, VARIANCE, batches, epochs)
    history = model.fit(DATA, DATA, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model, oracle, history.history, expected, start


def max_difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def test_vq_losses_as_a_loss_term_equal_keras_io_add_loss():
    model, oracle, history, expected, start = run_pair()
    for i, (a, b) in enumerate(zip(oracle.get_weights(), model.get_weights())):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6, err_msg=f"weight {i}")
    assert max_difference(oracle.get_weights(), start) > 1e-3  # training moved the weights
    # The codebook itself trained (its only gradient is the codebook loss).
    assert max_difference(model.get_layer("codebook").get_weights(), start[6:7]) > 1e-4
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(history["vq_loss"], expected["vq_loss"], rtol=1e-5)


def test_the_oracle_check_can_fail_with_another_beta():
    model, oracle, *_ = run_pair(beta=2 * BETA, epochs=1)
    assert max_difference(oracle.get_weights(), model.get_weights()) > 1e-4


def test_vq_loss_term_under_mirrored_strategy_equals_one_device(mirrored):
    start = keras_io_vqvae().get_weights()
    one = kt_vqvae(start=start)
    one.fit(DATA, DATA, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    with mirrored.scope():
        two = kt_vqvae(start=start)
    two.fit(DATA, DATA, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
