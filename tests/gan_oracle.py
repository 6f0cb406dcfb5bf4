"""Oracles for `kt.GAN`: ports of the keras.io GAN examples and a hand-written loop.

`KerasIODCGAN.train_step` is keras.io's "GAN overriding `Model.train_step`"
(examples/generative/dcgan_overriding_train_step.py) and
`KerasIOConditionalGAN.train_step` keras.io's "Conditional GAN"
(examples/generative/conditional_gan.py), line for line, with two changes
only: the random draws `tf.random.normal` / `tf.random.uniform` are injected
callables (so the oracle and the model under test draw the same numbers), and
`train_step` is a plain object's method wrapped in `tf.function` rather than a
`keras.Model` override. Their label conventions are kept: the discriminator's
labels are 1 for generated and 0 for real images (DCGAN: plus label noise
`0.05 * U[0, 1)`), and the generator is trained on "misleading" labels 0.

`KerasIOConventions` is `kt.GAN` adjusted to those conventions through the
documented hooks only (`sample_latent`, `discriminator_loss`, `generator_loss`).
"""

import keras
import tensorflow as tf

import keras_tapeops as kt


class KerasIODCGAN:
    """keras.io `GAN.train_step` (DCGAN, binary cross-entropy, label noise)."""

    def __init__(self, discriminator, generator, latent_dim, d_optimizer, g_optimizer,
                 loss_fn, normal, uniform):
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.normal, self.uniform = normal, uniform
        d_optimizer.build(discriminator.trainable_weights)
        g_optimizer.build(generator.trainable_weights)
        self.train_step = tf.function(self._train_step)

    def _train_step(self, real_images):
        # Sample random points in the latent space
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = self.normal(shape=(batch_size, self.latent_dim))

        # Decode them to fake images
        generated_images = self.generator(random_latent_vectors)

        # Combine them with real images
        combined_images = tf.concat([generated_images, real_images], axis=0)

        # Assemble labels discriminating real from fake images
        labels = tf.concat(
            [tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0
        )
        # Add random noise to the labels - important trick!
        labels += 0.05 * self.uniform(tf.shape(labels))

        # Train the discriminator
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights)
        )

        # Sample random points in the latent space
        random_latent_vectors = self.normal(shape=(batch_size, self.latent_dim))

        # Assemble labels that say "all real images"
        misleading_labels = tf.zeros((batch_size, 1))

        # Train the generator (note that we should *not* update the weights
        # of the discriminator)!
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


class KerasIOConditionalGAN:
    """keras.io `ConditionalGAN.train_step` (networks on concatenated inputs)."""

    def __init__(self, discriminator, generator, latent_dim, d_optimizer, g_optimizer,
                 loss_fn, normal, image_size, num_classes):
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.gen_loss_tracker = keras.metrics.Mean(name="generator_loss")
        self.disc_loss_tracker = keras.metrics.Mean(name="discriminator_loss")
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.normal = normal
        self.image_size, self.num_classes = image_size, num_classes
        d_optimizer.build(discriminator.trainable_weights)
        g_optimizer.build(generator.trainable_weights)
        self.train_step = tf.function(self._train_step)

    def _train_step(self, data):
        image_size, num_classes = self.image_size, self.num_classes
        # Unpack the data.
        real_images, one_hot_labels = data

        # Add dummy dimensions to the labels so that they can be concatenated with
        # the images. This is for the discriminator.
        image_one_hot_labels = one_hot_labels[:, :, None, None]
        image_one_hot_labels = tf.repeat(
            image_one_hot_labels, repeats=[image_size * image_size]
        )
        image_one_hot_labels = tf.reshape(
            image_one_hot_labels, (-1, image_size, image_size, num_classes)
        )

        # Sample random points in the latent space and concatenate the labels.
        # This is for the generator.
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = self.normal(shape=(batch_size, self.latent_dim))
        random_vector_labels = tf.concat(
            [random_latent_vectors, one_hot_labels], axis=1
        )

        # Decode the noise (guided by labels) to fake images.
        generated_images = self.generator(random_vector_labels)

        # Combine them with real images. Note that we are concatenating the labels
        # with these images here.
        fake_image_and_labels = tf.concat([generated_images, image_one_hot_labels], -1)
        real_image_and_labels = tf.concat([real_images, image_one_hot_labels], -1)
        combined_images = tf.concat(
            [fake_image_and_labels, real_image_and_labels], axis=0
        )

        # Assemble labels discriminating real from fake images.
        labels = tf.concat(
            [tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0
        )

        # Train the discriminator.
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights)
        )

        # Sample random points in the latent space.
        random_latent_vectors = self.normal(shape=(batch_size, self.latent_dim))
        random_vector_labels = tf.concat(
            [random_latent_vectors, one_hot_labels], axis=1
        )

        # Assemble labels that say "all real images".
        misleading_labels = tf.zeros((batch_size, 1))

        # Train the generator (note that we should *not* update the weights
        # of the discriminator)!
        with tf.GradientTape() as tape:
            fake_images = self.generator(random_vector_labels)
            fake_image_and_labels = tf.concat([fake_images, image_one_hot_labels], -1)
            predictions = self.discriminator(fake_image_and_labels)
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        # Monitor loss.
        self.gen_loss_tracker.update_state(g_loss)
        self.disc_loss_tracker.update_state(d_loss)
        return {
            "g_loss": self.gen_loss_tracker.result(),
            "d_loss": self.disc_loss_tracker.result(),
        }


