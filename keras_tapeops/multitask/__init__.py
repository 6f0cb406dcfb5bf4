"""Multi-task training: per-task gradients and loss balancing inside `fit()`.

`compile(loss={...}, task_balancing=...)` with a gradient aggregator
(`keras_tapeops.aggregation`: PCGrad, MGDA, CAGrad, IMTL-G, Aligned-MTL,
UPGrad), a loss weighting (`UncertaintyWeighting`, `DWA`, `GradNorm`,
`FAMO`) or `MeasureConflict`. The engine (`engine.TaskEngine`) reads the
tasks from the model's per-output losses (`task_losses`).

Extension points (see `docs/extending.md`): `LossWeighting` (implement
`pass_weights(context) -> [K]`) and `keras_tapeops.aggregation.Aggregator`
(implement `weights(gramian, context) -> [K]`); both see a `StepContext`.
"""

from keras_tapeops.multitask.conflict import MeasureConflict
from keras_tapeops.multitask.dwa import DWA
from keras_tapeops.multitask.famo import FAMO
from keras_tapeops.multitask.gradnorm import GradNorm
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.multitask.option import LossWeighting
from keras_tapeops.multitask.option import TaskBalancing
from keras_tapeops.multitask.uncertainty import UncertaintyWeighting

__all__ = [
    "DWA",
    "FAMO",
    "GradNorm",
    "LossWeighting",
    "MeasureConflict",
    "StepContext",
    "TaskBalancing",
    "UncertaintyWeighting",
]
