"""keras_tapeops: full control of gradients in Keras 3 without giving up `fit()`.

Example:
```python
import keras_tapeops as kt
model = kt.upgrade(model)
model.compile(optimizer="adam", loss="mse",
              gradient_transforms=[kt.ClipByNorm(1.0, where="head*")])
model.fit(x, y)
```
"""

from typing import TYPE_CHECKING

from keras_tapeops.backend_check import require_supported_backend

_BACKEND = require_supported_backend()


def _installed_version():
    from importlib import metadata

    try:
        return metadata.version("keras-tapeops")
    except metadata.PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"


# On every backend (the JAX step: keras_tapeops.backend.jax).
from keras_tapeops import backend  # noqa: E402,F401  (kt.backend.name())
from keras_tapeops.groups import optimizer_groups  # noqa: E402
from keras_tapeops.layerwise_decay import layerwise_lr_decay  # noqa: E402
from keras_tapeops.terms.activation import ActivationPenalty  # noqa: E402
from keras_tapeops.terms.base import Term  # noqa: E402
from keras_tapeops.terms.base import TermContext  # noqa: E402
from keras_tapeops.terms.custom import LossTerm  # noqa: E402
from keras_tapeops.terms.penalty import GradientPenalty  # noqa: E402
from keras_tapeops.penalty import gradient_penalty  # noqa: E402
from keras_tapeops.sam import SAM  # noqa: E402
from keras_tapeops import privacy  # noqa: E402  (kt.privacy.epsilon, ...; poisson_batches on TF)
from keras_tapeops.privacy.dpsgd import DPSGD  # noqa: E402
from keras_tapeops.transforms.adaptive import AdaptiveClip  # noqa: E402
from keras_tapeops.transforms.adaptive import CentralizeGradients  # noqa: E402
from keras_tapeops.transforms.base import GradientTransform  # noqa: E402
from keras_tapeops.transforms.clipping import ClipByGlobalNorm  # noqa: E402
from keras_tapeops.transforms.clipping import ClipByNorm  # noqa: E402
from keras_tapeops.transforms.clipping import ClipByValue  # noqa: E402
from keras_tapeops.transforms.finite import SkipNonFinite  # noqa: E402
from keras_tapeops.transforms.observe import LogGradientNorm  # noqa: E402
from keras_tapeops.transforms.update_ratio import LogUpdateRatio  # noqa: E402
from keras_tapeops.upgrade import TapeOpsFunctional  # noqa: E402
from keras_tapeops.upgrade import TapeOpsSequential  # noqa: E402
from keras_tapeops.upgrade import upgrade  # noqa: E402
from keras_tapeops import callbacks  # noqa: E402  (kt.callbacks.PrivacyBudget; the rest on TF)
from keras_tapeops import gan  # noqa: E402,F401  (kt.gan.losses, kt.gan.DiscriminatorPenalty)
from keras_tapeops.gan import GAN  # noqa: E402
from keras_tapeops.gan import R1Penalty  # noqa: E402
from keras_tapeops.gan import WGANGP  # noqa: E402
from keras_tapeops.gan import WGANGradientPenalty  # noqa: E402

if TYPE_CHECKING or _BACKEND == "tensorflow":
    from keras_tapeops.mixin import TapeOpsMixin  # noqa: E402
    from keras_tapeops import accumulation  # noqa: E402,F401  (kt.accumulation.micro_batch_sizes; not in __all__)
    from keras_tapeops import attacks  # noqa: E402  (kt.attacks.FGSM, kt.attacks.PGD, ...)
    from keras_tapeops import attribution  # noqa: E402  (kt.attribution.saliency, ...)
    from keras_tapeops import meta  # noqa: E402  (kt.meta.InnerSGD)
    from keras_tapeops.meta import MetaLearner  # noqa: E402
    from keras_tapeops.second_order import hessian_vector_product  # noqa: E402
    from keras_tapeops.second_order import top_hessian_eigenvalue  # noqa: E402
    from keras_tapeops.terms.adversarial import TRADES  # noqa: E402
    from keras_tapeops.terms.adversarial import AdversarialLoss  # noqa: E402
    from keras_tapeops import physics  # noqa: E402  (kt.physics.BoxSampler, ...)
    from keras_tapeops.derivatives import input_derivatives  # noqa: E402
    from keras_tapeops.physics.condition import ConditionLoss  # noqa: E402
    from keras_tapeops.physics.residual import PDEResidual  # noqa: E402
    from keras_tapeops.aggregation import AlignedMTL, CAGrad, IMTLG, MGDA, PCGrad, UPGrad  # noqa: E402,E501
    from keras_tapeops.aggregation import Aggregator  # noqa: E402
    from keras_tapeops.multitask import DWA, FAMO, GradNorm, MeasureConflict, UncertaintyWeighting  # noqa: E402,E501
    from keras_tapeops.multitask import LossWeighting  # noqa: E402
    from keras_tapeops.selection import (
        ImportanceSampling,
        ReducibleLoss,
        SelectiveBackprop,
        SelfPaced,
        SuperLoss,
        TopLoss,
    )  # noqa: E402,E501
    from keras_tapeops.selection import SelectionRule  # noqa: E402
