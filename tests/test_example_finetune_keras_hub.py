"""examples/finetune_keras_hub.py: an upgraded keras-hub Task trains, saves and reloads."""

import re
from pathlib import Path

from example_runner import run_example

import pytest

pytest.importorskip("keras_hub")

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "finetune_keras_hub.py"


def run_script(tmp_path):
    return run_example(SCRIPT, tmp_path)


def test_upgraded_keras_hub_task_trains_with_options_and_reloads(tmp_path):
    out = run_script(tmp_path)

    # The Task kept its class and preprocessor; the mixin sits before Keras's classes.
    assert ("upgraded class: TapeOpsBertTextClassifier; still a BertTextClassifier: True; "
            "preprocessor: BertTextClassifierPreprocessor") in out, out
    assert re.search(r"MRO: TapeOpsBertTextClassifier -> .*BertTextClassifier -> .*Task"
                     r" -> PipelineModel -> TapeOpsMixin -> Functional", out), out
    assert "dtype policy: mixed_float16; optimizer: LossScaleOptimizer" in out
    assert ("options: loss_terms=['act_l2'] on 'bert_backbone/transformer_layer_1', "
            "micro_batches=2") in out

    # Every epoch logs the activation penalty (about l2 * 1 for layer-normed
    # outputs), and training on raw strings learns the task.
    epochs = re.findall(
        r"epoch \d: loss (\S+), act_l2 (\S+), accuracy (\S+), val_loss (\S+), val_accuracy (\S+)", out
    )
    assert len(epochs) == 4, out
    losses = [float(e[0]) for e in epochs]
    penalties = [float(e[1]) for e in epochs]
    assert all(1e-5 < p < 1e-3 for p in penalties), penalties
    assert losses[-1] < losses[0]
    assert float(epochs[-1][4]) >= 0.9, out

    # save + load_model: class, options and weights come back.
    assert "reloaded class: TapeOpsBertTextClassifier; still a BertTextClassifier: True; dtype policy: mixed_float16" in out
    assert "layer='bert_backbone/transformer_layer_1'" in out and "micro_batches=2" in out
    assert re.search(r"max \|weight difference\| = 0,", out), out
    assert "reload matches: True" in out
    positive = float(re.search(r"P\(positive \| 'the movie was really great'\) = (\S+)", out).group(1))
    negative = float(re.search(r"P\(positive \| 'this film is very boring'\) = (\S+)", out).group(1))
    assert positive > 0.5 > negative, out
