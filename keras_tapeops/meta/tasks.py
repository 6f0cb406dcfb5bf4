"""Meta-batches of tasks: unpacking, validation and mapping over the task axis.

A meta-batch is `x = (support_x, support_y, query_x)`, `y = query_y`. Every
tensor has the task axis first and the example axis second: `support_x` is
`(tasks, support_examples, ...)` and `query_x` is `(tasks, query_examples,
...)`. Support and query halves must have the same structure and the same
per-example shapes; every tensor must hold the same number of tasks.
"""

import keras
import tensorflow as tf


class Tasks:
    """One validated meta-batch: `support_x`, `support_y`, `query_x`, `query_y`.

    Args:
        support_x, support_y, query_x, query_y: tensors (or nests of them)
            with the task axis first and the example axis second.

    Example:
    ```python
    tasks = unpack_meta_batch(data)
    tasks.count()   # tasks on this replica (a scalar int32 tensor)
    ```
    """

    def __init__(self, support_x, support_y, query_x, query_y):
        self.support_x = support_x
        self.support_y = support_y
        self.query_x = query_x
        self.query_y = query_y

    def as_tuple(self):
        """`(support_x, support_y, query_x, query_y)`: what `map_tasks` maps over."""
        return (self.support_x, self.support_y, self.query_x, self.query_y)

    def count(self):
        """The number of tasks (the leading dimension), an int32 scalar."""
        return tf.shape(tf.nest.flatten(self.support_x)[0])[0]


