"""Loss terms for `compile(loss_terms=[...])`: the protocol and the built-in terms."""

import keras

from keras_tapeops.terms.activation import ActivationPenalty
from keras_tapeops.terms.base import Term
from keras_tapeops.terms.base import TermContext
from keras_tapeops.terms.custom import LossTerm
from keras_tapeops.terms.penalty import GradientPenalty

__all__ = [
    "ActivationPenalty",
    "GradientPenalty",
    "LossTerm",
    "Term",
    "TermContext",
]

# The adversarial terms (attacks on the inputs) are TensorFlow-only for now.
if keras.backend.backend() == "tensorflow":
    from keras_tapeops.terms.adversarial import TRADES
    from keras_tapeops.terms.adversarial import AdversarialLoss

    __all__ += ["AdversarialLoss", "TRADES"]
