"""Which outputs are the tasks, and which variables they share, for one model.

Both are resolved when the option is bound (at `compile()` for a built
model), so a wrong configuration is refused before any weight changes:

- the tasks are the model's outputs (or the `tasks=` subset of them); a
  model with fewer than two outputs, or a `tasks` name that is not an
  output, is refused;
- the shared variables are the `shared=` selection (the one path grammar of
  `keras_tapeops.selectors`) or, with `shared=None` on a functional model,
  every trainable variable that two or more task outputs depend on. A
  selection that names nothing, or that covers every trainable variable
  (then no task has variables of its own), is refused.
"""

from keras_tapeops import selectors
from keras_tapeops._keras import multitask as private


def validate_tasks(tasks):
    """Checks `tasks=`: None or a list of at least two distinct output names.

    Returns:
        None or a tuple of str. Raises TypeError/ValueError with "Received:".
    """
    if tasks is None:
        return None
    if isinstance(tasks, str) or not isinstance(tasks, (list, tuple)):
        raise TypeError(
            f"`tasks` must be None or a list of output names. Received: tasks={tasks!r}"
        )
    if len(tasks) < 2 or not all(isinstance(t, str) and t for t in tasks):
        raise ValueError(
            "`tasks` must list at least two output names (non-empty strings). "
            f"Received: tasks={list(tasks)!r}"
        )
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"`tasks` names must be distinct. Received: tasks={list(tasks)!r}")
    return tuple(tasks)


def output_names(model):
    """The model's output names (functional/Sequential), or None if unknown."""
    names = getattr(model, "output_names", None)
    return list(names) if names else None


def _output_count(model):
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return None
    return len(outputs) if outputs is not None else None


def resolve_task_names(model, option):
    """The task names for `model`, in order; raises for a model that has no tasks.

    Args:
        model: the model being compiled.
        option: the `task_balancing` option.

    Returns:
        A list of str (the outputs' names, as Keras logs `<name>_loss`).
    """
    names = output_names(model)
    if names is None and _output_count(model) == 1:
        names = [model.name]  # a Sequential (or other one-output) model
    if names is None:
        if option.tasks is None:
            raise ValueError(
                "`task_balancing` could not read the output names of model "
                f"{model.name!r} (a subclassed model): pass tasks=[...] with the "
                "names of its outputs' losses. Received: tasks=None"
            )
        return list(option.tasks)
    if len(names) < 2:
        raise ValueError(
            "`task_balancing` needs a model with at least two outputs (one loss "
            f"per task); model {model.name!r} has one output ({names}). "
            f"Received: task_balancing={option!r}"
        )
    if option.tasks is None:
        return names
    unknown = [t for t in option.tasks if t not in names]
    if unknown:
        raise ValueError(
            f"`tasks` names {unknown} are not outputs of model {model.name!r} "
            f"(its outputs are {names}). Received: tasks={list(option.tasks)}"
        )
    return list(option.tasks)


def shared_mask(option, model, variables, tree, task_names):
    """Which of `variables` are shared by the tasks (a list of bools).

    Args:
        option: the `task_balancing` option (its `shared` selector).
        model: the built model.
        variables: its trainable variables, in gradient order.
        tree: `paths.LayerTree(model)`.
        task_names: the resolved task names.

    Returns:
        A list of bools aligned with `variables`. Raises ValueError with
        "Received: shared=..." for a selection that is empty or covers all.
    """
    if not option.takes_shared:  # loss weightings treat every variable alike
        return [False] * len(variables)
    where = option.shared
    if where is None:
        mask = _depended_on_by_several(model, variables, task_names)
    else:
        try:
            mask = selectors.select(where, model, variables, tree)
        except ValueError as error:
            raise ValueError(_as_shared(str(error))) from None
    shown = selectors.describe(where)
    if not any(mask):
        raise ValueError(
            "`shared` selects no trainable variable of model "
            f"{model.name!r}: the tasks would share nothing. Received: shared={shown}"
        )
    if all(mask):
        raise ValueError(
            "`shared` covers every trainable variable of model "
            f"{model.name!r}: the tasks must also have variables of their own "
            "(their heads), which get the ordinary gradient. Select the shared "
            f"layers only (e.g. shared='trunk/*'). Received: shared={shown}"
        )
    return mask


def _depended_on_by_several(model, variables, task_names):
    names = output_names(model)
    outputs = getattr(model, "outputs", None)
    if names is None or not outputs or len(outputs) != len(names):
        raise ValueError(
            "`shared=None` finds the shared layers of a functional model from its "
            f"graph; model {model.name!r} is not one: name them with "
            "shared='trunk/*' (a path, glob, list, layer or callable). "
            "Received: shared=None"
        )
    counts = {}
    by_name = dict(zip(names, outputs))
    for task in task_names:
        ids = set()
        for operation in private.layers_behind(by_name[task]):
            for variable in getattr(operation, "trainable_weights", []):
                ids.add(id(variable))
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
    return [counts.get(id(v), 0) >= 2 for v in variables]


def _as_shared(message):
    """A selector error reworded for the `shared` argument."""
    return message.replace("`where`", "`shared`").replace("where=", "shared=")
