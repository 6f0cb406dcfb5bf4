"""Every private Keras access of keras_tapeops, isolated here.

Keras 3 has no public API for a few things the step needs (the loss tracker,
the compiled loss's per-output view, the symbolic build, an optimizer's
variable keys, the functional model class). Each access lives in one of
these modules, in a function with a comment saying why it is needed and the
Keras versions it was checked on (3.10 to 3.15). Nothing outside this
subpackage imports `keras.src` or reads a private Keras attribute
(`tests/test_architecture.py` checks it).

Modules:
    private:      the model's trainer internals (loss tracker, compiled loss,
                  symbolic build, multi-worker logs, layer walking, a layer's
                  own trainable variables).
    compile_loss: the compiled loss's per-output entries, build structures,
                  `loss=` argument and per-output trackers.
    masking:      the Keras mask a tensor carries.
    models:       the functional model class and Keras's unpickling entry point.
    optimizers:   an optimizer's variable keys, the variables it was built
                  with, its weight-decay exclusions.
    multitask:    the compiled loss's per-output records for task balancing.
    selection:    the symbolic build of a model whose inputs carry example ids.
"""
