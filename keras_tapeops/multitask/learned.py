"""Adam for the small learned vectors of the loss weightings.

Uncertainty weighting's log-variances, GradNorm's weight logits and FAMO's
task logits are engine variables (training state, not model weights), so
the model's optimizer does not see them; each method steps them with this
Adam (PyTorch's `torch.optim.Adam` update, `weight_decay` added to the
gradient as there), once per applied optimizer step.
"""

import numpy as np
import tensorflow as tf


def adam_state(name, size):
    """Initial Adam slots for a `[size]` vector, as `initial_state` entries."""
    return {
        f"{name}_m": np.zeros([size], "float32"),
        f"{name}_v": np.zeros([size], "float32"),
        f"{name}_t": np.zeros([], "float32"),
    }


def adam_step(
    state,
    name,
    grad,
    learning_rate,
    weight_decay=0.0,
    beta_1=0.9,
    beta_2=0.999,
    epsilon=1e-8,
    apply=True,
):
    """One Adam step of `state[name]` along `grad` (skipped where `apply` is False).

    Args:
        state: the engine's state dict (holds `name` and its Adam slots).
        name: the learned variable's name.
        grad: `[K]` float32 gradient.
        learning_rate, weight_decay, beta_1, beta_2, epsilon: Adam's.
        apply: scalar bool tensor; False leaves every variable unchanged.

    Returns:
        None.
    """
    variable = state[name]
    m, v, t = state[f"{name}_m"], state[f"{name}_v"], state[f"{name}_t"]
    grad = grad + weight_decay * variable
    new_t = t + 1.0
    new_m = beta_1 * m + (1.0 - beta_1) * grad
    new_v = beta_2 * v + (1.0 - beta_2) * tf.square(grad)
    m_hat = new_m / (1.0 - tf.pow(beta_1, new_t))
    v_hat = new_v / (1.0 - tf.pow(beta_2, new_t))
    new_value = variable - learning_rate * m_hat / (tf.sqrt(v_hat) + epsilon)
    apply = tf.logical_and(apply, tf.reduce_all(tf.math.is_finite(new_value)))
    for target, value in ((variable, new_value), (m, new_m), (v, new_v), (t, new_t)):
        target.assign(tf.where(apply, value, target))
