"""`accumulation.flat.FlatLayout`: many tensors as one vector per dtype, and back.

The micro-batch loop carries its gradient sums and BatchNormalization
statistics packed; these tests pin the layout (round trip, dtype groups,
element-wise arithmetic equal to the pieces', constants) against NumPy.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_tapeops.accumulation.flat import FlatLayout

pytestmark = pytest.mark.unit


def _tensors():
    rng = np.random.default_rng(0)
    return [
        rng.normal(size=(3, 2)).astype("float32"),
        rng.normal(size=(4,)).astype("float64"),
        rng.normal(size=(2,)).astype("float32"),
        rng.normal(size=(2, 2, 3)).astype("float64"),
        rng.normal(size=()).astype("float32"),
    ]


def test_pack_groups_by_dtype_in_order_of_appearance_and_unpack_inverts_it():
    arrays = _tensors()
    layout = FlatLayout([a.shape for a in arrays], [a.dtype for a in arrays])
    flats = layout.pack([tf.constant(a) for a in arrays])
    assert [f.dtype for f in flats] == [tf.float32, tf.float64]
    np.testing.assert_array_equal(
        flats[0].numpy(), np.concatenate([arrays[0].ravel(), arrays[2], [arrays[4]]])
    )
    np.testing.assert_array_equal(flats[1].numpy(), np.concatenate([arrays[1], arrays[3].ravel()]))
    back = layout.unpack(flats)
    for got, want in zip(back, arrays):
        assert got.dtype == tf.as_dtype(want.dtype) and got.shape == want.shape
        np.testing.assert_array_equal(got.numpy(), want)


def test_elementwise_sums_of_packed_vectors_equal_the_pieces_bit_for_bit():
    arrays = _tensors()
    other = [a * 3.1 + 0.7 for a in arrays]
    layout = FlatLayout([a.shape for a in arrays], [a.dtype for a in arrays])
    total = layout.zeros()
    for batch in (arrays, other, arrays):
        total = [s + t for s, t in zip(total, layout.pack([tf.constant(a) for a in batch]))]
    for got, a, b in zip(layout.unpack(total), arrays, other):
        np.testing.assert_array_equal(got.numpy(), (tf.zeros_like(a) + a + b + a).numpy())


def test_constant_broadcasts_each_value_over_its_tensor_in_the_group_dtype():
    arrays = _tensors()
    layout = FlatLayout([a.shape for a in arrays], [a.dtype for a in arrays])
    values = [0.99, 0.9, 1.0 - 0.99, 0.5, 0.1]
    for got, a, v in zip(layout.unpack(layout.constant(values)), arrays, values):
        expected = tf.fill(a.shape, tf.constant(v, tf.as_dtype(a.dtype)))
        np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_a_wrong_layout_would_be_caught():
    """The round trip above can fail: unpacking with a reordered layout does."""
    arrays = _tensors()[:3]
    layout = FlatLayout([a.shape for a in arrays], [a.dtype for a in arrays])
    swapped = FlatLayout([(2,), (4,), (3, 2)], ["float32", "float64", "float32"])
    back = swapped.unpack(layout.pack([tf.constant(a) for a in arrays]))
    assert not np.array_equal(back[2].numpy(), arrays[0])


def test_a_shape_not_known_statically_is_refused():
    with pytest.raises(ValueError, match=r"static shapes. Received: shape=\(None, 2\)"):
        FlatLayout([(None, 2)], ["float32"])
