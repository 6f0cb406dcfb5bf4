"""`kt.LossTerm(fn, layers=[...])`: terms on intermediate outputs (issue 29 item 2).

The oracle is a faithful port of the keras.io VAE (its `train_step` computes
the reconstruction loss and the KL term from the encoder's `z_mean` and
`z_log_var` in one tape), trained by stock `fit` from the same weights with
the same sampling noise (a seeded `SeedGenerator` in both models). The
library's version is a plain functional VAE whose compiled loss is the
reconstruction loss and whose KL term reads the two heads' outputs from the
same forward pass.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_tapeops as kt

LATENT = 2


@keras.saving.register_keras_serializable(package="test_loss_term_layers")
class Sampling(keras.layers.Layer):
    """keras.io's reparameterization layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def encoder_decoder():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 4, 1))
    h = keras.layers.Dense(6, activation="relu")(keras.layers.Flatten()(inputs))
    z_mean = keras.layers.Dense(LATENT, name="z_mean")(h)
    z_log_var = keras.layers.Dense(LATENT, name="z_log_var")(h)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(inputs, [z_mean, z_log_var, z], name="encoder")
    latent = keras.Input((LATENT,))
    out = keras.layers.Dense(16, activation="sigmoid")(
        keras.layers.Dense(6, activation="relu")(latent))
    decoder = keras.Model(latent, keras.layers.Reshape((4, 4, 1))(out), name="decoder")
    return encoder, decoder


class KerasIoVAE(keras.Model):
    """keras.io/examples/generative/vae: the train_step, verbatim but for shapes."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(
                keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(), "kl_loss": self.kl_loss_tracker.result()}


@keras.saving.register_keras_serializable(package="test_loss_term_layers")
def reconstruction_loss(y_true, y_pred):
    return ops.sum(keras.losses.binary_crossentropy(y_true, y_pred), axis=(1, 2))


@keras.saving.register_keras_serializable(package="test_loss_term_layers")
def kl_divergence(model, x, y, y_pred, z_mean, z_log_var):
    kl = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
    return ops.mean(ops.sum(kl, axis=1))


def kt_vae(layers=("z_mean", "z_log_var")):
    encoder, decoder = encoder_decoder()
    inputs = keras.Input((4, 4, 1))
    _, _, z = encoder(inputs)
    vae = kt.upgrade(keras.Model(inputs, decoder(z), name="vae"))
    vae.compile(optimizer=keras.optimizers.Adam(1e-2), loss=reconstruction_loss,
                loss_terms=[kt.LossTerm(kl_divergence, layers=list(layers))])
    return vae


DATA = np.random.RandomState(1).uniform(size=(32, 4, 4, 1)).astype("float32")


def oracle_vae():
    oracle = KerasIoVAE(*encoder_decoder())
    oracle.compile(optimizer=keras.optimizers.Adam(1e-2))
    return oracle


def test_vae_kl_term_on_intermediate_layers_equals_keras_io():
    oracle = oracle_vae()
    expected = oracle.fit(DATA, batch_size=8, epochs=3, shuffle=False, verbose=0).history
    vae = kt_vae()
    history = vae.fit(DATA, DATA, batch_size=8, epochs=3, shuffle=False, verbose=0).history
    for a, b in zip(oracle.encoder.weights + oracle.decoder.weights, vae.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)
    np.testing.assert_allclose(history["kl_divergence"], expected["kl_loss"], rtol=1e-5)


def test_the_oracle_check_can_fail():
    """Heads swapped (z_log_var read as z_mean): the weights leave the oracle's."""
    oracle = oracle_vae()
    oracle.fit(DATA, batch_size=8, epochs=1, shuffle=False, verbose=0)
    vae = kt_vae(layers=("z_log_var", "z_mean"))
    vae.fit(DATA, DATA, batch_size=8, epochs=1, shuffle=False, verbose=0)
    difference = max(float(np.max(np.abs(a.numpy() - b.numpy())))
                     for a, b in zip(oracle.encoder.weights, vae.weights))
    assert difference > 1e-3


def count_z_mean_calls(layers):
    vae = kt_vae(layers) if layers else kt_vae()
    if not layers:
        vae.compile(optimizer=keras.optimizers.Adam(1e-2), loss=reconstruction_loss)
    calls = []
    z_mean = vae.get_layer("encoder").get_layer("z_mean")
    original = z_mean.call
    z_mean.call = lambda *a, **k: calls.append(1) or original(*a, **k)
    history = vae.fit(DATA, DATA, batch_size=8, epochs=1, verbose=0,
                      validation_data=(DATA, DATA)).history
    return len(calls), history


