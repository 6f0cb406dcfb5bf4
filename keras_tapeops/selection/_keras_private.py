"""The one private Keras access of the selection package (isolated here).

Under a `tf.distribute` strategy Keras builds the model from the first data
batch before the first step (`Trainer._symbolic_build(data_batch=...)`,
private), calling the model on `x` as the dataset yields it. With
`kt.ReducibleLoss`'s id convention `x` also holds the example ids, which
the model does not take; the engine removes them in the step, and this
wrapper removes them from that build batch. The proper place is the mixin's
`_maybe_symbolic_build` asking the engine to split its inputs (proposed in
issue 20's report); until then the wrapper is set on the model instance.
"""

from keras_tapeops.selection import batch as batches


def strip_ids_before_symbolic_build(model, id_key):
    """Wraps `model._symbolic_build` so the build batch's `x` has no ids."""
    build = type(model)._symbolic_build.__get__(model)

    def symbolic_build(iterator=None, data_batch=None):
        if isinstance(data_batch, tuple) and data_batch:
            x, _ = batches.split_ids(data_batch[0], id_key)
            data_batch = (x,) + tuple(data_batch[1:])
        elif isinstance(data_batch, dict):
            data_batch, _ = batches.split_ids(data_batch, id_key)
        return build(iterator=iterator, data_batch=data_batch)

    object.__setattr__(model, "_symbolic_build", symbolic_build)
