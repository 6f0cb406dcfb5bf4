"""The recordings of Dense and EinsumDense layers: their input and pre-activation output.

DP-SGD's ghost rules for these layers (`privacy.ghost_dense`) and the
multi-task step's layer-by-layer Gramian (`multitask.layerwise`) record the
same two tensors per call; a recording says which layers it applies to
(`applies`) and how a call is recorded (`forward`), and nothing about what
is computed from the records.

Example:
```python
recording = next((r for r in (DenseRecording, EinsumDenseRecording) if r.applies(layer)), None)
outputs, record = recording.forward(layer, layer.call, (x,), {})   # record["a"], record["z"]
```
"""

import keras

from keras_tapeops.layer_records.forwards import pre_activation_forward
from keras_tapeops.layer_records.forwards import stock_call
from keras_tapeops.layer_records.layouts import layout


class DenseRecording:
    """A `keras.layers.Dense` (any input rank) running its own `call`: input and pre-activation."""

    family = "Dense"

    @staticmethod
    def applies(layer):
        return stock_call(layer, keras.layers.Dense)

    forward = staticmethod(pre_activation_forward)


class EinsumDenseRecording:
    """A `keras.layers.EinsumDense` whose equation reads as `b S C, C O -> b S O` (`layout`)."""

    family = "EinsumDense"

    @staticmethod
    def applies(layer):
        return (
            stock_call(layer, keras.layers.EinsumDense) and layout(layer.equation, None) is not None
        )

    forward = staticmethod(pre_activation_forward)
