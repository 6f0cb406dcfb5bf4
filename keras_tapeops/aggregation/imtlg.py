"""IMTL-G (Liu et al., 2021, "Towards Impartial Multi-task Learning").

The gradient part of IMTL: the step `d = sum_k w_k g_k` (weights summing to
one) has equal projections on every task's unit gradient. We follow
torchjd's generalization (which also handles linearly dependent rows):
`v = pinv(G) sqrt(diag(G))`, `w = v / sum(v)` (zeros when the sum vanishes).
LibMTL's `IMTL` also learns loss scales (the hybrid IMTL); that is not this.
"""

from __future__ import annotations

import tensorflow as tf

from keras_tapeops import gramian as gram
from keras_tapeops.aggregation.base import Aggregator
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.registration import register


@gram.nan_unless_finite
def imtlg_weights(gramian):
    """IMTL-G's weights (computed on the trace-normalized Gramian; scale-free).

    Args:
        gramian: `[K, K]` float32.

    Returns:
        `[K]` float32 weights summing to 1 (or zeros).
    """
    g = gram.normalize(gramian, 1e-20)
    v = tf.linalg.matvec(gram.psd_pinv(g), gram.row_norms(g))
    total = tf.reduce_sum(v)
    return tf.where(tf.abs(total) < 1e-12, tf.zeros_like(v), v / tf.where(total == 0.0, 1.0, total))


@register
class IMTLG(Aggregator):
    """Impartial multi-task learning, gradient part.

    Args:
        shared: selector of the shared variables.
        tasks: None or the output names that are tasks.

    Example:
    ```python
    kt.IMTLG(shared="trunk/*")
    ```
    """

    def weights(self, gramian: tf.Tensor, context: StepContext) -> tf.Tensor:
        return imtlg_weights(gramian)
