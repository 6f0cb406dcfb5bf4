"""Loss terms for `compile(loss_terms=[...])`: the protocol and the built-in terms."""

import keras

from keras_tapeops.terms.activation import ActivationPenalty
from keras_tapeops.terms.base import Term
from keras_tapeops.terms.base import TermContext
from keras_tapeops.terms.custom import LossTerm

__all__ = [
    "ActivationPenalty",
    "LossTerm",
    "Term",
    "TermContext",
]

# The terms that differentiate through the inputs (gradient penalties,
# attacks) are TensorFlow-only for now; on JAX `compile()` names them.
if keras.backend.backend() == "tensorflow":
    from keras_tapeops.terms.adversarial import TRADES
    from keras_tapeops.terms.adversarial import AdversarialLoss
    from keras_tapeops.terms.penalty import GradientPenalty

    __all__ += ["AdversarialLoss", "GradientPenalty", "TRADES"]
