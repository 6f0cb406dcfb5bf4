"""Watching a user's `train_step`/`test_step` override: did it reach the mixin's step?

Keras wraps `model.train_step` when it makes its step function. If the
model's class overrides the step, the mixin installs a watched wrapper for
Keras to wrap instead: it records whether the override called the mixin's
step (`super().train_step(data)`). One that did not replaced the
keras_tapeops step: the options compiled into the model are not applied by
it and their metrics are hidden (nothing updates them), with one warning.
"""

import contextlib
import threading
import warnings

_STEP_RECORDS = threading.local()  # per thread: replicas trace in their own


@contextlib.contextmanager
def step_record(model):
    """Records, for one call of an overridden step, whether the mixin's step ran.

    Args:
        model: the model whose step is called.

    Yields:
        A dict whose `"ran"` entry the mixin's step sets to True.
    """
    records = _STEP_RECORDS.__dict__.setdefault("records", [])
    record = {"model": model, "ran": False}
    records.append(record)
    try:
        yield record
    finally:
        records.pop()


def _innermost_record(model):
    for record in reversed(getattr(_STEP_RECORDS, "records", [])):
        if record["model"] is model:
            return record
    return None


def mark_step_ran(model):
    """Called by the mixin's own step: the override (if any) reached it."""
    record = _innermost_record(model)
    if record is not None:
        record["ran"] = True


def in_replaced_step(model):
    """True inside an overridden step that has not (yet) reached the mixin's."""
    record = _innermost_record(model)
    return record is not None and not record["ran"]


@contextlib.contextmanager
def watching_step(model, name, is_overridden):
    """While Keras makes its step function, an overridden step is watched.

    Args:
        model: the model.
        name: `"train_step"` or `"test_step"`.
        is_overridden: whether `type(model).<name>` is not the mixin's.

    Yields:
        None; inside the block `model.<name>` is the watched override.
    """
    state = model.tapeops_state
    if state is None or not is_overridden:
        yield
        return
    override = getattr(model, name)

    def watched(data):
        with step_record(model) as record:
            outputs = override(data)
        if not record["ran"]:
            step_replaced(model, name)
        return outputs

    object.__setattr__(model, name, watched)  # an instance attribute, for Keras to wrap
    try:
        yield
    finally:
        object.__delattr__(model, name)


def step_replaced(model, name):
    """A `name` override ran without the mixin's step: warn once, hide metrics."""
    state = model.tapeops_state
    step = "train" if name == "train_step" else "test"
    if state is None or step in state.replaced_steps:
        return
    state.replaced_steps.add(step)
    applied = state.options.set_option_names()
    if step == "train" and applied:
        warnings.warn(
            f"{type(model).__name__}.train_step does not call "
            "super().train_step(data), so the keras_tapeops options "
            f"compiled into this model ({', '.join(applied)}) are not "
            "applied by it, and their metrics are not logged. Call "
            "super().train_step(data) in it, or apply the gradients with "
            "self.apply_gradients_with_options(grads, batch_size=...) "
            "(keras_tapeops.custom_step), or compile without them.",
            stacklevel=2,
        )


# The steps a model class may define that the mixin also defines.
STEP_NAMES = ("train_step", "test_step")
_LIBRARY_PACKAGES = ("keras", "keras_hub", "keras_tapeops")


def keep_own_steps(cls, mixin):
    """Keeps the steps a user's base class defines when the mixin is listed first.

    `class Mine(kt.TapeOpsMixin, KerasIoGAN)` puts the mixin's `train_step`
    before `KerasIoGAN.train_step` in the MRO, which would silently replace
    the GAN's own step. The first user class after the mixin that defines a
    step keeps it: `cls` gets that function (unless `cls`, or a class before
    the mixin, defines the step itself). With no keras_tapeops option the
    model then trains exactly as its class does; compiled options that the
    kept step does not apply (it does not call `super().train_step(data)`)
    are reported by the step watch (`step_replaced`).

    Args:
        cls: a new class whose MRO contains `mixin`.
        mixin: the `TapeOpsMixin` class.

    Returns:
        The names of the steps kept, e.g. `["train_step"]`.

    Example:
    ```python
    class Mine(kt.TapeOpsMixin, KerasIoGAN):
        pass

    Mine.train_step is KerasIoGAN.train_step   # True
    ```
    """
    mro = cls.__mro__
    after_mixin = mro[mro.index(mixin) + 1 :]
    before_mixin = mro[: mro.index(mixin)]
    kept = []
    for name in STEP_NAMES:
        if any(name in vars(klass) for klass in before_mixin):
            continue
        owner = next((klass for klass in after_mixin if name in vars(klass)), None)
        if owner is None or owner.__module__.split(".")[0] in _LIBRARY_PACKAGES:
            continue
        setattr(cls, name, vars(owner)[name])
        kept.append(name)
    return kept
