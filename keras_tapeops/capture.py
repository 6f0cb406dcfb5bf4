"""Records layer outputs during the step's single forward pass.

Keras 3 has no forward hooks. While the step's forward pass runs (at trace
time under `tf.function`), the selected layers' `call` is wrapped on the
instance so every output they produce is recorded; the wrapper is removed when
the pass ends. The layer is never run a second time.
"""

import contextlib

import keras

from keras_tapeops._keras import private


@contextlib.contextmanager
def recording_outputs(layers):
    """Records the outputs of `layers` produced inside this block.

    Args:
        layers: Keras layers whose outputs to record.

    Returns:
        (yields) a dict `id(layer) -> list of output tensors`, filled as the
        layers run; several calls and several outputs each add tensors.

    Example:
    ```python
    with recording_outputs([model.get_layer("dense")]) as acts:
        y = model(x)
    ```
    """
    records = {}
    patched = []
    for layer in {id(layer): layer for layer in layers}.values():
        records[id(layer)] = []
        patched.append((layer, layer.__dict__.get("call")))
        layer.call = _recording_call(layer.call, records[id(layer)])
    try:
        yield records
    finally:
        for layer, own_call in patched:
            if own_call is None:
                del layer.call
            else:
                layer.call = own_call


def _recording_call(original, sink):
    def call(*args, **kwargs):
        outputs = original(*args, **kwargs)
        # A symbolic build of an unbuilt model runs `call` on placeholders in
        # a scratch graph first; only the real forward pass counts.
        if not private.in_symbolic_build():
            sink.extend(t for t in keras.tree.flatten(outputs) if t is not None)
        return outputs

    return call
