"""Optimizer groups: one optimizer per group of variables, as a stock `MultiOptimizer`.

`optimizer_groups(model, [(where, optimizer), ...], default=None)` resolves
each `where=` with the selectors every keras_tapeops rule uses (globs, lists,
layers, callables; `keras_tapeops.selectors.select`) and returns a stock
`keras.optimizers.MultiOptimizer` (Keras 3.15) whose `OptimizerMap` lists the
selected variables by path. Keras compiles, saves and loads it like any
optimizer; keras_tapeops' step options (gradient transforms, loss terms,
micro-batches, accumulation, mixed precision, `tf.distribute`) see it as one
optimizer.

Which variables are mapped: every variable the model could train, i.e. every
variable created trainable, including those frozen now (`trainable=False` on
their layer, or on the variable itself). An `OptimizerMap` is fixed when it is
made, so a layer frozen today and unfrozen later (by hand, or by
`kt.callbacks.GradualUnfreezing`) already has its group; mapping only today's
trainable variables would send it silently to the default optimizer. State
that is never trained (BatchNormalization moving statistics, counters) is not
mapped and never counts as "unassigned".

How variables are keyed: Keras's `OptimizerMap` matches `variable.path` with
`re.fullmatch`. Each group is one key: the alternation of its variables'
escaped paths (exact, no wildcard beyond what is listed), in which the names
of the enclosing models are optional. Keras 3.15 writes a Sequential model's
name into its variables' paths when the model is built from code
(`"seq/dense/kernel"`) but not when it is loaded (`"dense/kernel"`), so an
exact key would lose its variables after `load_model`. The map is checked
against both forms before it is returned: a variable that would land in
another group (two variables whose paths differ only by a model name, in
different groups) is an error now, not a silent change after loading.

One key per optimizer, and the default optimizer never appears in the map:
Keras serializes the map's optimizers and the default separately, so an
optimizer listed twice would come back as two optimizers (and the saved
optimizer state would no longer fit). With `default=None` the last group's
optimizer is the map's default (its variables are the ones no key matches),
which keeps `multi.optimizers` in group order.

Example:
```python
opt = kt.optimizer_groups(model, [
    ("backbone/*", keras.optimizers.Adam(1e-5, name="backbone")),
    ("head", keras.optimizers.Adam(1e-3, name="head")),
])
model.compile(optimizer=opt, loss="mse")
```
"""

import re
from typing import Sequence

import keras

from keras_tapeops import _compat
from keras_tapeops._keras import optimizers as keras_optimizers
from keras_tapeops._keras import private
from keras_tapeops import paths
from keras_tapeops import selectors
from keras_tapeops.selectors import Selector

REQUIRED_KERAS = "3.15"


# ----------------------------------------------------------------- public API
def optimizer_groups(
    model: keras.Model,
    groups: Sequence[tuple[Selector, keras.optimizers.Optimizer]],
    default: keras.optimizers.Optimizer | None = None,
) -> keras.optimizers.Optimizer:
    """A `keras.optimizers.MultiOptimizer` with one optimizer per group of variables.

    Args:
        model: a built Keras model (its variables must exist).
        groups: a non-empty list of `(where, optimizer)` pairs. `where` is a
            selector as in `gradient_transforms` (a layer path or glob such
            as `"backbone/*"`, a list of them, a layer, or a callable
            `variable -> bool`); `optimizer` is an unbuilt Keras optimizer
            instance (not a `LossScaleOptimizer` or `MultiOptimizer`).
            Distinct optimizers must have distinct names: the name is the
            group's name in `kt.callbacks.GroupLearningRateScheduler`, in
            logs and in `group_optimizers()`.
        default: optional optimizer for the variables no group selects.
            With None every trainable variable (frozen ones included) must be
            selected by exactly one group.

    Returns:
        A stock `keras.optimizers.MultiOptimizer`.

    Raises:
        RuntimeError: on Keras older than 3.15 (no MultiOptimizer).
        TypeError: for a wrong type, naming the argument
            (`"... Received: groups=..."`).
        ValueError: a variable selected by two groups (naming both), variables
            selected by none with `default=None` (listing their layers), a
            selector that names nothing, an optimizer already built, two
            optimizers with one name, or two variables the map cannot tell
            apart.

    Example:
    ```python
    opt = kt.optimizer_groups(model, [("backbone/*", keras.optimizers.Adam(1e-5)),
                                      ("head", keras.optimizers.Adam(1e-3))])
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    ```
    """
    require_multi_optimizer("kt.optimizer_groups")
    check_model(model, "optimizer_groups")
    groups = _check_groups(groups)
    if default is not None:
        check_sub_optimizer(default, "default")
    variables = trainable_capable_variables(model)
    owner = exclusive_owners(
        model,
        variables,
        [where for where, _ in groups],
        lambda variable, j, i: (
            f"Variable {variable.path!r} is selected by two groups: "
            f"groups[{j}] (where={selectors.describe(groups[j][0])}) and "
            f"groups[{i}] (where={selectors.describe(groups[i][0])}). Each "
            "variable must belong to one group. "
            f"Received: groups={describe_groups(groups)}"
        ),
    )
    unassigned = [v for v in variables if id(v) not in owner]
    if unassigned and default is None:
        raise ValueError(
            "Some trainable variables are in no group and `default` is None. "
            f"Unassigned layers: {unassigned_layers(model, unassigned)}. Add "
            "them to a group or pass `default=<optimizer>`. "
            f"Received: groups={describe_groups(groups)}"
        )
    assignment = [(v, groups[owner[id(v)]][1] if id(v) in owner else default) for v in variables]
    return build_multi_optimizer(model, assignment, default)


