"""`ModelState`: what one model resolved from its compiled keras_tapeops options.

The options, transforms and terms are immutable configuration; everything a
model derives from them lives here, one object per model and compilation:

- each term's state (`term.bind(model)`: e.g. the resolved layer),
- each transform's state (`transform.bind(model, variables)`: the selection),
- one `Mean` tracker per term, and the cross-batch accumulator,
- the training state it saves (`TrainingState`: the transforms' and the
  multi-gradient engine's variables, which are not weights).

Terms are bound when the state is created (their layers exist even in an
unbuilt model); transforms and the accumulator need the model's variables,
so they are bound as soon as those exist: at `compile()` for a built model,
else before (or, for a model built lazily by its first call, inside) the
first step. A model whose trainable variables change (a layer unfrozen)
rebinds them before its next traced step.
"""

import keras

from keras_tapeops import accumulation
from keras_tapeops import paths
from keras_tapeops.training_state import TrainingState
from keras_tapeops.training_state import transform_state_items
from keras_tapeops.transforms.base import with_hook


class ModelState:
    """The bound state of one model for one `TapeOpsOptions`.

    Args:
        model: the model being compiled.
        options: its validated `TapeOpsOptions`.

    Raises:
        ValueError: if a term or (for a built model) a transform names
        something the model lacks; nothing is stored on the options.

    Example:
    ```python
    state = ModelState(model, TapeOpsOptions(loss_terms=[kt.ActivationPenalty("h", l2=1.0)]))
    state.terms   # [(ActivationPenalty(...), <Dense name='h'>)]
    ```
    """

    def __init__(self, model, options):
        self.options = options
        tree = paths.LayerTree(model)
        self.terms = [(term, term.bind(model, tree)) for term in options.loss_terms]
        self.term_trackers = {}
        self.transforms = None  # [(transform, TransformState)] once bound
        self.sam_selected = None  # the SAM option's selection once bound
        self.accumulator = None
        self.metric_names_checked = False
        self._bound_variables = None
        self.engine = None  # the multi-gradient option's MultiGradientState
        self.saveable = TrainingState(self)
        # "train"/"test" once a step override was seen not to run the mixin's.
        self.replaced_steps = set()
        chosen = options.multi_gradient
        if chosen is not None:
            with model.distribute_strategy.scope():  # its variables, metrics
                self.engine = chosen[1].bind(model, tree)
        if model.built:
            self.bind_variables(model, tree)

    def create_trackers(self):
        """One `Mean` per term (call inside the model's strategy scope)."""
        self.term_trackers = {
            term.name: keras.metrics.Mean(name=term.name) for term in self.options.loss_terms
        }

    def active_terms(self, training):
        """`(term, state)` pairs computed in training or in evaluation."""
        if training:
            return list(self.terms)
        return [(t, s) for t, s in self.terms if t.in_validation]

    def bind_variables(self, model, tree=None):
        """Binds transforms (and the accumulator) to the current trainable variables.

        Does nothing when they are already bound to the same variables.

        Args:
            model: the built model.
            tree: optional `paths.LayerTree(model)` to reuse.

        Returns:
            None. Raises ValueError for a selector that names nothing.
        """
        variables = list(model.trainable_variables)
        key = tuple(id(v) for v in variables)
        if key == self._bound_variables:
            return
        tree = tree or paths.LayerTree(model)
        options = self.options
        with model.distribute_strategy.scope():  # transform variables, metrics
            transforms = [(t, t.bind(model, variables, tree)) for t in options.gradient_transforms]
        _check_metric_names(transforms, options.loss_terms, self.engine)
        sam = options.sharpness_aware
        sam_selected = sam.bind(model, variables, tree) if sam is not None else None
        if options.accumulates:
            accumulation.check_model(model, options)
        if options.accumulation_steps > 1:
            with model.distribute_strategy.scope():
                self.accumulator = accumulation.CrossBatchAccumulator(
                    model, options.accumulation_steps
                )
        if self.engine is not None:
            with model.distribute_strategy.scope():
                self.engine.bind_variables(model, variables, tree)
        self.transforms = transforms
        self.sam_selected = sam_selected
        self._bound_variables = key

    @property
    def transform_variables(self):
        """Variables the bound transforms own (saved with the model), in order."""
        return [v for _, s in self.transforms or [] for v in s.variables.values()]

    @property
    def training_state_variables(self):
        """Transform variables, then the multi-gradient engine's (saved, not weights)."""
        return [variable for _, variable in self.training_state_items()]

    def training_state_items(self):
        """`(key, variable)` of the training state, keyed as saved in files.

        A transform's variable is keyed `"<position in gradient_transforms>.
        <class>.<variable name>"`, an engine's `"<option>.<class>.<index>"`, so
        a file saved with other options restores what matches by key.
        """
        items = transform_state_items(self.transforms or [])
        if self.engine is not None:
            option_name, option = self.options.multi_gradient
            items += [
                (f"{option_name}.{type(option).__name__}.{j}", variable)
                for j, variable in enumerate(self.engine.variables)
            ]
        return items

    @property
    def logged_metrics(self):
        """`{name: description}` of every name this state adds to the logs.

        Term names, the bound transforms' metrics and the engine's metrics;
        each description reads like "LogGradientNorm metric name 'grad_norm'"
        (for messages).
        """
        names = {t.name: f"Loss term name {t.name!r}" for t in self.options.loss_terms}
        for transform, state in self.transforms or []:
            for name in state.metrics:
                names.setdefault(name, f"{type(transform).__name__} metric name {name!r}")
        if self.engine is not None:
            option_name, option = self.options.multi_gradient
            for name in self.engine.metrics:
                names.setdefault(
                    name, f"{option_name}={type(option).__name__} metric name {name!r}"
                )
        return names

    def check_names_against(self, taken, where):
        """Raises if a logged name (`logged_metrics`) is in `taken`.

        Args:
            taken: names stock Keras logs (or will).
            where: what they are, for the message (e.g. "a metric of the model").

        Returns:
            None. Raises ValueError naming the clash, Keras style.
        """
        for name, subject in self.logged_metrics.items():
            if name in taken:
                raise ValueError(
                    f"{subject} clashes with {where} ({sorted(set(taken))}). "
                    f"Received: name={name!r}"
                )

    @property
    def metrics(self):
        """Term trackers, the bound transforms' metrics, then the engine's."""
        return list(self.term_trackers.values()) + self.training_only_metrics

    @property
    def training_only_metrics(self):
        """Metrics that exist only where an optimizer step runs (not in evaluate)."""
        transform_metrics = [m for _, s in self.transforms or [] for m in s.metrics.values()]
        # One metric may log several names (its `result()` a dict): listed once.
        engine = []
        if self.engine is not None:
            engine = list(dict.fromkeys(self.engine.metrics.values()))
        return transform_metrics + engine

    @property
    def gates(self):
        """True if a bound transform may skip a step (`keep_step`)."""
        return bool(with_hook(self.transforms or [], "keep_step"))

    @property
    def variables_bound(self):
        """True once transforms are bound to the model's trainable variables."""
        return self._bound_variables is not None


