"""The selection package's private Keras access: the symbolic build (Keras 3.10-3.15).

Under a `tf.distribute` strategy Keras builds the model from the first data
batch before the first step (`Trainer._symbolic_build(data_batch=...)`,
private), calling the model on `x` as the dataset yields it. With
`kt.ReducibleLoss`'s id convention `x` also holds the example ids, which
the model does not take; the engine removes them in the step, and this
wrapper removes them from that build batch. The proper place is the mixin's
`_maybe_symbolic_build` asking the engine to split its inputs (proposed in
issue 20's report); until then the wrapper is set on the model instance.
"""


def strip_ids_before_symbolic_build(model, split_ids):
    """Wraps `model._symbolic_build` so the build batch's `x` has no ids.

    Args:
        model: the model being built.
        split_ids: `x -> (x_without_ids, ids)` (the selection's id split).
    """
    build = type(model)._symbolic_build.__get__(model)

    def symbolic_build(iterator=None, data_batch=None):
        if isinstance(data_batch, tuple) and data_batch:
            x, _ = split_ids(data_batch[0])
            data_batch = (x,) + tuple(data_batch[1:])
        elif isinstance(data_batch, dict):
            data_batch, _ = split_ids(data_batch)
        return build(iterator=iterator, data_batch=data_batch)

    object.__setattr__(model, "_symbolic_build", symbolic_build)
