"""The keras_tapeops compile options: validated, immutable configuration.

What a model resolves from them (bound transforms and terms, trackers, the
accumulator) is that model's own state: see `keras_tapeops.state`.
"""

import keras

from keras_tapeops import validation
from keras_tapeops.config_repr import ConfigRepr
from keras_tapeops.multi_gradient import MULTI_GRADIENT_OPTIONS
from keras_tapeops.multi_gradient import MultiGradientOption
from keras_tapeops.multi_gradient import check_combinations
from keras_tapeops.registration import serialize_all
from keras_tapeops.sam import SAM
from keras_tapeops.terms.base import Term
from keras_tapeops.transforms.base import GradientTransform

OPTION_NAMES = (
    "gradient_transforms",
    "loss_terms",
    "micro_batches",
    "accumulation_steps",
    "batch_norm_updates",
    "sharpness_aware",
) + MULTI_GRADIENT_OPTIONS

# What each multi-gradient option expects, for the TypeError message.
_MULTI_GRADIENT_EXAMPLES = {
    "task_balancing": "kt.PCGrad(shared='trunk/*')",
    "differential_privacy": "kt.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1)",
    "sample_selection": "kt.TopLoss(fraction=0.25)",
}

BATCH_NORM_UPDATES = ("large_batch", "per_micro_batch")


class TapeOpsOptions(ConfigRepr):
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
        An immutable options object (one may serve several models); raises
        ValueError/TypeError naming the argument.

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
        sharpness_aware=None,
        task_balancing=None,
        differential_privacy=None,
        sample_selection=None,
    ):
        self.gradient_transforms = validation.instances(
            gradient_transforms, GradientTransform, "gradient_transforms",
            "kt.GradientTransform (e.g. kt.ClipByNorm(1.0))",
        )
        self.loss_terms = validation.instances(
            loss_terms, Term, "loss_terms",
            "loss term (e.g. kt.LossTerm(fn) or kt.ActivationPenalty(...))",
        )
        _check_term_names(self.loss_terms)
        self.micro_batches = validation.positive_int(micro_batches, "micro_batches")
        self.accumulation_steps = validation.positive_int(
            accumulation_steps, "accumulation_steps"
        )
        self.batch_norm_updates = validation.choice(
            batch_norm_updates, "batch_norm_updates", BATCH_NORM_UPDATES
        )
        if sharpness_aware is not None and not isinstance(sharpness_aware, SAM):
            raise TypeError(
                "`sharpness_aware` must be None or a kt.SAM (e.g. "
                f"kt.SAM(rho=0.05)). Received: sharpness_aware={sharpness_aware!r}"
            )
        self.sharpness_aware = sharpness_aware
        given = {
            "task_balancing": task_balancing,
            "differential_privacy": differential_privacy,
            "sample_selection": sample_selection,
        }
        for name, value in given.items():
            if value is not None and not (
                isinstance(value, MultiGradientOption) and value.option_name == name
            ):
                raise TypeError(
                    f"`{name}` must be None or a {name} option (e.g. "
                    f"{_MULTI_GRADIENT_EXAMPLES[name]}). Received: {name}={value!r}"
                )
            setattr(self, name, value)
        check_combinations(self)

    @property
    def multi_gradient(self):
        """`(name, option)` of the multi-gradient option that is set, or None.

        `check_combinations` allows at most one unless an option says it
        combines with another; the first in pipeline order is the engine.
        """
        for name in MULTI_GRADIENT_OPTIONS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    @property
    def transforms(self):
        """The gradient transforms (a tuple)."""
        return self.gradient_transforms

    @property
    def terms(self):
        """The loss terms (a tuple)."""
        return self.loss_terms

    @property
    def is_stock(self):
        """True when no option changes the stock step."""
        return not (
            self.gradient_transforms
            or self.loss_terms
            or self.micro_batches > 1
            or self.accumulation_steps > 1
            or self.sharpness_aware is not None
            or self.multi_gradient is not None
        )

    def set_option_names(self):
        """The options that change the stock step, as `compile()` arguments.

        Returns:
            A list such as `["gradient_transforms", "micro_batches=2"]`;
            empty when `is_stock`.
        """
        names = [n for n in ("gradient_transforms", "loss_terms") if getattr(self, n)]
        names += [
            f"{n}={getattr(self, n)}"
            for n in ("micro_batches", "accumulation_steps")
            if getattr(self, n) > 1
        ]
        names += [
            n for n in ("sharpness_aware",) + MULTI_GRADIENT_OPTIONS
            if getattr(self, n) is not None
        ]
        return names

    @property
    def accumulates(self):
        """True when gradients are summed over micro-batches or batches."""
        return self.micro_batches > 1 or self.accumulation_steps > 1

    def get_config(self, model=None):
        """Returns the options as compile-config entries.

        Args:
            model: the model being saved; layer selectors and layer objects
                are then written as their path in it.

        Returns:
            A JSON-friendly dict. Raises ValueError for a transform, term or
            callable that could not be loaded back.
        """
        return {
            "gradient_transforms": serialize_all(self.gradient_transforms, model),
            "loss_terms": serialize_all(self.loss_terms, model),
            "micro_batches": self.micro_batches,
            "accumulation_steps": self.accumulation_steps,
            "batch_norm_updates": self.batch_norm_updates,
            "sharpness_aware": (
                serialize_all([self.sharpness_aware], model)[0]
                if self.sharpness_aware is not None
                else None
            ),
            **{
                name: (
                    serialize_all([getattr(self, name)], model)[0]
                    if getattr(self, name) is not None
                    else None
                )
                for name in MULTI_GRADIENT_OPTIONS
            },
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
        for key in ("sharpness_aware",) + MULTI_GRADIENT_OPTIONS:
            if kwargs.get(key):
                kwargs[key] = keras.saving.deserialize_keras_object(kwargs[key])
        return kwargs


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