def group_optimizers(model_or_optimizer):
    """The sub-optimizers of a (possibly loss-scaled) MultiOptimizer, by name.

    Args:
        model_or_optimizer: a compiled model, or its optimizer.

    Returns:
        A dict `{name: optimizer}` in the MultiOptimizer's order; for any
        other optimizer `{name: optimizer}` with that one optimizer.

    Example:
    ```python
    {name: float(o.learning_rate) for name, o in group_optimizers(model).items()}
    ```
    """
    optimizer = model_or_optimizer
    if isinstance(model_or_optimizer, keras.Model):
        optimizer = model_or_optimizer.optimizer
    if optimizer is None:
        return {}
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    subs = getattr(optimizer, "optimizers", None)
    if subs is None:
        return {optimizer.name: optimizer}
    return {sub.name: sub for sub in subs}


def check_reused_optimizer(model, optimizer):
    """Refuses a built MultiOptimizer that no longer fits the model's trainable variables.

    Keras's MultiOptimizer applies exactly the variables it was built with
    (its first step, or `GradualUnfreezing`, builds it). Compiled again after
    a layer was unfrozen (or frozen), it fails inside `fit` ("Received 4
    gradients and 2 variables"); its sub-optimizers hold no state for the
    new variables and cannot grow, so it cannot be re-synchronized either.
    Called by `compile()`, before anything changes.

    Args:
        model: the model being compiled.
        optimizer: what was passed to `compile(optimizer=...)`.

    Returns:
        None. Raises ValueError saying to call `kt.optimizer_groups` again.

    Example:
    ```python
    opt = kt.optimizer_groups(model, groups); model.compile(opt, "mse"); model.fit(x, y)
    model.get_layer("backbone").trainable = True
    model.compile(opt, "mse")   # ValueError: call kt.optimizer_groups again
    ```
    """
    multi = _compat.multi_optimizer_class()
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if multi is None or not isinstance(inner, multi) or not inner.built:
        return
    if not model.built:
        return
    known = keras_optimizers.built_variable_keys(inner)
    now = list(model.trainable_variables)
    now_keys = {keras_optimizers.variable_key(inner, v) for v in now}
    if now_keys == known:
        return
    added = [v.path for v in now if keras_optimizers.variable_key(inner, v) not in known]
    removed = len(known - now_keys)
    change = []
    if added:
        change.append(f"{len(added)} trainable now that it does not know ({added})")
    if removed:
        change.append(f"{removed} it knows that are not trainable now")
    raise ValueError(
        f"The MultiOptimizer {inner.name!r} was built for {len(known)} trainable "
        f"variables, and the model has {len(now)} now: "
        f"{' and '.join(change)}. A layer was unfrozen or frozen since it was "
        "built; Keras's MultiOptimizer applies exactly the variables it was "
        "built with and its optimizers cannot grow. Call kt.optimizer_groups "
        "(or kt.layerwise_lr_decay) again after changing what is trainable, "
        "and compile with the new optimizer (or keep the layers trainable and "
        "freeze them with kt.callbacks.GradualUnfreezing). "
        f"Received: optimizer={inner.name!r} (built)"
    )


# ------------------------------------------------------------- shared helpers
def require_multi_optimizer(caller):
    """Returns `keras.optimizers.MultiOptimizer`, or raises naming the Keras needed."""
    cls = _compat.multi_optimizer_class()
    if cls is None:
        raise RuntimeError(
            f"{caller} needs keras.optimizers.MultiOptimizer, which Keras added "
            f"in version {REQUIRED_KERAS}. Installed: Keras {keras.__version__}. "
            f"Upgrade with `pip install 'keras>={REQUIRED_KERAS}'`."
        )
    return cls


