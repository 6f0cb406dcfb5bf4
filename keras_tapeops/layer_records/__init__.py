"""Layer records: a layer's inputs and output gradients, recorded in one forward pass.

DP-SGD's ghost norms (`keras_tapeops.privacy`) and the multi-task step's
layer-by-layer Gramian (`keras_tapeops.multitask.layerwise`) both compute
what they need from each layer's inputs and the gradients of its
(pre-activation) outputs, materializing the per-example or per-task rows
only for the layers where they are the cheaper way. What they share lives
here, below both:

- `sites`: which layer owns which trainable variables, and the `Recorder`
  that wraps their calls during one forward pass;
- `forwards`: how a call is recorded (the input, the pre-activation output);
- `layouts`: a record's tensors as `[B, T, features]` matrices (EinsumDense
  equations read as `b S C, C O -> b S O`);
- `dense`: the recordings of Dense and EinsumDense layers.

Nothing here imports `privacy` or `multitask`.
"""
