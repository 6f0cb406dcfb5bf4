"""The one path grammar: layers named from the outer model down.

A path names a layer from the outer model down through nested models
(functional, Sequential or subclassed) and layers that own layers:
`"backbone/block_16_project"` is the layer `block_16_project` inside the
sub-model `backbone`. A variable's path is its innermost layer's path plus the
variable's name: `"backbone/block_16_project/kernel"`.

Keras's own `variable.path` does not say this: the variables of a nested
functional model (every `keras.applications` model, every keras-hub backbone)
have paths such as `"block_16_project/kernel"`, without the sub-model's name.
This module walks the layers instead, so the same path works for every
selector (`where=`), `ActivationPenalty` and optimizer groups.

Example:
```python
tree = LayerTree(model)
tree.find("backbone/block_16_project")      # the layer
tree.variable_paths(model.trainable_variables[0])  # ["backbone/Conv1/kernel"]
```
"""

import keras

from keras_tapeops._keras import private

GLOB_CHARACTERS = "*?["


def is_glob(text):
    """True if `text` has a wildcard (`*`, `?` or `[`)."""
    return any(ch in text for ch in GLOB_CHARACTERS)


class LayerTree:
    """Every layer of a model under each path that reaches it.

    A layer shared between two places appears under both paths. Input layers
    are skipped.

    Args:
        model: a Keras model (or layer).

    Example:
    ```python
    LayerTree(model).paths()   # ["backbone", "backbone/Conv1", ..., "head"]
    ```
    """

    def __init__(self, model):
        self.model = model
        self.entries = []  # (path, layer), depth first
        self._walk(model, "", set())
        self._owners = {}  # id(variable) -> paths of the layers holding it
        for path, layer in self.entries:
            for v in layer.weights:
                self._owners.setdefault(id(v), []).append(path)

    def _walk(self, layer, prefix, on_stack):
        on_stack = on_stack | {id(layer)}
        for child in _children(layer):
            if isinstance(child, keras.layers.InputLayer) or id(child) in on_stack:
                continue
            path = prefix + child.name
            self.entries.append((path, child))
            self._walk(child, path + "/", on_stack)

    def paths(self):
        """All layer paths, depth first."""
        return [path for path, _ in self.entries]

    def paths_of(self, layer):
        """The paths under which `layer` appears (empty if it is not in the model)."""
        return [path for path, other in self.entries if other is layer]

    def find(self, spec):
        """Returns the one layer named by `spec` (a path or a bare name), or raises.

        A bare name (no "/") is searched at any depth and must name exactly one
        layer; a path must match a layer path exactly.

        Args:
            spec: `"dense_1"` or `"backbone/dense_1"` (no wildcards).

        Returns:
            The layer.

        Raises:
            ValueError: no such layer (listing the available paths), or a bare
            name shared by several layers (listing their paths).
        """
        matches = self.find_all(spec)
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise ValueError(
                f"No layer {spec!r} in model {self.model.name!r}. "
                f"Available layer paths: {self.paths()}"
            )
        found = [path for path, layer in self.entries if layer.name == spec]
        raise ValueError(
            f"Several layers of model {self.model.name!r} are named {spec!r} "
            f"({found}); give the path instead, or a glob to select them all"
        )

    def resolve_layer(self, ref):
        """Returns the one layer `ref` refers to: a layer object, a path or a bare name.

        A layer object must appear in the tree (under any path); a string is
        looked up with `find`. Like `find`'s, the ValueErrors do not say
        which argument `ref` came from: a caller adds its own
        `Received: <argument>=...`.

        Args:
            ref: a layer of the model, a path (`"backbone/dense_1"`) or a bare
                name found at any depth (no wildcards).

        Returns:
            The layer.

        Raises:
            ValueError: a layer object that is not in the model, or a string
                `find` rejects (no such layer, or a bare name shared by several
                layers); each lists the available or matching paths.
            TypeError: `ref` is neither a layer nor a string.

        Example:
        ```python
        import keras
        from keras_tapeops.paths import LayerTree
        inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")],
                                 name="backbone")
        model = keras.Sequential([keras.Input((4,)), inner, keras.layers.Dense(1, name="head")])
        tree = LayerTree(model)
        assert tree.resolve_layer("backbone/d") is inner.layers[0]
        assert tree.resolve_layer("head") is tree.resolve_layer(model.layers[-1])
        ```
        """
        if isinstance(ref, keras.layers.Layer):
            if not self.paths_of(ref):
                raise ValueError(
                    f"The layer {ref.name!r} is not part of the model "
                    f"{self.model.name!r}. Available layer paths: {self.paths()}"
                )
            return ref
        if not isinstance(ref, str):
            raise TypeError(
                "`ref` must be a layer of the model, a layer path or a layer "
                f"name. Received: ref={ref!r}"
            )
        return self.find(ref)

    def find_all(self, spec):
        """The distinct layers a bare name or exact path names (maybe none)."""
        spec = spec.strip("/")
        if "/" in spec:
            found = [layer for path, layer in self.entries if path == spec]
        else:
            found = [layer for _, layer in self.entries if layer.name == spec]
        return list({id(layer): layer for layer in found}.values())

    def owner_paths(self, variable):
        """Paths of every layer that holds `variable`, directly or nested."""
        return self._owners.get(id(variable), [])

    def variable_paths(self, variable):
        """Paths of `variable`: each innermost owner's path plus its own name."""
        owners = self.owner_paths(variable)
        name = variable.path.split("/")[-1]
        return [f"{p}/{name}" for p in owners if not any(o.startswith(p + "/") for o in owners)]


def _children(layer):
    if isinstance(layer, keras.Model) and hasattr(layer, "layers"):
        try:
            return list(layer.layers)
        except (AttributeError, ValueError):
            pass
    return private.direct_sublayers(layer)