def check_model(model, caller):
    """Raises unless `model` is a built Keras model."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`{caller}` needs a Keras model as `model`. "
            f"Received: model={model!r} of type {type(model).__name__}"
        )
    if not model.built or not model.weights:
        raise ValueError(
            f"`{caller}` needs a built model (its variables must exist to be "
            "grouped): call it on a batch or build it first. "
            f"Received: model={model.name!r} (built={model.built})"
        )


def check_sub_optimizer(optimizer, name):
    """Raises unless `optimizer` can be one group's optimizer."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"`{name}` must be a Keras optimizer instance, e.g. "
            f"keras.optimizers.Adam(1e-3). Received: {name}={optimizer!r}"
        )
    wrapper = None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        wrapper = "a LossScaleOptimizer (mixed precision wraps the whole MultiOptimizer itself)"
    elif getattr(optimizer, "optimizers", None) is not None:
        wrapper = "a MultiOptimizer (groups cannot nest)"
    if wrapper:
        raise TypeError(f"`{name}` cannot be {wrapper}. Received: {name}={optimizer!r}")
    if optimizer.built:
        raise ValueError(
            f"`{name}` is already built (it holds state for other variables). "
            f"Pass a new optimizer. Received: {name}={optimizer.name!r}"
        )


def exclusive_owners(model, variables, wheres, overlap_message):
    """Maps `id(variable)` to the index of the one selector in `wheres` selecting it.

    Args:
        model: the model the selectors resolve against.
        variables: the candidate variables.
        wheres: validated selectors (groups, or blocks).
        overlap_message: `(variable, j, i) -> str`, the message when
            selectors `j` and `i` both select `variable`.

    Returns:
        A dict; variables no selector selects are absent.

    Raises:
        ValueError: for a variable selected twice (before anything changes).
    """
    owner = {}
    for i, where in enumerate(wheres):
        mask = selectors.select(where, model, variables)
        for variable, selected in zip(variables, mask):
            if not selected:
                continue
            if id(variable) in owner:
                raise ValueError(overlap_message(variable, owner[id(variable)], i))
            owner[id(variable)] = i
    return owner


def trainable_capable_variables(model):
    """Every variable of `model` created trainable, frozen now or not.

    See `keras_tapeops._keras.private.trainable_capable_variables`.
    """
    return private.trainable_capable_variables(model)


def build_multi_optimizer(model, assignment, default):
    """The MultiOptimizer for `[(variable, optimizer), ...]`.

    Args:
        model: the model the variables belong to.
        assignment: every trainable-capable variable with its optimizer.
        default: the map's default optimizer, or None to use the last
            group's optimizer.

    Returns:
        A `keras.optimizers.MultiOptimizer`.
    """
    cls = require_multi_optimizer("kt.optimizer_groups")
    ordered = []  # distinct optimizers in first-use order
    for _, optimizer in assignment:
        if not any(optimizer is o for o in ordered):
            ordered.append(optimizer)
    if default is None:
        default = ordered[-1]
    _check_distinct_names(ordered + [default])
    tree = paths.LayerTree(model)
    layers = dict(tree.entries)
    names = {id(v): enclosing_model_names(model, tree, v, layers) for v, _ in assignment}
    patterns = {}  # id(optimizer) -> [variable patterns]
    for variable, optimizer in assignment:
        if optimizer is default:
            continue
        pattern = variable_pattern(variable, names[id(variable)])
        listed = patterns.setdefault(id(optimizer), [])
        if pattern not in listed:
            listed.append(pattern)
    optimizer_map = keras.optimizers.OptimizerMap(default_optimizer=default)
    for optimizer in ordered:
        if optimizer is not default:
            optimizer_map[_alternation(patterns[id(optimizer)])] = optimizer
    _check_map(optimizer_map, assignment, names)
    return cls(optimizer_map)


def enclosing_model_names(model, tree, variable, layers=None):
    """Names of the models enclosing `variable`, outer first (`model` included)."""
    layers = dict(tree.entries) if layers is None else layers
    names = [model.name]
    for path in sorted(tree.owner_paths(variable), key=lambda p: p.count("/")):
        layer = layers.get(path)
        if isinstance(layer, keras.Model) and layer.name not in names:
            names.append(layer.name)
    return names


def variable_pattern(variable, model_names):
    """The exact (escaped) path of `variable` with its model-name prefixes optional.

    `"seq/dense/kernel"` with models `["seq"]` gives `"(?:seq/)?dense/kernel"`:
    it matches the path Keras gives when the model is built from code and the
    one it gives after `load_model`.
    """
    tail = stripped_path(variable.path, model_names)
    optional = "".join(f"(?:{re.escape(name)}/)?" for name in model_names)
    return optional + re.escape(tail)


