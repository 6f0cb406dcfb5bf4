"""`kt.GAN`'s step on JAX: stateless player updates inside Keras's JAX `fit`.

`JaxGANStep` is `GAN`'s first base with `KERAS_BACKEND=jax`. Keras's JAX
trainer threads `(trainable, non_trainable, optimizer, metrics)` values
through a jitted `train_step(state, data)`; the "optimizer" group is
`model.optimizer.variables`, so `compile()` sets `model.optimizer` to
`PlayerOptimizers`, which lists both players' optimizers' variables (it is
not saved: each player's optimizer is saved under its own name, as on
TensorFlow, so files cross backends).

One step, as on TensorFlow: `discriminator_steps` discriminator updates,
then one generator update. Each update is `jax.value_and_grad` over the
player's weights of the shared loss hooks (`discriminator_losses`,
`generator_objective`), run inside a `keras.StatelessScope` that maps every
variable to this step's value; the player's gradient transforms see true
gradients (unscaled under mixed precision; the global batch's under
`DataParallel`), then the player's optimizer's `stateless_apply`. Random
draws (the latent noise, the penalty's interpolation weights) come from a
key folded from the model's noise seed, a training/evaluation tag and a
train-step counter the step carries with the metrics (not saved), so every
step draws anew, also after a loss-scale overflow. The penalties' input
gradients are `jax.grad` (`input_gradients`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any
from typing import TYPE_CHECKING
from typing import Callable
from typing import Iterator
from typing import Sequence

import jax
import keras
from keras import ops

from keras_tapeops.backend.jax import loss as jax_loss
from keras_tapeops.backend.jax.carried import CarriedState
from keras_tapeops.backend.jax.carried import TransformVariables
from keras_tapeops.backend.jax.mixin import _restoring_state_on_error
from keras_tapeops.backend.jax.true_gradients import true_transformed
from keras_tapeops.split_sizes import static_batch_size
from keras_tapeops.transforms.base import after_apply_in_order
from keras_tapeops.transforms.base import apply_in_order
from keras_tapeops.transforms.base import keep_step_decision
from keras_tapeops.transforms.finite import SkipNonFinite
from keras_tapeops.typing_aliases import Nested

#: The TensorFlow step's hooks (a `tf.GradientTape` each); the JAX step does not call them.
TENSORFLOW_HOOKS = (
    "discriminator_train_step",
    "generator_train_step",
    "apply_discriminator_gradients",
    "critic_train_step",
    "apply_critic_gradients",
)
_NOISE = "_tapeops_step_noise"


class PlayerOptimizers:
    """`model.optimizer` of a GAN on JAX: both players' optimizers as one state group.

    Keras's JAX trainer carries `model.optimizer.variables` through the step;
    these are the generator optimizer's variables, then the discriminator's.

    Args:
        optimizers: `(generator_optimizer, discriminator_optimizer)`.
        players: `(generator, discriminator)`: the models they train.

    Example:
    ```python
    gan.optimizer = PlayerOptimizers((g_opt, d_opt), (gan.generator, gan.discriminator))
    ```
    """

    def __init__(self, optimizers: Sequence[Any], players: Sequence[keras.Model]) -> None:
        self.optimizers = tuple(optimizers)
        self.players = tuple(players)

    @property
    def variables(self) -> list[Any]:
        """The generator optimizer's variables, then the discriminator optimizer's."""
        return [v for optimizer in self.optimizers for v in optimizer.variables]

    @property
    def built(self) -> bool:
        """True once both optimizers have their variables."""
        return all(optimizer.built for optimizer in self.optimizers)

    @property
    def iterations(self) -> Any:
        """The generator optimizer's step count (one per train step)."""
        return self.optimizers[0].iterations

    def build(self, variables: Any = None) -> None:
        """Builds each optimizer on its player's trainable variables."""
        for optimizer, player in zip(self.optimizers, self.players):
            if not optimizer.built:
                optimizer.build(player.trainable_variables)

    def slices(self) -> list[slice]:
        """Where each optimizer's variables are in `variables`."""
        out, start = [], 0
        for optimizer in self.optimizers:
            out.append(slice(start, start + len(optimizer.variables)))
            start += len(optimizer.variables)
        return out


