"""`upgrade(model)`: the keras_tapeops-enabled version of an existing model.

- A plain `keras.Sequential` or functional model (`keras.Model(inputs,
  outputs)`) becomes a new `TapeOpsSequential` / `TapeOpsFunctional` built from
  the same layers.
- A model of a class that subclasses `keras.Model` or `keras.Sequential` but is
  built the functional way (its `__init__` calls `super().__init__(inputs,
  outputs)`, as every keras-hub Task does) keeps its class: it is re-classed in
  place to `upgraded_class(type(model))`, a subclass of its own class with
  `TapeOpsMixin` inserted where `class Net(kt.TapeOpsMixin, keras.Model)` would
  put it (after the model's own classes, before Keras's). Nothing is rebuilt,
  so its methods, attributes, preprocessor, compile state and optimizer state
  are all kept.
- A truly subclassed model (its own `call`) cannot be rebuilt: TypeError
  saying to add the mixin to its bases.

Saving: every upgraded class is registered under one name,
`"keras_tapeops>UpgradedModel"`, whose registered object is a loader, and its
`get_config()` records the original class (module, name, registered name).
`keras.models.load_model` finds the loader, which resolves the original class
the way Keras does (registered objects, then keras/keras-hub modules), builds
the upgraded class if this process has not yet, and calls its `from_config`.
So a fresh process needs only `import keras_tapeops` plus whatever stock Keras
needs to load the original class. The loaded model is compiled with its saved
options through its class's `compile()` when that takes the saved arguments
(keras-hub's Tasks do); otherwise Keras's "compile() ... is custom" warning is
given and it is returned uncompiled, as stock Keras does.
"""

import importlib
import inspect
import weakref
from typing import TYPE_CHECKING
from typing import Any

import keras

from keras_tapeops._keras import models as keras_models
from keras_tapeops.registration import PACKAGE
from keras_tapeops.registration import register

if TYPE_CHECKING or keras.backend.backend() == "tensorflow":
    from keras_tapeops.mixin import TapeOpsMixin
else:  # the JAX step (keras_tapeops.backend.jax); no TensorFlow import
    from keras_tapeops.backend.jax.mixin import TapeOpsMixin

#: The `get_config()` key under which an upgraded model records its original class.
BASE_CLASS_KEY = "keras_tapeops_upgraded_from"
#: The registered name shared by every upgraded class (it resolves to the loader).
UPGRADED_NAME = "UpgradedModel"
# Packages whose modules Keras itself imports while loading (and we likewise).
_IMPORTABLE_PACKAGES = ("keras", "keras_hub", "keras_cv", "keras_nlp")


@register
class TapeOpsSequential(TapeOpsMixin, keras.Sequential):
    """A `keras.Sequential` with the keras_tapeops training step.

    Example:
    ```python
    model = kt.TapeOpsSequential([keras.Input((4,)), keras.layers.Dense(1)])
    ```
    """


@register
class TapeOpsFunctional(TapeOpsMixin, keras.Model):
    """A functional model (built from `inputs=`/`outputs=`) with the keras_tapeops step.

    Keras swaps `keras.Model` for its functional class in this class's bases
    when it is constructed with inputs and outputs; use it only that way.

    Example:
    ```python
    inputs = keras.Input((4,))
    model = kt.TapeOpsFunctional(inputs, keras.layers.Dense(1)(inputs))
    ```
    """


def upgrade(model: keras.Model) -> keras.Model:
    """Returns a keras_tapeops-enabled model with `model`'s layers and weights.

    Args:
        model: a `keras.Sequential`, a functional `keras.Model`, or a model
            of a `keras.Model`/`keras.Sequential` subclass built the
            functional way (its `__init__` calls `super().__init__(inputs,
            outputs)`, like every keras-hub Task). A model that already has
            the mixin is returned unchanged.

    Returns:
        For a plain Sequential or functional model, a new
        `TapeOpsSequential` or `TapeOpsFunctional` with the same layers
        (shared, not copied), weights, name, inputs and outputs; the
        original model is left as it was and compile state is not carried
        over (compile the returned model). For a subclass, the same object,
        re-classed in place to `upgraded_class(type(model))`: it is still an
        instance of its class, with `TapeOpsMixin` before Keras's classes in
        its MRO, and keeps everything it had (attributes, preprocessor,
        overridden hooks, compile and optimizer state). Compile it again to
        add keras_tapeops options.

    Raises:
        TypeError: for a truly subclassed model (its own `call()`), saying to
            put `kt.TapeOpsMixin` first in its bases, and for non-models.

    Example:
    ```python
    model = kt.upgrade(keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)]))
    model.compile(optimizer="adam", loss="mse",
                  gradient_transforms=[kt.ClipByGlobalNorm(1.0)])

    # A keras-hub Task keeps its class (upgraded in place; see docs/upgrade.md):
    # classifier = kt.upgrade(keras_hub.models.BertTextClassifier(...))
    # classifier.compile(optimizer="adam", micro_batches=2)
    # classifier.fit(raw_strings, labels)         # its preprocessor still runs
    ```
    """
    if isinstance(model, TapeOpsMixin):
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(
            "upgrade() takes a keras.Sequential or functional keras.Model. "
            f"Received: model={model!r} of type {type(model).__name__}"
        )
    cls = type(model)
    if cls is keras.Sequential:
        return _upgrade_sequential(model)
    if cls is _functional_class():
        return TapeOpsFunctional(
            inputs=model.input,
            outputs=model.output,
            name=model.name,
            trainable=model.trainable,
        )
    if isinstance(model, (keras.Sequential, _functional_class())):
        return _reclass(model, upgraded_class(cls))
    raise TypeError(_subclassed_model_message(cls))


