"""Saving and loading a keras_tapeops model: compile options, training state, legacy files.

The mixin's `get_compile_config`, `compile_from_config`, `save` and
`load_own_variables` are thin: the work is here.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_tapeops.hook_overrides import overrides
from keras_tapeops.options import OPTION_NAMES
from keras_tapeops.options import TapeOpsOptions
from keras_tapeops.typing_aliases import ModelMixinBase


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
    if not legacy:
        stock_load(store)
        return
    from keras_tapeops._keras import private  # TensorFlow: legacy files only

    own = private.own_variables(model)
    if len(store.keys()) == len(own) + len(legacy):
        values = [store[str(i)] for i in range(len(own) + len(legacy))]
        stock_load({str(i): v for i, v in enumerate(values[: len(own)])})
        for (_, variable), value in zip(legacy, values[len(own) :]):
            variable.assign(value)
        return
    stock_load(store)


class SavingMethods(ModelMixinBase):
    """The mixin's saving methods (a base of `TapeOpsMixin`, before `keras.Model`).

    Saves the options with the compile config and the options' training
    state with the weights; loading compiles the model as it was saved.
    """

    @property
    def _tapeops_training_state(self):
        """The options' training state, saved by `save`/`save_weights` (or None).

        Keras saves every saveable attribute of a model under the
        attribute's name; this one holds the variables of stateful transforms
        and of the multi-gradient engine (`training_state.TrainingState`), which are
        not in `model.weights`. A stock model has no such entry and ignores
        it in a file.
        """
        state = self.tapeops_state
        return state.saveable if state is not None else None

    def load_own_variables(self, store: Any) -> None:
        """Stock loading, also of files saved before issue 17.

        keras_tapeops up to then listed the options' training state among the
        model's own variables, after the model's others: a file whose
        model-level entry has exactly that many more values loads them into
        the training state. Any other file loads as in stock Keras.
        """
        load_own_variables(self, store, super().load_own_variables)

    def get_compile_config(self) -> dict[str, Any] | None:
        return compile_config(self, super().get_compile_config())

    def save(self, filepath: str, *args: Any, **kwargs: Any) -> None:
        """Stock `save()`, refusing an unsaveable configuration first.

        `get_compile_config` raises for an unregistered transform class or
        callable; Keras calls it only after opening (and truncating) the
        target file, so check before: a refused save leaves an existing
        file intact.
        """
        self.get_compile_config()
        return super().save(filepath, *args, **kwargs)

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Compiles a loaded model as it was saved, with its keras_tapeops options.

        As in stock Keras, a class whose `compile()` is its own (beyond the
        mixin's, e.g. `compile(self, d_optimizer, g_optimizer)`) is not
        compiled on load: Keras warns and the model is returned uncompiled
        (compile it, or override this method).
        """
        if not self._tapeops_replays_compile(config):
            return super().compile_from_config(config)  # stock: warns, skips
        replay_compile(self, config)

    def _tapeops_replays_compile(self, config):
        """True when loading may call `compile(**config)` (no compile override)."""
        return not overrides(self, "compile")
