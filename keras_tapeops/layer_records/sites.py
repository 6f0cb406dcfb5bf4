"""Where each trainable variable's gradient comes from: its "site".

A site is a layer that directly owns trainable variables (a Dense's kernel
and bias, an Embedding's table). During one forward pass (DP-SGD's, or the
multi-task step's) every site's `call` is wrapped on the instance (Keras 3
has no forward hooks, as in `keras_tapeops.capture`): the wrapper records
what the site's rule needs (the layer's inputs and its pre-activation output
`z`, whose gradient the backward pass then computes) and returns the layer's
usual outputs.

A variable read outside its owner's calls (weights tied to another layer, a
variable a model reads directly, a layer called inside a loop body such as
an RNN's cell) has a gradient its owner's inputs and outputs alone do not
give: an audit tape that is paused inside every site call sees those reads
(`Recorder.foreign`), and the step takes such variables' rows from the
whole forward pass instead.

Example:
```python
sites, orphans = discover(model, model.trainable_variables, choose_rule, tree)
with Recorder(sites, model.trainable_variables) as recorder:
    y_pred = model(x, training=True)
recorder.invocations[id(layer)]    # one record per call: {"a": inputs, "z": [z]}
```
"""

import contextlib

import tensorflow as tf

from keras_tapeops._keras import private


class Site:
    """One layer owning trainable variables, and the rule that records (and clips) them.

    Attributes:
        layer: the Keras layer.
        path: its path from the outer model (for the report).
        variables: the trainable variables it owns directly, in
            `model.trainable_weights` order.
        rule: what `discover`'s `choose_rule` returned for the layer: an
            object with `forward(layer, original_call, args, kwargs) ->
            (outputs, record)` (a DP-SGD clipping rule, or a recording of
            `layer_records.dense`), or None where the caller has none for
            it (the multi-task step drops those sites before recording).
        allowed: ids of the variables its call may read (its own and its
            sublayers').
    """

    def __init__(self, layer, path, variables, rule):
        self.layer = layer
        self.path = path
        self.variables = list(variables)
        self.rule = rule
        self.allowed = {id(v) for v in layer.weights}


def discover(model, variables, choose_rule, tree):
    """The sites of `model` for its trainable `variables`.

    Args:
        model: the built model.
        variables: `model.trainable_weights`.
        choose_rule: callable `layer -> rule`.
        tree: `paths.LayerTree(model)` (for layer paths in the report).

    Returns:
        `(sites, orphans)`: the list of `Site`, and the variables no layer
        below the model owns (read by the model itself).
    """
    wanted = {id(v): v for v in variables}
    claimed = set()
    sites = []
    for layer in private.all_layers(model):
        own = _direct_variables(layer)
        mine = [v for v in variables if id(v) in own and id(v) not in claimed]
        if not mine:
            continue
        claimed.update(id(v) for v in mine)
        sites.append(Site(layer, _path(tree, layer), mine, choose_rule(layer)))
    orphans = [v for i, v in wanted.items() if i not in claimed]
    return sites, orphans


def _direct_variables(layer):
    """Ids of the variables `layer` created itself (not its sublayers')."""
    inner = set()
    for sub in private.direct_sublayers(layer):
        inner.update(id(v) for v in sub.weights)
    return {id(v) for v in layer.weights if id(v) not in inner}


def _path(tree, layer):
    for path, candidate in tree.entries:
        if candidate is layer:
            return path
    return layer.name