def _subclassed_model_message(cls):
    """What `upgrade()` says about a subclassed model it cannot rebuild."""
    bases = ", ".join(_base_name(base) for base in cls.__bases__)
    defines_call = any(
        "call" in vars(klass) for klass in cls.__mro__ if klass.__module__.split(".")[0] != "keras"
    )
    if defines_call:
        what = "a subclassed model (one with its own `call()`)"
        fix = f"`class {cls.__name__}(kt.TapeOpsMixin, {bases}): ...`"
    else:
        # e.g. the keras.io GAN: no call(), its own train_step.
        what = (
            "a subclassed model that is not built from inputs and outputs (it defines no `call()`)"
        )
        fix = (
            f"`class TapeOps{cls.__name__}(kt.TapeOpsMixin, {cls.__name__}): pass` "
            "(a train_step or test_step the class defines is kept)"
        )
    return (
        f"upgrade() cannot rebuild {what}: subclass it with the mixin first "
        f"instead: {fix}. Models built the functional way "
        "(`super().__init__(inputs, outputs)`) are upgraded in place. "
        f"Received: model of type {cls.__name__}"
    )


def upgraded_class(cls: type[Any]) -> type[Any]:
    """Returns the keras_tapeops-enabled subclass of a model class (one per class).

    The class is named `"TapeOps" + cls.__name__` and lists `cls`, then
    `TapeOpsMixin`, then Keras's functional (or Sequential) class as bases,
    so its MRO is `cls`'s own classes, `TapeOpsMixin`, then Keras's classes:
    what `class Net(kt.TapeOpsMixin, keras.Model)` gives. Methods `cls`
    defines (`train_step`, `compile`, `fit`, ...) run first and reach the
    mixin through `super()`.

    Args:
        cls: a subclass of `keras.Model` built the functional way, or of
            `keras.Sequential`.

    Returns:
        The upgraded class, registered for saving (see the module docstring).

    Example:
    ```python
    Upgraded = upgraded_class(keras_hub.models.BertTextClassifier)
    Upgraded.__mro__[1:3]   # (BertTextClassifier, TextClassifier) ... TapeOpsMixin
    ```
    """
    if issubclass(cls, TapeOpsMixin):
        return cls
    upgraded = _UPGRADED_CLASSES.get(cls)
    if upgraded is not None:
        return upgraded
    keras_base = keras.Sequential if issubclass(cls, keras.Sequential) else _functional_class()
    name = f"TapeOps{cls.__name__}"
    upgraded = type(
        name,
        # The mixin's own bases are listed too: C3 then keeps them before
        # Keras's classes (`cls` precedes the mixin here, and Keras injects
        # `Functional` into `cls`'s bases, which would otherwise come first).
        (_UpgradedModel, cls, TapeOpsMixin, *TapeOpsMixin.__bases__, keras_base),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": (
                f"`{cls.__module__}.{cls.__qualname__}` with the keras_tapeops "
                "training step (made by `kt.upgrade`)."
            ),
            "_tapeops_base_class": cls,
        },
    )
    # Serialize as "keras_tapeops>UpgradedModel" (this sets the class's name
    # for serialization), then point that name back at the loader: Keras
    # looks classes up only in its registry, which a fresh process has not
    # filled with classes made at runtime.
    keras.saving.register_keras_serializable(PACKAGE, UPGRADED_NAME)(upgraded)
    keras.saving.register_keras_serializable(PACKAGE, UPGRADED_NAME)(_UpgradedModelLoader)
    _UPGRADED_CLASSES[cls] = upgraded
    return upgraded


