"""One traced function per model and per static setting, re-traced when the model is edited.

A `tf.function` bakes in the Python attributes its trace read: after
`model.layers[-1].activation = None` (the keras.io Grad-CAM recipe) a cached
trace would go on explaining the old model. So each cached function is kept
with a fingerprint of the model's layers (every layer, nested ones included,
with the identity of every attribute value in its `__dict__`); a call whose
fingerprint differs traces again. Reassigning an attribute (an activation,
a rate, a sub-layer, a Python flag of a subclassed model) changes the
fingerprint; mutating an object in place (appending to a list attribute)
does not. Variables' values are read at run time and need no new trace.

The fingerprint costs one walk over the layers per call (measured on a
shared 2-core CPU: 0.7-2.6 ms for MobileNetV2's 157 layers, where one
`saliency` call on 4 images of 32x32 takes about 22 ms and a new trace
4-5 s); the fingerprint stored with a new trace
is taken after its first run, so the bookkeeping Keras does on a layer's
first call (`_called`, RNN dropout masks) does not force a second trace.
"""

import weakref

import tensorflow as tf

from keras_tapeops._keras import private

# model -> {static key: tf.function}, and model -> {static key: the
# fingerprint the function was traced for}. Each function holds only a weak
# reference to its model, so the caches never keep a model alive.
_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fingerprint(model):
    """A hashable summary of the model's Python state that a trace may bake in.

    Args:
        model: a Keras model or layer.

    Returns:
        A tuple: per layer (the model first, then every layer inside it),
        its identity, its attribute names and the identities of their values.
    """
    parts = []
    for layer in [model] + private.all_layers(model):
        state = vars(layer)
        parts.append((id(layer), tuple(state), tuple(map(id, state.values()))))
    return tuple(parts)


def traced(model, key, build):
    """Returns the model's traced function for `key`, traced again after an edit.

    Args:
        model: the Keras model.
        key: a hashable description of what the trace bakes in (the
            method, its static arguments).
        build: `build(ref) -> python function`; `ref()` gives the model.

    Returns:
        A callable that runs the `tf.function` (`reduce_retracing=True`:
        new batch sizes reuse a relaxed trace), traced again whenever the
        model's fingerprint changed since the cached trace.

    Example:
    ```python
    fn = traced(model, ("saliency",), lambda ref: lambda x: ref()(x))
    ```
    """
    functions = _FUNCTIONS.setdefault(model, {})
    fingerprints = _FINGERPRINTS.setdefault(model, {})
    if key in functions and fingerprints.get(key) == fingerprint(model):
        return functions[key]
    function = tf.function(build(weakref.ref(model)), reduce_retracing=True)
    functions[key] = function
    fingerprints[key] = None

    def first_run(*args):
        result = function(*args)
        # The model as it is after its first traced call (Keras sets a few
        # attributes on a layer's first call).
        fingerprints[key] = fingerprint(model)
        return result

    return first_run