class Recorder:
    """Wraps every site's `call` during one forward pass and records its calls.

    Inside the block, `invocations[id(layer)]` fills with what each call's
    rule recorded, and `foreign` with the trainable variables read outside
    their owner's calls.

    Args:
        sites: the `Site` list.
        trainable: the model's trainable variables.
        scope: None (variables read anywhere in the block are audited), or a
            layer (the model): only reads inside its calls are audited. The
            multi-task step passes the model: its task losses depend on the
            outputs alone, so a weight read while the loss is computed (a
            kernel regularizer) cannot reach them.
    """

    def __init__(self, sites, trainable, scope=None):
        self.sites = sites
        # Tapes report the TensorFlow variables behind Keras's (and, under
        # tf.distribute, each replica's component): map them back.
        self.trainable = {}
        for variable in trainable:
            for inner in _tensorflow_variables(variable):
                self.trainable[id(inner)] = variable
        self.invocations = {id(site.layer): [] for site in sites}
        self.foreign = {}
        self._depth = 0
        self._graph = None
        self._audit = None
        self._active = False
        self._scope = scope
        self._patched = []

    def __enter__(self):
        # The graph the forward pass is traced in (None when eager): a site
        # called inside an inner graph (the loop body of an RNN whose cell
        # holds it) produces tensors the backward pass cannot stop at.
        self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        for site in self.sites:
            layer = site.layer
            self._patched.append((layer, layer.__dict__.get("call")))
            layer.call = self._wrapped(site, layer.call)
        if self._scope is not None:
            scope = self._scope
            self._patched.append((scope, scope.__dict__.get("call")))
            scope.call = self._audited(scope.call)
        else:
            self._audit = tf.GradientTape(watch_accessed_variables=True)
            self._audit.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc):
        self._active = False
        audit, self._audit = self._audit, None
        if audit is not None:
            audit.__exit__(*exc)
            self._collect(audit)
        for layer, own_call in self._patched:
            if own_call is None:
                del layer.call
            else:
                layer.call = own_call
        self._patched = []
        return False

    def _collect(self, audit):
        """Adds the trainable variables `audit` saw read to `foreign`."""
        for inner in audit.watched_variables():
            variable = self.trainable.get(id(inner))
            if variable is not None:
                self.foreign[id(variable)] = variable

    def _audited(self, original):
        """`scope`'s call, with the reads outside its sites audited."""

        def call(*args, **kwargs):
            if private.in_symbolic_build() or not self._active or self._audit is not None:
                return original(*args, **kwargs)
            with tf.GradientTape(watch_accessed_variables=True) as audit:
                self._audit = audit
                try:
                    outputs = original(*args, **kwargs)
                finally:
                    self._audit = None
            self._collect(audit)
            return outputs

        return call

    def _wrapped(self, site, original):
        def call(*args, **kwargs):
            if private.in_symbolic_build() or not self._active:
                return original(*args, **kwargs)
            inner = (
                not tf.executing_eagerly()  # a function traced inside an eager step
                if self._graph is None
                else tf.compat.v1.get_default_graph() is not self._graph
            )
            if inner:
                # Inside a loop (or branch) body: the variables are treated
                # as read outside their owner's calls (whole-model rows).
                for variable in site.variables:
                    self.foreign[id(variable)] = variable
                return original(*args, **kwargs)
            with self._site_scope(), tf.GradientTape(watch_accessed_variables=True) as local:
                outputs, record = site.rule.forward(site.layer, original, args, kwargs)
            for inner in local.watched_variables():
                variable = self.trainable.get(id(inner))
                if variable is not None and id(variable) not in site.allowed:
                    self.foreign[id(variable)] = variable
            self.invocations[id(site.layer)].append(record)
            return outputs

        return call

    @contextlib.contextmanager
    def _site_scope(self):
        """Pauses the audit tape while a site runs (only at the outermost site)."""
        self._depth += 1
        try:
            if self._depth == 1 and self._audit is not None:
                with self._audit.stop_recording():
                    yield
            else:
                yield
        finally:
            self._depth -= 1


def _tensorflow_variables(variable):
    """The `tf.Variable`s a tape reports when `variable` is read.

    A Keras 3 variable on the TensorFlow backend keeps its `tf.Variable` in
    the private `_value` (Keras has no public handle on it); under
    `tf.distribute` that is a distributed variable whose `values` are the
    per-replica components.
    """
    inner = getattr(variable, "_value", variable)
    found = [variable, inner]
    found.extend(getattr(inner, "values", ()) or ())
    return found
