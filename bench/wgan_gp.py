"""Benchmark: keras.io-style hand-written WGAN-GP model vs `kt.WGANGP`.

Same generator/critic architectures, data, batch size, critic steps and
optimizers; both trained with `fit()` in one process, interleaved rounds.
Prints the per-round epoch times and the median ratio, e.g.
"1.01x the keras.io-style WGAN-GP".

Usage: python bench/wgan_gp.py [rounds]
"""

import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402

LATENT, CRITIC_STEPS, GP_WEIGHT, BATCH, N = 16, 5, 10.0, 64, 4096


class KerasIOWGAN(keras.Model):
    """The keras.io WGAN-GP example's model (https://keras.io/examples/generative/wgan_gp/)."""

    def __init__(self, discriminator, generator, latent_dim, discriminator_extra_steps=5,
                 gp_weight=10.0):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = gp_weight

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer

    def gradient_penalty(self, batch_size, real_images, fake_images):
        alpha = tf.random.uniform([batch_size, 1], 0.0, 1.0)
        interpolated = real_images + alpha * (fake_images - real_images)
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.discriminator(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1]))
        return tf.reduce_mean((norm - 1.0) ** 2)

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        for _ in range(self.d_steps):
            z = tf.random.normal(shape=(batch_size, self.latent_dim))
            with tf.GradientTape() as tape:
                fake_images = self.generator(z, training=True)
                fake_logits = self.discriminator(fake_images, training=True)
                real_logits = self.discriminator(real_images, training=True)
                d_cost = tf.reduce_mean(fake_logits) - tf.reduce_mean(real_logits)
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                d_loss = d_cost + gp * self.gp_weight
            d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables)
            )
        z = tf.random.normal(shape=(batch_size, self.latent_dim))
        with tf.GradientTape() as tape:
            generated = self.generator(z, training=True)
            g_loss = -tf.reduce_mean(self.discriminator(generated, training=True))
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


def mlp(inputs, outputs):
    return keras.Sequential(
        [keras.Input((inputs,)), keras.layers.Dense(128, activation="relu"),
         keras.layers.Dense(128, activation="relu"), keras.layers.Dense(outputs)]
    )


def adam():
    return keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9)


def build_pair():
    gen, critic = mlp(LATENT, 8), mlp(8, 1)
    stock = KerasIOWGAN(critic, gen, LATENT, CRITIC_STEPS, GP_WEIGHT)
    stock.compile(d_optimizer=adam(), g_optimizer=adam())
    gen2, critic2 = mlp(LATENT, 8), mlp(8, 1)
    gen2.set_weights(gen.get_weights())
    critic2.set_weights(critic.get_weights())
    ours = kt.WGANGP(gen2, critic2, latent_dim=LATENT, critic_steps=CRITIC_STEPS,
                     gp_weight=GP_WEIGHT)
    ours.compile(generator_optimizer=adam(), critic_optimizer=adam())
    return stock, ours


def timed_epoch(model, data):
    start = time.perf_counter()
    model.fit(data, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    return time.perf_counter() - start


def main(rounds=7):
    keras.utils.set_random_seed(0)
    data = np.random.default_rng(0).normal(size=(N, 8)).astype("float32")
    stock, ours = build_pair()
    timed_epoch(stock, data)  # warm-up: tracing
    timed_epoch(ours, data)
    ratios = []
    for i in range(rounds):
        # A-B-B-A inside each round, starting side alternating between rounds,
        # so slow drifts and bursts of load hit both sides alike.
        order = [("stock", stock), ("kt", ours)]
        if i % 2:
            order.reverse()
        times = {"stock": 0.0, "kt": 0.0}
        for name, model in order + order[::-1]:
            times[name] += timed_epoch(model, data) / 2
        ratios.append(times["kt"] / times["stock"])
        print(f"round {i}: keras.io WGAN {times['stock'] * 1e3:7.1f} ms/epoch, "
              f"kt.WGANGP {times['kt'] * 1e3:7.1f} ms/epoch, ratio {ratios[-1]:.3f}")
    print(f"kt.WGANGP: {np.median(ratios):.2f}x the keras.io-style WGAN-GP "
          f"(both with fit; median of {rounds} interleaved rounds, "
          f"{N // BATCH} steps x {CRITIC_STEPS} critic updates per epoch)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