# Original class -> upgraded class; weak so a class defined in a test or a
# notebook cell can go away.
_UPGRADED_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _UpgradedModel:
    """First base of every upgraded class: records the original class in configs."""

    _tapeops_base_class = None

    def get_config(self):
        config = dict(super().get_config())
        config[BASE_CLASS_KEY] = _class_spec(self._tapeops_base_class)
        return config

    def _tapeops_replays_compile(self, config):
        """Loading compiles through the class's own `compile()` if it takes the config.

        `upgrade` promises that a saved upgraded model comes back compiled
        with its keras_tapeops options. keras-hub Tasks override `compile()`
        with `optimizer`, `loss`, `metrics` and `**kwargs`, so the saved
        arguments go through it. A `compile()` with another signature (say
        `compile(self, d_optimizer, g_optimizer)`) is skipped with Keras's
        warning, as stock Keras skips every custom `compile()`.
        """
        try:
            inspect.signature(type(self).compile).bind(self, **config)
        except TypeError:
            return False
        return True

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config.pop(BASE_CLASS_KEY, None)
        if custom_objects is None:
            return super().from_config(config)
        return super().from_config(config, custom_objects=custom_objects)

    def __reduce__(self):
        # Keras pickles a model as its saved bytes plus a bound classmethod
        # of its class, which pickle stores by name: a class made at runtime
        # has none, so unpickle through a module-level function instead.
        _, args = super().__reduce__()
        return (_unpickle, args)


def _unpickle(bytesio):
    """Loads a pickled upgraded model (see `_UpgradedModel.__reduce__`).

    Through Keras's private unpickling entry point, which does not depend on
    the class it is called on (`keras_tapeops._keras.models.unpickle_model`).
    """
    return keras_models.unpickle_model(bytesio)


class _UpgradedModelLoader:
    """What `"keras_tapeops>UpgradedModel"` resolves to when Keras loads a model.

    `from_config` finds the original class recorded in the config, builds
    (or reuses) its upgraded class and lets that class rebuild the model.
    """

    def get_config(self):
        # `register_keras_serializable` requires the method; Keras only ever
        # calls `from_config` on this class, never saves an instance of it.
        return {}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        spec = config.get(BASE_CLASS_KEY)
        if not isinstance(spec, dict):
            raise ValueError(
                "Cannot load an upgraded keras_tapeops model: its config does "
                f"not record the original class under {BASE_CLASS_KEY!r}. "
                f"Received: config keys {sorted(config)}"
            )
        return upgraded_class(_resolve_class(spec)).from_config(config)


keras.saving.register_keras_serializable(PACKAGE, UPGRADED_NAME)(_UpgradedModelLoader)


def _class_spec(cls):
    return {
        "module": cls.__module__,
        "class_name": cls.__name__,
        "registered_name": keras.saving.get_registered_name(cls),
    }


def _resolve_class(spec):
    """The original class of an upgraded model, found as Keras finds classes.

    Registered objects first (including `custom_objects` given to
    `load_model`, active while Keras calls `from_config`), then, for the
    keras packages only (as Keras does, for safety), the recorded module.
    """
    name = spec.get("registered_name")
    cls = keras.saving.get_registered_object(name) if name else None
    module = spec.get("module") or ""
    if cls is None and module.split(".")[0] in _IMPORTABLE_PACKAGES:
        try:
            cls = vars(importlib.import_module(module)).get(spec.get("class_name"))
        except ImportError:
            cls = None
    if not (isinstance(cls, type) and issubclass(cls, keras.Model)):
        raise TypeError(
            "Cannot load an upgraded keras_tapeops model: its original class "
            f"{spec.get('class_name')!r} (registered as {name!r}, module "
            f"{module!r}) is not known in this process. Register the class "
            "with @keras.saving.register_keras_serializable() and import it "
            "before loading, or pass it in custom_objects. Received: "
            f"{BASE_CLASS_KEY}={spec!r}"
        )
    return cls


def _reclass(model, upgraded):
    # `object.__setattr__`: Keras's `Layer.__setattr__` would try to track the
    # class object. The functions traced for the old class's steps are
    # dropped, so the next fit()/evaluate()/predict() traces the mixin's.
    object.__setattr__(model, "__class__", upgraded)
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
    return model


def _functional_class():
    """Keras's functional model class (`keras_tapeops._keras.models.functional_class`).

    Keras exports no public name for it; a functional-built subclass has it
    in its MRO, and the upgraded class must list it so that `TapeOpsMixin`
    comes before it.
    """
    return keras_models.functional_class()


def _base_name(base):
    for public in (keras.Model, keras.Sequential):
        if base is public:
            return f"keras.{public.__name__}"
    return base.__name__


def _upgrade_sequential(model):
    layers = list(model.layers)
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if inputs:
        spec = inputs[0]
        layers = [keras.Input(batch_shape=spec.shape, dtype=spec.dtype)] + layers
    new = TapeOpsSequential(layers=layers, name=model.name, trainable=model.trainable)
    return new
