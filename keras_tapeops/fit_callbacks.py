"""Callbacks a training dataset asks `fit()` to add (e.g. `kt.privacy.poisson_batches`).

A dataset built by keras_tapeops may need to know where training stands when
each epoch starts: `poisson_batches(model=...)` keys each epoch's draw by the
optimizer's step count at that moment. `attach(dataset, make_callback)`
records the request on the dataset object; `TapeOpsMixin.fit()` (on every
backend) calls `requested_by(x)` on the `x` it receives and adds the
callbacks first, before the user's.

Example:
```python
dataset = attach(dataset, lambda: MyEpochCallback())
model.fit(dataset)   # TapeOpsMixin.fit adds MyEpochCallback() first
```
"""

from __future__ import annotations

from typing import Any
from typing import Callable

import keras

_ATTRIBUTE = "_tapeops_fit_callbacks"


def attach(dataset: Any, make_callback: Callable[[], keras.callbacks.Callback]) -> Any:
    """Records on `dataset` that `fit()` should add `make_callback()`; returns `dataset`.

    Args:
        dataset: the object users pass to `fit()` as `x`.
        make_callback: builds a fresh callback for each `fit()`.

    Returns:
        `dataset` itself.
    """
    setattr(dataset, _ATTRIBUTE, (*getattr(dataset, _ATTRIBUTE, ()), make_callback))
    return dataset


def requested_by(x: Any) -> list[keras.callbacks.Callback]:
    """The callbacks `x` asked `fit()` to add (fresh ones), in the order attached."""
    return [make() for make in getattr(x, _ATTRIBUTE, ())]
