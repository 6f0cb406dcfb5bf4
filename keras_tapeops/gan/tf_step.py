"""`kt.GAN`'s step on TensorFlow: one `tf.GradientTape` per player update.

`TensorFlowGANStep` is `GAN`'s first base with `KERAS_BACKEND=tensorflow`
(`backend/jax/gan.py` is the JAX one): `train_step(data)` runs
`discriminator_steps` discriminator updates, then one generator update, each
through `discriminator_train_step` / `generator_train_step` (public,
overridable hooks), and updates the loss trackers. Losses are scaled like
Keras scales them for `tf.distribute` and mixed precision; each player's
gradient transforms see true gradients (unscaled, summed over replicas).
"""

from __future__ import annotations

from typing import Any
from typing import TYPE_CHECKING
from typing import Sequence

import keras
import tensorflow as tf

from keras_tapeops import replicas
from keras_tapeops import step_gate
from keras_tapeops import true_gradients
from keras_tapeops.accumulation.batch_norm import moving_statistics
from keras_tapeops.transforms.base import apply_in_order
from keras_tapeops.transforms.base import with_hook
from keras_tapeops.typing_aliases import Gradient
from keras_tapeops.typing_aliases import Nested


class TensorFlowGANStep:
    """The TensorFlow train and test steps of `kt.GAN` (a base of `GAN`, not used alone).

    Example:
    ```python
    gan = kt.GAN(generator, discriminator, latent_dim=128)  # on TensorFlow
    gan.compile(generator_optimizer="adam", discriminator_optimizer="adam")
    gan.fit(real, batch_size=64)   # calls TensorFlowGANStep.train_step
    ```
    """

    if TYPE_CHECKING:  # GAN's attributes and methods, which the step uses

        def __getattr__(self, name: str) -> Any: ...

    def _gan_check(self, bound: Sequence[Any]) -> None:
        """Every option runs on TensorFlow (the JAX step refuses some here)."""

    def _carried_metrics(self) -> list[Any]:
        """No state rides in the metrics on TensorFlow (the JAX step's noise count does)."""
        return []

    def _gan_compiled(self) -> None:
        """Nothing to prepare on TensorFlow (the JAX step sets its optimizer here)."""

    def train_step(self, data: Nested) -> dict[str, Any]:
        real, labels = self._unpack(data)
        n = replicas.batch_size(real)
        discriminator_losses, penalties = [], []
        for step in range(self._discriminator_steps):
            loss, penalty = self.discriminator_train_step(real, step, labels)
            discriminator_losses.append(loss)
            penalties.append(penalty)
        # One tracker update per batch (the mean over its discriminator steps,
        # all of the same size): the same epoch mean as one update per step.
        self._discriminator_tracker.update_state(
            _unless_empty(_mean(discriminator_losses), n), sample_weight=n
        )
        if self.gradient_penalty is not None:
            self.gradient_penalty_tracker.update_state(
                _unless_empty(_mean(penalties), n), sample_weight=n
            )
        generator_loss = self.generator_train_step(real, labels)
        self.generator_loss_tracker.update_state(_unless_empty(generator_loss, n), sample_weight=n)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data: Nested) -> dict[str, Any]:
        real, labels = self._unpack(data)
        n = replicas.batch_size(real)
        loss, penalty = self.discriminator_losses(real, 0, False, labels)
        generator_loss = self.generator_objective(real, False, labels)
        self._discriminator_tracker.update_state(_unless_empty(loss, n), sample_weight=n)
        if self.gradient_penalty is not None:
            self.gradient_penalty_tracker.update_state(_unless_empty(penalty, n), sample_weight=n)
        self.generator_loss_tracker.update_state(_unless_empty(generator_loss, n), sample_weight=n)
        return {m.name: m.result() for m in self._trackers()}

    def discriminator_train_step(
        self, real: Nested, step: int, labels: Nested = None
    ) -> tuple[Any, Any]:
        """One discriminator update; returns the (unscaled) `(loss, penalty)`."""
        optimizer = self._discriminator_optimizer
        variables = self._discriminator.trainable_variables
        snapshot = _snapshot_if_gated(self, getattr(self, f"_bound_{self._role}_transforms"))
        with tf.GradientTape() as tape:
            loss, penalty = self.discriminator_losses(real, step, True, labels)
            scaled = optimizer.scale_loss(replicas.scale_for_distribution(loss))
        grads = tape.gradient(scaled, variables)
        keep = self.apply_discriminator_gradients(grads, variables)
        step_gate.restore_unless(keep, snapshot)
        return loss, penalty

    def generator_train_step(self, real: Nested, labels: Nested = None) -> Any:
        """One generator update; returns the (unscaled) generator loss."""
        variables = self.generator.trainable_variables
        bound = self._bound_generator_transforms
        snapshot = _snapshot_if_gated(self, bound)
        with tf.GradientTape() as tape:
            loss = self.generator_objective(real, True, labels)
            scaled = self.generator_optimizer.scale_loss(replicas.scale_for_distribution(loss))
        grads = tape.gradient(scaled, variables)
        keep = _apply(self.generator_optimizer, bound, grads, variables)
        step_gate.restore_unless(keep, snapshot)
        return loss

    def apply_discriminator_gradients(
        self, grads: Sequence[Gradient], variables: Sequence[keras.Variable]
    ) -> Any:
        """Applies the discriminator's gradients, through its transforms if any.

        As in `TapeOpsMixin.apply_optimizer_step`: the transforms see true
        gradients (unscaled, summed once over replicas); a non-finite step
        still reaches a `LossScaleOptimizer` as non-finite so it is skipped.
        A transform's gate (`kt.SkipNonFinite`) may skip the update, and its
        `after_apply` hooks (`kt.LogUpdateRatio`) run after it.

        Returns:
            The gates' decision (a scalar bool tensor), or None without gates.
        """
        return _apply(
            self._discriminator_optimizer,
            getattr(self, f"_bound_{self._role}_transforms"),
            grads,
            variables,
        )


def _apply(optimizer, bound, grads, variables):
    """One player's update through its bound transforms; returns the gates' decision."""
    if not bound:
        optimizer.apply_gradients(zip(grads, variables))
        return None
    return true_gradients.apply_transformed(
        optimizer,
        grads,
        variables,
        transform=lambda g, v: apply_in_order(bound, g, v),
        keep_step=step_gate.keep_step_function(bound),
        after_apply=step_gate.after_apply_function(bound, variables),
    )


def _snapshot_if_gated(model, bound):
    """Both players' moving statistics, read before an update a gate may skip."""
    return moving_statistics(model) if with_hook(bound, "keep_step") else []


def _unless_empty(value, n):
    """`value`, or 0 for an empty batch (its mean is nan; its tracker weight is 0)."""
    value = tf.convert_to_tensor(value)
    return tf.where(tf.cast(n, tf.float32) > 0, value, tf.zeros_like(value))


def _mean(values):
    return tf.add_n(values) / float(len(values))
