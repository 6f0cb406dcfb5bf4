"""One traced function per model and per static setting, kept while the model lives."""

import weakref

import tensorflow as tf

# model -> {static key: tf.function}. Each function holds only a weak
# reference to its model, so the cache never keeps a model alive.
_FUNCTIONS = weakref.WeakKeyDictionary()


def traced(model, key, build):
    """Returns the model's `tf.function` for `key`, tracing `build(model_ref)` once.

    Args:
        model: the Keras model.
        key: a hashable description of what the trace bakes in (the
            method, its static arguments).
        build: `build(ref) -> python function`; `ref()` gives the model.

    Returns:
        A `tf.function` (`reduce_retracing=True`: new batch sizes reuse a
        relaxed trace).

    Example:
    ```python
    fn = traced(model, ("saliency",), lambda ref: lambda x: ref()(x))
    ```
    """
    functions = _FUNCTIONS.setdefault(model, {})
    if key not in functions:
        functions[key] = tf.function(build(weakref.ref(model)), reduce_retracing=True)
    return functions[key]
