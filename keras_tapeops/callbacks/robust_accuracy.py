"""`RobustAccuracy`: logs accuracy under attack at the end of every epoch."""

from __future__ import annotations

from typing import Any

from keras_tapeops import validation
from keras_tapeops.attacks.base import Attack
from keras_tapeops.attacks.robustness import RobustnessEvaluator
from keras_tapeops.callbacks.epoch_measure import EpochMeasure
from keras_tapeops.registration import register
from keras_tapeops.typing_aliases import Data


@register
class RobustAccuracy(EpochMeasure):
    """Writes the accuracy under `attack` on `data` into the epoch logs.

    At the end of every epoch (every `every` epochs) it runs
    `kt.attacks.evaluate_robustness(model, data, attack)` (one traced batch
    function, kept between epochs) and logs its `robust_accuracy` under
    `name`, so History, the progress bar, CSVLogger and TensorBoard show it,
    and `EarlyStopping(monitor=name, mode="max", restore_best_weights=True)`
    catches catastrophic overfitting (Wong et al. 2020: FGSM training whose
    PGD accuracy collapses within an epoch). List this callback before the
    callbacks that read the value. The attack runs in inference mode and
    changes nothing in the model.

    Args:
        data: a finite `tf.data.Dataset` of `(x, y[, sample_weight])`
            batches (the same batches each epoch), or a tuple
            `(x, y[, sample_weight])` of arrays.
        attack: a `kt.attacks` attack, e.g. `kt.attacks.PGD(8/255, 2/255,
            steps=20)`. With a `seed`, every epoch attacks with the same
            random starts.
        name: the log key.
        batch_size: for a tuple `data`: None (one batch) or a positive int.
        every: positive int, the period in epochs (epochs 0, every, ...).

    Example:
    ```python
    pgd = kt.attacks.PGD(0.1, steps=5, clip=(0.0, 1.0), seed=0)
    robust = kt.callbacks.RobustAccuracy((x, y), pgd, batch_size=32)
    stop = keras.callbacks.EarlyStopping(monitor="robust_accuracy", mode="max",
                                         patience=2, restore_best_weights=True)
    history = model.fit(x, y, epochs=2, verbose=0, callbacks=[robust, stop])
    history.history["robust_accuracy"]
    ```
    """

    def __init__(
        self,
        data: Data,
        attack: Attack,
        name: str = "robust_accuracy",
        batch_size: int | None = None,
        every: int = 1,
    ) -> None:
        self.evaluator = RobustnessEvaluator(attack)
        self.attack = attack
        if batch_size is not None:
            batch_size = validation.positive_int(batch_size, "batch_size")
        self.batch_size = batch_size
        super().__init__(data, name, every)

    def measure(self) -> float:
        """Runs the attack on `data`; returns the robust accuracy (a float)."""
        result = self.evaluator(self.model, self.data, self.batch_size)
        return result["robust_accuracy"]

    def get_config(self) -> dict[str, Any]:
        """The arguments; `data` is held by reference (not JSON-serializable)."""
        return {
            "data": self.data,
            "attack": self.attack,
            "name": self.name,
            "batch_size": self.batch_size,
            "every": self.every,
        }
