"""kt.upgrade() on a keras-hub Task (issue 10): the Task keeps its class and preprocessor.

A small BertTextClassifier built from a config (no preset download) trains on
raw strings once upgraded, exactly like the stock Task, and saves/loads with
its class, preprocessor and keras_tapeops options.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

import keras_tapeops as kt  # noqa: E402

VOCABULARY = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
    "the", "a", "movie", "film", "plot", "was", "is", "very", "not",
    "good", "great", "fun", "bad", "dull", "boring",
]
POSITIVE = {"good", "great", "fun"}


def bert_classifier(seed, dropout=0.1):
    """A 2-layer BERT text classifier with a WordPiece tokenizer, built from config."""
    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=VOCABULARY, lowercase=True)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=12)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(VOCABULARY), num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=12, dropout=dropout, name="bert_backbone",
    )
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=preprocessor, dropout=dropout, name="classifier",
    )


def text_data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    words = VOCABULARY[5:]
    texts = np.array([" ".join(rng.choice(words, size=6)) for _ in range(n)])
    labels = np.array([int(any(w in POSITIVE for w in t.split())) for t in texts])
    return texts, labels


def compile_task(model, **options):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"],
        **options,
    )


def test_upgraded_task_keeps_class_backbone_and_preprocessor():
    task = bert_classifier(seed=0)
    preprocessor, backbone = task.preprocessor, task.backbone
    variables = [id(v) for v in task.weights]
    upgraded = kt.upgrade(task)
    assert upgraded is task
    assert isinstance(upgraded, keras_hub.models.BertTextClassifier)
    assert isinstance(upgraded, keras_hub.models.Task)
    assert isinstance(upgraded, kt.TapeOpsMixin)
    assert upgraded.preprocessor is preprocessor and upgraded.backbone is backbone
    assert upgraded.num_classes == 2
    assert [id(v) for v in upgraded.weights] == variables
    mro = type(upgraded).__mro__
    assert mro.index(keras_hub.models.Task) < mro.index(kt.TapeOpsMixin) < mro.index(keras.Model)


def test_upgraded_task_trains_on_raw_strings_like_the_stock_task():
    x, y = text_data()
    stock = bert_classifier(seed=7)
    upgraded = kt.upgrade(bert_classifier(seed=7))
    for a, b in zip(stock.weights, upgraded.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    histories = []
    for model in (stock, upgraded):
        compile_task(model)
        # Raw strings: the Task's preprocessor tokenizes them inside fit().
        histories.append(
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
        )
    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(stock.get_weights(), upgraded.get_weights())
    )
    assert diff <= 1e-6, diff
    for key in histories[0]:
        np.testing.assert_allclose(histories[0][key], histories[1][key], atol=1e-6, rtol=0)
    assert sorted(histories[0]) == sorted(histories[1])
    # The training changed the weights (the comparison is not vacuous).
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(
        bert_classifier(seed=7).get_weights(), upgraded.get_weights())) > 1e-3
    np.testing.assert_allclose(
        stock.predict(x, verbose=0), upgraded.predict(x, verbose=0), atol=1e-6, rtol=0
    )
    np.testing.assert_allclose(
        stock.evaluate(x, y, verbose=0), upgraded.evaluate(x, y, verbose=0), atol=1e-6, rtol=0
    )


def test_upgraded_task_uses_keras_tapeops_options_on_raw_strings():
    x, y = text_data()
    model = kt.upgrade(bert_classifier(seed=1))
    compile_task(
        model,
        gradient_transforms=[kt.ClipByGlobalNorm(0.5, where="bert_backbone/*")],
        loss_terms=[kt.ActivationPenalty("bert_backbone/transformer_layer_1", l2=1e-3, name="act_l2")],
    )
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    assert history["act_l2"][0] > 0


LOAD_SCRIPT = r"""
import json, sys
import numpy as np
import keras
import keras_tapeops as kt   # keras_hub itself is imported by the loader

model = keras.models.load_model(sys.argv[1])
import keras_hub
texts = json.loads(sys.argv[2])
print(json.dumps({
    "class": type(model).__name__,
    "is_task": isinstance(model, keras_hub.models.BertTextClassifier),
    "preprocessor": type(model.preprocessor).__name__,
    "transforms": [repr(t) for t in model.tapeops_options.gradient_transforms],
    "terms": [t.name for t in model.tapeops_options.loss_terms],
    "predictions": model.predict(np.array(texts), verbose=0).tolist(),
}))
"""


def test_upgraded_task_saves_and_loads_in_a_fresh_process(tmp_path):
    x, y = text_data(n=16)
    model = kt.upgrade(bert_classifier(seed=2))
    compile_task(
        model,
        gradient_transforms=[kt.ClipByNorm(1.0)],
        loss_terms=[kt.ActivationPenalty("bert_backbone/transformer_layer_0", l2=1e-3, name="act_l2")],
    )
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    path = tmp_path / "task.keras"
    model.save(path)

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    out = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(path), json.dumps(x[:4].tolist())],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    predictions = np.array(loaded.pop("predictions"))
    assert loaded == {
        "class": "TapeOpsBertTextClassifier",
        "is_task": True,
        "preprocessor": "BertTextClassifierPreprocessor",
        "transforms": [repr(kt.ClipByNorm(1.0))],
        "terms": ["act_l2"],
    }
    np.testing.assert_allclose(predictions, model.predict(x[:4], verbose=0), atol=1e-6, rtol=0)