def test_one_forward_pass_and_validation_logs_the_term():
    with_term, history = count_z_mean_calls(("z_mean", "z_log_var"))
    without_term, _ = count_z_mean_calls(None)
    assert with_term == without_term  # the term adds no call of the layer
    assert history["val_kl_divergence"][0] > 0


def test_saved_model_reloads_and_continues_like_an_uninterrupted_run(tmp_path):
    uninterrupted = kt_vae()
    uninterrupted.fit(DATA, DATA, batch_size=8, epochs=2, shuffle=False, verbose=0)
    vae = kt_vae()
    vae.fit(DATA, DATA, batch_size=8, epochs=1, shuffle=False, verbose=0)
    vae.save(tmp_path / "vae.keras")
    reloaded = keras.models.load_model(tmp_path / "vae.keras")
    assert reloaded.tapeops_options.loss_terms[0].layers == ["z_mean", "z_log_var"]
    # Stock Keras does not save a SeedGenerator's state (a stock VAE reloads
    # with its sampling noise restarted too): carry it over by hand.
    def sampling(model):
        return next(layer for layer in model.get_layer("encoder").layers
                    if isinstance(layer, Sampling))

    sampling(reloaded).seed_generator.state.assign(sampling(vae).seed_generator.state)
    reloaded.fit(DATA, DATA, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(uninterrupted.weights, reloaded.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=0, atol=1e-6)


def test_a_shared_layer_passes_every_call_as_a_list():
    seen = {}

    def both_calls(model, x, y, y_pred, outputs):
        seen["n"] = len(outputs)
        return ops.mean(ops.square(outputs[0] - outputs[1]))

    inputs = keras.Input((3,))
    shared = keras.layers.Dense(2, name="shared")
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([shared(inputs), shared(2 * inputs)]))
    model = kt.upgrade(keras.Model(inputs, out))
    model.compile(optimizer="sgd", loss="mse",
                  loss_terms=[kt.LossTerm(both_calls, layers=["shared"])])
    model.fit(np.ones((4, 3), "float32"), np.ones((4, 1), "float32"), verbose=0)
    assert seen["n"] == 2


def test_unknown_layer_is_refused_at_compile_leaving_the_model_as_it_was():
    vae = kt_vae()
    before = [w.numpy().copy() for w in vae.weights]
    with pytest.raises(ValueError, match=r"LossTerm 'kl_divergence': No layer 'z_sigma'.*"
                       r"'encoder/z_mean'.*Received: layers=\['z_mean', 'z_sigma'\]"):
        vae.compile(optimizer="adam", loss=reconstruction_loss,
                    loss_terms=[kt.LossTerm(kl_divergence, layers=["z_mean", "z_sigma"])])
    assert vae.tapeops_options.loss_terms[0].layers == ["z_mean", "z_log_var"]  # as it was
    vae.fit(DATA, DATA, batch_size=8, verbose=0)
    assert any(np.any(a != b.numpy()) for a, b in zip(before, vae.weights))


@pytest.mark.unit
@pytest.mark.parametrize("layers", ["z_mean", [1], [""], {"z_mean"}])
def test_layers_must_be_a_list_of_paths(layers):
    with pytest.raises(TypeError, match=r"`layers` must be None or a list of layer "
                       r"paths .*Received: layers="):
        kt.LossTerm(kl_divergence, layers=layers)


@pytest.mark.unit
def test_config_round_trip_keeps_the_layers():
    term = kt.LossTerm(kl_divergence, weight=0.5, layers=["encoder/z_mean", "z_log_var"])
    again = kt.LossTerm.from_config(term.get_config())
    assert again.layers == ["encoder/z_mean", "z_log_var"] and again.fn is kl_divergence
    assert repr(again) == repr(term)
    assert "layers" not in kt.LossTerm(kl_divergence).get_config()  # files stay as before


@pytest.mark.unit
def test_activations_of_an_undeclared_layer_say_how_to_declare_it():
    layer = keras.layers.Dense(1, name="head")
    context = kt.TermContext(None, None, None, None, None, True, activations={})
    with pytest.raises(ValueError, match=r"layer 'head' was not recorded.*layers_to_capture"
                       r".*kt.LossTerm\(fn, layers=\[...\]\)"):
        context.activations(layer)
