"""`ModelState`: what one model resolved from its compiled keras_tapeops options.

The options, transforms and terms are immutable configuration; everything a
model derives from them lives here, one object per model and compilation:

- each term's state (`term.bind(model)`: e.g. the resolved layer),
- each transform's state (`transform.bind(model, variables)`: the selection),
- one `Mean` tracker per term, and the cross-batch accumulator.

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
        self.accumulator = None
        self.metric_names_checked = False
        self._bound_variables = None
        if model.built:
            self.bind_variables(model, tree)

    def create_trackers(self):
        """One `Mean` per term (call inside the model's strategy scope)."""
        self.term_trackers = {
            term.name: keras.metrics.Mean(name=term.name)
            for term in self.options.loss_terms
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
        transforms = [
            (t, t.bind(model, variables, tree)) for t in options.gradient_transforms
        ]
        if options.accumulates:
            accumulation.check_model(model, options)
        if options.accumulation_steps > 1:
            with model.distribute_strategy.scope():
                self.accumulator = accumulation.CrossBatchAccumulator(
                    model, options.accumulation_steps
                )
        self.transforms = transforms
        self._bound_variables = key

    @property
    def variables_bound(self):
        """True once transforms are bound to the model's trainable variables."""
        return self._bound_variables is not None
