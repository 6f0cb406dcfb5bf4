"""The `GradientTransform` protocol.

A transform is built once on the model and its trainable variables, then maps
a list of gradients (one per variable, `None` allowed, `tf.IndexedSlices`
allowed) to a new list of the same length. Transforms always receive true
gradients: unscaled under mixed precision and aggregated over replicas under
`tf.distribute`.
"""


class GradientTransform:
    """Base class for gradient transforms passed to `compile(gradient_transforms=)`.

    Subclasses implement `transform(grads, variables)` and `get_config()`.
    `build(model, variables)` is called once before the first step; the base
    implementation resolves `where=` into `self.selected`, a list of bools
    aligned with `variables`.

    Args:
        where: selector of the variables this transform acts on (see
            `keras_tapeops.selectors`). None selects every trainable variable.

    Example:
    ```python
    class Scale(kt.GradientTransform):
        def __init__(self, factor, where=None):
            super().__init__(where=where)
            self.factor = factor

        def transform(self, grads, variables):
            return [g * self.factor if on and g is not None else g
                    for g, on in zip(grads, self.selected)]
    ```
    """

    def __init__(self, where=None):
        from keras_tapeops import selectors

        self.where = selectors.validate_selector(where)
        self.selected = None

    def build(self, model, variables):
        """Resolves `where=` against `model` and the trainable `variables`.

        Args:
            model: the Keras model being trained.
            variables: the list of trainable variables, in gradient order.

        Returns:
            None. Sets `self.selected` (list of bools).
        """
        from keras_tapeops import selectors

        self.selected = selectors.select(self.where, model, variables)

    def transform(self, grads, variables):
        """Returns the transformed list of gradients (same length as `grads`)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement transform(grads, variables)."
        )

    def __call__(self, grads, variables):
        return self.transform(grads, variables)

    def get_config(self):
        """Returns the constructor arguments; `where` must be serializable."""
        from keras_tapeops import selectors

        return {"where": selectors.serialize_selector(self.where)}

    @classmethod
    def from_config(cls, config):
        """Rebuilds the transform from `get_config()` output."""
        from keras_tapeops import selectors

        config = dict(config)
        if "where" in config:
            config["where"] = selectors.deserialize_selector(config["where"])
        return cls(**config)

    def selection(self, n):
        """Returns `self.selected`, or all True when `where=None` and not built.

        Args:
            n: the number of gradients.

        Returns:
            A list of `n` bools.
        """
        if self.selected is not None:
            if len(self.selected) != n:
                raise ValueError(
                    f"{type(self).__name__} was built on {len(self.selected)} "
                    f"variables but received {n} gradients."
                )
            return self.selected
        if self.where is None:
            return [True] * n
        raise ValueError(
            f"{type(self).__name__} with where={self.where!r} must be built "
            "on a model before use: call transform.build(model, variables)."
        )


def apply_in_order(transforms, grads, variables):
    """Applies `transforms` to `grads` one after another, in list order.

    Args:
        transforms: a list of `GradientTransform`s (built on `variables`).
        grads: list of gradients, one per variable (None allowed).
        variables: the matching variables.

    Returns:
        The list of transformed gradients.

    Example:
    ```python
    grads = apply_in_order([kt.ClipByNorm(1.0), kt.ClipByValue(0.5)], grads, variables)
    ```
    """
    grads = list(grads)
    for transform in transforms:
        grads = list(transform(grads, variables))
    return grads
