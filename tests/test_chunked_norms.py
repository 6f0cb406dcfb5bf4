"""`ghost_conv.chunked_norms` returns every example's results once, in order.

Chunks are views of the batch: the last chunk ends at the batch's end and
overlaps the one before it when the chunk size does not divide the batch,
and its repeated rows are dropped; a batch smaller than a chunk is padded to
one. These tests compare the chunked results with one call on the whole
batch for batch sizes around the chunk size (dynamic and static shapes,
XLA), with rows that differ per example so a misplaced or repeated row shows.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_tapeops.privacy import ghost_conv

pytestmark = pytest.mark.unit

FEATURES = 3
PER_EXAMPLE = 2 * FEATURES  # floats `_norms` allocates per example


def _norms(xs, gs):
    """Squared norms and per-example rows, as a rule's `norms` returns them."""
    x, g = xs[0], gs[0]
    rows = x * g
    return [tf.reduce_sum(rows * rows, 1), rows]


def _batch(size):
    rng = np.random.default_rng(size)
    x = rng.normal(size=(size, FEATURES)).astype("float32")
    g = rng.normal(size=(size, FEATURES)).astype("float32")
    return x, g


def _expected(x, g):
    rows = x * g
    return [np.sum(rows * rows, 1), rows]


@pytest.fixture
def chunk_of_four(monkeypatch):
    monkeypatch.setattr(ghost_conv, "CHUNK_ELEMENTS", 4 * PER_EXAMPLE)


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_chunked_results_equal_one_call_for_batches_around_the_chunk(chunk_of_four, jit):
    spec = tf.TensorSpec([None, FEATURES], tf.float32)

    @tf.function(input_signature=[spec, spec], jit_compile=jit)
    def chunked(x, g):
        return ghost_conv.chunked_norms(_norms, [x], [g], PER_EXAMPLE, [(), (FEATURES,)])

    for size in (0, 1, 3, 4, 5, 8, 9, 11, 13):
        x, g = _batch(size)
        results = chunked(tf.constant(x), tf.constant(g))
        for got, want in zip(results, _expected(x, g)):
            assert got.shape == want.shape, size
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, err_msg=f"batch {size}")


def test_a_static_batch_no_larger_than_a_chunk_is_one_call(chunk_of_four):
    calls = []

    def counting(xs, gs):
        calls.append(xs[0].shape[0])
        return _norms(xs, gs)

    x, g = _batch(4)
    results = ghost_conv.chunked_norms(
        counting, [tf.constant(x)], [tf.constant(g)], PER_EXAMPLE, [(), (FEATURES,)]
    )
    assert calls == [4]
    np.testing.assert_allclose(results[1].numpy(), x * g, rtol=1e-6)


def test_the_comparison_sees_a_repeated_row(chunk_of_four):
    """The check above can fail: the stacked chunks of a batch of 5 (chunks
    `[0, 4)` and `[1, 5)`) hold examples 1-3 twice, so taking the first five
    rows, as slicing padded chunks did, differs from the batch."""
    x, g = _batch(5)
    picked = np.concatenate([x[0:4] * g[0:4], x[1:5] * g[1:5]])[:5]
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(picked, x * g, rtol=1e-6)
