"""Physics-informed training with `fit`: residual and condition terms, point samplers.

`kt.PDEResidual` and `kt.ConditionLoss` are loss terms (`compile(loss_terms=)`)
evaluated on their own points, drawn from a sampler at every optimizer step;
`kt.physics.lbfgs` refines a model after `fit` on the same objective. See
docs/physics_informed.md.
"""

from keras_tapeops.physics.condition import ConditionLoss  # noqa: F401  (also kt.physics.*)
from keras_tapeops.physics.lbfgs import lbfgs
from keras_tapeops.physics.residual import PDEResidual  # noqa: F401  (also kt.physics.*)
from keras_tapeops.physics.samplers import BoxSampler
from keras_tapeops.physics.samplers import FixedPoints
from keras_tapeops.physics.samplers import Sampler

# The terms are documented once, as kt.PDEResidual and kt.ConditionLoss.
__all__ = ["BoxSampler", "FixedPoints", "Sampler", "lbfgs"]