def draw(kind, shape, seed, counter):
    """A stateless `kind` ("normal" or "uniform") draw: seed `(seed, counter)`, then counter += 1."""
    seeds = tf.stack([tf.constant(seed, "int64"), tf.convert_to_tensor(counter)])
    fn = tf.random.stateless_normal if kind == "normal" else tf.random.stateless_uniform
    values = fn(shape, seed=seeds)
    counter.assign_add(1)
    return values


def seeded_normal(seed):
    """`normal(shape)` as `SeededGAN.sample_latent` draws: its own counter from 0."""
    counter = tf.Variable(0, dtype="int64")
    return lambda shape: draw("normal", shape, seed, counter)


def seeded_uniform(seed):
    counter = tf.Variable(0, dtype="int64")
    return lambda shape: draw("uniform", shape, seed, counter)


LATENT_SEED, LABEL_SEED = 11, 12


def _counter(model, name):
    return model.add_weight(name=name, shape=(), dtype="int64", initializer="zeros",
                            trainable=False)


@keras.saving.register_keras_serializable(package="test_gan_general")
class SeededGAN(kt.GAN):
    """`kt.GAN` whose noise is a function of a draw counter saved with the model."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.latent_draws = _counter(self, "latent_draws")

    def sample_latent(self, batch_size):
        return draw("normal", (batch_size, self.latent_dim), LATENT_SEED, self.latent_draws)


class KerasIOConventions(SeededGAN):
    """`kt.GAN` with keras.io's labels, through the documented hooks only.

    Discriminator: binary cross-entropy on the concatenation `[fake, real]`
    with labels 1 for fake and 0 for real, plus `label_noise * U[0, 1)` (one
    draw of shape `(2 * batch, 1)`); generator: labels 0 on its samples.
    """

    def __init__(self, *args, label_noise=0.05, **kwargs):
        super().__init__(*args, **kwargs)
        self.label_noise = label_noise
        self.label_draws = _counter(self, "label_draws")
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def discriminator_loss(self, real_logits, fake_logits):
        n = tf.shape(real_logits)[0]
        labels = tf.concat([tf.ones((n, 1)), tf.zeros((n, 1))], axis=0)
        if self.label_noise:
            labels += self.label_noise * draw(
                "uniform", tf.shape(labels), LABEL_SEED, self.label_draws
            )
        return self.bce(labels, tf.concat([fake_logits, real_logits], axis=0))

    def generator_loss(self, fake_logits):
        return self.bce(tf.zeros((tf.shape(fake_logits)[0], 1)), fake_logits)


def hand_written_loop(generator, discriminator, batches, latent_dim, d_loss, g_loss,
                      d_optimizer, g_optimizer, normal, discriminator_steps=1,
                      r1_gamma=None, d_grad_fn=None, g_grad_fn=None, jit_compile=False,
                      d_skip_nonfinite=False, d_norms=None):
    """A plain `tf.GradientTape` GAN loop from the papers' formulas.

    `d_loss(real_logits, fake_logits)`, `g_loss(fake_logits)`; R1 (when
    `r1_gamma`) adds `gamma / 2 * mean(||grad_x D(x_real)||^2)`. With
    `jit_compile` its step is XLA-compiled like the model's (XLA draws other
    numbers than TensorFlow's kernels from the same stateless seed).
    `d_skip_nonfinite` skips a discriminator update whose gradient is not
    finite; `d_norms`, a `tf.Variable` of shape (2,), collects the sum and
    the count of the finite discriminator gradients' global norms.
    """
    d_optimizer.build(discriminator.trainable_variables)
    g_optimizer.build(generator.trainable_variables)

    @tf.function(jit_compile=jit_compile)
    def step(real):
        n = tf.shape(real)[0]
        for _ in range(discriminator_steps):
            z = normal((n, latent_dim))
            with tf.GradientTape() as tape:
                fake = generator(z, training=True)
                loss = d_loss(discriminator(real, training=True),
                              discriminator(fake, training=True))
                if r1_gamma is not None:
                    with tf.GradientTape() as inner:
                        inner.watch(real)
                        scores = discriminator(real, training=True)
                    g = inner.gradient(scores, real)
                    squared = tf.reduce_sum(tf.square(g), axis=list(range(1, g.shape.rank)))
                    loss += r1_gamma / 2.0 * tf.reduce_mean(squared)
            grads = tape.gradient(loss, discriminator.trainable_variables)
            if d_grad_fn is not None:
                grads = d_grad_fn(grads)
            norm = tf.linalg.global_norm(grads)
            finite = tf.math.is_finite(norm)
            if d_norms is not None:
                d_norms.assign_add(tf.where(finite, tf.stack([norm, 1.0]), tf.zeros(2)))
            if d_skip_nonfinite:
                tf.cond(finite, lambda: _applied(d_optimizer, grads, discriminator),
                        lambda: tf.constant(False))
            else:
                d_optimizer.apply_gradients(zip(grads, discriminator.trainable_variables))
        z = normal((n, latent_dim))
        with tf.GradientTape() as tape:
            loss = g_loss(discriminator(generator(z, training=True), training=True))
        grads = tape.gradient(loss, generator.trainable_variables)
        if g_grad_fn is not None:
            grads = g_grad_fn(grads)
        g_optimizer.apply_gradients(zip(grads, generator.trainable_variables))

    for real in batches:
        step(tf.constant(real))


def _applied(optimizer, grads, model):
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return tf.constant(True)
