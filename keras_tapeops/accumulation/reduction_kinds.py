"""The reduction kinds of a compiled loss, read from `compile()`'s `loss` (backend-neutral).

Which normalizer each Keras reduction divides a batch's loss by, and the
refusals that follow for `micro_batches` and `accumulation_steps` (see
reductions.py for the TensorFlow interception that reads them per batch).
Shared by the TensorFlow and JAX steps: no TensorFlow here.
"""

from __future__ import annotations

from typing import Any

import keras

MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")
UNREDUCED = (None, "none")


def kind_of(reduction, has_weights, has_mask):
    """The component kind of a loss with this reduction (see the module docstring)."""
    if reduction == "sum":
        return "unit"
    if has_mask:
        return "masked"
    if reduction == "mean_with_sample_weight" and has_weights:
        return "weights"
    return "samples"


def refuse_unreduced(option, value, name, reduction):
    """The error for a loss that does not reduce (`None` / `"none"`)."""
    return ValueError(
        f"`{option}={value}` cannot split a loss that is not reduced: the loss "
        f"of output {name!r} returns one value per sample (reduction="
        f"{reduction!r}), whose gradient Keras takes as the sum over the "
        "batch while it logs the mean. Use reduction='sum' (the same "
        f"gradient) or a mean reduction. Received: reduction={reduction!r}"
    )


def check_compile_loss(options: Any, loss: Any) -> None:
    """Refuses at `compile()` what accumulation cannot make exact, seen from `loss`.

    Catches an unreduced loss (`reduction=None` or `"none"`) with
    `micro_batches` or `accumulation_steps`, and, with `accumulation_steps`,
    a `"sum"` loss next to a mean-reduced output or a loss term. Mixes that
    depend on the data (sample weights, masks) are checked on the first batch.

    Args:
        options: the validated `TapeOpsOptions`.
        loss: the `loss` argument given to `compile()`.

    Returns:
        None. Raises ValueError naming the option and the reduction.
    """
    if not options.accumulates or loss is None:
        return
    option, value = option_of(options)
    named = named_losses(loss)
    for name, reduction in named:
        if reduction in UNREDUCED:
            raise refuse_unreduced(option, value, name, reduction)
    if options.accumulation_steps > 1:
        sums = [name for name, r in named if r == "sum"]
        means = [name for name, r in named if r != "sum"]
        if sums and (means or options.loss_terms):
            raise refuse_mixed_window(
                options.accumulation_steps,
                {name: r for name, r in named},
                "loss terms" if options.loss_terms and not means else None,
            )


def refuse_mixed_window(steps, reductions, extra=None):
    """The error for a window whose pieces need two different normalizers."""
    also = f" and {extra}" if extra else ""
    return ValueError(
        f"`accumulation_steps={steps}` cannot make this loss exact: its parts "
        f"are normalized differently ({describe(reductions)}{also}), and "
        "the window's normalizers are known only after its last batch, so one "
        "accumulator cannot weight both. Use one reduction for every output "
        "(loss terms and regularizers count as per-sample means, so they go "
        "with a mean reduction), or use `micro_batches`, which is exact for "
        f"every mix. Received: reduction={describe(reductions)}"
    )


def option_of(options):
    """`(name, value)` of the accumulation option in force, for messages."""
    if options.micro_batches > 1:
        return "micro_batches", options.micro_batches
    return "accumulation_steps", options.accumulation_steps


def named_losses(loss):
    """`[(name, reduction)]` of the Loss objects in a compile() `loss` argument."""
    out = []
    if isinstance(loss, dict):
        items = list(loss.items())
    elif isinstance(loss, (list, tuple)):
        items = [(f"output_{i}", item) for i, item in enumerate(loss)]
    else:
        items = [("loss", loss)]
    for name, item in items:
        if isinstance(item, (dict, list, tuple)):
            out += [(f"{name}/{n}", r) for n, r in named_losses(item)]
        elif isinstance(item, keras.losses.Loss):
            out.append((name, item.reduction))
        elif item is not None:
            out.append((name, "sum_over_batch_size"))
    return out


def describe(reductions):
    return "{" + ", ".join(f"{n!r}: {r!r}" for n, r in reductions.items()) + "}"
