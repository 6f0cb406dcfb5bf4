"""MGDA (Sener & Koltun, 2018, "Multi-Task Learning as Multi-Objective Optimization").

The step is the min-norm point of the convex hull of the task gradients,
`d = sum_k a_k g_k` with `a = argmin ||sum_k a_k g_k||` over the simplex.
We solve that sub-problem exactly on the Gramian (`qp.min_norm_weights`;
the paper and torchjd use a Frank-Wolfe loop with a tolerance, the official
code its `MinNormSolver`: all approximate the same minimizer).

`normalization` follows the official code (isl-org/MultiObjectiveOptimization,
"optional and not included in the paper"): the weights are computed from
gradients divided by `||g_k||` (`"l2"`), the loss (`"loss"`) or both
(`"loss+"`), and applied to the raw losses. LibMTL applies them to the
normalized gradients instead; the default `"none"` makes no difference.

`on="representation"` is the paper's MGDA-UB: the weights come from the
gradients with respect to the shared representation `Z` (the output of
`representation`, one backward pass per task through the heads only), and
the shared variables get one backward pass of `sum_k a_k L_k`. As in the
official code the `Z` gradient is the whole `[batch, ...]` tensor (LibMTL
sums it over the batch).
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import keras
import tensorflow as tf

from keras_tapeops import paths
from keras_tapeops import validation
from keras_tapeops import gramian as gram
from keras_tapeops.aggregation import qp
from keras_tapeops.aggregation.base import Aggregator
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.paths import LayerTree
from keras_tapeops.registration import register
from keras_tapeops.selectors import Selector

NORMALIZATIONS = ("none", "l2", "loss", "loss+")


@gram.nan_unless_finite
def mgda_weights(gramian, losses=None, normalization="none"):
    """MGDA's weights: the min-norm convex combination of the (normalized) rows.

    Args:
        gramian: `[K, K]` float32.
        losses: `[K]` task losses (for `"loss"` and `"loss+"`).
        normalization: one of `NORMALIZATIONS`.

    Returns:
        `[K]` float32 weights on the simplex.
    """
    k = int(gramian.shape[0])
    if normalization == "none":
        scale = tf.ones([k])
    elif normalization == "l2":
        scale = gram.row_norms(gramian)
    elif normalization == "loss":
        scale = tf.cast(losses, tf.float32)
    else:
        scale = tf.cast(losses, tf.float32) * gram.row_norms(gramian)
    scale = tf.where(scale > 0.0, scale, 1.0)
    normalized = gramian / (scale[:, tf.newaxis] * scale[tf.newaxis, :])
    return qp.min_norm_weights(normalized)


@register
class MGDA(Aggregator):
    """The multiple-gradient descent algorithm (min-norm point of the task gradients).

    Args:
        shared: selector of the shared variables.
        tasks: None or the output names that are tasks.
        on: `"parameters"` (rows of the shared variables) or
            `"representation"` (MGDA-UB: rows of the representation's
            output, much cheaper).
        representation: with `on="representation"`, the path of the layer
            whose output is the shared representation; None takes the layer
            `shared` names (`"trunk"` or `"trunk/*"`).
        normalization: `"none"`, `"l2"`, `"loss"` or `"loss+"` (see above).

    Example:
    ```python
    kt.MGDA(shared="trunk/*", on="representation")
    ```
    """

    max_tasks = qp.MAX_TASKS

    def __init__(
        self,
        shared: Selector = None,
        tasks: Sequence[str] | None = None,
        on: str = "parameters",
        representation: str | None = None,
        normalization: str = "none",
    ) -> None:
        super().__init__(shared=shared, tasks=tasks)
        self.on = validation.choice(on, "on", ("parameters", "representation"))
        if representation is not None:
            if (
                not isinstance(representation, str)
                or not representation.strip("/")
                or paths.is_glob(representation)
            ):
                raise ValueError(
                    "`representation` must be a layer path (no wildcards). "
                    f"Received: representation={representation!r}"
                )
            if self.on != "representation":
                raise ValueError(
                    "`representation` is only used with on='representation'. "
                    f"Received: representation={representation!r}, on={on!r}"
                )
        self.representation = representation
        self.normalization = validation.choice(normalization, "normalization", NORMALIZATIONS)

    # A property over the base's class attribute: the kind depends on `on`.
    @property
    def kind(self) -> str:  # type: ignore[override]
        return "representation" if self.on == "representation" else "rows"

    def weights(self, gramian: tf.Tensor, context: StepContext) -> tf.Tensor:
        return mgda_weights(gramian, context.losses, self.normalization)

    def micro_batch_refusal(self, replicas: int) -> str | None:
        if self.on == "representation" and replicas > 1:
            return (
                "on='representation' takes its weights from each pass's "
                "representation gradients summed over replicas, which cannot be "
                "synchronized inside the micro-batch loop"
            )
        return None

    def representation_layer(self, model: keras.Model, tree: LayerTree) -> keras.layers.Layer:
        """The layer whose output is the shared representation (resolved per model)."""
        path = self.representation
        if path is None:
            shared = self.shared
            if isinstance(shared, str) and not paths.is_glob(shared.rstrip("*").rstrip("/")):
                path = shared[:-2] if shared.endswith("/*") else shared
            elif hasattr(shared, "name") and not isinstance(shared, str):
                path = tree.paths_of(shared)[0] if tree.paths_of(shared) else shared.name
        if path is None or paths.is_glob(path):
            raise ValueError(
                "MGDA(on='representation') needs the layer whose output is the "
                "shared representation: pass representation='<layer path>'. "
                f"Received: representation=None, shared={self.shared!r}"
            )
        try:
            return tree.find(path)
        except ValueError as error:
            raise ValueError(f"{error}. Received: representation={path!r}") from None

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "on": self.on,
            "representation": self.representation,
            "normalization": self.normalization,
        }
