"""`PrivacyBudget`: logs DP-SGD's epsilon each epoch and stops at a target."""

import math

import keras

from keras_tapeops import validation
from keras_tapeops.privacy import accounting
from keras_tapeops.registration import register


@register
class PrivacyBudget(keras.callbacks.Callback):
    """Logs the epsilon spent so far by `kt.DPSGD` training; stops at a target.

    At the end of every epoch it writes
    `kt.privacy.epsilon(steps, sampling_rate, noise_multiplier, delta)` into
    the epoch logs under `name` (History, the progress bar, and TensorBoard
    or CSVLogger listed AFTER this callback see it), where `steps` counts
    the applied (noisy) optimizer steps of the model and `noise_multiplier`
    is its compiled `kt.DPSGD`'s. With `target_epsilon`, training stops
    after the last step that keeps epsilon at or below the target (checked
    after every batch), so the target is never exceeded.

    The sampling rate is `sampling_rate` if given (use the one passed to
    `kt.privacy.poisson_batches`), else the largest number of samples in an
    applied step divided by `dataset_size`: the usual `batch_size / N` for
    fixed-size batches (an approximation: see docs/privacy.md), and an
    over-estimate (a larger, safe epsilon) for padded Poisson batches.

    Args:
        dataset_size: the number of training examples N (int >= 1).
        delta: the target delta, in (0, 1).
        target_epsilon: None, or a positive epsilon at which to stop.
        sampling_rate: None (inferred as above) or the Poisson sampling rate.
        accountant: `"pld"` (tight) or `"rdp"` (faster, looser).
        name: the log key (default `"epsilon"`).

    Example:
    ```python
    model.compile(optimizer="sgd", loss="categorical_crossentropy",
                  differential_privacy=kt.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1))
    budget = kt.callbacks.PrivacyBudget(dataset_size=64, target_epsilon=20.0, accountant="rdp")
    history = model.fit(x, y, batch_size=16, epochs=2, callbacks=[budget], verbose=0)
    history.history["epsilon"]
    ```
    """

    def __init__(
        self, dataset_size, delta=1e-5, target_epsilon=None, sampling_rate=None,
        accountant="pld", name="epsilon",
    ):
        super().__init__()
        self.dataset_size = validation.positive_int(dataset_size, "dataset_size")
        self.delta = validation.positive_number(delta, "delta")
        if self.delta >= 1:
            raise ValueError(f"`delta` must be in (0, 1). Received: delta={delta!r}")
        self.target_epsilon = (
            None if target_epsilon is None
            else validation.positive_number(target_epsilon, "target_epsilon")
        )
        self.sampling_rate = (
            None if sampling_rate is None else accounting.check_sampling_rate(sampling_rate)
        )
        self.accountant = validation.choice(accountant, "accountant", accounting.ACCOUNTANTS)
        self.name = validation.name(name, "name")
        self._noise_multiplier = None
        self._engine = None
        self._largest_step = 0.0
        self._max_steps = None  # (rate, steps) of the last stopping-point search

    # ----------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
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

    def on_train_batch_end(self, batch, logs=None):
        if self.sampling_rate is None:
            self._largest_step = max(self._largest_step, float(self._engine.step_samples.numpy()))
        if self.target_epsilon is not None and self._steps() >= self._allowed_steps():
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs[self.name] = self.epsilon()

    # --------------------------------------------------------------- values
    def epsilon(self):
        """The epsilon spent by the applied steps so far (0 before the first)."""
        steps = self._steps()
        rate = self._rate()
        if steps == 0 or rate is None:
            return 0.0
        return accounting.epsilon(
            steps, rate, self._noise_multiplier, self.delta, self.accountant
        )

    def _steps(self):
        return int(self.model.optimizer.iterations.numpy())

    def _rate(self):
        if self.sampling_rate is not None:
            return self.sampling_rate
        if self._largest_step == 0:
            return None
        return min(1.0, self._largest_step / self.dataset_size)

    def _allowed_steps(self):
        """The most steps whose epsilon stays at or below the target."""
        rate = self._rate()
        if rate is None:
            return math.inf
        if self._max_steps is not None and self._max_steps[0] == rate:
            return self._max_steps[1]
        if self._noise_multiplier == 0:
            allowed = 0
        else:
            def within(steps):
                return accounting.epsilon(
                    steps, rate, self._noise_multiplier, self.delta, self.accountant
                ) <= self.target_epsilon

            allowed = _largest_true(within)
        self._max_steps = (rate, allowed)
        return allowed

    def get_config(self):
        return {
            "dataset_size": self.dataset_size,
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            "sampling_rate": self.sampling_rate,
            "accountant": self.accountant,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)


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
