"""Loss-based sample selection and reweighting (`compile(sample_selection=...)`).

`kt.TopLoss`, `kt.ReducibleLoss` (RHO-LOSS), `kt.SelectiveBackprop`,
`kt.ImportanceSampling` select examples of each batch by their loss;
`kt.SelfPaced` and `kt.SuperLoss` reweight them. See `docs/selection.md`.
"""

from keras_tapeops.selection.top_loss import TopLoss

__all__ = ["TopLoss"]
