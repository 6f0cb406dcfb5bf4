"""The execution mode of the hand-written oracles in the `fit` tests.

`fit` runs its train step as a `tf.function` (graph mode). Under
mixed_float16 the same math executed eagerly is not the same computation on
every CPU: where TensorFlow's oneDNN runs float16 matmuls natively
(AVX512-FP16 / AMX), the graph's fused kernels round the float16
activations differently from the op-by-op eager kernels, and an eager oracle
ends up to ~3e-3 away from `fit` after a few steps (issue 9). Run in graph
mode, the oracle executes the same kernels as `fit` and the comparisons hold
at the float32 tolerances (1e-5) whatever the CPU and whatever
`TF_ENABLE_ONEDNN_OPTS` says.

Every oracle step fed float16 activations is therefore wrapped in
`graph_step`; the test modules import the name (`from oracle_utils import
graph_step`), so a diagnostic run can swap it for the identity to measure the
eager oracle.
"""

import tensorflow as tf


def graph_step(fn):
    """`fn` as a `tf.function`, traced the way Keras traces its train step.

    `reduce_retracing=True` as in Keras's TensorFlow trainer, so a short last
    batch reuses a relaxed-shape trace as `fit`'s does. Pass tensors (not
    Python numbers) for values that change between calls, and build any
    optimizer before the first call (a `LossScaleOptimizer` that is not yet
    built would bake its initial scale into the trace).
    """
    return tf.function(fn, reduce_retracing=True)
