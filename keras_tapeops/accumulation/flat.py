"""Many tensors as one flat vector per dtype: few loop variables, few ops.

The micro-batch loop carries a gradient sum for every trainable variable and
the BatchNormalization statistics of every layer. As separate loop variables
each one costs a placeholder in the loop's condition and body, an identity,
an add and a zero to start from: on MobileNetV2 (about 160 variables and 50
BatchNormalization layers) about a third of the traced step's ops
(bench/first_epoch.py), and tracing is most of a first epoch. Packed, the
loop carries one vector per dtype, and an element-wise update is one op.

Packing is `reshape` to 1-D (no copy) and one `concat`; unpacking is one
`split` and reshapes. Element-wise arithmetic on the packed vectors gives
bit for bit what it gives on the pieces.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import numpy as np
import tensorflow as tf


class FlatLayout:
    """Where each of a list of tensors lives in one flat vector per dtype.

    Args:
        shapes: the tensors' static shapes, in order.
        dtypes: their dtypes (one flat vector per distinct dtype, in order of
            first appearance).

    Example:
    ```python
    layout = FlatLayout([(3, 2), (2,)], ["float32", "float32"])
    flats = layout.pack([tf.ones([3, 2]), tf.zeros([2])])   # [a [8] vector]
    kernel, bias = layout.unpack(flats)
    ```
    """

    def __init__(self, shapes: Sequence[Any], dtypes: Sequence[Any]) -> None:
        self.shapes = [tf.TensorShape(shape) for shape in shapes]
        for shape in self.shapes:
            if not shape.is_fully_defined():
                raise ValueError(f"FlatLayout needs static shapes. Received: shape={shape}")
        self.dtypes = [tf.as_dtype(dtype) for dtype in dtypes]
        self.groups: list[tf.DType] = list(dict.fromkeys(self.dtypes))
        self._members = [
            [i for i, dtype in enumerate(self.dtypes) if dtype == group] for group in self.groups
        ]

    def pack(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The tensors (in layout order) as one 1-D vector per dtype group."""
        flats = []
        for members in self._members:
            pieces = [_vector(tensors[i]) for i in members]
            flats.append(pieces[0] if len(pieces) == 1 else tf.concat(pieces, 0))
        return flats

    def unpack(self, flats: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The inverse of `pack`: the tensors in layout order, in their shapes."""
        out: list[Any] = [None] * len(self.shapes)
        for flat, members in zip(flats, self._members):
            sizes = [self.shapes[i].num_elements() for i in members]
            pieces = [flat] if len(members) == 1 else tf.split(flat, sizes)
            for i, piece in zip(members, pieces):
                out[i] = piece if self.shapes[i].rank == 1 else tf.reshape(piece, self.shapes[i])
        return out

    def zeros(self) -> list[tf.Tensor]:
        """One zero vector per dtype group (what `pack` of zeros gives)."""
        return [
            tf.zeros([sum(self.shapes[i].num_elements() for i in members)], group)
            for group, members in zip(self.groups, self._members)
        ]

    def constant(self, values: Sequence[float]) -> list[tf.Tensor]:
        """`values[i]` broadcast over tensor `i`'s entries, packed: one constant per group."""
        return [
            tf.constant(
                np.concatenate(
                    [np.full(self.shapes[i].num_elements(), values[i]) for i in members]
                ).astype(group.as_numpy_dtype)
            )
            for group, members in zip(self.groups, self._members)
        ]


def _vector(tensor: tf.Tensor) -> tf.Tensor:
    """`tensor` as 1-D (a bias or a statistic already is: no op)."""
    return tensor if tensor.shape.rank == 1 else tf.reshape(tensor, [-1])
