"""Differential privacy for `fit` (`kt.privacy.*`): DP-SGD's sampling and accounting.

`kt.DPSGD` (a `compile(differential_privacy=...)` option) clips every
example's gradient and adds Gaussian noise once per step; this module holds
what surrounds it:

- `poisson_batches(dataset, sampling_rate, seed, model=None)`: Poisson-sampled
  batches, padded to one size with a mask (one traced step), new each epoch
  and, with `model`, after a restart too;
- `ClippingRule` and `register_clipping_rule(rule)`: per-example norms for
  a layer family of your own (the extension point; `Part`, `Context` and
  `per_example_part` are what a rule returns and reads);
- `epsilon(steps, sampling_rate, noise_multiplier, delta, accountant)` and
  `noise_multiplier_for(target_epsilon, ...)`: accounting on Google's
  `dp-accounting` package (`pip install keras-tapeops[privacy]`).

Internals, one concern per file: `dpsgd.py` (the option), `engine.py` (the
per-model step; which layer owns which variable, and the recording of
their calls, are `keras_tapeops.layer_records`), `rules.py` (the rule
protocol), `ghost_dense.py`, `ghost_embedding.py`, `ghost_conv.py`, `ghost_depthwise.py`,
`ghost_layer_norm.py`, `ghost_group_norm.py` (per-example norms per layer family),
`vectorized.py` (the fallback), `noise.py`, `accounting.py`, `poisson.py`
(TensorFlow); `dpsgd.py`, `seeds.py`, `refusals.py` and `accounting.py` serve JAX too.
See docs/privacy.md for what is guaranteed.
"""

import keras

from keras_tapeops.privacy.accounting import epsilon
from keras_tapeops.privacy.accounting import noise_multiplier_for

__all__ = ["epsilon", "noise_multiplier_for"]

# Poisson batches and the per-layer clipping rules are TensorFlow's; on JAX
# the per-example gradients come from `jax.vmap` (keras_tapeops.backend.jax.privacy).
if keras.backend.backend() == "tensorflow":
    from keras_tapeops.privacy.ghost_dense import per_example_part
    from keras_tapeops.privacy.poisson import poisson_batches
    from keras_tapeops.privacy.rules import ClippingRule
    from keras_tapeops.privacy.rules import Context
    from keras_tapeops.privacy.rules import Part
    from keras_tapeops.privacy.rules import register_clipping_rule

    __all__ += [
        "ClippingRule",
        "Context",
        "Part",
        "per_example_part",
        "poisson_batches",
        "register_clipping_rule",
    ]
