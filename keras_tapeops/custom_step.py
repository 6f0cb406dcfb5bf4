"""Building blocks for a user's own `train_step` that keep the compiled options.

A team with its own step (the keras.io "customizing fit" guide, a GAN, a
two-view self-supervised step) keeps it and still gets the options that act
on gradients:

```python
def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
        loss, y_pred = self.compute_total_loss(x, y, None, training=True)
    grads = tape.gradient(loss, self.trainable_variables)
    self.apply_gradients_with_options(grads, batch_size=tf.shape(x)[0])
    return self.compute_metrics(x, y, y_pred)
```

`compute_total_loss` (the mixin's) runs the forward pass, the compiled loss
and the compiled `loss_terms`, and logs the loss and each term;
`apply_gradients_with_options` applies the compiled `gradient_transforms`
(with their step gates, e.g. `kt.SkipNonFinite`) and `accumulation_steps`.
The options that decide how gradients are computed (`micro_batches`,
`sharpness_aware`, `task_balancing`, `differential_privacy`,
`sample_selection`) need the library's step: with one of them compiled the
building block refuses, naming it.
"""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from keras_tapeops import step_watch
from keras_tapeops.options import OPTIONS
from keras_tapeops.typing_aliases import Gradient
from keras_tapeops.typing_aliases import ModelMixinBase

# Options that change how the gradient is computed, not what is done with it.
_NEEDS_THE_LIBRARYS_STEP = (
    "micro_batches",
    "sharpness_aware",
    "task_balancing",
    "differential_privacy",
    "sample_selection",
)


class CustomStepMethods(ModelMixinBase):
    """`apply_gradients_with_options`: the options' gradient pipeline for a custom step."""

    def apply_gradients_with_options(
        self,
        grads: Sequence[Gradient],
        batch_size: int | tf.Tensor | None = None,
        variables: Sequence[keras.Variable] | None = None,
    ) -> tf.Tensor | None:
        """Applies `grads` through the compiled gradient options, in a custom `train_step`.

        `grads` are what a stock custom step passes to `optimizer.apply`:
        gradients of the step's loss (per replica, as `compute_loss` and
        `compute_total_loss` return it; under mixed precision, of
        `self.optimizer.scale_loss(loss)`, as Keras's own step does). They
        go through the compiled `gradient_transforms` (on the true gradients:
        unscaled and summed over replicas), their step gates, and
        `accumulation_steps` windows, exactly as in the library's step.

        Args:
            grads: one gradient per variable (None for none).
            batch_size: the batch's (per-replica) sample count; needed with
                `accumulation_steps > 1` (windows weight batches by size).
            variables: the variables `grads` belong to (default: all
                trainable variables, in `self.trainable_variables` order);
                a subset (e.g. a GAN's discriminator) is not accumulated.

        Returns:
            The step gate's keep decision (a scalar bool tensor) when a
            gating transform such as `kt.SkipNonFinite` decided it now,
            else None.

        Raises:
            ValueError: an option that computes gradients its own way is
                compiled, or `batch_size` is missing where it is needed.

        Example:
        ```python
        class Net(kt.TapeOpsMixin, keras.Model):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.compute_loss(y=y, y_pred=y_pred)
                grads = tape.gradient(loss, self.trainable_variables)
                self.apply_gradients_with_options(grads, batch_size=tf.shape(x)[0])
                return self.compute_metrics(x, y, y_pred)
        ```
        """
        step_watch.mark_step_ran(self)
        options = self.tapeops_options
        state = self.tapeops_state
        if state is not None:
            # A model without `call()` (a GAN, SimSiam) is never `built`: its
            # variables exist once the step has computed their gradients.
            state.bind_variables(self)
            state.saveable.restore_pending()
        if options is not None:
            compiled = [
                option.name
                for option in OPTIONS
                if option.name in _NEEDS_THE_LIBRARYS_STEP
                and option.is_set(getattr(options, option.name))
            ]
            if compiled:
                raise ValueError(
                    "apply_gradients_with_options() applies what is done with "
                    "gradients (gradient_transforms, accumulation_steps); "
                    f"{', '.join(compiled)} decide(s) how they are computed and "
                    "need(s) the library's step: call super().train_step(data). "
                    f"Received: {', '.join(f'{n}={getattr(options, n)!r}' for n in compiled)}"
                )
        accumulating = state is not None and state.accumulator is not None
        if variables is not None:
            if accumulating:
                raise ValueError(
                    "apply_gradients_with_options(variables=...) cannot "
                    "accumulate a subset of the variables across batches; "
                    "pass gradients for all trainable variables. Received: "
                    f"accumulation_steps={options.accumulation_steps}"
                )
            return self.apply_optimizer_step(list(grads), list(variables))
        grads = list(grads)
        if len(grads) != len(self.trainable_weights):
            raise ValueError(
                "apply_gradients_with_options() takes one gradient per trainable "
                f"variable ({len(self.trainable_weights)}), or `variables=`. "
                f"Received: {len(grads)} gradients"
            )
        if accumulating and batch_size is None:
            raise ValueError(
                "apply_gradients_with_options() needs `batch_size` with "
                f"accumulation_steps={options.accumulation_steps} (windows weight "
                "batches by their size). Received: batch_size=None"
            )
        return self.update_weights(grads, batch_size if batch_size is not None else 0)
