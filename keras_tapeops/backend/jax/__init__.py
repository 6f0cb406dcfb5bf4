"""The JAX backend: the keras_tapeops step on Keras's stateless JAX trainer.

No module here imports TensorFlow: on JAX the package runs without it.
"""
