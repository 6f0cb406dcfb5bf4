"""Meta-learning with `fit()`: `MetaLearner` (MAML, first-order MAML, Reptile, ANIL, Meta-SGD).

Modules, one concern each: `config` (the validated options), `tasks`
(meta-batches: validation and the map over tasks), `task_loss` (one task's
loss), `inner_loop` (functional SGD on the support set), `rates` (fixed or
learned inner rates), `learner` (the Keras model).
"""

from keras_tapeops.meta.learner import MetaLearner

__all__ = ["MetaLearner"]
