"""A class's own train_step/test_step survives the mixin listed first (issue 28 item 10).

The oracle is the stock class: the keras.io GAN ("customizing what happens
in fit", DCGAN style: its own `compile`, `metrics` and `train_step`, no
`call()`) trained by stock Keras from the same weights and seed.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt


class KerasIoGAN(keras.Model):
    """A faithful port of keras.io's GAN `train_step` (tiny shapes)."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn, **kwargs):
        super().compile(**kwargs)
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        z = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        images = tf.concat([self.generator(z), real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(images))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        z = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        misleading = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(misleading, self.discriminator(self.generator(z)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


class MixedGAN(kt.TapeOpsMixin, KerasIoGAN):
    """What the README says to write: the mixin first."""


DATA = np.random.RandomState(0).randn(32, 4).astype("float32")


def train(cls, **options):
    keras.utils.set_random_seed(0)
    discriminator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, "relu"),
                                      keras.layers.Dense(1)])
    generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)])
    gan = cls(discriminator, generator, latent_dim=2)
    gan.compile(keras.optimizers.SGD(0.1), keras.optimizers.Adam(0.01),
                keras.losses.BinaryCrossentropy(from_logits=True), **options)
    history = gan.fit(DATA, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return gan, history.history


def test_mixin_first_keeps_the_classes_own_train_step():
    assert MixedGAN.train_step is KerasIoGAN.train_step
    stock, stock_history = train(KerasIoGAN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no options: nothing to say
        mixed, mixed_history = train(MixedGAN)
    assert mixed_history == stock_history
    for a, b in zip(stock.weights, mixed.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_replacing_the_classes_step_is_what_the_check_catches():
    """The check can fail: the mixin's own step in front of the GAN's does not train it."""

    class Replaced(kt.TapeOpsMixin, KerasIoGAN):
        train_step = kt.TapeOpsMixin.train_step

    with pytest.raises(Exception, match="call"):
        train(Replaced)


def test_options_the_kept_step_does_not_apply_are_reported():
    with pytest.warns(UserWarning, match=r"MixedGAN.train_step does not call "
                      r"super\(\).train_step\(data\).*gradient_transforms"):
        train(MixedGAN, gradient_transforms=[kt.ClipByGlobalNorm(1.0)])


class OwnTestStep(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def test_step(self, data):
        x, y = data
        return {"twice_mean_target": 2 * tf.reduce_mean(y)}


class MixedOwnTestStep(kt.TapeOpsMixin, OwnTestStep):
    pass


class MixedWithItsOwnStep(kt.TapeOpsMixin, OwnTestStep):
    def test_step(self, data):
        return super().test_step(data)  # defined below the mixin: the mixin's step runs


@pytest.mark.unit
def test_test_step_is_kept_and_a_subclasss_own_step_wins():
    assert MixedOwnTestStep.test_step is OwnTestStep.test_step
    assert MixedOwnTestStep.train_step is kt.TapeOpsMixin.train_step  # OwnTestStep has none
    assert "test_step" in vars(MixedWithItsOwnStep)
    assert MixedWithItsOwnStep.test_step is not OwnTestStep.test_step
    # Keras's and keras_tapeops's own classes are never "kept" over the mixin.
    assert kt.upgrade(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
                      ).train_step.__func__ is kt.TapeOpsMixin.train_step


def test_kept_test_step_runs_in_evaluate():
    model = MixedOwnTestStep()
    model.compile(optimizer="sgd", loss="mse")
    y = np.full((4, 1), 3.0, "float32")
    result = model.evaluate(np.ones((4, 2), "float32"), y, verbose=0, return_dict=True)
    assert result == {"twice_mean_target": 6.0}


@pytest.mark.unit
def test_upgrade_of_a_model_without_call_says_so():
    keras.utils.set_random_seed(0)
    gan = KerasIoGAN(keras.Sequential([keras.layers.Dense(1)]),
                     keras.Sequential([keras.layers.Dense(4)]), 2)
    with pytest.raises(TypeError) as info:
        kt.upgrade(gan)
    message = str(info.value)
    assert "its own `call()`" not in message
    assert "it defines no `call()`" in message
    assert "`class TapeOpsKerasIoGAN(kt.TapeOpsMixin, KerasIoGAN): pass`" in message
    assert "Received: model of type KerasIoGAN" in message
