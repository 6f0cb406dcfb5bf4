"""The keras_tapeops compile options: validated, immutable configuration.

What a model resolves from them (bound transforms and terms, trackers, the
accumulator) is that model's own state: see `keras_tapeops.state`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Optional
from typing import Sequence

import keras

from keras_tapeops import validation
from keras_tapeops.config_repr import ConfigRepr
from keras_tapeops.multi_gradient import MULTI_GRADIENT_OPTIONS
from keras_tapeops.multi_gradient import MultiGradientOption
from keras_tapeops.multi_gradient import check_combinations
from keras_tapeops.registration import serialize_all
from keras_tapeops.transforms.base import GradientTransform

if TYPE_CHECKING:
    from keras_tapeops.attacks.base import Attack
    from keras_tapeops.sam import SAM
    from keras_tapeops.terms.base import Term

# The classes of the TensorFlow-only options (loss terms, SAM, attacks) are
# imported when such an option is validated, so that this table loads on
# every backend; on JAX `compile()` refuses them before validating.

BATCH_NORM_UPDATES = ("large_batch", "per_micro_batch")

# What each multi-gradient option expects, for the TypeError message.
_MULTI_GRADIENT_EXAMPLES = {
    "task_balancing": "kt.PCGrad(shared='trunk/*')",
    "differential_privacy": "kt.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1)",
    "sample_selection": "kt.TopLoss(fraction=0.25)",
}


class Option:
    """One row of the option table: a `compile()` keyword argument.

    Args:
        name: the keyword.
        default: its default (the stock step).
        kind: `"list"` (a list of serializable objects), `"int"` (a
            positive count), `"choice"` (one of `choices`) or `"object"`
            (None or one serializable object).
        validate: `value -> validated value`, raising TypeError/ValueError
            naming the argument.
        doc: one line for `compile()`'s docstring.
        annotation: the keyword's type in `compile()`'s signature.
    """

    def __init__(
        self,
        name: str,
        default: Any,
        kind: str,
        validate: Callable[[Any], Any],
        doc: str,
        annotation: Any = inspect.Parameter.empty,
    ) -> None:
        self.name = name
        self.default = default
        self.kind = kind
        self.validate = validate
        self.doc = doc
        self.annotation = annotation

    def is_set(self, value: Any) -> bool:
        """True when `value` changes the stock step."""
        if self.kind == "list":
            return bool(value)
        if self.kind == "int":
            return value > 1
        if self.kind == "object":
            return value is not None
        return False  # a choice only matters with another option set

    def label(self, value: Any) -> str:
        """How `set_option_names` shows a set value."""
        return f"{self.name}={value}" if self.kind == "int" else self.name

    def serialize(self, value: Any, model: keras.Model) -> Any:
        if self.kind == "list":
            return serialize_all(value, model)
        if self.kind == "object":
            return serialize_all([value], model)[0] if value is not None else None
        return value

    def deserialize(self, value: Any) -> Any:
        if self.kind == "list" and value:
            return [keras.saving.deserialize_keras_object(c) for c in value]
        if self.kind == "object" and value:
            return keras.saving.deserialize_keras_object(value)
        return value


def _transforms(value):
    return validation.instances(
        value,
        GradientTransform,
        "gradient_transforms",
        "kt.GradientTransform (e.g. kt.ClipByNorm(1.0))",
    )


def _terms(value):
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return ()
    from keras_tapeops.terms.base import Term

    terms = validation.instances(
        value,
        Term,
        "loss_terms",
        "loss term (e.g. kt.LossTerm(fn) or kt.ActivationPenalty(...))",
    )
    _check_term_names(terms)
    return terms


def _sam(value):
    if value is None:
        return None
    from keras_tapeops.sam import SAM

    if not isinstance(value, SAM):
        raise TypeError(
            "`sharpness_aware` must be None or a kt.SAM (e.g. "
            f"kt.SAM(rho=0.05)). Received: sharpness_aware={value!r}"
        )
    return value


def _attack(value):
    if value is None:
        return None
    from keras_tapeops.attacks.base import check_attack

    return check_attack(value, "adversarial_training")


def _multi_gradient(name):
    def validate(value):
        if value is not None and not (
            isinstance(value, MultiGradientOption) and value.option_name == name
        ):
            raise TypeError(
                f"`{name}` must be None or a {name} option (e.g. "
                f"{_MULTI_GRADIENT_EXAMPLES[name]}). Received: {name}={value!r}"
            )
        return value

    return validate


# The one table of compile options, in pipeline order: it drives `compile()`'s
# signature, validation, `get_config`, `set_option_names` and the combination
# checks (`multi_gradient.check_combinations`).
OPTIONS = (
    Option(
        "gradient_transforms",
        None,
        "list",
        _transforms,
        "list of `kt.GradientTransform`, applied in order to the true "
        "(unscaled, replica-aggregated) gradients.",
        Optional[Sequence[GradientTransform]],
    ),
    Option(
        "loss_terms",
        None,
        "list",
        _terms,
        "list of loss terms added inside the training tape.",
        Optional[Sequence["Term"]],
    ),
    Option(
        "micro_batches",
        1,
        "int",
        lambda v: validation.positive_int(v, "micro_batches"),
        "split every batch into this many micro-batches.",
        int,
    ),
    Option(
        "accumulation_steps",
        1,
        "int",
        lambda v: validation.positive_int(v, "accumulation_steps"),
        "batches per optimizer step.",
        int,
    ),
    Option(
        "batch_norm_updates",
        "large_batch",
        "choice",
        lambda v: validation.choice(v, "batch_norm_updates", BATCH_NORM_UPDATES),
        '`"large_batch"` or `"per_micro_batch"`: how BatchNormalization '
        "moving statistics follow `micro_batches`.",
        str,
    ),
    Option(
        "sharpness_aware",
        None,
        "object",
        _sam,
        "None or a `kt.SAM`: sharpness-aware minimization.",
        Optional["SAM"],
    ),
    Option(
        "adversarial_training",
        None,
        "object",
        _attack,
        "None or a `kt.attacks` attack: train on the attacked inputs only "
        "(Madry et al.; no clean pass).",
        Optional["Attack"],
    ),
) + tuple(
    Option(
        name,
        None,
        "object",
        _multi_gradient(name),
        f"None or a {name} option (e.g. `{_MULTI_GRADIENT_EXAMPLES[name]}`).",
        Optional[MultiGradientOption],
    )
    for name in MULTI_GRADIENT_OPTIONS
)

OPTION_NAMES = tuple(option.name for option in OPTIONS)
OPTION_DEFAULTS = {option.name: option.default for option in OPTIONS}


class TapeOpsOptions(ConfigRepr):
    """The keras_tapeops options of one `compile()` call, validated.

    Takes the keyword arguments of the option table (`OPTIONS`), each
    validated by its row; then the combination rules.

    Args:
        gradient_transforms: list of `GradientTransform`, applied in order.
        loss_terms: list of `Term`.
        micro_batches: int >= 1, splits of every batch.
        accumulation_steps: int >= 1, batches per optimizer step.
        batch_norm_updates: with `micro_batches > 1`, how BatchNormalization
            moving statistics are updated: `"large_batch"` (one update with
            the whole batch's statistics, as stock Keras on the large batch)
            or `"per_micro_batch"` (one update per micro-batch).
        sharpness_aware, task_balancing, differential_privacy,
            sample_selection: None or the option's object.

    Returns:
        An immutable options object (one may serve several models); raises
        ValueError/TypeError naming the argument.

    Example:
    ```python
    TapeOpsOptions(gradient_transforms=[kt.ClipByNorm(1.0)])
    ```
    """

    # Set in __init__, one attribute per row of `OPTIONS` (declared for type checkers).
    gradient_transforms: tuple[GradientTransform, ...]
    loss_terms: tuple[Term, ...]
    micro_batches: int
    accumulation_steps: int
    batch_norm_updates: str
    sharpness_aware: SAM | None
    task_balancing: MultiGradientOption | None
    differential_privacy: MultiGradientOption | None
    sample_selection: MultiGradientOption | None

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(
                f"Unknown keras_tapeops option(s): {', '.join(unknown)}. "
                f"The options are: {', '.join(OPTION_NAMES)}. Received: {unknown}"
            )
        for option in OPTIONS:
            setattr(self, option.name, option.validate(kwargs.get(option.name, option.default)))
        check_combinations(self)

    @classmethod
    def pop_from(cls, kwargs: dict[str, Any]) -> "TapeOpsOptions":
        """Validated options from (and removed from) `compile()`'s kwargs.

        Args:
            kwargs: a dict of `compile()` keyword arguments; the option
                keywords are removed from it, the stock ones stay.

        Returns:
            A `TapeOpsOptions`.
        """
        return cls(**{name: kwargs.pop(name) for name in OPTION_NAMES if name in kwargs})

    @property
    def multi_gradient(self) -> tuple[str, MultiGradientOption] | None:
        """`(name, option)` of the multi-gradient option that is set, or None.

        `check_combinations` allows at most one unless an option says it
        combines with another; the first in pipeline order is the engine.
        """
        for name in MULTI_GRADIENT_OPTIONS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    @property
    def transforms(self) -> tuple[GradientTransform, ...]:
        """The gradient transforms (a tuple)."""
        return self.gradient_transforms

    @property
    def terms(self) -> tuple[Term, ...]:
        """The loss terms (a tuple)."""
        return self.loss_terms

    @property
    def is_stock(self) -> bool:
        """True when no option changes the stock step."""
        return not self.set_option_names()

    def set_option_names(self) -> list[str]:
        """The options that change the stock step, as `compile()` arguments.

        Returns:
            A list such as `["gradient_transforms", "micro_batches=2"]`;
            empty when `is_stock`.
        """
        return [
            option.label(getattr(self, option.name))
            for option in OPTIONS
            if option.is_set(getattr(self, option.name))
        ]

    @property
    def accumulates(self) -> bool:
        """True when gradients are summed over micro-batches or batches."""
        return self.micro_batches > 1 or self.accumulation_steps > 1

    def get_config(self, model: keras.Model = None) -> dict[str, Any]:
        """Returns the options as compile-config entries.

        Args:
            model: the model being saved; layer selectors and layer objects
                are then written as their path in it.

        Returns:
            A JSON-friendly dict. Raises ValueError for a transform, term or
            callable that could not be loaded back.
        """
        return {
            option.name: option.serialize(getattr(self, option.name), model) for option in OPTIONS
        }

    @staticmethod
    def kwargs_from_config(config: dict[str, Any]) -> dict[str, Any]:
        """Returns compile() keyword arguments from `get_config()` output."""
        kwargs = dict(config)
        for option in OPTIONS:
            if option.name in kwargs:
                kwargs[option.name] = option.deserialize(kwargs[option.name])
        return kwargs


def compile_signature(compile_method: Callable[..., Any]) -> inspect.Signature:
    """`compile(self, *args, <the table's options, keyword-only>, **kwargs)`.

    Args:
        compile_method: the mixin's `compile` (`(self, *args, **kwargs)`).

    Returns:
        An `inspect.Signature` for `help()`, IDEs and `inspect.signature`.
    """
    parameters = list(inspect.signature(compile_method).parameters.values())
    var_keyword = parameters.pop()
    options = [
        inspect.Parameter(
            option.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=option.default,
            annotation=option.annotation,
        )
        for option in OPTIONS
    ]
    return inspect.Signature(
        parameters + options + [var_keyword],
        return_annotation=inspect.signature(compile_method).return_annotation,
    )


def _check_term_names(terms):
    """Term names key History and every callback's logs, so they must be distinct.

    A name must be unique, must not be `"loss"` (the logged total) and must
    not start with `"val_"`: Keras logs validation values as `val_<name>`, so
    a term named `"val_loss"` (or `"val_<other term>"`) would be overwritten
    by, or overwrite, a validation entry.
    """
    first_index = {}
    for i, term in enumerate(terms):
        name = term.name
        if name == "loss":
            raise ValueError(
                "A loss term cannot be named 'loss': `loss` is the logged "
                f"total. Received: loss_terms[{i}].name='loss'"
            )
        if name.startswith("val_"):
            raise ValueError(
                "A loss term name cannot start with 'val_': validation logs "
                "are named 'val_<name>' and would clash with it. "
                f"Received: loss_terms[{i}].name={name!r}"
            )
        if name in first_index:
            raise ValueError(
                f"Loss term names must be unique: loss_terms[{first_index[name]}] "
                f"and loss_terms[{i}] are both named {name!r}. "
                f"Received: loss_terms[{i}].name={name!r}"
            )
        first_index[name] = i
