"""Saving and loading a keras_tapeops model: compile options, training state, legacy files.

The mixin's `get_compile_config`, `compile_from_config`, `save` and
`load_own_variables` are thin: the work is here.
"""

import keras

from keras_tapeops._keras import private
from keras_tapeops.options import OPTION_NAMES
from keras_tapeops.options import TapeOpsOptions


def compile_config(model, stock_config):
    """Stock compile config plus the model's keras_tapeops options.

    Args:
        model: the model.
        stock_config: what Keras's `get_compile_config` returned.

    Returns:
        The config dict (or `stock_config` as it was when empty).
    """
    options = model.tapeops_options
    if stock_config and options is not None:
        stock_config.update(options.get_config(model))
    return stock_config


def replay_compile(model, config):
    """Compiles a loaded model as it was saved, with its keras_tapeops options.

    Args:
        model: the loaded model (its class's `compile` is the mixin's).
        config: the saved compile config.
    """
    config = dict(config)
    ours = {k: config.pop(k) for k in OPTION_NAMES if k in config}
    stock = keras.saving.deserialize_keras_object(config)
    model.compile(**stock, **TapeOpsOptions.kwargs_from_config(ours))
    if model.built and model.optimizer is not None:
        model.optimizer.build(model.trainable_variables)


def load_own_variables(model, store, stock_load):
    """Stock loading, also of files saved before issue 17.

    keras_tapeops up to then listed the options' training state among the
    model's own variables, after the model's others: a file whose
    model-level entry has exactly that many more values loads them into
    the training state. Any other file loads as in stock Keras.

    Args:
        model: the model.
        store: the file's entry for the model's own variables.
        stock_load: Keras's `load_own_variables` (bound).
    """
    state = model.tapeops_state
    legacy = state.training_state_items() if state is not None else []
    own = private.own_variables(model)
    if legacy and len(store.keys()) == len(own) + len(legacy):
        values = [store[str(i)] for i in range(len(own) + len(legacy))]
        stock_load({str(i): v for i, v in enumerate(values[: len(own)])})
        for (_, variable), value in zip(legacy, values[len(own):]):
            variable.assign(value)
        return
    stock_load(store)
