"""Loss-based sample selection and reweighting (`compile(sample_selection=...)`).

`kt.TopLoss`, `kt.ReducibleLoss` (RHO-LOSS), `kt.SelectiveBackprop`,
`kt.ImportanceSampling` select examples of each batch by their loss;
`kt.SelfPaced` and `kt.SuperLoss` reweight them. See `docs/selection.md`.
A user-defined rule subclasses `SelectionRule` (one method,
`select(losses, context) -> [batch] weights`; see `docs/extending.md`).
"""

from keras_tapeops.selection.base import SelectionContext
from keras_tapeops.selection.base import SelectionRule
from keras_tapeops.selection.importance_sampling import ImportanceSampling
from keras_tapeops.selection.reducible_loss import ReducibleLoss
from keras_tapeops.selection.selective_backprop import SelectiveBackprop
from keras_tapeops.selection.self_paced import SelfPaced
from keras_tapeops.selection.super_loss import SuperLoss
from keras_tapeops.selection.top_loss import TopLoss

__all__ = [
    "ImportanceSampling",
    "ReducibleLoss",
    "SelectionContext",
    "SelectionRule",
    "SelectiveBackprop",
    "SelfPaced",
    "SuperLoss",
    "TopLoss",
]
