"""`GradualUnfreezing`: keep parts of a model frozen until an epoch or a step.

ULMFiT-style gradual unfreezing inside one `fit()`, without recompiling:
while a selection is frozen its variables are not trainable, so the step
neither computes their gradients (the backward pass stops below the lowest
trainable layer) nor updates them, and their optimizer is not called (with
`kt.optimizer_groups`, a group frozen until step k makes its first update at
step k with its own step counter at 0, as if its optimizer had been created
then: Adam's bias correction starts afresh).

How it works, in Keras 3 terms:

- Frozen means what `layer.trainable = False` means in Keras. A layer all of
  whose own trainable variables are in the frozen selection gets
  `layer.trainable = False` (so a BatchNormalization layer runs in inference
  mode, normalizing with its moving statistics and not updating them, as
  Keras's own fine-tuning recipe freezes it); a layer only part of whose
  variables are selected (a `"*/kernel"` glob) keeps its flag and only the
  selected variables get `variable.trainable = False`. Unfreezing gives the
  layer back `trainable = True`. A layer with no trainable variables of its
  own (a container model, or a BatchNormalization with `center=False,
  scale=False`) is never selected, so it keeps its behaviour.
- The change takes effect at the next step: the callback re-creates the train
  function (`model.make_train_function(force=True)`, one new trace per
  change) and re-synchronizes a MultiOptimizer with the new variable list
  (`MultiOptimizer.apply` insists on exactly the variables it was built
  with). A plain optimizer needs no change: it keeps state for every variable
  it was built with.
- Optimizer state for the frozen variables exists from the start (Keras
  builds the optimizer before the first step, while everything is still
  trainable; a group that was already frozen then is built here), so the
  saved optimizer has the same variables before and after unfreezing, and
  `model.save`/`BackupAndRestore` work at any point.
- `unit="step"` counts applied optimizer steps (`optimizer.iterations`, so
  with `accumulation_steps=k` a step is k batches); the change happens at
  the first batch boundary where the count reaches `at` (with
  `steps_per_execution=n`, at a multiple of n batches), never inside an
  accumulation window. `unit="epoch"` changes at the start of epoch `at`.
- At the end of `fit` every selected variable gets back the `trainable`
  flag it had when `fit` started, so a later `fit` or `compile` sees the
  model as it was.
"""

from __future__ import annotations

from typing import Sequence
from typing import TYPE_CHECKING
import numbers
from typing import Any

import keras
import numpy as np

from keras_tapeops._keras import optimizers as _keras_optimizers
from keras_tapeops._keras import private as _keras_private
from keras_tapeops import selectors
from keras_tapeops.callbacks.group_learning_rate import check_verbose
from keras_tapeops.groups import check_selector_pair
from keras_tapeops.groups import trainable_capable_variables
from keras_tapeops.registration import register
from keras_tapeops.selectors import Selector
from keras_tapeops.typing_aliases import Logs

if TYPE_CHECKING:
    from typing_extensions import Self

UNITS = ("epoch", "step")


