"""Adversarial attacks (`kt.attacks.FGSM`, `kt.attacks.PGD`) and robust evaluation.

Example:
```python
import keras, numpy as np
import keras_tapeops as kt
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x, y = np.random.rand(16, 4).astype("float32"), np.arange(16) % 3
x_adv = kt.attacks.PGD(epsilon=0.1, steps=5, clip=(0.0, 1.0))(model, x, y)
kt.attacks.evaluate_robustness(model, (x, y), kt.attacks.FGSM(0.1))
```
"""

from keras_tapeops.attacks.base import Attack
from keras_tapeops.attacks.fgsm import FGSM
from keras_tapeops.attacks.pgd import PGD
from keras_tapeops.attacks.robustness import evaluate_robustness

__all__ = ["Attack", "FGSM", "PGD", "evaluate_robustness"]
