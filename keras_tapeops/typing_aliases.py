"""Type aliases of the public signatures.

TensorFlow and Keras ship no type information: to a type checker their
classes (`keras.Model`, `keras.Variable`, `tf.Tensor`, ...) are `Any`. The
signatures name them anyway, for the reader and the API reference; the
aliases below name what has no single class.
"""

from typing import TYPE_CHECKING
from typing import Any
from typing import Union

import keras
import tensorflow as tf

#: Keras's nested data: a tensor or array, or a (nested) tuple, list or dict
#: of them, as `x`, `y`, `sample_weight`, `y_pred` and a batch `data` are.
#: Truly anything a model accepts, hence `Any`.
Nested = Any

#: One variable's gradient: a dense tensor, `tf.IndexedSlices` (an embedding's
#: sparse gradient) or None (the variable does not affect the loss).
Gradient = Union[tf.Tensor, tf.IndexedSlices, None]

#: The `logs` Keras passes a callback hook: metric name -> value, or None.
Logs = Union[dict[str, Any], None]

if TYPE_CHECKING:
    # The mixin's bases are plain classes at run time (Keras rewrites the
    # bases of a `keras.Model` subclass for functional construction); to the
    # type checker they are models, so their methods may use the model's
    # attributes and `super()`'s stock methods.
    ModelMixinBase = keras.Model
else:
    ModelMixinBase = object
