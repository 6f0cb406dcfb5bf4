"""Adversarial training as loss terms: `AdversarialLoss` (Madry et al.) and `TRADES`.

Both attack the (micro-)batch inside the training step, at the current
weights, with the model in inference mode, and hold `x_adv` constant
(`tf.stop_gradient`): the weights' gradient flows only through the forward
pass on `x_adv` (run with the step's `training` flag, like the clean pass).
"""

from __future__ import annotations

from typing import Any
from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from keras_tapeops._keras import private
from keras_tapeops import replicas
from keras_tapeops import validation
from keras_tapeops.attacks import noise
from keras_tapeops.attacks import objectives
from keras_tapeops.attacks.base import Attack
from keras_tapeops.attacks.base import check_attack
from keras_tapeops.registration import register
from keras_tapeops.terms.base import Term
from keras_tapeops.terms.base import deserialize_weight
from keras_tapeops.terms.base import TermContext
from keras_tapeops.terms.base import Weight

if TYPE_CHECKING:
    from typing_extensions import Self


class _AttackTerm(Term):
    """A term holding an attack: its config and the step key of its random start."""

    def __init__(self, attack: Attack, weight: Weight, name: str, in_validation: bool) -> None:
        self.attack = check_attack(attack)
        super().__init__(weight=weight, name=name, in_validation=in_validation)

    def _perturb(self, context, objective):
        model = context.model
        options = getattr(model, "tapeops_options", None)
        # Micro-batch passes are traced in a loop body: no all-gather there.
        whole_batch = options is None or options.micro_batches == 1
        return self.attack.perturb(
            model,
            context.x,
            objective,
            noise.step_counter(model),
            gather_batch_sizes=whole_batch,
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["attack"] = keras.saving.serialize_keras_object(self.attack)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        config["attack"] = keras.saving.deserialize_keras_object(config["attack"])
        return super().from_config(config)


@register
class AdversarialLoss(_AttackTerm):
    """Adds `weight * loss(model(x_adv), y)`: training on adversarial examples.

    `x_adv = attack(model, x, y)` is generated in the step at the current
    weights (the attack ascends the compiled loss, or its own `loss=`) and
    held constant; the term is the model's compiled loss on it, with the
    batch's sample weights (and class weights) and per-output loss weights.
    The clean loss stays in the total: `loss + weight * adversarial loss`
    (Goodfellow et al.'s mix; Madry et al.'s PGD training and Wong et al.'s
    fast FGSM training are the same with the clean part set aside, which
    `weight` large relative to 1 approaches). The forward pass on `x_adv`
    uses the step's `training` flag (dropout, BatchNormalization batch
    statistics), like the clean pass.

    Args:
        attack: a `kt.attacks` attack, e.g. `kt.attacks.FGSM(8/255)` or
            `kt.attacks.PGD(8/255, 2/255, steps=7)`. Give it a `seed` to make
            the random starts reproducible (and equal on one device and on
            several replicas).
        weight: a number, a schedule or a callable `step -> number`.
        name: the name logged in History and the progress bar.
        in_validation: default False: `evaluate()` and validation neither
            attack nor count the term (use `kt.callbacks.RobustAccuracy` to
            measure robustness). True logs `val_<name>` too.

    Returns:
        A term for `compile(loss_terms=[...])`.

    Example:
    ```python
    model.compile(optimizer="adam", loss="categorical_crossentropy", loss_terms=[
        kt.AdversarialLoss(kt.attacks.FGSM(0.1, clip=(0.0, 1.0), seed=0))])
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    history.history["adversarial_loss"]
    ```
    """

    def __init__(
        self,
        attack: Attack,
        weight: Weight = 1.0,
        name: str = "adversarial_loss",
        in_validation: bool = False,
    ) -> None:
        super().__init__(attack, weight, name, in_validation)

    def call(self, context: TermContext) -> tf.Tensor:
        model = context.model
        objective = objectives.loss_objective(model, self.attack.loss, context.y)
        x_adv = self._perturb(context, objective)
        y_adv = private.call_model(model, x_adv, context.training)
        value = objectives.compiled_loss_value(model, context.y, y_adv, context.sample_weight)
        # Keras's losses divide by the replicas; the step scales terms itself.
        return replicas.unscale_for_distribution(tf.cast(value, tf.float32))


@register
class TRADES(_AttackTerm):
    """Adds `beta * KL(p(x) || p(x_adv))` (Zhang et al. 2019, TRADES).

    The attack maximizes `KL(p(x) || p(x'))` from the clean predictions at
    the current weights (inference mode, held constant) instead of the loss,
    so it needs a random start: at `x' = x` the KL is at its minimum and its
    gradient is zero. The term is the per-example KL between the step's
    clean predictions (differentiated) and the predictions on `x_adv`,
    averaged like a Keras loss: `sum(sample_weight * KL) / batch_size`.
    The clean loss of `compile(loss=...)` is TRADES's natural loss.

    Args:
        attack: a `kt.attacks` attack with `random_start=True`, e.g.
            `kt.attacks.PGD(8/255, 2/255, steps=10)`.
        beta: the trade-off (the paper uses 1 to 10; 6 on CIFAR-10): a
            non-negative number, a schedule or a callable `step -> number`.
            It is the term's weight: History logs `beta * KL`.
        from_logits: whether the model outputs logits (softmax is applied;
            a single unit is a sigmoid logit) or probabilities. A compiled
            crossentropy loss that says otherwise is an error.
        name: the name logged in History and the progress bar.
        in_validation: default False (see `kt.AdversarialLoss`).

    Returns:
        A term for `compile(loss_terms=[...])`.

    Example:
    ```python
    attack = kt.attacks.PGD(0.1, step_size=0.025, steps=5, clip=(0.0, 1.0), seed=0)
    model.compile(optimizer="adam", loss="categorical_crossentropy",   # softmax outputs
                  loss_terms=[kt.TRADES(attack, beta=6.0, from_logits=False)])
    model.fit(x, y, batch_size=16, epochs=1, verbose=0).history["trades"]
    ```
    """

    def __init__(
        self,
        attack: Attack,
        beta: float = 6.0,
        from_logits: bool = True,
        name: str = "trades",
        in_validation: bool = False,
    ) -> None:
        check_attack(attack)
        if not attack.random_start:
            raise ValueError(
                "TRADES needs an attack with random_start=True: at x' = x the "
                "KL divergence is at its minimum and its gradient is zero, so "
                "the attack would not move. Received: attack="
                f"{attack!r}"
            )
        if not callable(beta):
            validation.non_negative_number(beta, "beta")
        self.from_logits = validation.boolean(from_logits, "from_logits")
        super().__init__(attack, beta, name, in_validation)

    @property
    def beta(self) -> float:
        return self.weight

    def call(self, context: TermContext) -> tf.Tensor:
        model = context.model
        if tf.nest.is_nested(context.y_pred):
            raise ValueError(
                f"TRADES {self.name!r} needs a single-output classifier. Received: "
                f"outputs {tf.nest.map_structure(lambda t: t.shape, context.y_pred)}"
            )
        self._check_from_logits(model)
        clean = private.call_model(model, context.x, training=False)
        objective = objectives.kl_objective(
            objectives.log_probabilities(clean, self.from_logits), self.from_logits
        )
        x_adv = self._perturb(context, objective)
        y_adv = private.call_model(model, x_adv, context.training)
        kl = objectives.kl_per_example(
            objectives.log_probabilities(context.y_pred, self.from_logits),
            objectives.log_probabilities(y_adv, self.from_logits),
        )
        if context.sample_weight is not None:
            kl = kl * tf.cast(tf.reshape(context.sample_weight, [-1]), tf.float32)
        return tf.reduce_mean(kl)

    def _check_from_logits(self, model):
        loss = getattr(model, "loss", None)  # what compile() was given
        if isinstance(loss, str):
            # A crossentropy by name takes probabilities.
            compiled = False if "crossentropy" in loss else None
        elif isinstance(loss, keras.losses.Loss):
            compiled = loss.get_config().get("from_logits")
        else:
            compiled = None
        if isinstance(compiled, bool) and compiled != self.from_logits:
            raise ValueError(
                f"TRADES {self.name!r} reads the outputs as "
                f"{'logits' if self.from_logits else 'probabilities'}, but the "
                f"compiled loss has from_logits={compiled}. Pass "
                f"from_logits={compiled}. Received: from_logits={self.from_logits}"
            )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["beta"] = config.pop("weight")
        config["from_logits"] = self.from_logits
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        config["attack"] = keras.saving.deserialize_keras_object(config["attack"])
        config["beta"] = deserialize_weight(config["beta"])
        return cls(**config)