def _check_metric_names(transforms, terms, engine=None):
    """Raises if a logged name is taken twice, is "loss", or starts with "val_".

    Terms, transform metrics and the multi-gradient engine's metrics are all
    logged in History under their names (term names are checked alone by
    `TapeOpsOptions`). Names stock Keras logs are checked against them in
    `TapeOpsMixin` (at `compile()` and before the first step).
    """
    seen = {term.name: f"loss term {term.name!r}" for term in terms}
    owners = [(type(t).__name__, s.metrics) for t, s in transforms]
    if engine is not None:
        owners.append((f"The {type(engine).__name__} engine", engine.metrics))
    for owner, metrics in owners:
        for name in metrics:
            check_logged_name(owner, name, seen)
            seen[name] = owner


def check_logged_name(owner, name, taken):
    """Raises ValueError if `owner` may not log under `name`.

    Args:
        owner: who logs it (for the message), e.g. "LogGradientNorm".
        name: the logged name.
        taken: `{name: what logs it}` of names already logged.

    Returns:
        None.
    """
    if name in taken or name == "loss":
        raise ValueError(
            f"{owner} logs a metric named {name!r}, which is already taken "
            f"(by {taken.get(name, 'the loss')}). Give it another `name`. "
            f"Received: name={name!r}"
        )
    if name.startswith("val_"):
        raise ValueError(
            f"{owner} logs a metric named {name!r}: names starting with 'val_' "
            "are Keras's validation logs ('val_<name>'), and a training "
            "metric named so would clash with or hide one. Give it another "
            f"`name`. Received: name={name!r}"
        )