def unpack_meta_batch(data):
    """Unpacks and validates what `fit`/`evaluate` pass to a step.

    Args:
        data: `((support_x, support_y, query_x), query_y)` as `fit` yields it.

    Returns:
        A `Tasks`.

    Raises:
        TypeError: `x` is not a triple, `y` is missing, or sample weights
            were passed. ValueError: structures or shapes disagree (see
            `check_tasks`). Raised while the step is traced, so before any
            weight changes.

    Example:
    ```python
    tasks = unpack_meta_batch(((sx, sy, qx), qy))
    ```
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if sample_weight is not None:
        raise TypeError(
            "MetaLearner does not take sample weights (every task's query "
            "loss is the compiled loss's mean over its examples). "
            f"Received: sample_weight={_describe(sample_weight)}"
        )
    support_x, support_y, query_x = unpack_inputs(x)
    if y is None:
        raise TypeError(
            "MetaLearner needs the query targets as `y` "
            "(fit(x=(support_x, support_y, query_x), y=query_y)). Received: y=None"
        )
    tasks = Tasks(support_x, support_y, query_x, y)
    check_tasks(tasks)
    return tasks


def unpack_inputs(x):
    """Returns `(support_x, support_y, query_x)` from `x`, or raises TypeError."""
    if not isinstance(x, (tuple, list)) or len(x) != 3:
        raise TypeError(
            "MetaLearner takes x=(support_x, support_y, query_x) (a tuple of "
            "three, task axis first) and y=query_y. "
            f"Received: x={_describe(x)}"
        )
    return tuple(x)


def check_tasks(tasks):
    """Checks a meta-batch's structures and static shapes.

    Args:
        tasks: a `Tasks`.

    Raises:
        ValueError: support and query structures differ, a tensor has fewer
            than two axes (tasks, examples), per-example shapes differ between
            support and query, or the task counts differ.

    Example:
    ```python
    check_tasks(Tasks(sx, sy, qx, qy))
    ```
    """
    _same_structure(tasks.support_x, tasks.query_x, "support_x", "query_x")
    _same_structure(tasks.support_y, tasks.query_y, "support_y", "query_y")
    named = {
        "support_x": tasks.support_x,
        "support_y": tasks.support_y,
        "query_x": tasks.query_x,
        "query_y": tasks.query_y,
    }
    for name, value in named.items():
        for tensor in tf.nest.flatten(value):
            if tensor.shape.rank is not None and tensor.shape.rank < 2:
                raise ValueError(
                    f"Every tensor of `{name}` needs a task axis and an example "
                    f"axis: (tasks, examples, ...). Received: {name} with shape "
                    f"{tuple(tensor.shape)}"
                )
    for support, query in (("support_x", "query_x"), ("support_y", "query_y")):
        for s, q in zip(tf.nest.flatten(named[support]), tf.nest.flatten(named[query])):
            if not s.shape[2:].is_compatible_with(q.shape[2:]):
                raise ValueError(
                    f"`{support}` and `{query}` must have the same per-example "
                    f"shape (after the task and example axes). Received: {support} "
                    f"with shape {tuple(s.shape)}, {query} with shape {tuple(q.shape)}"
                )
    counts = {name: t.shape[0] for name, value in named.items() for t in tf.nest.flatten(value)[:1]}
    known = {n for n in counts.values() if n is not None}
    if len(known) > 1:
        raise ValueError(
            "Every part of a meta-batch must hold the same number of tasks "
            f"(its first axis). Received: {counts}"
        )


def check_support(support_x, support_y):
    """Checks one task's support set for `MetaLearner.adapt` (example axis first).

    Raises:
        ValueError: a tensor has no example axis, or the example counts of
            `support_x` and `support_y` differ.
    """
    counts = {}
    for name, value in (("support_x", support_x), ("support_y", support_y)):
        for tensor in tf.nest.flatten(value):
            if tensor.shape.rank is not None and tensor.shape.rank < 1:
                raise ValueError(
                    f"`{name}` holds one task's examples (example axis first). "
                    f"Received: {name} with shape {tuple(tensor.shape)}"
                )
            counts.setdefault(name, tensor.shape[0])
    if None not in counts.values() and len(set(counts.values())) > 1:
        raise ValueError(
            "`support_x` and `support_y` must hold the same number of examples. "
            f"Received: support_x with {counts['support_x']} examples, "
            f"support_y with {counts['support_y']}"
        )


def map_tasks(fn, elements):
    """Runs `fn` on every task of `elements` at once, vectorized over the task axis.

    `tf.vectorized_map` turns the per-task computation (inner tapes included)
    into batched operations; an operation it cannot vectorize runs in a
    `tf.while_loop` instead (TensorFlow logs a warning when that happens).

    Args:
        fn: callable on one task's tensors, returning a nest of tensors.
        elements: a nest of tensors with the task axis first.

    Returns:
        `fn`'s outputs stacked along a new first (task) axis.

    `tf.vectorized_map` cannot run on fewer than two tasks: with none the
    vectorized graph has nothing to run on (a replica given no task of the
    last meta-batch), and with one some of its converters mistake the task
    axis for an axis of size one (`tf.squeeze` without an axis, which Keras's
    bias add of a Conv layer uses, drops it: "Incompatible shapes"). Such a
    meta-batch runs as two tasks, the one task twice (or two all-zero tasks
    when there is none), and only the real tasks' outputs are returned: the
    copies contribute nothing to the losses or the gradients.

    Example:
    ```python
    losses = map_tasks(lambda t: tf.reduce_sum(t[0]), (support_x,))
    ```
    """
    first = tf.nest.flatten(elements)[0]
    if first.shape[0] is not None and first.shape[0] >= 2:
        # A static count of two or more needs no padding; keeping the task
        # axis static (no `tf.cond`) keeps the vectorized graph as lean as a
        # hand-written `tf.vectorized_map` (a cond made the step 1.15-1.2x).
        return tf.vectorized_map(fn, elements, fallback_to_while_loop=True)
    count = tf.shape(first)[0]
    padded = tf.nest.map_structure(lambda t: _at_least_two_tasks(t, count), elements)
    outputs = tf.vectorized_map(fn, padded, fallback_to_while_loop=True)
    return tf.nest.map_structure(lambda t: t[:count], outputs)


def _at_least_two_tasks(tensor, count):
    """`tensor` itself with two tasks or more; else its one task twice, or two zero tasks."""

    def padded():
        zeros = tf.zeros(tf.concat([[2], tf.shape(tensor)[1:]], 0), tensor.dtype)
        return tf.concat([tensor, tensor, zeros], 0)[:2]

    if tensor.shape[0] is not None:  # 0 or 1 task, known at trace time
        return padded()
    return tf.cond(count >= 2, lambda: tensor, padded)


def global_count(local_count):
    """The number of tasks over all replicas (the local count outside `tf.distribute`)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return local_count
    return context.all_reduce(tf.distribute.ReduceOp.SUM, local_count)


def merge_task_axis(value):
    """Reshapes every tensor `(tasks, examples, ...)` to `(tasks * examples, ...)`."""

    def merge(t):
        shape = tf.shape(t)
        return tf.reshape(t, tf.concat([[shape[0] * shape[1]], shape[2:]], 0))

    return tf.nest.map_structure(merge, value)


def _same_structure(a, b, name_a, name_b):
    try:
        tf.nest.assert_same_structure(a, b)
    except (ValueError, TypeError):
        raise ValueError(
            f"`{name_a}` and `{name_b}` must have the same structure. "
            f"Received: {name_a}={_describe(a)}, {name_b}={_describe(b)}"
        ) from None


def _describe(value):
    """A nest with its tensors shown by shape (never their values)."""

    def show(t):
        shape = getattr(t, "shape", None)
        return f"<tensor shape={tuple(shape)}>" if shape is not None else repr(t)

    return repr(tf.nest.map_structure(show, value)).replace("'", "")
