"""Input attribution: saliency, SmoothGrad, Integrated Gradients and Grad-CAM.

Each method is traced once per model and setting (a `tf.function` kept while
the model lives, traced again when the model has been edited since, e.g. a
layer's activation set to None) and computes a whole batch, with all its noisy copies or
interpolation points, in one forward and backward pass.

Example:
```python
import keras, numpy as np
import keras_tapeops as kt
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, name="conv"),
                          keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
x = np.random.rand(2, 8, 8, 1).astype("float32")
ig = kt.attribution.integrated_gradients(model, x, steps=16)
cam = kt.attribution.grad_cam(model, x, layer="conv", upsample=True)
```
"""

from keras_tapeops.attribution.grad_cam import grad_cam
from keras_tapeops.attribution.gradients import saliency
from keras_tapeops.attribution.gradients import smoothgrad
from keras_tapeops.attribution.integrated import integrated_gradients

__all__ = ["grad_cam", "integrated_gradients", "saliency", "smoothgrad"]
