"""Resolution of `where=` selectors (placeholder API filled by the transforms work)."""


def validate_selector(where):
    """Raises TypeError if `where` is not a supported selector type."""
    if where is not None:
        raise TypeError(f"`where` selectors are not implemented yet. Received: where={where!r}")


def select(where, model, variables):
    """Returns a list of bools: which of `variables` `where` selects."""
    return [True] * len(variables)


def serialize_selector(where):
    return where
