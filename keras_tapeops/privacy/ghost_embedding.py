"""Ghost norms for Embedding (repeated ids included).

One example's gradient of the table has, in row `v`, the sum of the output
gradients `g_t` at the positions `t` whose id is `v`. Its squared norm is

    sum_{t, s : id_t == id_s} <g_t, g_s>

(a `T x T` Gramian masked by equal ids), computed without forming the
`vocabulary x dim` per-example gradient. For long sequences (T > 256, outside
XLA) the positions are grouped by `(example, id)` instead (a segment sum,
linear in T). The clipped sum is `tf.IndexedSlices` of `c_i g_t` at the ids,
like the stock gradient of an embedding lookup. Ragged ids (`tf.RaggedTensor`
sequences of different lengths) are padded with id 0 and a zero output
gradient, which adds nothing.
"""

import keras
import tensorflow as tf

from keras_tapeops.layer_records.forwards import float32
from keras_tapeops.layer_records.forwards import output_forward
from keras_tapeops.layer_records.forwards import stock_call
from keras_tapeops.privacy.rules import Part

GRAM_MAX_POSITIONS = 256


class EmbeddingRule:
    """Ghost norms for `keras.layers.Embedding`."""

    family = "Embedding"

    @staticmethod
    def applies(layer):
        return stock_call(layer, keras.layers.Embedding)

    forward = staticmethod(output_forward)  # record["a"]: the ids

    @staticmethod
    def clip(site, records, grads, context):
        table = site.layer.embeddings
        dim = table.shape[-1]
        ids = tf.concat([_flat_positions(tf.cast(r["a"], tf.int64), 0) for r in records], axis=1)
        g = tf.concat([_flat_positions(float32(gz[0]), dim) for gz in grads], axis=1)
        positions = ids.shape[1]
        if positions == 1:
            squared = tf.reduce_sum(g * g, [1, 2])
        elif context.jit or (positions is not None and positions <= GRAM_MAX_POSITIONS):
            same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), tf.float32)
            squared = tf.reduce_sum(same * tf.einsum("btd,bsd->bts", g, g), [1, 2])
        else:
            squared = _grouped_squared_norms(ids, g, table.shape[0])
        squared = squared / (context.scale * context.scale)

        def weighted(c):
            values = tf.reshape(g * c[:, None, None], [-1, dim])
            return tf.IndexedSlices(
                values, tf.reshape(ids, [-1]), tf.shape(table, out_type=tf.int64)
            )

        return {id(table): Part(squared, weighted, "ghost")}


def _flat_positions(tensor, dim):
    """`[B, T]` ids (`dim=0`) or `[B, T, dim]` output gradients, one row per example.

    A `tf.RaggedTensor` (ragged ids: sequences of different lengths) is padded
    to its longest sequence: padded positions get id 0 and a zero output
    gradient, so they add nothing to a norm or to the clipped sum.
    """
    if isinstance(tensor, tf.RaggedTensor):
        tensor = tensor.to_tensor()
    if dim:
        return tf.reshape(tensor, [tf.shape(tensor)[0], -1, dim])
    return tf.reshape(tensor, [tf.shape(tensor)[0], -1])


def _grouped_squared_norms(ids, g, vocabulary):
    """Per-example `sum_v ||sum_{t: id_t = v} g_t||^2` by a segment sum over `(example, id)`."""
    batch = tf.shape(ids, out_type=tf.int64)[0]
    example = tf.broadcast_to(tf.range(batch)[:, None], tf.shape(ids, out_type=tf.int64))
    keys = tf.reshape(example * vocabulary + ids, [-1])
    unique, segment = tf.unique(keys)
    sums = tf.math.unsorted_segment_sum(
        tf.reshape(g, [-1, g.shape[-1]]), segment, tf.shape(unique)[0]
    )
    owner = unique // vocabulary
    return tf.math.unsorted_segment_sum(tf.reduce_sum(sums * sums, 1), owner, batch)
