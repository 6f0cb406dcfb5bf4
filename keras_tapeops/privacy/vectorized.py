"""The vectorized per-example fallback, for every layer without a ghost rule.

For a layer `L` with outputs `z` (recorded in the forward pass) and the
gradients `gz` of the loss-scaled objective with respect to them, example
i's gradient of `L`'s own variables is the gradient of
`u_i = sum(z_i * stop_gradient(gz_i))`. The rows `d u_i / d variables` are
one vectorized Jacobian (`keras_tapeops.rows.jacobian_rows`, pfor) on the
same tape: the layer is not run again (dropout inside it keeps its mask), and
only the layer's own backward pass is vectorized. The per-example gradients
are materialized (`[B, P]` for the layer's P parameters).

Variables read outside their owner's calls (`engine.GLOBAL`) get their rows
from the Jacobian of the per-example losses through the whole forward pass.
"""

import tensorflow as tf

from keras_tapeops import rows as rows_lib
from keras_tapeops.layer_records.forwards import float32
from keras_tapeops.privacy.ghost_dense import per_example_part
from keras_tapeops.privacy.rules import finite_or_zero


class VectorizedRule:
    """Per-example gradients of one layer's variables by a vectorized Jacobian."""

    family = "any layer"

    @staticmethod
    def applies(layer):
        return True

    @staticmethod
    def forward(layer, original, args, kwargs):
        outputs = original(*args, **kwargs)
        watched = [
            t
            for t in tf.nest.flatten(outputs)
            if t is not None and tf.is_tensor(t) and t.dtype.is_floating
        ]
        return outputs, {"z": watched}

    @staticmethod
    def clip(site, records, grads, context):
        tape = context.tape
        with tape:  # re-entered: u is recorded on the forward pass's tape
            terms = []
            for record, record_grads in zip(records, grads):
                for z, gz in zip(record["z"], record_grads):
                    product = float32(z) * tf.stop_gradient(float32(gz))
                    terms.append(tf.reduce_sum(tf.reshape(product, [tf.shape(z)[0], -1]), 1))
            objectives = tf.add_n(terms)
        return rows_parts(
            tape,
            objectives,
            site.variables,
            context.scale,
            "vectorized",
            sanitize=context.sanitize,
        )


def rows_parts(tape, objectives, variables, scale, method, sanitize=False):
    """`Part`s of `variables` from the rows `d objectives[i] / d variables`.

    Args:
        tape: the persistent tape that recorded `objectives`.
        objectives: `[B]` float32, loss-scaled per-example objectives.
        variables: the variables to differentiate by.
        scale: the loss scale.
        method: the name shown in the report.
        sanitize: replace non-finite entries of the rows by zeros (a
            non-finite example is zeroed: see `engine.DPSGDState._parts`).

    Returns:
        A dict `id(variable) -> Part`.
    """
    matrix = rows_lib.jacobian_rows(tape, objectives, list(variables), method="pfor")
    if sanitize:
        matrix = finite_or_zero(matrix)
    parts = {}
    start = 0
    for variable in variables:
        size = variable.shape.num_elements()
        block = matrix[:, start : start + size]
        start += size
        # Jacobian rows are not row-local: a NaN in one example's activations
        # reaches the others' rows (see `per_example_part`).
        parts[id(variable)] = per_example_part(
            block, scale, variable.shape, method, row_local=False
        )
    return parts
