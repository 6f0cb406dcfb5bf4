"""DP-SGD's refusals shared by both backends' engines (the same words on TensorFlow and JAX).

Each function returns the ValueError to raise; the engines raise them
before any weight changes.
"""

from __future__ import annotations


def loss_terms_refused(names: list[str]) -> ValueError:
    """The error for `loss_terms` next to DPSGD (on every backend)."""
    return ValueError(
        "DPSGD cannot be combined with `loss_terms`: a loss term is "
        "computed from the whole batch, so it has no per-example "
        "gradient to clip. Received: loss_terms with names "
        f"{names}"
    )


def sample_weight_refused(dtypes: list[str], mask_note: str = "") -> ValueError:
    """The error for a `sample_weight`/`class_weight` that is not a boolean mask.

    Args:
        dtypes: the dtypes received.
        mask_note: text after "read as a mask of real examples" (e.g. who pads).
    """
    return ValueError(
        "DPSGD does not support sample_weight or class_weight: a "
        "weight scales an example's gradient, so the bound "
        "l2_norm_clip on each example's contribution, which the "
        "privacy guarantee rests on, would no longer hold. Train "
        "on unweighted data (resample instead of weighting). A "
        "boolean sample_weight is read as a mask of real "
        f"examples{mask_note}. Received: sample_weight of dtype {dtypes}"
    )


def added_losses_refused(count: int, model_name: str) -> ValueError:
    """The error for losses added in the forward pass (`add_loss`, activity regularizers)."""
    return ValueError(
        "DPSGD cannot clip losses added in the forward pass (add_loss, "
        "activity_regularizer): they are computed from the whole batch, "
        "so they have no per-example gradient. Weight regularizers are "
        "fine. Received: "
        f"{count} added loss(es) in model {model_name!r}"
    )


#: The error text for a batch without targets.
NO_TARGETS = "DPSGD needs targets to compute one loss per example. Received: y=None"
