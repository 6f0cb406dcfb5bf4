"""Adversarial-only training (Madry et al.): the step trains on attacked inputs only.

`compile(adversarial_training=kt.attacks.PGD(...))` replaces each training
batch's inputs by adversarial ones before the step's forward pass: the attack
runs at the current weights (the model in inference mode, `k` forward and
backward passes for PGD-k) and ascends the compiled loss (or the attack's
own `loss=`); the step then runs once on `x_adv` (one forward and backward
pass: no clean pass), so a step costs about `k + 1` stock steps. Everything
else in the step (the compiled loss with its sample weights, loss terms,
metrics, the other options) sees `x_adv`; `evaluate()` and validation stay
clean (measure robustness with `kt.callbacks.RobustAccuracy`). Compare
`kt.AdversarialLoss`, which adds the adversarial loss to the clean one.
"""

from keras_tapeops.attacks import noise
from keras_tapeops.attacks import objectives


def adversarial_inputs(model, x, y):
    """Returns the batch's inputs the training step uses: `x`, or `x_adv`.

    Args:
        model: the keras_tapeops model (its options name the attack).
        x, y: the (whole, per-replica) batch, before any micro-batch split.

    Returns:
        `x` unchanged without `adversarial_training`; otherwise the attack's
        adversarial inputs, structured like `x` and held constant.

    Example:
    ```python
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  adversarial_training=kt.attacks.PGD(0.1, 0.025, steps=7))
    ```
    """
    options = model.tapeops_options
    attack = options.adversarial_training if options is not None else None
    if attack is None:
        return x
    objective = objectives.loss_objective(model, attack.loss, y)
    return attack.perturb(model, x, objective, noise.step_counter(model))
