"""Whether a model's class overrides one of the mixin's public hooks.

The mixin marks its own hooks with `default_hook`; code below the mixin
(the accumulation reductions, the engines) asks `overrides(model, name)`
without importing the mixin, so imports only go down.
"""

_MARK = "_tapeops_default_hook"


def default_hook(function):
    """Marks `function` as the mixin's own implementation of a hook.

    Args:
        function: a method of `TapeOpsMixin`.

    Returns:
        The same function, marked.

    Example:
    ```python
    class Mixin:
        @default_hook
        def compute_terms(self, terms, context): ...
    ```
    """
    setattr(function, _MARK, True)
    return function


def overrides(model, name):
    """True when `type(model).<name>` is not the mixin's marked default.

    Args:
        model: a model whose class mixes in `TapeOpsMixin`.
        name: the hook's name, e.g. `"compute_terms"`.

    Returns:
        A bool.
    """
    return not getattr(getattr(type(model), name, None), _MARK, False)
