"""Per-step random seeds for the stochastic selections (one draw per call).

Selection runs inside the traced step; stateless random ops with a seed
made of the option's seed and a counter variable give reproducible draws,
different at every call and on every replica.
"""

import tensorflow as tf

from keras_tapeops import validation


def seed_argument(seed):
    """None, or `seed` as a non-negative int (else ValueError with "Received:")."""
    if seed is None:
        return None
    return int(validation.finite_number(seed, "seed", minimum=0))


class StepSeeds:
    """A counter variable turning into a fresh stateless seed per call.

    Args:
        seed: an int (reproducible) or None (a random one, drawn now).
    """

    def __init__(self, seed):
        if seed is None:
            seed = int(tf.random.uniform([], 0, 2**31 - 1, dtype="int64"))
        self.seed = int(seed)
        self.counter = tf.Variable(
            0,
            dtype="int64",
            trainable=False,
            name="selection_seed_counter",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )

    def next(self, advance=True):
        """Returns a `[2]` int64 seed for `tf.random.stateless_*` and advances.

        Args:
            advance: a bool (or scalar bool tensor): False leaves the counter
                as it is (an empty batch draws nothing, so the next batch
                gets the seed it would have had without it).
        """
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        context = tf.distribute.get_replica_context()
        replica = 0
        if context is not None:
            replica = tf.cast(context.replica_id_in_sync_group, "int64")
        count = self.counter.read_value()
        with tf.control_dependencies([count]):
            self.counter.assign_add(tf.cast(advance, "int64"))
        return tf.stack([tf.constant(self.seed, "int64"), count * replicas + replica])
