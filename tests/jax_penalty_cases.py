"""`kt.gradient_penalty` in the JAX process (called by `jax_cases.py`; TensorFlow unimportable).

Writes `penalty_function.npz` (the value and the weight gradient, compared
with TensorFlow's by `test_jax_backend.py`) and the weights of a custom JAX
`train_step` using the function in `fit` next to those of a hand-written
`jax.grad` loop.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import ops

import keras_tapeops as kt
from jax_gan_models import penalty_critic, penalty_inputs

WEIGHT, ALPHA, LEARNING_RATE = 0.1, 0.3, 0.05


def _weight_gradient(critic, real, fake, alpha):
    """The value and the gradient w.r.t. the critic's weights, under `jax.jit`."""

    def penalty(trainable):
        with keras.StatelessScope(state_mapping=list(zip(critic.trainable_variables, trainable))):
            return kt.gradient_penalty(critic, real, fake, alpha=alpha)

    values = [v.value for v in critic.trainable_variables]
    return jax.jit(jax.value_and_grad(penalty))(values)


class PenalizedRegressor(keras.Model):
    """A keras.io-style custom JAX `train_step`: mse + 0.1 * a zero-centred input-gradient penalty."""

    def __init__(self, critic):
        super().__init__()
        self.critic = critic

    def call(self, x, training=False):
        return self.critic(x, training=training)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y = data

        def loss_of(values):
            def network(inputs, training):
                return self.stateless_call(values, non_trainable, inputs, training=training)[0]

            y_pred = network(x, True)
            penalty = kt.gradient_penalty(network, x, 0.5 * x, alpha=ALPHA, target=0.0)
            return ops.mean(ops.square(y_pred - y)) + WEIGHT * penalty

        loss, grads = jax.value_and_grad(loss_of)(trainable)
        trainable, optimizer_vars = self.optimizer.stateless_apply(
            optimizer_vars, grads, trainable
        )
        return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)


def _hand_written_loop(weights, x, y, batch):
    """The same training from the formulas: `jax.grad` for the input gradient, SGD."""

    def forward(w, inputs):
        return jnp.tanh(inputs @ w[0] + w[1]) @ w[2] + w[3]

    def loss(w, xb, yb):
        x_hat = xb + ALPHA * (0.5 * xb - xb)
        g = jax.grad(lambda inputs: jnp.sum(forward(w, inputs)))(x_hat)
        norm = jnp.sqrt(jnp.maximum(jnp.sum(g**2, axis=1), 1e-30))
        return jnp.mean((forward(w, xb) - yb) ** 2) + WEIGHT * jnp.mean(norm**2)

    @jax.jit
    def step(w, xb, yb):
        return [v - LEARNING_RATE * g for v, g in zip(w, jax.grad(loss)(w, xb, yb))]

    w = [jnp.asarray(v) for v in weights]
    for start in range(0, len(x), batch):
        w = step(w, x[start : start + batch], y[start : start + batch])
    return [np.asarray(v) for v in w]


def penalty_function_cases(out, report):
    """kt.gradient_penalty on JAX: value and weight gradient, in fit, and its seed."""
    critic = penalty_critic()
    real, fake, alpha = penalty_inputs()
    value, grads = _weight_gradient(critic, real, fake, alpha)
    eager = kt.gradient_penalty(critic, real, fake, alpha=alpha)
    np.savez(
        out / "penalty_function.npz",
        value=np.asarray(value),
        eager=np.asarray(eager),
        **{f"g{i}": np.asarray(g) for i, g in enumerate(grads)},
    )

    # In fit: a custom train_step against the hand-written loop.
    x, y = real, np.sin(real[:, :1])
    start = penalty_critic().get_weights()
    model = PenalizedRegressor(penalty_critic())
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE))
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    np.savez(out / "penalty_in_fit.npz", *model.get_weights())
    np.savez(out / "penalty_hand.npz", *_hand_written_loop(start, x, y, 4))

    # alpha=None: an int seed draws the same under jit as eagerly; without a
    # seed a jitted function is refused by Keras (its JAX RNG rule).
    seeded = jax.jit(lambda r, f: kt.gradient_penalty(critic, r, f, seed=7))
    report["penalty_seeded"] = [
        float(seeded(real, fake)),
        float(kt.gradient_penalty(critic, real, fake, seed=7)),
        float(kt.gradient_penalty(critic, real, fake, seed=8)),
    ]
    try:
        jax.jit(lambda r, f: kt.gradient_penalty(critic, r, f))(real, fake)
        report["penalty_unseeded_error"] = None
    except Exception as error:  # Keras's ValueError about seeded random ops
        report["penalty_unseeded_error"] = f"{type(error).__name__}: {error}"[:300]
