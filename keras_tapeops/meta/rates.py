"""Inner learning rates: one number for every adapted weight, or learned ones (Meta-SGD).

Meta-SGD (Li et al. 2017) learns one inner rate per adapted parameter: a
variable shaped like each adapted weight, initialized to the inner learning
rate and trained by the outer optimizer with the weights. The variables
belong to the learner (saved with it), never to the wrapped model.
"""

import keras


def create_learned_rates(learner, variables, initial_rate):
    """Creates one rate variable per adapted variable, owned by `learner`.

    Args:
        learner: the `MetaLearner` (a Keras model) that owns the rates.
        variables: the adapted trainable variables of its model.
        initial_rate: the float every rate starts at.

    Returns:
        A list of trainable float32 Keras variables, aligned with `variables`.

    Example:
    ```python
    rates = create_learned_rates(meta, [dense.kernel, dense.bias], 0.01)
    ```
    """
    rates = []
    for i, variable in enumerate(variables):
        name = variable.path.replace("/", "_")
        rates.append(
            learner.add_weight(
                shape=tuple(variable.shape),
                initializer=keras.initializers.Constant(initial_rate),
                dtype="float32",
                trainable=True,
                name=f"inner_rate_{i}_{name}",
            )
        )
    return rates


def rates_for(adapted_variables, rate_owner, learned, initial_rate):
    """The inner rate of each adapted variable, in order.

    Args:
        adapted_variables: the variables the inner loop adapts this step.
        rate_owner: dict `id(variable) -> learned rate variable` (Meta-SGD).
        learned: bool, whether the rates are learned.
        initial_rate: the fixed rate (used when not learned).

    Returns:
        A list: tensors (the learned rates' values) or floats.

    Raises:
        ValueError: a variable adapted now had no rate created for it (its
            layer was frozen when the learner was built and unfrozen since).
    """
    if not learned:
        return [initial_rate] * len(adapted_variables)
    out = []
    for variable in adapted_variables:
        rate = rate_owner.get(id(variable))
        if rate is None:
            raise ValueError(
                "learn_inner_learning_rate=True: the variable "
                f"{variable.path!r} is adapted now but had no learned rate when "
                "the MetaLearner was built (was its layer frozen then?). Build "
                "the MetaLearner after setting `trainable`. "
                f"Received: adapted variable {variable.path!r}"
            )
        out.append(rate.value)
    return out
