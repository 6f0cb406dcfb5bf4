"""Type aliases of the public signatures.

TensorFlow and Keras ship no type information: to a type checker their
classes (`keras.Model`, `keras.Variable`, `tf.Tensor`, ...) are `Any`. The
signatures name them anyway, for the reader and the API reference; the
aliases below name what has no single class.
"""

from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Union

import keras
import numpy as np

if TYPE_CHECKING or keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    #: One variable's gradient: a dense tensor, `tf.IndexedSlices` (an
    #: embedding's sparse gradient) or None (the variable does not affect the loss).
    Gradient = Union[tf.Tensor, tf.IndexedSlices, None]

    #: Evaluation data: a finite `tf.data.Dataset` of `(x, y[, sample_weight])`
    #: batches, or a tuple `(x, y[, sample_weight])` of arrays.
    Data = Union[tf.data.Dataset, tuple[Any, ...]]

    #: Numbers per example or per point: a NumPy array or a tensor.
    Array = Union[np.ndarray, tf.Tensor]
else:  # JAX: gradients are dense arrays; TensorFlow is not imported.
    Gradient = Any
    Data = Any
    Array = Any

#: Keras's nested data: a tensor or array, or a (nested) tuple, list or dict
#: of them, as `x`, `y`, `sample_weight`, `y_pred` and a batch `data` are.
#: Truly anything a model accepts, hence `Any`.
Nested = Any

#: The `logs` Keras passes a callback hook: metric name -> value, or None.
Logs = Union[dict[str, Any], None]

#: A loss: a `keras.losses.Loss`, its name, or a function `(y_true, y_pred) -> loss`.
LossLike = Union[str, keras.losses.Loss, Callable[..., Any]]

if TYPE_CHECKING:
    # The mixin's bases are plain classes at run time (Keras rewrites the
    # bases of a `keras.Model` subclass for functional construction); to the
    # type checker they are models, so their methods may use the model's
    # attributes and `super()`'s stock methods.
    ModelMixinBase = keras.Model
else:
    ModelMixinBase = object