@register
class GradualUnfreezing(keras.callbacks.Callback):
    """Keeps each selection frozen until epoch (or optimizer step) `at`.

    Args:
        schedule: a list of `(where, at)` pairs (or a dict `{where: at}`):
            `where` is a selector as in `gradient_transforms` (a layer path
            or glob such as `"backbone/*"`, a list of them, a layer, a
            callable `variable -> bool`), `at` a non-negative int: the
            variables are frozen while the position is below `at` and train
            from `at` on. Selections must not overlap.
        unit: `"epoch"` (0-based epoch index, as `fit` counts) or `"step"`
            (applied optimizer steps, `optimizer.iterations`).
        verbose: 0 or 1 (print each change).

    Example:
    ```python
    # head from the start, the top of the backbone from epoch 1, the rest from epoch 2
    model.fit(x, y, epochs=4, callbacks=[kt.callbacks.GradualUnfreezing(
        [("backbone/block_3*", 1), (["backbone/block_1*", "backbone/block_2*"], 2)])])
    ```
    """

    def __init__(
        self,
        schedule: Sequence[tuple[Selector, int]] | dict[Any, int],
        unit: str = "epoch",
        verbose: int = 0,
    ) -> None:
        super().__init__()
        self.schedule = _check_schedule(schedule)
        if not isinstance(unit, str) or unit not in UNITS:
            raise ValueError(f"`unit` must be one of {list(UNITS)}. Received: unit={unit!r}")
        self.unit = unit
        self.verbose = check_verbose(verbose)
        self._entries: list[Any] = []  # [(variables, at)] resolved for the model in fit
        self._frozen: frozenset[Any] = frozenset()
        self._initial_flags: dict[Any, Any] = {}
        self._layers: list[Any] = []  # [(layer, ids of its own trainable variables)]
        self._initial_layer_flags: dict[Any, Any] = {}
        self._done = False

    # ------------------------------------------------------------ callbacks
    def on_train_begin(self, logs: Logs = None) -> None:
        model = self.model
        capable = trainable_capable_variables(model)
        owner: dict[int, int] = {}  # id(variable) -> schedule entry
        entries = []
        for i, (where, at) in enumerate(self.schedule):
            mask = selectors.select(where, model, capable)
            chosen = [v for v, on in zip(capable, mask) if on]
            for v in chosen:
                if id(v) in owner:
                    raise ValueError(
                        f"Variable {v.path!r} is in two entries of the "
                        f"GradualUnfreezing schedule: {owner[id(v)]} and {i}. "
                        f"Received: schedule={self.schedule!r}"
                    )
                owner[id(v)] = i
            entries.append((chosen, at))
        self._entries = entries
        scheduled = [v for chosen, _ in entries for v in chosen]
        self._initial_flags = {id(v): (v, v.trainable) for v in scheduled}
        self._layers = frozen_layers_of(model, {id(v) for v in scheduled})
        self._initial_layer_flags = {
            id(layer): (layer, layer.trainable) for layer, _ in self._layers
        }
        self._frozen = frozenset(id(v) for v in scheduled if not v.trainable)
        self._done = False
        self._prepare_optimizer(capable, scheduled)
        if self.unit == "step":
            self._update(self._position(None))

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        self._update(self._position(epoch))

    def on_train_batch_begin(self, batch: int, logs: Logs = None) -> None:
        if self.unit == "step" and not self._done:
            self._update(self._position(None))

    def on_train_end(self, logs: Logs = None) -> None:
        changed = False
        for layer, flag in self._initial_layer_flags.values():
            if layer.trainable != flag:
                layer.trainable = flag
                changed = True
        for v, flag in self._initial_flags.values():
            if v.trainable != flag:
                v.trainable = flag
                changed = True
        if changed:
            self._resync()
        self._entries = []
        self._initial_flags = {}
        self._layers = []
        self._initial_layer_flags = {}
        self._frozen = frozenset()

    # ---------------------------------------------------------------- helpers
    def _position(self, epoch):
        if self.unit == "epoch":
            return epoch
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def _update(self, position):
        if position is None:
            return
        wanted = frozenset(id(v) for chosen, at in self._entries if position < at for v in chosen)
        self._done = not wanted
        layers_agree = all(layer.trainable == (not own <= wanted) for layer, own in self._layers)
        if wanted == self._frozen and layers_agree:
            return
        state = getattr(self.model, "tapeops_state", None)
        accumulator = getattr(state, "accumulator", None)
        if accumulator is not None and accumulator.pending_batches():
            return  # never inside an accumulation window; next batch
        for layer, own in self._layers:  # first: its setter sets its variables
            layer.trainable = not own <= wanted
        for chosen, at in self._entries:
            for v in chosen:
                v.trainable = id(v) not in wanted
        unfrozen = len(self._frozen - wanted)
        frozen = len(wanted - self._frozen)
        self._frozen = wanted
        self._resync()
        if self.verbose:
            print(
                f"\nGradualUnfreezing at {self.unit} {position}: {unfrozen} "
                f"variables unfrozen, {frozen} frozen; {len(wanted)} frozen now."
            )

    def _resync(self):
        model = self.model
        sync_multi_optimizer(model, list(model.trainable_variables))
        model.make_train_function(force=True)

    def _prepare_optimizer(self, capable, scheduled):
        """The optimizer holds state for every scheduled variable, or this raises."""
        model = self.model
        if model.optimizer is None:
            return
        ids = {id(v) for v in scheduled}
        full = [v for v in capable if v.trainable or id(v) in ids]
        inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        if not inner.built:
            with model.distribute_strategy.scope():
                model.optimizer.build(full)
        missing = [v for v in scheduled if not optimizer_knows(model.optimizer, v)]
        if missing and getattr(inner, "optimizers", None) is not None:
            # A group that was entirely frozen when Keras built the
            # MultiOptimizer has no state yet: building on the full list
            # builds it (groups already built are left as they are).
            sync_multi_optimizer(model, full)
            missing = [v for v in scheduled if not optimizer_knows(model.optimizer, v)]
        if missing:
            raise ValueError(
                "GradualUnfreezing cannot unfreeze "
                f"{[v.path for v in missing]}: the optimizer was built while "
                "they were frozen and holds no state for them (Keras optimizers "
                "cannot grow). Leave them trainable when `fit` starts and let "
                "GradualUnfreezing freeze them, or give them an optimizer group "
                "of their own."
            )
        sync_multi_optimizer(model, list(model.trainable_variables))

    def get_config(self) -> dict[str, Any]:
        return {
            "schedule": [[selectors.serialize_selector(w), at] for w, at in self.schedule],
            "unit": self.unit,
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        config["schedule"] = [
            (selectors.deserialize_selector(w), at) for w, at in config["schedule"]
        ]
        return cls(**config)


def frozen_layers_of(model, scheduled):
    """Layers a schedule freezes as a whole: `[(layer, ids of its own variables)]`.

    A layer qualifies when it has trainable variables of its own (created
    trainable, frozen now or not) and every one of them is scheduled; its
    sublayers are handled on their own (a container's `trainable` setter
    would reach into them).

    Args:
        model: the model being trained.
        scheduled: ids of every variable of the schedule.

    Returns:
        The qualifying layers, each with the ids of its own variables.
    """
    out = []
    for layer in _keras_private.all_layers(model):
        own = {id(v) for v in own_trainable_capable_variables(layer)}
        if own and own <= scheduled and not _keras_private.direct_sublayers(layer):
            out.append((layer, frozenset(own)))
    return out


def own_trainable_capable_variables(layer):
    """The variables `layer` itself created trainable (frozen now or not).

    Keras keeps them only in a private list, the one its `trainable` setter
    walks; no public API lists a layer's own variables apart from its
    sublayers'. See `keras_tapeops._keras.private.created_trainable_variables`.
    """
    return _keras_private.created_trainable_variables(layer)


def sync_multi_optimizer(model, variables):
    """Re-binds a (possibly loss-scaled) MultiOptimizer to `variables`.

    `MultiOptimizer.apply` requires exactly the variables it was built with.
    Building it again (after `built = False`) recomputes its variable map;
    sub-optimizers already built keep their state and a sub-optimizer not
    built yet is built on its variables. Does nothing for other optimizers.
    """
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "optimizers", None) is None:
        return
    with model.distribute_strategy.scope():
        inner.built = False
        inner.build(list(variables))


def optimizer_knows(optimizer, variable):
    """True if `optimizer` (or one of its sub-optimizers) was built with `variable`.

    Keras keeps the variables an optimizer was built with only in a private
    index (what `apply` checks its gradients against); no public API tells.
    See `keras_tapeops._keras.optimizers.was_built_with`.
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    subs = getattr(optimizer, "optimizers", None) or [optimizer]
    return any(_keras_optimizers.was_built_with(sub, variable) for sub in subs)


def _check_schedule(schedule):
    if isinstance(schedule, dict):
        schedule = list(schedule.items())
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise TypeError(
            "`schedule` must be a non-empty list of (where, at) pairs, e.g. "
            f"[('backbone/*', 2)]. Received: schedule={schedule!r}"
        )
    out = []
    for i, pair in enumerate(schedule):
        where, at = check_selector_pair(
            pair, i, "schedule", "at", "the whole model", "name the part to keep frozen"
        )
        if isinstance(at, (bool, np.bool_)) or not isinstance(at, numbers.Integral) or at < 0:
            raise ValueError(
                f"`at` must be a non-negative integer (an epoch or a step). "
                f"Received: schedule[{i}]={pair!r}"
            )
        out.append((where, int(at)))
    return out