else:
    from keras_tapeops.upgrade import TapeOpsMixin  # noqa: E402  (keras_tapeops.backend.jax.mixin)

__version__ = _installed_version()  # one source: `version` in pyproject.toml

__all__ = [
    # The model side.
    "TapeOpsFunctional",
    "TapeOpsMixin",
    "TapeOpsSequential",
    "upgrade",
    # Gradient transforms (compile(gradient_transforms=[...])).
    "ClipByGlobalNorm",
    "ClipByNorm",
    "ClipByValue",
    "AdaptiveClip",
    "CentralizeGradients",
    "GradientTransform",
    "LogGradientNorm",
    "LogUpdateRatio",
    "SkipNonFinite",
    # Loss terms (compile(loss_terms=[...])).
    "ActivationPenalty",
    "GradientPenalty",
    "AdversarialLoss",
    "TRADES",
    "LossTerm",
    "Term",
    "TermContext",
    # Optimizers per layer group (stock keras.optimizers.MultiOptimizer).
    "layerwise_lr_decay",
    "optimizer_groups",
    # Sharpness-aware minimization (compile(sharpness_aware=...)) and curvature.
    "SAM",
    "callbacks",
    "hessian_vector_product",
    "top_hessian_eigenvalue",
    # Gradient penalties and GANs.
    "WGANGP",
    "GAN",
    "R1Penalty",
    "WGANGradientPenalty",
    "gradient_penalty",
    # Differential privacy (compile(differential_privacy=...)) and its accounting.
    "DPSGD",
    "privacy",
    # Input gradients: attacks, adversarial training terms, attribution.
    "attacks",
    "attribution",
    # Meta-learning: MAML, first-order MAML, Reptile, ANIL, Meta-SGD.
    "MetaLearner",
    "meta",
    # Physics-informed training: input derivatives, residual and condition terms.
    "input_derivatives",
    "PDEResidual",
    "ConditionLoss",
    "physics",
    # Multi-task (compile(task_balancing=...)): gradient aggregators, loss weightings, conflict.
    "PCGrad",
    "MGDA",
    "CAGrad",
    "IMTLG",
    "AlignedMTL",
    "UPGrad",
    "UncertaintyWeighting",
    "DWA",
    "GradNorm",
    "FAMO",
    "MeasureConflict",
    "Aggregator",
    "LossWeighting",
    # Loss-based selection (compile(sample_selection=...)) and reweighting.
    "TopLoss",
    "ReducibleLoss",
    "SelectiveBackprop",
    "ImportanceSampling",
    "SelfPaced",
    "SuperLoss",
    "SelectionRule",
]

if _BACKEND != "tensorflow":
    # The names the JAX step does not support yet: `kt.<name>` says so.
    _TENSORFLOW_ONLY = frozenset(name for name in __all__ if name not in globals())
    __all__ = [name for name in __all__ if name not in _TENSORFLOW_ONLY]

    def __getattr__(name: str) -> object:
        if name in _TENSORFLOW_ONLY:
            raise AttributeError(
                f"kt.{name} is not available on the {_BACKEND} backend yet (keras_tapeops "
                f"{__version__}); it needs KERAS_BACKEND=tensorflow. On {_BACKEND}: "
                + ", ".join(f"kt.{n}" for n in __all__)
                + ". See docs/backends.md."
            )
        raise AttributeError(f"module 'keras_tapeops' has no attribute {name!r}")
