"""`MetaLearner`: MAML and its family (first-order MAML, Reptile, ANIL, Meta-SGD) with `fit()`.

A Keras model that wraps the model being meta-learned (as `kt.WGANGP` wraps
its generator and critic) and trains that model's own variables. Each step
takes a meta-batch of tasks, `x = (support_x, support_y, query_x)`,
`y = query_y` (task axis first); per task it runs `inner_steps` of SGD
(plain by default; mini-batches, momentum, the forward's `training` flag and
the loss reduction are options) on the compiled loss over the support set
with functional weights (the model's variables are never written by the
inner loop), then evaluates the
compiled loss on the query set at the adapted weights. The outer loss is the
mean over tasks of those query losses; it is what `fit` logs as `loss`, and
the compiled metrics are computed on the query predictions at the adapted
weights.
"""

from __future__ import annotations

from typing import Callable
from typing import Sequence
from typing import TYPE_CHECKING
import warnings
from typing import Any
from typing import Optional

import keras
import tensorflow as tf

from keras_tapeops._keras import private
from keras_tapeops import paths
from keras_tapeops import selectors
from keras_tapeops import validation
from keras_tapeops.meta import inner_loop
from keras_tapeops.meta import rates as rates_lib
from keras_tapeops.meta import tasks as tasks_lib
from keras_tapeops.meta.config import MetaConfig
from keras_tapeops.meta.inner_optimizer import InnerSGD
from keras_tapeops.meta.task_loss import TaskLoss
from keras_tapeops.registration import register
from keras_tapeops.typing_aliases import LossLike
from keras_tapeops.typing_aliases import Nested

if TYPE_CHECKING:
    from typing_extensions import Self


