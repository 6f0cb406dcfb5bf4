"""`MetaConfig`: the validated, immutable options of a `kt.MetaLearner`.

Configuration, not state: the numbers and choices a learner is built with,
checked once (Keras-style "Received:" messages) and serialized with the
learner. What a learner resolves from them for its model (which variables
are adapted, the Meta-SGD rate variables) is the learner's own state.
"""

from keras_tapeops import selectors
from keras_tapeops import validation
from keras_tapeops.config_repr import ConfigRepr
from keras_tapeops.meta import inner_optimizer as inner_optimizer_lib

ALGORITHMS = ("maml", "reptile")
REDUCTIONS = ("mean", "sum")


class MetaConfig(ConfigRepr):
    """The options of a meta-learner, validated.

    Args:
        inner_learning_rate: positive finite number, the step size of the
            inner SGD (the initial value of every learned rate with
            `learn_inner_learning_rate=True`).
        inner_steps: int >= 1, inner SGD steps per task.
        first_order: bool; MAML only: hold the inner gradients constant
            (first-order MAML). Reptile never differentiates through the
            inner loop, so the flag has no effect there.
        algorithm: `"maml"` or `"reptile"`.
        adapt: selector (the `where=` grammar) of the variables the inner
            loop adapts (ANIL: the head); None adapts every trainable
            variable. MAML only.
        learn_inner_learning_rate: bool, Meta-SGD: one learned inner rate per
            adapted parameter. MAML only.
        inner_batch_size: None (every inner step on the whole support set)
            or an int >= 1: the support set is cut in order into mini-batches
            of that size and inner step `s` takes mini-batch
            `s mod ceil(K / inner_batch_size)`.
        inner_optimizer: None (plain SGD) or an `InnerSGD` (momentum,
            Nesterov); the step size stays `inner_learning_rate`.
        inner_training: bool, the `training` flag of the inner loop's forward
            passes in `fit` (False: BatchNormalization normalizes with its
            moving statistics, as a model called without `training`).
        inner_loss_reduction: `"mean"` (the compiled loss) or `"sum"` (the
            per-example loss values summed over the mini-batch).

    Returns:
        The configuration object.

    Example:
    ```python
    MetaConfig(inner_learning_rate=0.01, inner_steps=5, adapt="head")
    ```
    """

    def __init__(
        self,
        inner_learning_rate=0.01,
        inner_steps=1,
        first_order=False,
        algorithm="maml",
        adapt=None,
        learn_inner_learning_rate=False,
        inner_batch_size=None,
        inner_optimizer=None,
        inner_training=True,
        inner_loss_reduction="mean",
    ):
        self.inner_learning_rate = validation.positive_number(
            inner_learning_rate, "inner_learning_rate"
        )
        self.inner_steps = validation.positive_int(inner_steps, "inner_steps")
        self.first_order = validation.boolean(first_order, "first_order")
        self.algorithm = validation.choice(algorithm, "algorithm", ALGORITHMS)
        self.adapt = selectors.validate_selector(adapt)
        self.learn_inner_learning_rate = validation.boolean(
            learn_inner_learning_rate, "learn_inner_learning_rate"
        )
        self.inner_batch_size = (
            None
            if inner_batch_size is None
            else validation.positive_int(inner_batch_size, "inner_batch_size")
        )
        self.inner_optimizer = inner_optimizer_lib.resolve(inner_optimizer)
        self.inner_training = validation.boolean(inner_training, "inner_training")
        self.inner_loss_reduction = validation.choice(
            inner_loss_reduction, "inner_loss_reduction", REDUCTIONS
        )
        if self.algorithm == "reptile":
            _refuse_with_reptile(
                "adapt",
                self.adapt,
                self.adapt is not None,
                "the variables it leaves out would never be trained "
                "(Reptile moves only the adapted weights)",
            )
            _refuse_with_reptile(
                "learn_inner_learning_rate",
                self.learn_inner_learning_rate,
                self.learn_inner_learning_rate,
                "Reptile does not differentiate through the inner loop, so "
                "the rates would never be learned (Meta-SGD needs "
                "algorithm='maml')",
            )

    def get_config(self):
        """The options as a JSON-friendly dict (the selector serialized)."""
        return {
            "inner_learning_rate": self.inner_learning_rate,
            "inner_steps": self.inner_steps,
            "first_order": self.first_order,
            "algorithm": self.algorithm,
            "adapt": selectors.serialize_selector(self.adapt),
            "learn_inner_learning_rate": self.learn_inner_learning_rate,
            "inner_batch_size": self.inner_batch_size,
            "inner_optimizer": inner_optimizer_lib.serialize(self.inner_optimizer),
            "inner_training": self.inner_training,
            "inner_loss_reduction": self.inner_loss_reduction,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["adapt"] = selectors.deserialize_selector(config.get("adapt"))
        return cls(**config)


def _refuse_with_reptile(name, value, refused, why):
    if refused:
        raise ValueError(
            f"`{name}` is not supported with algorithm='reptile': {why}. "
            f"Received: {name}={selectors.describe(value)}, algorithm='reptile'"
        )
