"""Which compile options the JAX step supports, and the refusal of the others."""

from __future__ import annotations

from typing import Any

from keras_tapeops.options import OPTIONS
from keras_tapeops.options import TapeOpsOptions
from keras_tapeops.privacy.refusals import loss_terms_refused
from keras_tapeops.terms.activation import ActivationPenalty
from keras_tapeops.terms.base import Term
from keras_tapeops.terms.custom import LossTerm
from keras_tapeops.terms.penalty import GradientPenalty
from keras_tapeops.transforms.adaptive import AdaptiveClip
from keras_tapeops.transforms.adaptive import CentralizeGradients
from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.transforms.clipping import ClipByGlobalNorm
from keras_tapeops.transforms.clipping import ClipByNorm
from keras_tapeops.transforms.clipping import ClipByValue
from keras_tapeops.transforms.finite import SkipNonFinite
from keras_tapeops.transforms.observe import LogGradientNorm
from keras_tapeops.transforms.update_ratio import LogUpdateRatio

#: The compile options the JAX step applies (the others are refused).
JAX_OPTIONS = (
    "gradient_transforms",
    "loss_terms",
    "micro_batches",
    "accumulation_steps",
    "batch_norm_updates",
    "sharpness_aware",
    "differential_privacy",
)

#: The built-in transforms available on JAX; a user's own `kt.GradientTransform`
#: is too (training state, step gates and `after_apply` hooks included).
JAX_TRANSFORMS = (
    ClipByNorm,
    ClipByGlobalNorm,
    ClipByValue,
    AdaptiveClip,
    CentralizeGradients,
    LogGradientNorm,
    LogUpdateRatio,
    SkipNonFinite,
)

#: The built-in loss terms available on JAX; a user's own `kt.Term` is too.
JAX_TERMS = (LossTerm, ActivationPenalty, GradientPenalty)


def _refuse(name: str, value: Any, what: str = "") -> None:
    raise ValueError(
        f"`{name}`{what} is not available on the JAX backend yet; on JAX, "
        "keras_tapeops supports micro_batches, accumulation_steps, sharpness_aware=kt.SAM(...), "
        "differential_privacy=kt.DPSGD(...), "
        "kt.optimizer_groups, "
        "kt.layerwise_lr_decay, loss_terms with "
        + ", ".join(f"kt.{t.__name__}" for t in JAX_TERMS)
        + " and your own kt.Term, and gradient_transforms with "
        + ", ".join(f"kt.{t.__name__}" for t in JAX_TRANSFORMS)
        + " and your own kt.GradientTransform (see docs/backends.md). "
        f"Use KERAS_BACKEND=tensorflow for it. Received: {name}={value!r}"
    )


def pop_jax_options(kwargs: dict[str, Any]) -> TapeOpsOptions:
    """Validated options from `compile()`'s kwargs, refusing what JAX lacks.

    Each option that is set and not in `JAX_OPTIONS` raises before anything
    is validated or compiled (its classes may need TensorFlow).

    Args:
        kwargs: `compile()`'s keyword arguments; the option keywords are
            removed, the stock ones stay.

    Returns:
        A `TapeOpsOptions` (only the options in `JAX_OPTIONS` may be set).
    """
    given = {option.name: kwargs.pop(option.name) for option in OPTIONS if option.name in kwargs}
    for option in OPTIONS:
        if option.name not in given or option.name in JAX_OPTIONS:
            continue
        value = given[option.name]
        if option.kind in ("int", "choice"):
            value = option.validate(value)  # TypeError/ValueError for bad input first
        if option.is_set(value):
            _refuse(option.name, value)
    options = TapeOpsOptions(**given)
    for transform in options.gradient_transforms:
        check_jax_transform(transform)
    for term in options.loss_terms:
        check_jax_term(term)
    check_jax_privacy(options)
    return options


def check_jax_privacy(options: TapeOpsOptions) -> None:
    """Refuses what `kt.DPSGD` does not combine with on JAX yet (before compiling).

    Args:
        options: the validated options.
    """
    private = options.differential_privacy
    if private is None:
        return
    if options.loss_terms:
        raise loss_terms_refused([term.name for term in options.loss_terms])


def check_jax_term(term: Term) -> None:
    """Raises ValueError for a loss term the JAX step cannot compute.

    Args:
        term: a `kt.Term`.
    """
    cls = type(term)
    if not isinstance(term, JAX_TERMS) and cls.__module__.startswith("keras_tapeops."):
        _refuse("loss_terms", [term], f" with {cls.__name__}")


def check_jax_transform(transform: GradientTransform) -> None:
    """Raises ValueError for a transform the JAX step cannot run.

    Args:
        transform: a `kt.GradientTransform`.
    """
    cls = type(transform)
    if not isinstance(transform, JAX_TRANSFORMS) and cls.__module__.startswith("keras_tapeops."):
        _refuse("gradient_transforms", [transform], f" with {cls.__name__}")
