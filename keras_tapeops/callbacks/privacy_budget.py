"""`PrivacyBudget`: logs DP-SGD's epsilon each epoch and stops before a target."""

from __future__ import annotations

from typing import Any
from typing import TYPE_CHECKING
import math

import keras

from keras_tapeops import validation
from keras_tapeops.privacy import accounting
from keras_tapeops.registration import register
from keras_tapeops.typing_aliases import Logs

if TYPE_CHECKING:
    from typing_extensions import Self


@register
class PrivacyBudget(keras.callbacks.Callback):
    """Logs the epsilon spent so far by `kt.DPSGD` training; stops before a target.

    At the end of every epoch it writes
    `kt.privacy.epsilon(steps, sampling_rate, noise_multiplier, delta)` into
    the epoch logs under `name` (History, the progress bar, and TensorBoard
    or CSVLogger listed AFTER this callback see it), where `steps` counts
    the applied (noisy) optimizer steps of the model (`optimizer.iterations`:
    it carries over repeated `fit` calls and runs resumed from a checkpoint)
    and `noise_multiplier` is its compiled `kt.DPSGD`'s.

    With `target_epsilon`, the target is never exceeded: before every
    execution of the train function (one batch, or `steps_per_execution=k`
    batches run at once) it checks that `steps + k` steps stay within the
    target, and otherwise runs no more step and stops training (a later
    `fit` trains no step either). With `k > 1` it may therefore stop up to
    `k - 1` steps before the last allowed one. A target that not even one
    step meets is refused in `on_train_begin`, before any step.

    The sampling rate is `sampling_rate` if given (use the one passed to
    `kt.privacy.poisson_batches`; it is required with those batches, whose
    padded size is not the sampling rate), else inferred as the largest
    number of samples in an applied step divided by `dataset_size`: the usual
    `batch_size / N` for fixed-size batches (an approximation: see
    docs/privacy.md). Before the first step that rate is unknown, so with a
    target and no `sampling_rate` the first execution runs only if its
    epsilon at rate 1 (the worst case) stays within the target; otherwise
    `on_train_begin` asks for `sampling_rate`.

    Args:
        dataset_size: the number of training examples N (int >= 1).
        delta: the target delta, in (0, 1).
        target_epsilon: None, or a positive epsilon not to exceed.
        sampling_rate: None (inferred as above) or the Poisson sampling rate.
        accountant: `"pld"` (tight) or `"rdp"` (faster, looser).
        name: the log key (default `"epsilon"`).

    Example:
    ```python
    model.compile(optimizer="sgd", loss="categorical_crossentropy",
                  differential_privacy=kt.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1))
    budget = kt.callbacks.PrivacyBudget(dataset_size=64, target_epsilon=20.0,
                                        sampling_rate=16 / 64, accountant="rdp")
    history = model.fit(x, y, batch_size=16, epochs=2, callbacks=[budget], verbose=0)
    history.history["epsilon"]
    ```
    """

    def __init__(
        self,
        dataset_size: int,
        delta: float = 1e-5,
        target_epsilon: float | None = None,
        sampling_rate: float | None = None,
        accountant: str = "pld",
        name: str = "epsilon",
    ) -> None:
        super().__init__()
        self.dataset_size = validation.positive_int(dataset_size, "dataset_size")
        self.delta = validation.positive_number(delta, "delta")
        if self.delta >= 1:
            raise ValueError(f"`delta` must be in (0, 1). Received: delta={delta!r}")
        self.target_epsilon = (
            None
            if target_epsilon is None
            else validation.positive_number(target_epsilon, "target_epsilon")
        )
        self.sampling_rate = (
            None if sampling_rate is None else accounting.check_sampling_rate(sampling_rate)
        )
        self.accountant = validation.choice(accountant, "accountant", accounting.ACCOUNTANTS)
        self.name = validation.name(name, "name")
        # Set by on_train_begin (float and the model's DPSGDState), read after it.
        self._noise_multiplier: Any = None
        self._engine: Any = None
        self._largest_step = 0.0
        self._max_steps = None  # (rate, steps) of the last stopping-point search

    # ----------------------------------------------------------------- hooks
    def on_train_begin(self, logs: Logs = None) -> None:
        accounting.require_dp_accounting()
        options = getattr(self.model, "tapeops_options", None)
        option = getattr(options, "differential_privacy", None)
        if option is None:
            raise ValueError(
                "PrivacyBudget needs a model compiled with "
                "`differential_privacy=kt.DPSGD(...)`. Received: model "
                f"{self.model.name!r} without it"
            )
        self._noise_multiplier = option.noise_multiplier
        self._engine = self.model.tapeops_state.engine
        if self.sampling_rate is None:
            if self._engine.saw_mask:
                raise ValueError(_MASKED_BATCHES)
            # Refused when the first masked batch is traced, before its step.
            self._engine.mask_refusal = _MASKED_BATCHES
        if self.target_epsilon is not None:
            self._check_target_reachable()

    def on_train_batch_begin(self, batch: int, logs: Logs = None) -> None:
        if self.target_epsilon is None or self.model.stop_training:
            return
        if self._steps() + self._execution_steps() > self._allowed_steps():
            self.model.stop_training = True
            _skip_next_execution(self.model)

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        if self.sampling_rate is None:
            samples = float(_current(self.model, self._engine.step_samples))
            self._largest_step = max(self._largest_step, samples)

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if logs is not None:
            logs[self.name] = self.epsilon()

    def on_train_end(self, logs: Logs = None) -> None:
        if self._engine is not None:
            self._engine.mask_refusal = None

    # --------------------------------------------------------------- values
    def epsilon(self) -> float:
        """The epsilon spent by the applied steps so far (0 before the first)."""
        steps = self._steps()
        rate = self._rate()
        if steps == 0 or rate is None:
            return 0.0
        return accounting.epsilon(steps, rate, self._noise_multiplier, self.delta, self.accountant)

    def _steps(self):
        return int(_current(self.model, self.model.optimizer.iterations))

    def _execution_steps(self):
        """The most optimizer steps one call of the train function can apply.

        One per batch of the execution (`steps_per_execution`); with
        `accumulation_steps > 1` fewer, so this bound is safe (see the class
        docstring).
        """
        return max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))

    def _rate(self):
        if self.sampling_rate is not None:
            return self.sampling_rate
        if self._largest_step == 0:
            return None
        return min(1.0, self._largest_step / self.dataset_size)

    def _check_target_reachable(self):
        """Refuses a target that no step (or, rate unknown, no first execution) meets."""
        rate = self._rate()
        if rate is not None:
            one_step = self._epsilon_of(1, rate)
            if one_step > self.target_epsilon:
                raise ValueError(
                    "PrivacyBudget: no step fits within target_epsilon: one "
                    f"step at sampling_rate={rate:g} with noise_multiplier="
                    f"{self._noise_multiplier:g} and delta={self.delta:g} "
                    "already spends more. Raise target_epsilon or the noise "
                    "multiplier, or sample fewer examples per step. Received: "
                    f"target_epsilon={self.target_epsilon:g} and a one-step "
                    f"epsilon of {one_step:g}"
                )
            return
        steps = self._execution_steps()
        worst = self._epsilon_of(steps, 1.0)
        if worst > self.target_epsilon:
            raise ValueError(
                "PrivacyBudget cannot tell whether the first step fits within "
                "target_epsilon: without `sampling_rate` the rate is inferred "
                f"from the steps themselves, and {steps} step(s) at the worst-"
                "case rate 1 would spend more than the target. Pass "
                "sampling_rate= (batch_size / dataset_size for fixed batches, "
                "the rate given to kt.privacy.poisson_batches). Received: "
                f"target_epsilon={self.target_epsilon:g}, sampling_rate=None "
                f"and a worst-case first-execution epsilon of {worst:g}"
            )

    def _epsilon_of(self, steps, rate):
        if self._noise_multiplier == 0:
            return math.inf
        return accounting.epsilon(steps, rate, self._noise_multiplier, self.delta, self.accountant)

    def _allowed_steps(self):
        """The most steps whose epsilon stays at or below the target.

        Before the first step without `sampling_rate`, at the worst-case rate 1.
        """
        rate = self._rate()
        if rate is None:
            rate = 1.0
        if self._max_steps is not None and self._max_steps[0] == rate:
            return self._max_steps[1]
        if self._noise_multiplier == 0:
            allowed = 0
        else:

            def within(steps):
                return self._epsilon_of(steps, rate) <= self.target_epsilon

            allowed = _largest_true(within)
        self._max_steps = (rate, allowed)
        return allowed

    def get_config(self) -> dict[str, Any]:
        return {
            "dataset_size": self.dataset_size,
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            "sampling_rate": self.sampling_rate,
            "accountant": self.accountant,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        return cls(**config)


_MASKED_BATCHES = (
    "PrivacyBudget cannot infer the sampling rate of masked batches (such as "
    "kt.privacy.poisson_batches'): their row count is the padded batch size, "
    "not the expected number of sampled examples, so the epsilon would be "
    "wrong. Pass the rate given to poisson_batches: "
    "PrivacyBudget(..., sampling_rate=q). Received: sampling_rate=None and "
    "batches with a boolean sample_weight mask"
)


def _current(model, variable):
    """`variable`'s value now, also between the steps of a JAX `fit`."""
    if keras.backend.backend() == "jax":
        from keras_tapeops._keras import jax_trainer

        return jax_trainer.value_after_last_step(model, variable)
    return variable.numpy()


def _skip_next_execution(model):
    """Makes the next call of `model.train_function` run no step (once).

    Keras's `fit` reads `stop_training` only after a train function call, so
    a callback cannot stop training before a batch. The call about to happen
    returns the current metric values instead; the original function is put
    back by that call, so the next `fit` trains as usual. On JAX the train
    function takes and returns the step's state: it is returned unchanged,
    with the metric values it holds.
    """
    original = model.train_function

    def no_step(*args):
        model.train_function = original
        if len(args) == 1:  # TensorFlow: train_function(iterator)
            return model.get_metrics_result()
        state = args[0]  # JAX: train_function(state, iterator) -> (logs, state)
        metrics = list(zip(model.metrics_variables, state[-1]))
        with keras.StatelessScope(state_mapping=metrics):
            logs = model.get_metrics_result()
        return logs, state

    model.train_function = no_step


def _largest_true(predicate, limit=10**9):
    """The largest n >= 0 with `predicate(n)` for a predicate true up to a point."""
    if not predicate(1):
        return 0
    low, high = 1, 2
    while high < limit and predicate(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if predicate(middle):
            low = middle
        else:
            high = middle
    return low