@register
class MetaLearner(keras.Model):
    """Meta-learning of `model` with `fit()`: MAML, first-order MAML, Reptile, ANIL, Meta-SGD.

    Per task of a meta-batch: `inner_steps` of SGD on the support set
    (`w' = w - inner_learning_rate * grad`, the compiled loss plus the
    model's regularization losses), then the query loss at `w'`. The inner
    loop's options (all algorithms): `inner_batch_size` (mini-batches of the
    support set), `inner_optimizer` (`kt.meta.InnerSGD(momentum=...)`),
    `inner_training` (the inner forward's `training` flag in `fit`) and
    `inner_loss_reduction` (`"sum"`: the per-example losses summed, as
    keras.io's Reptile differentiates them); docs/meta_learning.md's
    "Reptile, as keras.io writes it" maps that example onto them.

    - `algorithm="maml"` (Finn et al. 2017): the outer loss is the mean
      query loss over tasks, differentiated through the inner updates
      (second order) or with the inner gradients held constant
      (`first_order=True`), and applied by the compiled optimizer.
    - `algorithm="reptile"` (Nichol et al. 2018): the outer gradient is
      `w - mean_over_tasks(w')`; with `SGD(learning_rate=eps)` the step is
      Reptile's `w <- w + eps * (mean(w') - w)`. The query set is only
      evaluated (logged), never trained on.
    - `adapt=<selector>` (ANIL, Raghu et al. 2020): the inner loop adapts only
      the selected variables (`where=` path grammar: `"head"`, `"head/*"`,
      a layer, ...); the outer loop trains every trainable variable.
    - `learn_inner_learning_rate=True` (Meta-SGD, Li et al. 2017): one learned
      inner rate per adapted parameter, initialized to
      `inner_learning_rate`, trained with the weights and saved with the
      learner.

    Forward passes use `training=True` in `fit` (the inner ones
    `inner_training`) and `training=False` in `evaluate`, `predict` and
    `adapt`. Non-trainable variables
    (BatchNormalization statistics, seed states) are read, never updated.
    Calling the learner on `(support_x, support_y, query_x)` returns the query
    predictions at the adapted weights (task axis first); `predict` does
    that for a whole dataset.

    Args:
        model: a built Keras model with one output (the learner).
        inner_learning_rate: positive number, the inner SGD step size.
        inner_steps: int >= 1, inner SGD steps per task (in `fit`, `evaluate`,
            `predict`, and `adapt` by default).
        first_order: bool, first-order MAML (no effect for Reptile, which
            never differentiates through the inner loop).
        algorithm: `"maml"` or `"reptile"`.
        adapt: None (adapt every trainable variable) or a selector of the
            variables to adapt (ANIL). MAML only.
        learn_inner_learning_rate: bool, Meta-SGD. MAML only.
        inner_batch_size: None (default: every inner step on the whole
            support set) or an int >= 1: the support set of K examples is cut
            in order into `ceil(K / inner_batch_size)` mini-batches (the last
            one smaller if the size does not divide K) and inner step `s`
            takes mini-batch `s mod ceil(K / inner_batch_size)`; so
            `inner_steps = r * ceil(K / inner_batch_size)` makes `r` passes.
        inner_optimizer: None (default: plain SGD) or
            `kt.meta.InnerSGD(momentum=0.0, nesterov=False)`, Keras's SGD
            formulas with a velocity that starts at zero for every task. The
            step size is `inner_learning_rate` (or Meta-SGD's learned rates).
        inner_training: bool (default True), the `training` flag of the inner
            loop's forward passes in `fit`. False is what calling a model
            without `training` does (BatchNormalization uses its moving
            statistics). `evaluate`, `predict` and `adapt` always use False.
        inner_loss_reduction: `"mean"` (default: the compiled loss) or
            `"sum"`: the per-example values of the compiled loss summed over
            the mini-batch (the regularization losses added once). The query
            loss stays the compiled loss.
        **kwargs: `name` and other base `keras.Model` arguments.

    Returns:
        A `keras.Model`; compile it with an optimizer and a loss.

    Example:
    ```python
    import keras, numpy as np
    import keras_tapeops as kt
    net = keras.Sequential([keras.Input((1,)), keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Dense(1)])
    meta = kt.MetaLearner(net, inner_learning_rate=0.01, inner_steps=1)
    meta.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    sx, qx = np.random.uniform(-5, 5, (2, 4, 16, 1)).astype("float32")
    meta.fit((sx, np.sin(sx), qx), np.sin(qx), batch_size=2, verbose=0)
    adapted = meta.adapt(sx[0], np.sin(sx[0]), steps=1)
    ```
    """

    def __init__(
        self,
        model: keras.Model,
        inner_learning_rate: float = 0.01,
        inner_steps: int = 1,
        first_order: bool = False,
        algorithm: str = "maml",
        adapt: selectors.Selector = None,
        learn_inner_learning_rate: bool = False,
        inner_batch_size: Optional[int] = None,
        inner_optimizer: Optional[InnerSGD] = None,
        inner_training: bool = True,
        inner_loss_reduction: str = "mean",
        **kwargs: Any,
    ):
        _check_model(model)
        if isinstance(adapt, keras.layers.Layer):
            # Kept as its path: the learner holds no second reference to a
            # layer of its model (Keras's saving would visit the layer there).
            adapt = _layer_path(model, adapt)
        config = MetaConfig(
            inner_learning_rate=inner_learning_rate,
            inner_steps=inner_steps,
            first_order=first_order,
            algorithm=algorithm,
            adapt=adapt,
            learn_inner_learning_rate=learn_inner_learning_rate,
            inner_batch_size=inner_batch_size,
            inner_optimizer=inner_optimizer,
            inner_training=inner_training,
            inner_loss_reduction=inner_loss_reduction,
        )
        adapted = _adapted_variables(model, config.adapt)
        _warn_if_random_layers(model)
        super().__init__(**kwargs)
        self.model = model
        self._meta_config = config
        self._task_loss: TaskLoss | None = None  # set by compile()
        learned: list = []
        if config.learn_inner_learning_rate:
            learned = rates_lib.create_learned_rates(self, adapted, config.inner_learning_rate)
        self._learned_rates = learned
        self._rate_of = {id(v): r for v, r in zip(adapted, learned)}
        self.built = True

    # ------------------------------------------------------------- options
    @property
    def meta_config(self) -> MetaConfig:
        """The learner's validated options (a `MetaConfig`)."""
        return self._meta_config

    @property
    def inner_learning_rate(self) -> float:
        return self._meta_config.inner_learning_rate

    @property
    def inner_steps(self) -> int:
        return self._meta_config.inner_steps

    @property
    def first_order(self) -> bool:
        return self._meta_config.first_order

    @property
    def algorithm(self) -> str:
        return self._meta_config.algorithm

    @property
    def adapt_selector(self) -> selectors.Selector:
        """The `adapt=` selector (None: every trainable variable is adapted)."""
        return self._meta_config.adapt

    @property
    def learn_inner_learning_rate(self) -> bool:
        return self._meta_config.learn_inner_learning_rate

    @property
    def inner_batch_size(self) -> int | None:
        """None (whole support set) or the inner mini-batch size."""
        return self._meta_config.inner_batch_size

    @property
    def inner_optimizer(self) -> InnerSGD | None:
        """None (plain SGD) or the `kt.meta.InnerSGD` of the inner loop."""
        return self._meta_config.inner_optimizer

    @property
    def inner_training(self) -> bool:
        """The `training` flag of the inner forward passes in `fit`."""
        return self._meta_config.inner_training

    @property
    def inner_loss_reduction(self) -> str:
        """`"mean"` or `"sum"`: how a support mini-batch's losses are reduced."""
        return self._meta_config.inner_loss_reduction

    @property
    def learned_rates(self) -> list[keras.Variable]:
        """Meta-SGD's rate variables, aligned with the adapted variables ([] otherwise)."""
        return list(self._learned_rates)

    # ------------------------------------------------------------- compile
    def compile(
        self,
        optimizer: keras.optimizers.Optimizer | str = "rmsprop",
        loss: LossLike | None = None,
        metrics: Any = None,
        **kwargs: Any,
    ) -> None:
        """Configures meta-training: everything stock `compile()` takes.

        Args:
            optimizer: the outer optimizer (its variables are built for the
                model's trainable variables and the Meta-SGD rates). Under the
                `"mixed_float16"` policy Keras wraps it in a
                `LossScaleOptimizer`, which scales the outer loss (the inner
                losses are differentiated unscaled, in float32).
            loss: one loss (name, function or `keras.losses.Loss`): the inner
                loop minimizes it on the support set, the outer loop on the
                query set. Required.
            metrics: compiled metrics, computed on the query predictions at
                the adapted weights.
            **kwargs: other `keras.Model.compile` arguments
                (`steps_per_execution`, `jit_compile`, ...).

        Returns:
            None. Raises before changing anything if `loss` is missing, is a
            dict or list, or is not a loss.
        """
        task_loss = TaskLoss(loss)
        if kwargs.get("loss_weights") is not None:
            raise ValueError(
                "MetaLearner.compile() does not take `loss_weights` (one "
                "output, one loss). Received: "
                f"loss_weights={kwargs['loss_weights']!r}"
            )
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)
        self._task_loss = task_loss
        # Built now, in the one order of `outer_variables()`: otherwise the
        # first to build it decides, and under a strategy that is Keras's
        # symbolic build in fit/evaluate/predict, from `trainable_variables`
        # (the learner's rates first). The saved optimizer state is a list in
        # build order, so a learner saved under a strategy and loaded (where
        # `compile_from_config` builds it) put each slot on another variable.
        self.build_optimizer()

    def compile_from_config(self, config: dict[str, Any]) -> None:
        config = keras.saving.deserialize_keras_object(config)
        # `compile()` creates the optimizer variables, so the saved states
        # load into them.
        self.compile(**config)

    def make_train_function(self, force: bool = False) -> Callable[..., Any]:
        self.build_optimizer()
        return super().make_train_function(force=force)

    def outer_variables(self) -> list[keras.Variable]:
        """What the outer optimizer updates: the model's trainable variables, then the rates."""
        return self.model.trainable_variables + self.learned_rates

    def build_optimizer(self) -> None:
        """Creates the optimizer's variables for `outer_variables()` (in the strategy scope).

        Always in that order (the order of its saved state: weights, then
        rates, with or without a strategy), at `compile()` and before the
        first step: variables created lazily inside a replicated step would
        break `tf.distribute`. An optimizer passed to `compile()` already
        built keeps the order it was built with.
        """
        with self.distribute_strategy.scope():
            if not self.optimizer.built:
                self.optimizer.build(self.outer_variables())

    def get_compile_config(self) -> dict[str, Any] | None:
        # Stock (`compile()` records its arguments); declared because
        # `compile()` is overridden, which stops Keras from recompiling on load
        # unless both methods are.
        return super().get_compile_config()

    # ---------------------------------------------------------- the steps
    def train_step(self, data: Nested) -> dict[str, Any]:
        tasks = tasks_lib.unpack_meta_batch(data)
        total = tf.cast(tasks_lib.global_count(tasks.count()), "float32")
        variables = self.outer_variables()
        if self.algorithm == "reptile":  # (no learned rates: refused at construction)
            losses, y_pred, deltas = self.run_tasks(tasks, training=True, reptile=True)
            # Scaled like a loss, so a LossScaleOptimizer's unscaling (and
            # its skipping of non-finite steps) applies as to MAML's gradients.
            grads = [
                self.optimizer.scale_loss(tf.reduce_sum(delta, axis=0) / total) for delta in deltas
            ]
        else:
            with tf.GradientTape() as tape:
                losses, y_pred = self.run_tasks(tasks, training=True)
                loss = tf.reduce_sum(losses) / total
                scaled = self.optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        return self._update_metrics(tasks, losses, y_pred)

    def test_step(self, data: Nested) -> dict[str, Any]:
        tasks = tasks_lib.unpack_meta_batch(data)
        losses, y_pred = self.run_tasks(tasks, training=False)
        return self._update_metrics(tasks, losses, y_pred)

    def call(self, inputs: Nested, training: bool = False) -> Nested:
        """Query predictions at the adapted weights, `(tasks, query_examples, ...)`.

        Args:
            inputs: `(support_x, support_y, query_x)`, task axis first.
            training: the forward passes' `training` flag.
        """
        support_x, support_y, query_x = tasks_lib.unpack_inputs(inputs)
        if private.in_symbolic_build():
            # Keras builds the compiled loss and metrics from output shapes
            # only: no adaptation is needed to know them.
            return self.map_tasks(lambda qx: self.model(qx, training=False), query_x)
        tasks = tasks_lib.Tasks(support_x, support_y, query_x, None)
        _, y_pred = self.run_tasks(tasks, training=training)
        return y_pred

    def run_tasks(
        self,
        tasks: tasks_lib.Tasks,
        training: bool,
        reptile: bool = False,
        steps: int | None = None,
    ) -> tuple[Any, ...]:
        """Adapts to every task and evaluates its query set, vectorized over tasks.

        Reads the weights (and Meta-SGD rates) once, so an outer tape around
        this call differentiates the query losses through the inner loop.

        Args:
            tasks: a `tasks.Tasks` (`query_y` None: predictions only).
            training: the forward passes' `training` flag.
            reptile: also return, per adapted variable, `w - w'` for every task.
            steps: inner steps (default `inner_steps`).

        Returns:
            `(losses, y_pred)`: the per-task query losses `(tasks,)` (None
            without `query_y`) and query predictions; with `reptile=True`,
            also the list of per-task differences `(tasks, *variable.shape)`.
        """
        loss = self._functional_loss(training)
        inner_loss = self._inner_loss(training)
        weights = [tf.convert_to_tensor(v.value) for v in self.model.trainable_variables]
        adapted, rates = self._adapted_indices_and_rates()
        steps = self.inner_steps if steps is None else steps
        first_order = self.first_order or reptile
        with_targets = tasks.query_y is not None

        def one_task(task):
            support_x, support_y, query_x = task[:3]
            new = self._inner_loop(
                inner_loss,
                weights,
                support_x,
                support_y,
                adapted,
                rates,
                steps,
                first_order,
            )
            if not with_targets:
                return loss.predict(new, query_x)[0]
            out = loss(new, query_x, task[3])
            if reptile:
                out = out + ([weights[i] - new[i] for i in adapted],)
            return out

        if not with_targets:
            return None, self.map_tasks(one_task, tasks.as_tuple()[:3])
        return self.map_tasks(one_task, tasks.as_tuple())

    def map_tasks(
        self, fn: Callable[[tuple[Any, ...]], Nested], elements: Sequence[Nested]
    ) -> Nested:
        """Runs the per-task computation `fn` over the task axis of `elements`.

        The default is `tf.vectorized_map` (all tasks at once as batched
        operations, falling back to a loop for an operation it cannot
        vectorize). Override to trade speed for memory, e.g.
        `return tf.map_fn(fn, elements, fn_output_signature=...)`.

        Args:
            fn: callable on one task's tensors (a tuple), returning a nest.
            elements: a tuple of tensors (or nests), task axis first.

        Returns:
            `fn`'s outputs stacked along a new first (task) axis.
        """
        return tasks_lib.map_tasks(fn, elements)

    def _update_metrics(self, tasks, losses, y_pred):
        # One value per task: the epoch's mean over tasks, over all replicas
        # (a replica given no task adds nothing).
        private.loss_tracker(self).update_state(losses)
        return self.compute_metrics(
            None,
            tasks_lib.merge_task_axis(tasks.query_y),
            tasks_lib.merge_task_axis(y_pred),
        )

    # ------------------------------------------------------------ adapt
    def adapt(self, support_x: Nested, support_y: Nested, steps: int | None = None) -> keras.Model:
        """Returns a copy of the model at the weights adapted to one task.

        The learned weights (and the model) are unchanged: the copy
        (`keras.models.clone_model`) gets the adapted weights.

        Args:
            support_x: one task's support inputs, example axis first.
            support_y: one task's support targets.
            steps: int >= 1, inner SGD steps (default `inner_steps`), with
                the learner's inner rates (learned ones for Meta-SGD) and
                `training=False` forward passes.

        Returns:
            A new, uncompiled Keras model of the same architecture.

        Example:
        ```python
        net = keras.Sequential([keras.Input((1,)), keras.layers.Dense(16, activation="tanh"),
                                keras.layers.Dense(1)])
        meta = kt.MetaLearner(net, inner_learning_rate=0.01)
        meta.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        support_x = query_x = np.linspace(-5, 5, 10, dtype="float32")[:, None]
        support_y = np.sin(support_x)
        adapted = meta.adapt(support_x, support_y, steps=10)
        query_pred = adapted.predict(query_x, verbose=0)
        ```
        """
        weights = self.adapted_weights(support_x, support_y, steps)
        clone = keras.models.clone_model(self.model)
        clone.set_weights(self.model.get_weights())
        for variable, value in zip(clone.trainable_variables, weights):
            variable.assign(value)
        return clone

    def adapted_weights(
        self, support_x: Nested, support_y: Nested, steps: int | None = None
    ) -> list[tf.Tensor]:
        """The adapted values of `model.trainable_variables` for one task (tensors).

        Same arguments as `adapt`; nothing is copied or written.

        Returns:
            A list of tensors aligned with `model.trainable_variables`.
        """
        self._require_compiled("adapt")
        steps = self.inner_steps if steps is None else validation.positive_int(steps, "steps")
        support_x = tf.nest.map_structure(tf.convert_to_tensor, support_x)
        support_y = tf.nest.map_structure(tf.convert_to_tensor, support_y)
        tasks_lib.check_support(support_x, support_y)
        loss = self._inner_loss(training=False)
        weights = [tf.convert_to_tensor(v.value) for v in self.model.trainable_variables]
        adapted, rates = self._adapted_indices_and_rates()
        return self._inner_loop(
            loss,
            weights,
            support_x,
            support_y,
            adapted,
            rates,
            steps,
            first_order=True,
        )

    # ----------------------------------------------------------- helpers
    def _functional_loss(self, training, loss_fn=None):
        self._require_compiled("the step")
        non_trainable = [tf.convert_to_tensor(v.value) for v in self.model.non_trainable_variables]
        return inner_loop.FunctionalLoss(
            self.model, loss_fn or self._task_loss, non_trainable, training
        )

    def _inner_loss(self, training):
        """The support loss: `inner_training` in `fit`, `inner_loss_reduction`."""
        self._require_compiled("the step")
        loss_fn = self._task_loss.summed if self.inner_loss_reduction == "sum" else None
        return self._functional_loss(training and self.inner_training, loss_fn)

    def _inner_loop(self, loss, weights, x, y, adapted, rates, steps, first_order):
        return inner_loop.sgd_steps(
            loss,
            weights,
            x,
            y,
            adapted,
            rates,
            steps,
            first_order,
            batch_size=self.inner_batch_size,
            optimizer=self.inner_optimizer,
        )

    def _adapted_indices_and_rates(self):
        variables = self.model.trainable_variables
        mask = selectors.select(self.adapt_selector, self.model, variables)
        indices = [i for i, on in enumerate(mask) if on]
        rates = rates_lib.rates_for(
            [variables[i] for i in indices],
            self._rate_of,
            self.learn_inner_learning_rate,
            self.inner_learning_rate,
        )
        return indices, rates

    def _require_compiled(self, what):
        if self._task_loss is None:
            raise ValueError(
                f"MetaLearner must be compiled (with a loss) before {what}: the "
                "inner loop minimizes the compiled loss. Received: an uncompiled "
                f"MetaLearner {self.name!r}"
            )

    # ------------------------------------------------------------ saving
    def get_config(self) -> dict[str, Any]:
        with selectors.paths_relative_to(self.model):
            options = self._meta_config.get_config()
        return {
            "name": self.name,
            "trainable": self.trainable,
            "model": keras.saving.serialize_keras_object(self.model),
            **options,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"))
        # A file saved before an option existed has no entry for it: the
        # option's default (the behaviour it was saved with) applies.
        options = MetaConfig.from_config(
            {key: config.pop(key) for key in MetaConfig().get_config() if key in config}
        )
        return cls(model, **vars(options), **config)


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a Keras model. "
            f"Received: model={model!r} of type {type(model).__name__}"
        )
    if not model.built:
        raise ValueError(
            "`model` must be built (give it an `Input` or call it on data "
            "once) so its variables exist. Received: an unbuilt model "
            f"{model.name!r}"
        )
    if not model.trainable_variables:
        raise ValueError(f"`model` has no trainable variables. Received: model={model.name!r}")


def _warn_if_random_layers(model):
    """Warns when layers draw random numbers (Dropout, GaussianNoise, ...).

    Their seed state is a non-trainable variable, which the functional forward
    passes read but never advance: every step would reuse the same masks.
    """
    random = [
        layer.name
        for layer in [model] + private.all_layers(model)
        if any(isinstance(value, keras.random.SeedGenerator) for value in vars(layer).values())
    ]
    if random:
        warnings.warn(
            f"MetaLearner: the layers {random} of model {model.name!r} draw random "
            "numbers (e.g. Dropout), but the learner never advances their seed "
            "state: every step reuses the same random masks. Remove them or "
            "accept fixed masks.",
            stacklevel=3,
        )


def _layer_path(model, layer):
    found = paths.LayerTree(model).paths_of(layer)
    if not found:
        raise ValueError(
            f"The layer given as `adapt` is not part of model {model.name!r}. "
            f"Received: adapt=<{type(layer).__name__} name={layer.name!r}>"
        )
    return selectors.LayerPath(found[0])


def _adapted_variables(model, adapt):
    variables = model.trainable_variables
    mask = selectors.select(adapt, model, variables)
    return [v for v, on in zip(variables, mask) if on]
