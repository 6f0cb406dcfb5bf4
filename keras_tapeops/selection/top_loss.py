"""`kt.TopLoss`: online batch selection by the largest losses (Loshchilov & Hutter 2015)."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_tapeops.paths import LayerTree
from keras_tapeops.registration import register
from keras_tapeops.selection import batch as batches
from keras_tapeops.selection.base import SelectionOption
from keras_tapeops.selection.base import SelectionState
from keras_tapeops.selection.base import fraction_argument


@register
class TopLoss(SelectionOption):
    """Steps on the k = ceil(fraction * batch) examples with the largest loss.

    The whole batch is forwarded once without a tape (inference mode), the
    compiled loss is computed per example, and the forward and backward pass
    run on the kept examples only (in their batch order): the step's loss is
    the mean loss of the kept examples. `fraction=1` is the stock step.

    Args:
        fraction: the share of each batch kept, in (0, 1]. The fit-time value
            lives in the engine (`kt.callbacks.SelectionSchedule` changes it).

    Returns:
        An option for `compile(sample_selection=...)`.

    Example:
    ```python
    import keras, numpy as np, keras_tapeops as kt
    model = kt.upgrade(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer="sgd", loss="mse", sample_selection=kt.TopLoss(fraction=0.25))
    model.fit(np.ones((16, 4)), np.zeros((16, 1)), batch_size=8, verbose=0)
    ```
    """

    def __init__(self, fraction: float = 0.25) -> None:
        self.fraction = fraction_argument(fraction)

    def bind(self, model: keras.Model, tree: LayerTree) -> TopLossState:
        return TopLossState(self.fraction)

    def get_config(self) -> dict[str, Any]:
        return {"fraction": self.fraction}


class TopLossState(SelectionState):
    """Keeps the top k scores; `score` is the per-example loss."""

    def score(self, model, x, y, sample_weight, losses, ids):
        return losses

    def select(self, model, x, y, sample_weight, losses, ids, y_pred):
        scores = self.score(model, x, y, sample_weight, losses, ids)
        k = batches.kept_count(self.schedule_variable, tf.shape(scores)[0])
        top = tf.math.top_k(scores, k=k, sorted=False).indices
        return tf.sort(top), None