class _NoiseSteps(CarriedState):
    """The GAN's train-step count, carried with the metrics (the noise keys fold it in)."""

    def __init__(self) -> None:
        super().__init__(name="tapeops_gan_noise_steps")
        self.count = self.add_variable((), "zeros", "float32", name="count")


class _Noise:
    """The GAN's noise seed, step counter and the players' transforms' state.

    A plain holder (not saved, not a layer): the step carries the counter
    and the transforms' variables (e.g. `kt.SkipNonFinite`'s count of
    skipped updates in a row) with the metrics.
    """

    def __init__(self, seed: int, transform_variables: Sequence[Any] = ()) -> None:
        self.seed = seed
        self.steps = _NoiseSteps()
        self.transform_state = (
            TransformVariables(transform_variables) if transform_variables else None
        )


class _StepNoise:
    """The step's random key; each draw folds in its own index."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.draws = 0

    def next_key(self) -> Any:
        self.draws += 1
        return jax.random.fold_in(self.key, self.draws)


@contextlib.contextmanager
def _step_noise(model: keras.Model, key: Any) -> Iterator[None]:
    object.__setattr__(model, _NOISE, _StepNoise(key))
    try:
        yield
    finally:
        object.__delattr__(model, _NOISE)


def normal(model: keras.Model, shape: Sequence[Any]) -> Any:
    """`N(0, 1)` float32 draws from the step's key (outside a step: Keras's global seed)."""
    noise = getattr(model, _NOISE, None)
    if noise is None:
        return keras.random.normal(tuple(shape))
    return jax.random.normal(noise.next_key(), tuple(shape), dtype="float32")


def uniform(model: keras.Model, shape: Sequence[Any]) -> Any:
    """`U[0, 1]` float32 draws from the step's key (outside a step: Keras's global seed)."""
    noise = getattr(model, _NOISE, None)
    if noise is None:
        return keras.random.uniform(tuple(shape))
    return jax.random.uniform(noise.next_key(), tuple(shape), dtype="float32")


def input_gradients(
    function: Callable[[list[Any]], Any], inputs: Sequence[Any], restore: Sequence[Any] = ()
) -> list[Any]:
    """`jax.grad` of the sum of `function(inputs)`'s outputs w.r.t. the float inputs.

    Inside the step's `StatelessScope` the weights `function` reads are this
    step's traced values, so the result is differentiable w.r.t. them. The
    updates `function` makes to `restore` (moving statistics) are dropped.

    Returns:
        One gradient per input; None for a non-float input.
    """
    inputs = [ops.convert_to_tensor(t) for t in inputs]
    floating = [keras.backend.is_float_dtype(t.dtype) for t in inputs]
    before = [(v, v.value) for v in restore]

    def total(float_inputs: list[Any]) -> Any:
        it = iter(float_inputs)
        merged = [next(it) if f else t for t, f in zip(inputs, floating)]
        outputs = [o for o in keras.tree.flatten(function(merged)) if o is not None]
        result = ops.sum(ops.cast(outputs[0], "float32"))
        for output in outputs[1:]:
            result = result + ops.sum(ops.cast(output, "float32"))
        return result

    grads = jax.grad(total)([t for t, f in zip(inputs, floating) if f])
    for variable, value in before:
        variable.assign(value)
    it = iter(grads)
    return [next(it) if f else None for f in floating]


class _StepValues:
    """This step's variable values, updated player by player."""

    def __init__(
        self, model: Any, trainable: Any, non_trainable: Any, optimizer: Any, metrics: Any
    ) -> None:
        self.model = model
        self.trainable = list(trainable)
        self.non_trainable = list(non_trainable)
        self.optimizer = list(optimizer)
        self.metrics = list(metrics)

    def mapping(self, trainable: list[Any]) -> list[tuple[Any, Any]]:
        model = self.model
        return (
            list(zip(model.trainable_variables, trainable))
            + list(zip(model.non_trainable_variables, self.non_trainable))
            + list(zip(model.optimizer.variables, self.optimizer))
        )

    def update(
        self,
        player: keras.Model,
        which: int,
        bound: Sequence[Any],
        losses: Callable[[], tuple[Any, Any]],
    ) -> tuple[Any, Any]:
        """One update of `player` (0: generator, 1: discriminator); returns `losses()`.

        The player's transforms see its true gradients; a gate that says
        False (`kt.SkipNonFinite`) skips the update: the player's weights and
        optimizer state, and the moving statistics the update's forward pass
        changed, stay as they were. What the transforms log and carry is
        updated in `self.metrics`.
        """
        model = self.model
        optimizer = model.optimizer.optimizers[which]
        where = model.optimizer.slices()[which]
        positions = _positions(model.trainable_variables, player.trainable_variables)
        values = [self.trainable[i] for i in positions]

        def scaled_loss(player_values: list[Any]) -> tuple[Any, Any]:
            trainable = list(self.trainable)
            for i, value in zip(positions, player_values):
                trainable[i] = value
            with keras.StatelessScope(state_mapping=self.mapping(trainable)) as scope:
                loss, extra = losses()
                scaled = optimizer.scale_loss(loss)
            updated = [
                _current(scope, v, old)
                for v, old in zip(model.non_trainable_variables, self.non_trainable)
            ]
            return scaled, (loss, extra, updated)

        non_trainable = self.non_trainable
        (_, (loss, extra, updated)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(values)
        optimizer_values = self.optimizer[where]
        optimizer_state = list(zip(optimizer.variables, optimizer_values))
        with jax_loss.updating_metrics(model, self.metrics, optimizer_state) as metrics:
            grads, keep = _player_transformed(optimizer, optimizer_values, bound, grads, values)
        new_values, new_optimizer_values = optimizer.stateless_apply(
            optimizer_values, grads, values
        )
        if keep is not None:
            if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                # (a LossScaleOptimizer skipped it itself: an overflow)
                new_values = _where(keep, new_values, values)
                new_optimizer_values = _where(keep, new_optimizer_values, optimizer_values)
            updated = _where(keep, updated, non_trainable)
        self.non_trainable = list(updated)
        with jax_loss.updating_metrics(model, metrics, optimizer_state) as self.metrics:
            after_apply_in_order(bound, new_values, values)
        for i, value in zip(positions, new_values):
            self.trainable[i] = value
        self.optimizer[where] = list(new_optimizer_values)
        return loss, extra


def _where(keep: Any, new: Sequence[Any], old: Sequence[Any]) -> list[Any]:
    return [ops.where(keep, n, o) for n, o in zip(new, old)]


def _positions(variables: Sequence[Any], subset: Sequence[Any]) -> list[int]:
    index = {id(v): i for i, v in enumerate(variables)}
    return [index[id(v)] for v in subset]


def _current(scope: Any, variable: Any, old: Any) -> Any:
    value = scope.get_current_value(variable)
    return old if value is None else value


def _player_transformed(
    optimizer: Any,
    optimizer_values: Sequence[Any],
    bound: Sequence[Any],
    grads: Sequence[Any],
    values: list[Any],
) -> tuple[list[Any], Any]:
    """The player's gates and transforms on its true gradients (`true_transformed`).

    Without transforms the gradients go to the optimizer as they are (no
    unscaling and rescaling: a static `loss_scale_factor` need not be a
    power of two).

    Returns:
        `(grads, keep)`; `keep` is None without gates.
    """
    if not bound:
        return list(grads), None
    return true_transformed(
        optimizer,
        jax_loss.loss_scale(optimizer, optimizer_values),
        grads,
        values,
        lambda g, v: keep_step_decision(bound, g, v),
        lambda g, v: apply_in_order(bound, g, v),
    )


def _unless_empty(value: Any, n: Any) -> Any:
    """`value`, or 0 for an empty batch (its mean is nan; its tracker weight is 0)."""
    value = ops.convert_to_tensor(value)
    return ops.where(ops.cast(n, "float32") > 0, value, ops.zeros_like(value))


def _mean(values: Sequence[Any]) -> Any:
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total / float(len(values))


class JaxGANStep:
    """The JAX train and test steps of `kt.GAN` (a base of `GAN`, not used alone).

    Example:
    ```python
    gan = kt.GAN(generator, discriminator, latent_dim=128)  # KERAS_BACKEND=jax
    gan.compile(generator_optimizer="adam", discriminator_optimizer="adam")
    gan.fit(real, batch_size=64)   # calls JaxGANStep.train_step(state, data)
    ```
    """

    if TYPE_CHECKING:  # GAN's attributes and methods, which the step uses

        def __getattr__(self, name: str) -> Any: ...

    def _gan_check(self, bound: Sequence[Sequence[Any]]) -> None:
        """Refuses, before compiling, what the JAX step cannot run.

        Args:
            bound: each player's bound `(transform, state)` pairs.
        """
        _refuse_tensorflow_hooks(type(self))
        for pairs in bound:
            _refuse_stopping_transforms(pairs)

    def _gan_compiled(self) -> None:
        """Sets `optimizer` to both players' (the state group Keras's JAX step carries).

        Also draws the noise seed and creates the train-step counter the
        noise keys fold in (carried with the metrics, not saved: a plain
        holder keeps it out of the model's files).
        """
        self.optimizer = PlayerOptimizers(
            (self.generator_optimizer, self._discriminator_optimizer),
            (self.generator, self._discriminator),
        )
        seed = keras.random.randint((), 0, 2**31 - 1, seed=keras.random.SeedGenerator())
        carried = [
            v
            for _, bound in self._players_bound_transforms()
            for _, state in bound
            for v in state.variables.values()
        ]
        object.__setattr__(self, "_tapeops_noise", _Noise(int(seed), carried))

    def _carried_metrics(self) -> list[Any]:
        noise = getattr(self, "_tapeops_noise", None)
        if noise is None:
            return []
        return [noise.steps] + ([noise.transform_state] if noise.transform_state else [])

    def make_train_function(self, force: bool = False) -> Any:
        """Keras's, wrapped so a step that fails while traced leaves the weights in place."""
        super().make_train_function(force)  # type: ignore[misc]
        function = _restoring_state_on_error(self, getattr(self, "train_function"))
        setattr(self, "train_function", function)
        return function

    def make_test_function(self, force: bool = False) -> Any:
        """Keras's, wrapped so a step that fails while traced leaves the weights in place."""
        super().make_test_function(force)  # type: ignore[misc]
        function = _restoring_state_on_error(self, getattr(self, "test_function"))
        setattr(self, "test_function", function)
        return function

    def _noise_key(self, purpose: int, index: Any) -> Any:
        """One step's key: the seed, then training (0) or evaluation (1), then `index`."""
        key = jax.random.PRNGKey(self._tapeops_noise.seed)
        key = jax.random.fold_in(key, purpose)
        return jax.random.fold_in(key, ops.cast(index, "uint32"))

    def train_step(self, state: Any, data: Nested) -> tuple[dict[str, Any], Any]:
        """The stateless JAX step: `(logs, new_state)` for one batch."""
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        real, labels = self._unpack(data)
        n = static_batch_size(real)
        values = _StepValues(self, trainable, non_trainable, optimizer_vars, metrics_vars)
        steps = self._tapeops_noise.steps.count
        with keras.StatelessScope(state_mapping=list(zip(self.metrics_variables, metrics_vars))):
            step = ops.convert_to_tensor(steps)
        discriminator_bound = getattr(self, f"_bound_{self._role}_transforms")
        losses, penalties = [], []
        with _step_noise(self, self._noise_key(0, step)):
            for index in range(self._discriminator_steps):
                loss, penalty = values.update(
                    self._discriminator,
                    1,
                    discriminator_bound,
                    functools.partial(self.discriminator_losses, real, index, True, labels),
                )
                losses.append(loss)
                penalties.append(penalty)
            generator_loss, _ = values.update(
                self.generator,
                0,
                getattr(self, "_bound_generator_transforms"),
                lambda: (self.generator_objective(real, True, labels), None),
            )
        with jax_loss.updating_metrics(self, values.metrics) as metrics_vars:
            steps.assign(step + 1.0)
            # One tracker update per batch, as on TensorFlow.
            self._discriminator_tracker.update_state(
                _unless_empty(_mean(losses), n), sample_weight=n
            )
            if self.gradient_penalty is not None:
                self.gradient_penalty_tracker.update_state(
                    _unless_empty(_mean(penalties), n), sample_weight=n
                )
            self.generator_loss_tracker.update_state(
                _unless_empty(generator_loss, n), sample_weight=n
            )
            logs = {m.name: m.result() for m in self._trackers() + self._transform_metrics()}
        new_state = (values.trainable, values.non_trainable, values.optimizer, metrics_vars)
        return logs, new_state

    def test_step(self, state: Any, data: Nested) -> tuple[dict[str, Any], Any]:
        """The stateless JAX evaluation step (no update): `(logs, new_state)`."""
        trainable, non_trainable, metrics_vars = state
        real, labels = self._unpack(data)
        n = static_batch_size(real)
        mapping = list(zip(self.trainable_variables, trainable)) + list(
            zip(self.non_trainable_variables, non_trainable)
        )
        with jax_loss.updating_metrics(self, metrics_vars, mapping) as metrics_vars:
            # Each evaluation batch draws its own noise (keyed by the samples seen so far).
            seen = ops.convert_to_tensor(self.generator_loss_tracker.count)
            with _step_noise(self, self._noise_key(1, seen)):
                loss, penalty = self.discriminator_losses(real, 0, False, labels)
                generator_loss = self.generator_objective(real, False, labels)
            self._discriminator_tracker.update_state(_unless_empty(loss, n), sample_weight=n)
            if self.gradient_penalty is not None:
                self.gradient_penalty_tracker.update_state(
                    _unless_empty(penalty, n), sample_weight=n
                )
            self.generator_loss_tracker.update_state(
                _unless_empty(generator_loss, n), sample_weight=n
            )
            logs = {m.name: m.result() for m in self._trackers()}
        return logs, (trainable, non_trainable, metrics_vars)


def _refuse_tensorflow_hooks(cls: type) -> None:
    """A user's override of a TensorFlow step hook would be silently ignored: refused."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(("keras_tapeops.", "keras.")):
            continue
        for name in TENSORFLOW_HOOKS:
            if name in vars(klass):
                raise ValueError(
                    f"`{name}` is a hook of the TensorFlow GAN step (a tf.GradientTape "
                    "update); the JAX step is stateless and does not call it. On JAX, "
                    "override `discriminator_losses`, `generator_objective`, "
                    "`discriminator_loss`, `generator_loss` or `sample_latent`, or use "
                    f"KERAS_BACKEND=tensorflow. Received: {klass.__name__}.{name}"
                )


def _refuse_stopping_transforms(bound: Sequence[Any]) -> None:
    """`kt.SkipNonFinite(max_consecutive=...)` needs a check between steps the GAN lacks."""
    for transform, _ in bound:
        if isinstance(transform, SkipNonFinite) and transform.max_consecutive is not None:
            raise ValueError(
                "A GAN player's kt.SkipNonFinite(max_consecutive=...) stops training "
                "from inside the step on TensorFlow; the GAN step on the JAX backend "
                "does not carry that stop yet. Use SkipNonFinite() without "
                "max_consecutive (steps are still skipped and counted), or "
                f"KERAS_BACKEND=tensorflow. Received: {transform!r}"
            )
