"""`GradientPenalty`: a loss term on the gradient of the outputs w.r.t. the inputs."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_tapeops.penalty_norm import per_sample_norm
from keras_tapeops.penalty_norm import validate_target
from keras_tapeops.registration import register
from keras_tapeops.terms.base import Term
from keras_tapeops.terms.base import TermContext
from keras_tapeops.terms.base import Weight


@register
class GradientPenalty(Term):
    """Penalizes the input gradient of the model on the real (training) batch.

    The value is `mean_over_batch((||d sum(outputs) / d inputs||_2 - target)^2)`,
    the norm taken per sample over all non-batch axes of all float inputs
    jointly. `target=0` is the R1-style zero-centred penalty (on the data),
    `target=1` pulls towards a one-Lipschitz model. The gradient comes from an
    inner tape around the step's single forward pass (the model is not run
    twice), and the term is differentiable w.r.t. the weights.

    Sample weights do not weight the penalty: it is a plain batch mean, like
    a regularizer. Under `tf.distribute` the step scales it like the loss.

    Args:
        weight: a number, a schedule or a callable `step -> number`.
        target: the norm the penalty pulls towards (>= 0). Default 0.0.
        name: the name logged in History and the progress bar.
        in_validation: default False: `evaluate()` and validation neither
            compute the penalty (no extra tape or backward pass) nor count it
            in `val_loss`, so `val_loss` stays comparable with a model
            trained without it. Set True to log `val_<name>` too.

    Returns:
        A `Term` for `compile(loss_terms=[...])`.

    Example:
    ```python
    model.compile(optimizer="adam", loss="mse",
                  loss_terms=[kt.GradientPenalty(weight=10.0, target=1.0)])
    model.fit(x, y)   # logs `loss` and `gradient_penalty`
    ```
    """

    needs_input_gradients = True

    def __init__(
        self,
        weight: Weight = 1.0,
        target: float = 0.0,
        name: str = "gradient_penalty",
        in_validation: bool = False,
    ) -> None:
        super().__init__(weight=weight, name=name, in_validation=in_validation)
        self.target = validate_target(target)

    def call(self, context: TermContext) -> Any:
        """Returns the unweighted penalty for the context's batch (float32)."""
        # The outputs themselves are the targets (the inner tape recorded
        # them); TF sums a list of targets.
        outputs = [
            t
            for t in keras.tree.flatten(context.y_pred)
            if t is not None and keras.backend.is_float_dtype(t.dtype)
        ]
        grads = context.input_gradients(target=outputs)
        norm = per_sample_norm(keras.tree.flatten(grads))
        return ops.mean(ops.square(norm - self.target))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["target"] = self.target
        return config
