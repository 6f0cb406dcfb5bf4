"""Fine-tuning a keras-hub Task with keras_tapeops options, on raw strings.

`kt.upgrade(task)` keeps a keras-hub Task's class: the upgraded
`BertTextClassifier` is still a `BertTextClassifier` (its preprocessor,
default compile arguments and `save`/`load_model` all keep working) with
`kt.TapeOpsMixin` placed before Keras's classes. Here:

- a small BERT classifier built from a config (2 transformer layers, hidden
  size 32, a WordPiece vocabulary of 30 words): nothing is downloaded;
- mixed precision (`mixed_float16`, set before building), so Keras wraps the
  optimizer in a LossScaleOptimizer;
- `loss_terms=[kt.ActivationPenalty("bert_backbone/transformer_layer_1",
  l2=1e-4)]`: an L2 penalty on the outputs of the last transformer layer,
  named by its path from the outer model, from the same forward pass;
- `micro_batches=2`: every batch of 16 runs as two forward/backward passes
  of 8, one optimizer step per batch;
- training on raw strings (the Task's preprocessor tokenizes them), then
  `save` and `keras.models.load_model`: the class, the options and the
  weights come back, and the reloaded model predicts the same.

Runs on CPU in under a minute. Usage: `python examples/finetune_keras_hub.py`
(needs `pip install keras-hub`, or `pip install keras-tapeops[hub]`).
"""

import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402

VOCABULARY = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
    "the", "a", "this", "movie", "film", "plot", "acting", "story", "was",
    "is", "very", "really", "quite", "not",
    "good", "great", "fun", "brilliant", "lovely",
    "bad", "dull", "boring", "awful", "weak", "slow",
]
POSITIVE = ["good", "great", "fun", "brilliant", "lovely"]
NEGATIVE = ["bad", "dull", "boring", "awful", "weak", "slow"]
SEQUENCE_LENGTH = 12
PENALIZED_LAYER = "bert_backbone/transformer_layer_1"


def make_reviews(n, seed):
    """Short reviews whose label is the sentiment word they contain."""
    rng = np.random.default_rng(seed)
    subjects = ["the movie", "this film", "the plot", "the acting", "a story"]
    adverbs = ["very", "really", "quite", ""]
    labels = rng.integers(0, 2, size=n)
    texts = []
    for label in labels:
        word = rng.choice(POSITIVE if label else NEGATIVE)
        text = f"{rng.choice(subjects)} {rng.choice(['is', 'was'])} {rng.choice(adverbs)} {word}"
        texts.append(" ".join(text.split()))
    return np.array(texts), labels.astype("int32")


def build_classifier():
    """A BertTextClassifier from a small config: tokenizer, preprocessor, backbone, head."""
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=VOCABULARY, lowercase=True)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer, sequence_length=SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(VOCABULARY), num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=SEQUENCE_LENGTH, name="bert_backbone",
    )
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=preprocessor, name="review_classifier"
    )


def main():
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    x_train, y_train = make_reviews(256, seed=1)
    x_val, y_val = make_reviews(64, seed=2)

    classifier = kt.upgrade(build_classifier())
    # The mixin's own method bases (saving, metrics, step functions) are left out.
    mro = [c.__name__ for c in type(classifier).__mro__ if c not in kt.TapeOpsMixin.__mro__[1:]]
    print(f"upgraded class: {type(classifier).__name__}; "
          f"still a BertTextClassifier: {isinstance(classifier, keras_hub.models.BertTextClassifier)}; "
          f"preprocessor: {type(classifier.preprocessor).__name__}")
    print("MRO: " + " -> ".join(mro[: mro.index("Functional") + 1]))

    # The Task's own compile() fills in its defaults (sparse categorical
    # cross-entropy from logits, accuracy) and passes the options through.
    classifier.compile(
        optimizer=keras.optimizers.Adam(2e-3),
        loss_terms=[kt.ActivationPenalty(PENALIZED_LAYER, l2=1e-4, name="act_l2")],
        micro_batches=2,
    )
    print(f"dtype policy: {classifier.dtype_policy.name}; "
          f"optimizer: {type(classifier.optimizer).__name__}")
    print(f"options: loss_terms={[t.name for t in classifier.tapeops_options.loss_terms]} "
          f"on '{PENALIZED_LAYER}', micro_batches={classifier.tapeops_options.micro_batches}")

    history = classifier.fit(
        x_train, y_train, validation_data=(x_val, y_val),
        batch_size=16, epochs=4, shuffle=False, verbose=0,
    ).history
    for epoch in range(len(history["loss"])):
        print(f"epoch {epoch + 1}: loss {history['loss'][epoch]:.4f}, "
              f"act_l2 {history['act_l2'][epoch]:.3e}, "
              f"accuracy {history['sparse_categorical_accuracy'][epoch]:.3f}, "
              f"val_loss {history['val_loss'][epoch]:.4f}, "
              f"val_accuracy {history['val_sparse_categorical_accuracy'][epoch]:.3f}")

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "review_classifier.keras")
        classifier.save(path)
        reloaded = keras.models.load_model(path)
    options = reloaded.tapeops_options
    print(f"reloaded class: {type(reloaded).__name__}; "
          f"still a BertTextClassifier: {isinstance(reloaded, keras_hub.models.BertTextClassifier)}; "
          f"dtype policy: {reloaded.dtype_policy.name}")
    print(f"reloaded options: loss_terms={[repr(t) for t in options.loss_terms]}, "
          f"micro_batches={options.micro_batches}")
    weight_diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(classifier.get_weights(), reloaded.get_weights())
    )
    # float16 logits: a float16 rounding step (about 1e-3 near 1) is the
    # most two traces of the same weights may differ by.
    prediction_diff = float(np.max(np.abs(
        np.asarray(classifier.predict(x_val, verbose=0), "float32")
        - np.asarray(reloaded.predict(x_val, verbose=0), "float32")
    )))
    print(f"reload: max |weight difference| = {weight_diff:.3g}, "
          f"max |logit difference| on raw validation strings = {prediction_diff:.3g}")
    print(f"reload matches: {weight_diff == 0.0 and prediction_diff <= 1e-2}")

    samples = np.array(["the movie was really great", "this film is very boring"])
    logits = np.asarray(reloaded.predict(samples, verbose=0), "float32")
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    for text, p in zip(samples, probabilities):
        print(f"reloaded model: P(positive | {str(text)!r}) = {p[1]:.3f}")

if __name__ == "__main__":
    main()
