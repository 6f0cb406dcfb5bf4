"""`kt.ReducibleLoss`: RHO-LOSS selection (Mindermann et al. 2022).

Reference: OATML/RHO-Loss, `src/curricula/selection_methods.py`
(`reducible_loss_selection`): reducible loss = training loss minus the
irreducible loss (looked up by the example's global index in a tensor, or
computed by a model trained on a holdout set), keep the top k.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence
from typing import TYPE_CHECKING

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops._keras import private as keras_private
from keras_tapeops.paths import LayerTree
from keras_tapeops.per_example import per_example_losses
from keras_tapeops.registration import register
from keras_tapeops._keras import selection as private
from keras_tapeops.selection import batch as batches
from keras_tapeops.selection.base import SelectionOption
from keras_tapeops.selection.base import fraction_argument
from keras_tapeops.selection.top_loss import TopLossState
from keras_tapeops.typing_aliases import Array

if TYPE_CHECKING:
    from typing_extensions import Self

ID_KEY = "example_id"


@register
class ReducibleLoss(SelectionOption):
    """Steps on the k = ceil(fraction * batch) largest reducible losses.

    reducible_i = loss_i - irreducible_i, where the irreducible loss is the
    loss of a model trained on a holdout set: either precomputed for every
    training example and looked up by the example's id (an array), or
    computed by that model in the step (a `keras.Model`; its outputs go
    through the training model's compiled loss).

    Id convention: with an array, `x` is a dict holding the integer example
    ids (indices into `irreducible`) under `id_key` and the model's inputs
    under its other keys; a single remaining entry is passed to the model
    unwrapped (`{"x": features, "example_id": ids}` for a one-input model),
    several are passed as a dict. Ids are removed before the model sees `x`;
    evaluate and predict take data without them. A batch without ids, or
    with ids that are not integers, is refused at the first step; an id
    outside `[0, len(irreducible))` stops the step that sees it with an
    error naming the id, before any weight changes. With a table the ids
    cannot be checked inside an XLA-compiled step, so `jit_compile=True`
    is refused at the first step (a holdout model works under jit).

    Args:
        irreducible: a 1-D array of irreducible losses indexed by example id,
            or a `keras.Model` (the irreducible-loss model).
        fraction: share of each candidate batch kept, in (0, 1] (RHO-LOSS
            uses 0.1: a candidate batch 10x the training batch).
        id_key: the key of the ids in `x`.

    Returns:
        An option for `compile(sample_selection=...)`.

    Example:
    ```python
    import keras, numpy as np, keras_tapeops as kt
    x, y = np.random.rand(32, 4).astype("float32"), np.zeros((32, 1), "float32")
    model = kt.upgrade(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer="sgd", loss="mse",
                  sample_selection=kt.ReducibleLoss(irreducible=np.zeros(32), fraction=0.25))
    model.fit({"x": x, "example_id": np.arange(32)}, y, batch_size=16, verbose=0)
    ```
    """

    def __init__(
        self,
        irreducible: Array | Sequence[float] | keras.Model,
        fraction: float = 0.1,
        id_key: str = ID_KEY,
    ) -> None:
        self.fraction = fraction_argument(fraction)
        if not isinstance(id_key, str) or not id_key:
            raise ValueError(f"`id_key` must be a non-empty string. Received: id_key={id_key!r}")
        self.id_key = id_key
        if isinstance(irreducible, keras.Model):
            self.irreducible = irreducible
        else:
            try:
                values = np.asarray(irreducible, dtype="float32")
            except (TypeError, ValueError):
                values = None
            if (
                values is None
                or values.ndim != 1
                or values.size == 0
                or not np.all(np.isfinite(values))
            ):
                raise ValueError(
                    "`irreducible` must be a non-empty 1-D array of finite losses "
                    "indexed by example id, or a keras.Model. "
                    f"Received: irreducible={_short(irreducible)}"
                )
            self.irreducible = values

    @property
    def uses_ids(self) -> bool:
        return not isinstance(self.irreducible, keras.Model)

    def bind(self, model: keras.Model, tree: LayerTree) -> ReducibleLossState:
        if self.uses_ids:
            private.strip_ids_before_symbolic_build(
                model, lambda x: batches.split_ids(x, self.id_key)
            )
        return ReducibleLossState(self)

    def get_config(self) -> dict[str, Any]:
        if self.uses_ids:
            irreducible = self.irreducible.tolist()
        else:
            # The holdout model's architecture and weights, so that a saved
            # model reloads with the same selection.
            irreducible = {
                "model": keras.saving.serialize_keras_object(self.irreducible),
                "weights": [w.tolist() for w in self.irreducible.get_weights()],
            }
        return {"irreducible": irreducible, "fraction": self.fraction, "id_key": self.id_key}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        irreducible = config.pop("irreducible")
        if isinstance(irreducible, dict):
            model = keras.saving.deserialize_keras_object(irreducible["model"])
            model.set_weights([np.asarray(w, "float32") for w in irreducible["weights"]])
            irreducible = model
        return cls(irreducible=irreducible, **config)


class ReducibleLossState(TopLossState):
    """Top k of loss minus irreducible loss."""

    def __init__(self, option):
        super().__init__(option.fraction)
        self.option = option
        self.table = None
        if option.uses_ids:
            self.table = tf.constant(option.irreducible)

    def split_inputs(self, x):
        return batches.split_ids(x, self.option.id_key)

    def check_batch(self, model, x, y, sample_weight):
        if not self.option.uses_ids:
            return
        key = self.option.id_key
        if not (isinstance(x, dict) and key in x):
            raise ValueError(
                "kt.ReducibleLoss looks up the irreducible loss by example id: pass x "
                f"as a dict with the integer ids under {key!r} and the "
                f"model's inputs under the other keys. Received: x as {batches.describe(x)}"
            )
        dtype = tf.as_dtype(x[key].dtype)
        if not dtype.is_integer:
            raise ValueError(
                f"kt.ReducibleLoss needs integer example ids under {key!r} (indices "
                f"into `irreducible`); a {dtype.name} id would be truncated. "
                f"Received: {key} with dtype {dtype.name}"
            )
        if getattr(model, "jit_compile", False):
            raise ValueError(
                "kt.ReducibleLoss with a table of irreducible losses cannot check the "
                f"example ids inside an XLA-compiled step (XLA has no run-time errors "
                f"and clamps an out-of-range {key!r} silently): compile with "
                "jit_compile=False, or pass a holdout keras.Model as `irreducible`. "
                "Received: jit_compile=True"
            )

    def checked_ids(self, ids):
        """`ids` as int32, after run-time checks that each is in `[0, len(irreducible))`.

        The checks run before the table lookup, so a bad id stops the step
        before any weight changes, with a message naming the id key, the
        valid range and the offending values.
        """
        key = self.option.id_key
        size = int(self.option.irreducible.shape[0])
        ids = tf.cast(ids, "int64")
        valid = tf.logical_and(ids >= 0, ids < size)
        all_valid = tf.reduce_all(valid)
        checked = tf.cast(ids, "int32")

        def refuse():
            # The offending ids are gathered only here, on the failing path.
            check = tf.debugging.Assert(
                all_valid,
                [
                    f"kt.ReducibleLoss: every {key} must index the irreducible table, "
                    f"in [0, {size}). Received: {key}=",
                    tf.boolean_mask(ids, tf.logical_not(valid)),
                ],
                summarize=20,
            )
            with tf.control_dependencies([check]):
                return tf.identity(checked)

        return tf.cond(all_valid, lambda: checked, refuse)

    def score(self, model, x, y, sample_weight, losses, ids):
        if self.table is not None:
            irreducible = tf.gather(self.table, self.checked_ids(ids))
        else:
            holdout = self.option.irreducible
            predictions = keras_private.call_model(holdout, x, training=False)
            irreducible = per_example_losses(model, y, predictions, sample_weight)
        return losses - tf.stop_gradient(irreducible)


def _short(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
