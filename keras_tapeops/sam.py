"""Sharpness-aware minimization: `compile(sharpness_aware=kt.SAM(rho=0.05))`.

Each step (Foret et al. 2021; ASAM: Kwon et al. 2021):

1. the first pass computes the gradient `g` at the weights `w` (this pass is
   the one logged: loss, terms, metrics; BatchNormalization moving statistics
   are updated here, once per step);
2. the selected weights move to `w + e`, with `e = rho * g / ||g||`
   (ASAM, `adaptive=True`: `e = rho * |w|^2 g / || |w| g ||`, element-wise),
   the norm taken over the selected group on true gradients (unscaled under
   mixed precision, summed over replicas);
3. the second pass computes the gradient at `w + e` (loss terms and gradient
   penalties are part of both passes; nothing is logged, and the moving
   statistics it would update are put back);
4. the weights are restored exactly (copied back, not `w + e - e`) and the
   second gradient goes through the usual pipeline: all-reduce, gradient
   transforms, optimizer.

Under `tf.distribute` the perturbation uses the global gradient (one extra
all-reduce per step), so training equals single-device SAM on the same global
batch; the paper's per-replica m-sharpness is not used. With `micro_batches`,
both passes run over the micro-batches (the perturbation comes from the whole
batch's gradient); with `accumulation_steps`, every batch is perturbed by its
own gradient and the windows sum the second gradients.

The configuration and the perturbation's math (`keras.ops`, any backend) are
here; the TensorFlow step is `sam_step.py`, the JAX step is in
`backend/jax/mixin.py`.
"""

from typing import Any
from typing import Sequence

import keras
from keras import ops

from keras_tapeops import selectors
from keras_tapeops import validation
from keras_tapeops.config_repr import ConfigRepr
from keras_tapeops.paths import LayerTree
from keras_tapeops.registration import register
from keras_tapeops.transforms.clipping import add_n
from keras_tapeops.transforms.clipping import squared_norm
from keras_tapeops.transforms.sparse import dense


@register
class SAM(ConfigRepr):
    """Sharpness-aware minimization, configured at `compile(sharpness_aware=...)`.

    Args:
        rho: non-negative finite number, the radius of the perturbation
            (0 is plain training, at twice the cost).
        adaptive: ASAM: scale the perturbation element-wise by `|w|`.
        where: selector of the weights perturbed (None: all trainable);
            the others keep their value in the second pass.

    Returns:
        The option for `compile(sharpness_aware=...)`.

    Example:
    ```python
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                  sharpness_aware=kt.SAM(rho=0.05))
    ```
    """

    def __init__(
        self, rho: float = 0.05, adaptive: bool = False, where: selectors.Selector = None
    ) -> None:
        self.rho = validation.non_negative_number(rho, "rho")
        self.adaptive = validation.boolean(adaptive, "adaptive")
        self.where = selectors.validate_selector(where)

    def bind(
        self, model: keras.Model, variables: Sequence[keras.Variable], tree: LayerTree | None = None
    ) -> list[bool]:
        """Returns the selection (list of bools) for `model`'s `variables`."""
        return selectors.select(self.where, model, variables, tree)

    def perturbation(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], selected: Sequence[bool]
    ) -> list[Any]:
        """`e` for every variable (None where not selected or no gradient).

        Args:
            grads: true gradients (dense or IndexedSlices, None allowed).
            variables: the matching variables (or their values).
            selected: list of bools.

        Returns:
            A list of tensors or None, aligned with `variables`.
        """
        scaled: list[Any] = []
        for g, v, on in zip(grads, variables, selected):
            if not on or g is None:
                scaled.append(None)
                continue
            g = ops.cast(dense(g), "float32")
            if self.adaptive:
                g = g * ops.abs(ops.cast(v, "float32"))
            scaled.append(g)
        present = [s for s in scaled if s is not None]
        if not present:
            return scaled
        norm = ops.sqrt(add_n([squared_norm(s) for s in present]))
        factor = self.rho / ops.maximum(norm, 1e-12)
        out: list[Any] = []
        for s, v in zip(scaled, variables):
            if s is None:
                out.append(None)
                continue
            if self.adaptive:
                s = s * ops.abs(ops.cast(v, "float32"))
            out.append(ops.cast(s * factor, v.dtype))
        return out

    def get_config(self) -> dict[str, Any]:
        return {
            "rho": self.rho,
            "adaptive": self.adaptive,
            "where": selectors.serialize_selector(self.where),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "SAM":
        config = dict(config)
        config["where"] = selectors.deserialize_selector(config.get("where"))
        return cls(**config)
