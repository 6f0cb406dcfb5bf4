"""Meta-learning with `fit()`: `MetaLearner` (MAML, first-order MAML, Reptile, ANIL, Meta-SGD).

Modules, one concern each: `config` (the validated options), `tasks`
(meta-batches: validation and the map over tasks), `task_loss` (one task's
loss), `inner_optimizer` (`InnerSGD`, the inner loop's functional SGD with
momentum), `inner_loop` (the inner steps on the support set or its
mini-batches), `rates` (fixed or learned inner rates), `learner` (the Keras
model).
"""

from keras_tapeops.meta.inner_optimizer import InnerSGD
from keras_tapeops.meta.learner import MetaLearner

__all__ = ["InnerSGD", "MetaLearner"]
