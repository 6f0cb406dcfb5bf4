"""Privacy accounting for DP-SGD on Google's `dp-accounting` package.

A DP-SGD run of `steps` noisy steps, each on a Poisson sample of the data
with probability `sampling_rate`, with noise `noise_multiplier`, is the
`dp_accounting` event
`SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)`
(add-or-remove-one neighbouring datasets). `epsilon` gives its epsilon at a
delta with the PLD accountant (tight, the default) or the RDP accountant
(an upper bound, faster); `noise_multiplier_for` the smallest sigma that
keeps a target epsilon.

`dp-accounting` is an optional dependency: `pip install keras-tapeops[privacy]`.
"""

import math
import numbers

from keras_tapeops import validation

ACCOUNTANTS = ("pld", "rdp")


def _dp_accounting():
    try:
        import dp_accounting
    except ImportError as error:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "Privacy accounting needs Google's `dp-accounting` package: "
            "pip install keras-tapeops[privacy] (or pip install dp-accounting)."
        ) from error
    return dp_accounting


def require_dp_accounting():
    """Raises ImportError (with the install command) if `dp-accounting` is missing.

    Returns:
        None. Call it before training starts (`PrivacyBudget` does, in
        `on_train_begin`), so a missing package fails before any step.
    """
    _dp_accounting()


def dp_event(steps, sampling_rate, noise_multiplier):
    """The `dp_accounting` event of a DP-SGD run (Poisson sampling, Gaussian noise).

    Args:
        steps: number of noisy steps (int >= 0).
        sampling_rate: the probability of each example being in a step's batch.
        noise_multiplier: sigma, in units of the clipping bound.

    Returns:
        A `dp_accounting.DpEvent`.
    """
    dp = _dp_accounting()
    step = dp.PoissonSampledDpEvent(sampling_rate, dp.GaussianDpEvent(noise_multiplier))
    return dp.SelfComposedDpEvent(step, steps)


def make_accountant(accountant):
    """A fresh `dp_accounting` accountant: `"pld"` or `"rdp"`, default settings."""
    dp = _dp_accounting()
    if accountant == "pld":
        return dp.pld.PLDAccountant()
    return dp.rdp.RdpAccountant()


def epsilon(
    steps: int,
    sampling_rate: float,
    noise_multiplier: float,
    delta: float = 1e-5,
    accountant: str = "pld",
) -> float:
    """The epsilon of a DP-SGD run at `delta`, from `dp-accounting`.

    Args:
        steps: number of noisy (applied) optimizer steps, an int >= 0.
        sampling_rate: the probability that a given example is in a step's
            batch (Poisson sampling), in (0, 1]. With fixed batches from a
            shuffled dataset, `batch_size / dataset_size` is the usual
            approximation (see docs/privacy.md).
        noise_multiplier: sigma of `kt.DPSGD`, >= 0 (0 gives infinity).
        delta: the target delta, in (0, 1).
        accountant: `"pld"` (privacy loss distributions: tight) or `"rdp"`
            (Renyi DP: a looser upper bound).

    Returns:
        Epsilon (a float; `inf` without noise, 0 for zero steps).

    Example:
    ```python
    kt.privacy.epsilon(steps=1000, sampling_rate=0.01, noise_multiplier=1.1)
    ```
    """
    steps = _steps(steps)
    sampling_rate = check_sampling_rate(sampling_rate)
    noise_multiplier = validation.non_negative_number(noise_multiplier, "noise_multiplier")
    delta = _delta(delta)
    accountant = validation.choice(accountant, "accountant", ACCOUNTANTS)
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    tracker = make_accountant(accountant)
    tracker.compose(dp_event(steps, sampling_rate, noise_multiplier))
    return float(tracker.get_epsilon(delta))


def noise_multiplier_for(
    target_epsilon: float,
    steps: int,
    sampling_rate: float,
    delta: float = 1e-5,
    accountant: str = "pld",
) -> float:
    """The smallest noise multiplier whose run stays within `target_epsilon`.

    Args:
        target_epsilon: the epsilon to reach, > 0.
        steps: number of noisy (applied) optimizer steps, an int >= 1.
        sampling_rate: the Poisson sampling probability, in (0, 1].
        delta: the target delta, in (0, 1).
        accountant: `"pld"` or `"rdp"`, as in `epsilon`.

    Returns:
        float: the noise multiplier sigma, with `epsilon(steps, sampling_rate,
            sigma, delta) <= target_epsilon` within `dp_accounting`'s
            calibration tolerance.

    Example:
    ```python
    sigma = kt.privacy.noise_multiplier_for(3.0, steps=500, sampling_rate=0.02)
    ```
    """
    target_epsilon = validation.positive_number(target_epsilon, "target_epsilon")
    steps = _steps(steps)
    if steps == 0:
        raise ValueError("`steps` must be at least 1 to calibrate noise. Received: steps=0")
    sampling_rate = check_sampling_rate(sampling_rate)
    delta = _delta(delta)
    accountant = validation.choice(accountant, "accountant", ACCOUNTANTS)
    dp = _dp_accounting()

    def calibrate(kind, bracket):
        return float(
            dp.calibrate_dp_mechanism(
                lambda: make_accountant(kind),
                lambda sigma: dp_event(steps, sampling_rate, sigma),
                target_epsilon,
                delta,
                bracket,
                tol=1e-3,
            )
        )

    upper = calibrate("rdp", dp.LowerEndpointAndGuess(0.05, 1.0))
    if accountant == "rdp":
        return upper
    # PLD's epsilon is below RDP's bound, so its sigma is below RDP's: search
    # down from it (a PLD evaluation is slow at small sigma; start close).
    lower = upper
    while lower > 0.05:
        lower *= 0.7
        if epsilon(steps, sampling_rate, lower, delta, "pld") > target_epsilon:
            return calibrate("pld", dp.ExplicitBracketInterval(lower, upper))
        upper = lower
    return upper


def check_sampling_rate(sampling_rate):
    """Returns `sampling_rate` as a float if it is in (0, 1], else raises ValueError."""
    rate = validation.positive_number(sampling_rate, "sampling_rate")
    if rate > 1:
        raise ValueError(
            f"`sampling_rate` must be in (0, 1]. Received: sampling_rate={sampling_rate!r}"
        )
    return rate


def _delta(delta):
    value = validation.positive_number(delta, "delta")
    if value >= 1:
        raise ValueError(f"`delta` must be in (0, 1). Received: delta={delta!r}")
    return value


def _steps(steps):
    """An int >= 0 (`validation.positive_int` refuses 0, a run of no step)."""
    if isinstance(steps, numbers.Integral) and not isinstance(steps, bool) and steps == 0:
        return 0
    return validation.positive_int(steps, "steps")
