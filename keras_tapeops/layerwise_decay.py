"""Layer-wise learning-rate decay: lower blocks train more slowly than the top.

`layerwise_lr_decay(model, base_optimizer, decay, layers)` gives the top block
(the last of `layers`) the base learning rate and each block below it `decay`
times the rate of the block above: block `i` of `n` trains at
`base * decay ** (n - 1 - i)`. Variables in no listed block (embeddings, a
stem) are "the rest": by default they train at `base * decay ** n`, one step
below the lowest block, as in the usual recipe (BERT/ELECTRA/BEiT fine-tuning,
where the embeddings get the lowest rate).

Each block gets a clone of `base_optimizer`
(`type(base).from_config(base.get_config())` with the scaled learning rate),
so every clone keeps the base's hyperparameters (betas, weight decay,
epsilon, EMA...). A `LearningRateSchedule` is scaled, not replaced: block `i`
gets `ScaledSchedule(schedule, decay ** (n - 1 - i))`, a registered
schedule that Keras saves and loads; warm-up and decay keep their shape and
every block follows the same curve at its own scale.

The result is the same stock `keras.optimizers.MultiOptimizer` that
`kt.optimizer_groups` returns (same keys, same checks).

Example:
```python
opt = kt.layerwise_lr_decay(
    model, keras.optimizers.AdamW(2e-5), decay=0.8,
    layers=[f"encoder/block_{i}" for i in range(12)] + ["head"],
)
model.compile(optimizer=opt, loss=...)
```
"""

import numbers
from typing import Sequence

import keras
import numpy as np

from keras_tapeops._keras import optimizers as keras_optimizers
from keras_tapeops import groups as groups_module
from keras_tapeops import selectors
from keras_tapeops.selectors import Selector
from keras_tapeops import validation
from keras_tapeops.registration import register

REST_CHOICES = ("lowest", "error")


def layerwise_lr_decay(
    model: keras.Model,
    base_optimizer: keras.optimizers.Optimizer,
    decay: float,
    layers: Sequence[Selector],
    rest: str = "lowest",
) -> keras.optimizers.Optimizer:
    """A MultiOptimizer whose blocks train at geometrically decaying rates.

    Args:
        model: a built Keras model.
        base_optimizer: an unbuilt Keras optimizer (its learning rate, a
            number or a `LearningRateSchedule`, is the top block's). It is
            only read: every block gets a clone.
        decay: the ratio between a block's rate and the rate of the block
            above it, a number in (0, 1].
        layers: the blocks from the bottom to the top: a non-empty list of
            selectors (a layer path or glob, a list of them, a layer, or a
            callable `variable -> bool`), one per block.
        rest: the variables in no block: `"lowest"` (default) trains them at
            `decay ** len(layers)` times the base rate, one step below the
            lowest block (the embeddings, in the usual recipe); `"error"`
            refuses them (the message lists their layers); a number in
            (0, 1] is their multiplier of the base rate.

    Returns:
        A stock `keras.optimizers.MultiOptimizer`. Block `i` (and the rest)
        is a group named `f"{base_optimizer.name}_{i}"` (`..._rest`), usable
        in `kt.callbacks.GroupLearningRateScheduler`.

    Raises:
        TypeError: as `kt.optimizer_groups`, and for a `decay`, `layers` or
            `rest` of the wrong type, or a base learning rate that is
            neither a number nor a `LearningRateSchedule`.
        ValueError: as `kt.optimizer_groups`, and for a `decay` or `rest`
            outside (0, 1], an empty `layers`, or a variable in two blocks.

    Example:
    ```python
    opt = kt.layerwise_lr_decay(model, keras.optimizers.Adam(1e-3), decay=0.5,
                                layers=["block_1", "block_2", "head"])
    # head 1e-3, block_2 5e-4, block_1 2.5e-4, everything else 1.25e-4
    ```
    """
    groups_module.require_multi_optimizer("kt.layerwise_lr_decay")
    groups_module.check_model(model, "layerwise_lr_decay")
    groups_module.check_sub_optimizer(base_optimizer, "base_optimizer")
    decay = validation.finite_number(decay, "decay", minimum=0.0, strict=True)
    if decay > 1.0:
        raise ValueError(f"`decay` must be in (0, 1]. Received: decay={decay!r}")
    if not isinstance(layers, (list, tuple)):
        raise TypeError(
            "`layers` must be a list of block selectors from the bottom to the "
            f"top, e.g. ['block_1', 'block_2', 'head']. Received: layers={layers!r}"
        )
    if not layers:
        raise ValueError(f"`layers` must name at least one block. Received: layers={layers!r}")
    rest = _check_rest(rest)
    base_rate = _base_rate(base_optimizer)
    n = len(layers)
    multipliers = [decay ** (n - 1 - i) for i in range(n)]
    rest_multiplier = decay**n if rest == "lowest" else rest

    variables = groups_module.trainable_capable_variables(model)
    blocks = []
    for i, where in enumerate(layers):
        where = selectors.validate_listed_selector(where, f"layers[{i}]")
        if where is None:
            raise ValueError(
                f"layers[{i}] is None; each block must be a selector. Received: layers={layers!r}"
            )
        blocks.append(where)
    block_of = groups_module.exclusive_owners(
        model,
        variables,
        blocks,
        lambda variable, j, i: (
            f"Variable {variable.path!r} is in two blocks: layers[{j}] "
            f"({selectors.describe(layers[j])}) and layers[{i}] "
            f"({selectors.describe(blocks[i])}). Blocks must not overlap. "
            f"Received: layers={layers!r}"
        ),
    )
    unassigned = [v for v in variables if id(v) not in block_of]
    if unassigned and rest == "error":
        raise ValueError(
            "Some trainable variables are in no block and rest='error'. "
            f"Unassigned layers: {groups_module.unassigned_layers(model, unassigned)}. "
            f"Received: layers={layers!r}"
        )

    clones = [
        clone_with_rate(base_optimizer, base_rate, m, f"{base_optimizer.name}_{i}")
        for i, m in enumerate(multipliers)
    ]
    rest_clone = None
    if unassigned:
        rest_clone = clone_with_rate(
            base_optimizer, base_rate, rest_multiplier, f"{base_optimizer.name}_rest"
        )
    assignment = [
        (v, clones[block_of[id(v)]] if id(v) in block_of else rest_clone) for v in variables
    ]
    # Blocks bottom to top, then the rest (as `default`); or the top block is
    # the default when every variable is in a block.
    return groups_module.build_multi_optimizer(model, assignment, rest_clone)


