"""Aligned-MTL (Senushkin et al., 2023, "Independent Component Alignment for Multi-Task Learning").

The task gradients are aligned by the balance transformation
`B = sqrt(lambda_scale) V Sigma^-1/2 V^T` (`G = V Sigma V^T`, over the
non-zero eigenvalues), making the aggregated directions orthogonal and of
equal norm; the step is `(B w)^T J` with `w = 1/K` (torchjd's default
preference vector; LibMTL uses `B.sum(0)`, i.e. K times larger).
`scale_mode`: `"min"` (the smallest non-zero eigenvalue, the paper's
choice and torchjd's default), `"median"` (the lower median) or `"rmse"`
(their mean, as in the original implementation).
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops import gramian as gram
from keras_tapeops.aggregation.base import Aggregator
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.registration import register
from keras_tapeops.selectors import Selector

SCALE_MODES = ("min", "median", "rmse")


@gram.nan_unless_finite
def aligned_mtl_weights(gramian, scale_mode="min"):
    """Aligned-MTL's weights (on the trace-normalized Gramian; scale-free).

    Args:
        gramian: `[K, K]` float32.
        scale_mode: one of `SCALE_MODES`.

    Returns:
        `[K]` float32 weights (`1/K` each when every row is zero).
    """
    k = int(gramian.shape[0])
    preference = tf.fill([k], 1.0 / k)
    values, vectors = gram.eigh_ascending(gram.normalize(gramian, 1e-20))
    kept = values > gram.RCOND * tf.reduce_max(values)
    rank = tf.reduce_sum(tf.cast(kept, tf.int32))
    inverse_sqrt = tf.where(kept, 1.0 / tf.sqrt(tf.where(kept, values, 1.0)), 0.0)
    if scale_mode == "min":
        scale = tf.reduce_min(tf.where(kept, values, float("inf")))
    elif scale_mode == "median":  # torch.median: the lower of the two middle values
        scale = tf.gather(values, k - rank + (rank - 1) // 2)
    else:
        kept_sum = tf.reduce_sum(tf.where(kept, values, 0.0))
        scale = kept_sum / tf.cast(tf.maximum(rank, 1), tf.float32)
    balance = tf.sqrt(scale) * tf.matmul(
        vectors * inverse_sqrt[tf.newaxis], vectors, transpose_b=True
    )
    weights = tf.linalg.matvec(balance, preference)
    return tf.where(rank > 0, weights, preference)


@register
class AlignedMTL(Aggregator):
    """Aligned multi-task learning (independent component alignment).

    Args:
        scale_mode: `"min"`, `"median"` or `"rmse"` (see above).
        shared: selector of the shared variables.
        tasks: None or the output names that are tasks.

    Example:
    ```python
    kt.AlignedMTL(shared="trunk/*")
    ```
    """

    def __init__(
        self,
        scale_mode: str = "min",
        shared: Selector = None,
        tasks: Sequence[str] | None = None,
    ) -> None:
        super().__init__(shared=shared, tasks=tasks)
        self.scale_mode = validation.choice(scale_mode, "scale_mode", SCALE_MODES)

    def weights(self, gramian: tf.Tensor, context: StepContext) -> tf.Tensor:
        return aligned_mtl_weights(gramian, self.scale_mode)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "scale_mode": self.scale_mode}
