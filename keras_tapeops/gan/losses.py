"""The adversarial losses of `kt.GAN`, by name: one pair of functions each.

Standard conventions: the discriminator outputs one *realness* logit (or
score) per sample; real samples are the positive class. Each loss is the mean
over the batch (summed over the outputs of a multi-output discriminator), in
float32.

| name             | discriminator loss                          | generator loss              |
|------------------|---------------------------------------------|-----------------------------|
| `non_saturating` | `softplus(-D(x)) + softplus(D(G(z)))`       | `softplus(-D(G(z)))`        |
| `hinge`          | `relu(1 - D(x)) + relu(1 + D(G(z)))`        | `-D(G(z))`                  |
| `least_squares`  | `(D(x) - 1)^2 / 2 + D(G(z))^2 / 2`          | `(D(G(z)) - 1)^2 / 2`       |
| `wasserstein`    | `D(G(z)) - D(x)`                            | `-D(G(z))`                  |

`non_saturating` is binary cross-entropy on logits (real = 1, fake = 0) with
the generator trained on the label "real" (Goodfellow et al., 2014).
Written with `keras.ops`: the same functions serve TensorFlow and JAX.
"""

import keras
from keras import ops


def mean_score(logits, fn=None):
    """`sum over outputs of mean(fn(output))` in float32 (`fn` None: identity)."""
    flat = [ops.cast(t, "float32") for t in keras.tree.flatten(logits)]
    means = [ops.mean(t if fn is None else fn(t)) for t in flat]
    total = means[0]
    for value in means[1:]:
        total = total + value
    return total


def _non_saturating_d(real, fake):
    return mean_score(real, lambda t: ops.softplus(-t)) + mean_score(fake, ops.softplus)


def _non_saturating_g(fake):
    return mean_score(fake, lambda t: ops.softplus(-t))


def _hinge_d(real, fake):
    return mean_score(real, lambda t: ops.relu(1.0 - t)) + mean_score(
        fake, lambda t: ops.relu(1.0 + t)
    )


def _least_squares_d(real, fake):
    return 0.5 * mean_score(real, lambda t: ops.square(t - 1.0)) + 0.5 * mean_score(
        fake, ops.square
    )


def _least_squares_g(fake):
    return 0.5 * mean_score(fake, lambda t: ops.square(t - 1.0))


def _wasserstein_d(real, fake):
    return mean_score(fake) - mean_score(real)


def _minus_mean(fake):
    return -mean_score(fake)


# name -> (discriminator_loss(real_logits, fake_logits), generator_loss(fake_logits))
LOSSES = {
    "non_saturating": (_non_saturating_d, _non_saturating_g),
    "hinge": (_hinge_d, _minus_mean),
    "least_squares": (_least_squares_d, _least_squares_g),
    "wasserstein": (_wasserstein_d, _minus_mean),
}
LOSS_NAMES = tuple(LOSSES)


def discriminator_loss(name, real_logits, fake_logits):
    """The discriminator loss `name` (a key of `LOSSES`), a float32 scalar."""
    return LOSSES[name][0](real_logits, fake_logits)


def generator_loss(name, fake_logits):
    """The generator loss `name` (a key of `LOSSES`), a float32 scalar."""
    return LOSSES[name][1](fake_logits)