def clone_with_rate(optimizer, base_rate, multiplier, name):
    """A new, unbuilt copy of `optimizer` at `multiplier` times its rate.

    Args:
        optimizer: the optimizer to copy (only its config is read).
        base_rate: its learning rate, a float or a `LearningRateSchedule`.
        multiplier: a positive float.
        name: the copy's name.

    Returns:
        The copy. Weight-decay exclusions set with
        `optimizer.exclude_from_weight_decay(...)` are copied too (Keras does
        not keep them in the config).
    """
    config = optimizer.get_config()
    config["name"] = name
    if isinstance(base_rate, keras.optimizers.schedules.LearningRateSchedule):
        config["learning_rate"] = (
            base_rate if multiplier == 1.0 else ScaledSchedule(base_rate, multiplier)
        )
    else:
        config["learning_rate"] = base_rate * multiplier
    clone = type(optimizer).from_config(config)
    # `exclude_from_weight_decay()` keeps its arguments only in private
    # attributes (and no config); the clone must exclude the same variables.
    keras_optimizers.copy_weight_decay_exclusions(optimizer, clone)
    return clone


def _base_rate(optimizer):
    """The optimizer's learning rate as a float or a `LearningRateSchedule`.

    Read from `get_config()`, which holds the schedule itself (the public
    `learning_rate` of a scheduled optimizer is only its current value).
    """
    rate = optimizer.get_config().get("learning_rate")
    if isinstance(rate, dict):
        try:
            rate = keras.saving.deserialize_keras_object(rate)
        except (TypeError, ValueError):  # e.g. a lambda, refused by safe mode
            rate = f"<{rate.get('class_name')}>"
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return rate
    if isinstance(rate, numbers.Real) and not isinstance(rate, bool):
        return float(rate)
    raise TypeError(
        "`base_optimizer`'s learning rate must be a number or a "
        "keras.optimizers.schedules.LearningRateSchedule (a plain callable "
        f"cannot be scaled and saved). Received: learning_rate={rate!r}"
    )


def _check_rest(rest):
    if isinstance(rest, str):
        return validation.choice(rest, "rest", REST_CHOICES)
    if isinstance(rest, (bool, np.bool_)) or not isinstance(rest, numbers.Real):
        raise TypeError(
            f"`rest` must be 'lowest', 'error' or a multiplier in (0, 1]. Received: rest={rest!r}"
        )
    value = validation.finite_number(rest, "rest", minimum=0.0, strict=True)
    if value > 1.0:
        raise ValueError(f"`rest` as a multiplier must be in (0, 1]. Received: rest={rest!r}")
    return value


@register
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule multiplied by a constant: `factor * schedule(step)`.

    What `kt.layerwise_lr_decay` gives each block when the base learning rate
    is a schedule: the block follows the schedule's shape (warm-up, decay)
    at its own scale. Saved and loaded by Keras like any schedule.

    Args:
        schedule: a `keras.optimizers.schedules.LearningRateSchedule`.
        factor: a positive number.

    Example:
    ```python
    base = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=1000)
    kt.layerwise_decay.ScaledSchedule(base, 0.5)(0)   # 5e-4
    ```
    """

    def __init__(self, schedule, factor):
        if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError(
                "`schedule` must be a keras.optimizers.schedules."
                f"LearningRateSchedule. Received: schedule={schedule!r}"
            )
        self.schedule = schedule
        self.factor = validation.positive_number(factor, "factor")

    def __call__(self, step):
        return self.schedule(step) * self.factor

    def get_config(self):
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "factor": self.factor,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(**config)

    def __repr__(self):
        return f"ScaledSchedule(schedule={self.schedule!r}, factor={self.factor!r})"
