"""`kt.DPSGD`: differentially private SGD as a compile option."""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

import keras

from keras_tapeops import validation
from keras_tapeops.multi_gradient import MultiGradientOption
from keras_tapeops.paths import LayerTree
from keras_tapeops.privacy import seeds
from keras_tapeops.registration import register

if TYPE_CHECKING:
    from keras_tapeops.privacy.engine import DPSGDState

METHODS = ("auto", "vectorized")

_REASONS = {
    "sharpness_aware": (
        "SAM takes a second gradient at weights moved along the first, whose "
        "per-example contributions are neither clipped nor covered by the "
        "privacy accounting of one noisy step"
    ),
    "task_balancing": (
        "task balancing reweights per-task gradients of the whole batch, so "
        "an example's contribution depends on the other examples and is no "
        "longer bounded by l2_norm_clip"
    ),
    "sample_selection": (
        "selecting the largest losses makes which examples contribute depend "
        "on the whole batch, so adding one example changes the others' "
        "contributions and the sensitivity bound no longer holds"
    ),
}


@register
class DPSGD(MultiGradientOption):
    """Differentially private SGD: per-example clipping and Gaussian noise in `fit`.

    Every example's gradient over all trainable variables is clipped to
    `l2_norm_clip` (L2 norm), the clipped gradients are summed, Gaussian
    noise of standard deviation `l2_norm_clip * noise_multiplier` is added
    once per applied optimizer step (not per replica, not per micro-batch),
    and the sum is divided by the step's number of samples. Gradient
    transforms and the optimizer then see it like any gradient.

    Per-example norms come from ghost norms (Dense, EinsumDense, Embedding,
    Conv1D/2D, LayerNormalization: computed from each layer's inputs and
    output gradients, one backward pass) and from a vectorized per-example
    Jacobian for any other layer (`method="auto"`); `method="vectorized"`
    uses the vectorized Jacobian everywhere.
    `model.tapeops_state.engine.report()` lists the choice per variable.

    Refused: BatchNormalization layers that train (they mix the examples of
    a batch: use GroupNormalization or LayerNormalization, or freeze them);
    `sample_weight`/`class_weight`, `loss_terms` and losses added with
    `add_loss`; `sharpness_aware`, `task_balancing` and `sample_selection`.
    Composes with `micro_batches`, `accumulation_steps` (one noisy step per
    window), `gradient_transforms` (applied after the noise),
    `tf.distribute` and mixed precision (norms in float32).

    Args:
        l2_norm_clip: the clipping bound C (a positive number).
        noise_multiplier: sigma, the noise standard deviation in units of C
            (a finite number >= 0; 0 trains with clipping and no privacy).
        seed: None (a fresh random seed per `compile()`: use this for
            privacy) or a non-negative integer (reproducible noise, for
            tests: anyone who knows it can remove the noise).
        method: `"auto"` (ghost norms where a rule exists) or
            `"vectorized"` (the per-example Jacobian for every layer).

    Returns:
        An option for `compile(differential_privacy=...)`.

    Example:
    ```python
    model.compile(optimizer="sgd", loss="categorical_crossentropy",
                  differential_privacy=kt.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    print(kt.privacy.epsilon(steps=4, sampling_rate=16 / 64, noise_multiplier=1.1))
    ```
    """

    option_name = "differential_privacy"

    def __init__(
        self,
        l2_norm_clip: float,
        noise_multiplier: float,
        seed: int | None = None,
        method: str = "auto",
    ) -> None:
        self.l2_norm_clip = validation.positive_number(l2_norm_clip, "l2_norm_clip")
        self.noise_multiplier = validation.non_negative_number(noise_multiplier, "noise_multiplier")
        self.seed = seeds.check_seed(seed)
        self.method = validation.choice(method, "method", METHODS)

    def bind(self, model: keras.Model, tree: LayerTree) -> DPSGDState:
        """The TensorFlow engine for `model` (see `keras_tapeops.privacy.engine`)."""
        from keras_tapeops.privacy.engine import DPSGDState  # TensorFlow's engine

        self.check_model(model, tree)
        return DPSGDState(self, model)

    def check_model(self, model: keras.Model, tree: LayerTree) -> None:
        """Refuses a model with layers that mix the examples of a batch (on every backend).

        Args:
            model: the model being compiled.
            tree: its `LayerTree`.
        """
        mixing = [path for path, layer in tree.entries if mixes_examples(layer)]
        if mixing:
            raise ValueError(
                "DPSGD cannot train layers that mix the examples of a batch: "
                f"BatchNormalization layers {mixing} normalize each example "
                "with the statistics of the others, so no per-example "
                "gradient exists to clip. Use GroupNormalization or "
                "LayerNormalization instead, or freeze them "
                "(layer.trainable = False runs them in inference mode). "
                f"Received: model={model.name!r}"
            )

    def combines_with(self, name: str, value: Any) -> str | None:
        return _REASONS.get(name, super().combines_with(name, value))

    def get_config(self) -> dict[str, Any]:
        return {
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "seed": self.seed,
            "method": self.method,
        }


def mixes_examples(layer: keras.layers.Layer) -> bool:
    """True for a layer whose training-mode output mixes the examples of a batch."""
    return isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
