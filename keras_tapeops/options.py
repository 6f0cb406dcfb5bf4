"""Validation, state and serialization of the keras_tapeops compile options."""

import keras

from keras_tapeops.terms.base import Term
from keras_tapeops.transforms.base import GradientTransform

OPTION_NAMES = (
    "gradient_transforms",
    "loss_terms",
    "micro_batches",
    "accumulation_steps",
    "batch_norm_updates",
)

BATCH_NORM_UPDATES = ("large_batch", "per_micro_batch")


class TapeOpsOptions:
    """The keras_tapeops options of one `compile()` call, validated.

    Args:
        gradient_transforms: list of `GradientTransform`, applied in order.
        loss_terms: list of `Term`.
        micro_batches: int >= 1, splits of every batch.
        accumulation_steps: int >= 1, batches per optimizer step.
        batch_norm_updates: with `micro_batches > 1`, how BatchNormalization
            moving statistics are updated: `"large_batch"` (one update with
            the whole batch's statistics, as stock Keras on the large batch)
            or `"per_micro_batch"` (one update per micro-batch).

    Returns:
        An options object; raises ValueError/TypeError naming the argument.

    Example:
    ```python
    TapeOpsOptions(gradient_transforms=[kt.ClipByNorm(1.0)])
    ```
    """

    def __init__(
        self,
        gradient_transforms=None,
        loss_terms=None,
        micro_batches=1,
        accumulation_steps=1,
        batch_norm_updates="large_batch",
    ):
        self.transforms = _validate_list(
            gradient_transforms, GradientTransform, "gradient_transforms",
            "kt.GradientTransform (e.g. kt.ClipByNorm(1.0))",
        )
        self.terms = _validate_list(
            loss_terms, Term, "loss_terms",
            "loss term (e.g. kt.LossTerm(fn) or kt.ActivationPenalty(...))",
        )
        _check_term_names(self.terms)
        self.micro_batches = validate_positive_int(micro_batches, "micro_batches")
        self.accumulation_steps = validate_positive_int(
            accumulation_steps, "accumulation_steps"
        )
        self.batch_norm_updates = validate_choice(
            batch_norm_updates, "batch_norm_updates", BATCH_NORM_UPDATES
        )
        self.term_trackers = {}
        self.accumulator = None
        self.terms_built = False
        self.names_checked = False  # term names seen against built metrics
        self.built = False

    @property
    def is_stock(self):
        """True when no option changes the stock step."""
        return not (
            self.transforms
            or self.terms
            or self.micro_batches > 1
            or self.accumulation_steps > 1
        )

    def active_terms(self, training):
        if training:
            return self.terms
        return [t for t in self.terms if t.in_validation]

    def create_trackers(self):
        """Creates one `Mean` metric per term (call inside the strategy scope)."""
        self.term_trackers = {
            term.name: keras.metrics.Mean(name=term.name) for term in self.terms
        }

    def get_config(self):
        return {
            "gradient_transforms": [
                keras.saving.serialize_keras_object(t) for t in self.transforms
            ],
            "loss_terms": [
                keras.saving.serialize_keras_object(t) for t in self.terms
            ],
            "micro_batches": self.micro_batches,
            "accumulation_steps": self.accumulation_steps,
            "batch_norm_updates": self.batch_norm_updates,
        }

    @staticmethod
    def kwargs_from_config(config):
        """Returns compile() keyword arguments from `get_config()` output."""
        kwargs = dict(config)
        for key in ("gradient_transforms", "loss_terms"):
            if kwargs.get(key):
                kwargs[key] = [
                    keras.saving.deserialize_keras_object(c) for c in kwargs[key]
                ]
        return kwargs


def validate_positive_int(value, name):
    """Returns `value` if it is an int >= 1, else raises naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"`{name}` must be a positive integer. Received: {name}={value!r} "
            f"of type {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(
            f"`{name}` must be a positive integer (>= 1). Received: {name}={value}"
        )
    return value


def validate_choice(value, name, choices):
    """Returns `value` if it is one of `choices` (strings), else raises naming `name`."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"`{name}` must be one of {list(choices)}. Received: {name}={value!r}"
        )
    return value


def _validate_list(values, kind, name, example):
    if values is None:
        return []
    if isinstance(values, kind):
        values = [values]
    if not isinstance(values, (list, tuple)):
        raise TypeError(
            f"`{name}` must be a list of {example}. Received: {name}={values!r}"
        )
    for i, value in enumerate(values):
        if not isinstance(value, kind):
            raise TypeError(
                f"`{name}` must be a list of {example}; item {i} is not. "
                f"Received: {name}[{i}]={value!r}"
            )
    return list(values)


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