def stripped_path(path, model_names):
    """`path` without the leading components that name enclosing models."""
    parts = path.split("/")
    i = 0
    for name in model_names:
        if i < len(parts) - 1 and parts[i] == name:
            i += 1
    return "/".join(parts[i:])


def unassigned_layers(model, variables):
    """Layer paths holding `variables` (innermost owners), else their Keras paths."""
    tree = paths.LayerTree(model)
    out = []
    for variable in variables:
        owners = tree.variable_paths(variable)
        label = owners[0].rsplit("/", 1)[0] if owners else variable.path
        if label not in out:
            out.append(label)
    return out


def describe_groups(groups):
    """`[(where, optimizer name), ...]` for messages."""
    return (
        "["
        + ", ".join(f"({selectors.describe(w)}, {getattr(o, 'name', o)!r})" for w, o in groups)
        + "]"
    )


def check_selector_pair(pair, i, name, item, scope, hint):
    """Item `i` of a list argument of `(where, item)` pairs, as `(where, item)`.

    Shared by `optimizer_groups`, `layerwise_lr_decay`'s callers and
    `GradualUnfreezing`: the pair's shape, its selector (validated), and
    no `where=None`.

    Args:
        pair: the item.
        i: its index.
        name: the argument's name (`"groups"`, `"schedule"`).
        item: the second element's name, for the message.
        scope: what `where=None` would select, for the message.
        hint: what to do instead, for the message.

    Returns:
        `(where, second)` with `where` validated. Raises TypeError or
        ValueError naming `name[i]`.
    """
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
        raise TypeError(
            f"`{name}` must be a list of (where, {item}) pairs; item "
            f"{i} is not a pair. Received: {name}[{i}]={pair!r}"
        )
    where, second = pair
    where = selectors.validate_listed_selector(where, f"{name}[{i}]")
    if where is None:
        raise ValueError(
            f"{name}[{i}] has where=None ({scope}); {hint}. Received: {name}[{i}]={pair!r}"
        )
    return where, second


# -------------------------------------------------------------------- checks
def _check_groups(groups):
    if not isinstance(groups, (list, tuple)):
        raise TypeError(
            "`groups` must be a list of (where, optimizer) pairs, e.g. "
            "[('backbone/*', keras.optimizers.Adam(1e-5)), ('head', "
            f"keras.optimizers.Adam(1e-3))]. Received: groups={groups!r}"
        )
    if not groups:
        raise ValueError(
            f"`groups` must hold at least one (where, optimizer) pair. Received: groups={groups!r}"
        )
    checked = []
    for i, pair in enumerate(groups):
        where, optimizer = check_selector_pair(
            pair,
            i,
            "groups",
            "optimizer",
            "every variable",
            "a group must select part of the model (use `default=` for the rest)",
        )
        check_sub_optimizer(optimizer, f"groups[{i}][1]")
        checked.append((where, optimizer))
    return checked


def _check_distinct_names(optimizers):
    seen = {}
    for optimizer in optimizers:
        other = seen.get(optimizer.name)
        if other is not None and other is not optimizer:
            raise ValueError(
                f"Two different optimizers are named {optimizer.name!r}. A "
                "group is named after its optimizer (callbacks and logs use "
                "the name): give each one a distinct `name=`. "
                f"Received: names={[o.name for o in optimizers]}"
            )
        seen[optimizer.name] = optimizer


def _alternation(patterns):
    return patterns[0] if len(patterns) == 1 else "(?:" + "|".join(patterns) + ")"


def _check_map(optimizer_map, assignment, names):
    """Every variable maps to its optimizer, by its path now and after a reload."""
    tails = {id(v): stripped_path(v.path, names[id(v)]) for v, _ in assignment}
    for variable, optimizer in assignment:
        tail = tails[id(variable)]
        for path in dict.fromkeys([variable.path, tail]):
            try:
                found = optimizer_map[path]
            except ValueError:  # several keys match
                found = None
            if found is optimizer:
                continue
            clash = [
                other.path
                for other, o in assignment
                if o is not optimizer and tails[id(other)] == tail
            ]
            raise ValueError(
                f"Variable {variable.path!r} cannot be told apart from "
                f"{clash or 'a variable of another group'} by Keras's "
                "OptimizerMap, which matches `variable.path` (a path that "
                "loses the names of Sequential models once the model is "
                "loaded), yet they are in different groups. Give their layers "
                "distinct names, or put them in one group."
            )
