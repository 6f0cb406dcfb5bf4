"""compile() validates keras_tapeops options before changing anything."""

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from parity_utils import classification_data
from parity_utils import sequential_model


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"micro_batches": 0}, ValueError, r"micro_batches.*Received: micro_batches=0"),
        ({"micro_batches": -2}, ValueError, r"Received: micro_batches=-2"),
        ({"micro_batches": 2.5}, TypeError, r"Received: micro_batches=2.5"),
        ({"micro_batches": True}, TypeError, r"Received: micro_batches=True"),
        ({"accumulation_steps": 0}, ValueError, r"Received: accumulation_steps=0"),
        ({"accumulation_steps": "4"}, TypeError, r"Received: accumulation_steps='4'"),
        ({"gradient_transforms": "clip"}, TypeError, r"Received: gradient_transforms='clip'"),
        ({"gradient_transforms": [1.0]}, TypeError, r"Received: gradient_transforms\[0\]=1.0"),
        ({"loss_terms": [lambda m: 0.0]}, TypeError, r"Received: loss_terms\[0\]="),
    ],
)
def test_bad_options_raise_clear_errors(kwargs, error, message):
    model = kt.upgrade(sequential_model())
    with pytest.raises(error, match=message):
        model.compile(optimizer="sgd", loss="mse", **kwargs)


def test_unknown_option_is_rejected_by_compile():
    model = kt.upgrade(sequential_model())
    with pytest.raises(TypeError, match="clip_everything"):
        model.compile(optimizer="sgd", loss="mse", clip_everything=True)


def test_failed_compile_leaves_model_and_weights_untouched():
    x, y = classification_data()
    model = kt.upgrade(sequential_model())
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.copy() for w in model.get_weights()]
    optimizer = model.optimizer
    with pytest.raises(ValueError):
        model.compile(optimizer="adam", loss="mse", micro_batches=0)
    assert model.optimizer is optimizer
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    model.fit(x, y, verbose=0, epochs=1)  # the earlier compile still works


def test_options_are_visible_after_compile():
    model = kt.upgrade(sequential_model())
    model.compile(optimizer="sgd", loss="mse", micro_batches=3, accumulation_steps=2)
    assert model.tapeops_options.micro_batches == 3
    assert model.tapeops_options.accumulation_steps == 2
    assert model.get_compile_config()["micro_batches"] == 3


# ------------------------------------------------------------ loss term names
def _penalty(name, layer="backbone_dense"):
    return kt.ActivationPenalty(layer, l2=1e-3, name=name)


CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize(
    "names, message",
    [
        (["act", "act"],
         r"Loss term names must be unique: loss_terms\[0\] and loss_terms\[1\] "
         r"are both named 'act'\. Received: loss_terms\[1\]\.name='act'"),
        (["act", "head_l1", "act"],
         r"loss_terms\[0\] and loss_terms\[2\] are both named 'act'\. "
         r"Received: loss_terms\[2\]\.name='act'"),
        (["loss"],
         r"cannot be named 'loss'.*Received: loss_terms\[0\]\.name='loss'"),
        (["act", "loss"], r"Received: loss_terms\[1\]\.name='loss'"),
        (["val_loss"],
         r"cannot start with 'val_'.*Received: loss_terms\[0\]\.name='val_loss'"),
        (["act", "val_act"], r"Received: loss_terms\[1\]\.name='val_act'"),
    ],
)
def test_bad_term_names_keep_the_previous_compilation(names, message):
    x, y = classification_data()
    model = kt.upgrade(sequential_model())
    model.compile(optimizer="sgd", loss=CE, loss_terms=[_penalty("kept")])
    optimizer, options = model.optimizer, model.tapeops_options
    before = [w.copy() for w in model.get_weights()]
    terms = [_penalty(n, "backbone_dense" if i % 2 == 0 else "head")
             for i, n in enumerate(names)]
    with pytest.raises(ValueError, match=message):
        model.compile(optimizer="adam", loss="mse", loss_terms=terms)
    assert model.optimizer is optimizer
    assert model.tapeops_options is options
    assert [t.name for t in model.tapeops_options.terms] == ["kept"]
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    history = model.fit(x, y, verbose=0, epochs=1).history
    assert sorted(history) == ["kept", "loss"]  # the earlier compile is in force


@pytest.mark.parametrize(
    "names", [["act", "act_2"], ["loss_2"], ["validation"], ["val"], ["my_val_act"]]
)
def test_term_names_that_do_not_clash_are_accepted(names):
    """Companion of the test above: the name checks reject only real clashes."""
    model = kt.upgrade(sequential_model())
    terms = [_penalty(n, "backbone_dense" if i % 2 == 0 else "head")
             for i, n in enumerate(names)]
    model.compile(optimizer="sgd", loss=CE, loss_terms=terms)
    assert [t.name for t in model.tapeops_options.terms] == names


class TrackedMetricNet(kt.TapeOpsMixin, keras.Model):
    """A subclassed model that tracks its own metric named `extra`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, name="hidden")
        self.out = keras.layers.Dense(3, name="out")
        self.extra = keras.metrics.Mean(name="extra")

    def call(self, x):
        return self.out(self.hidden(x))


def _tracked_metric_net(term_name):
    x, y = classification_data()
    model = TrackedMetricNet()
    model(x[:1])
    model.compile(
        optimizer="sgd", loss=CE,
        loss_terms=[kt.ActivationPenalty("hidden", l2=1e-3, name=term_name)],
    )
    return model, x, y


def test_term_name_clashing_with_a_model_metric_fails_before_training():
    model, x, y = _tracked_metric_net("extra")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(
        ValueError,
        match=r"Loss term name 'extra' clashes with a metric of the model "
        r"\(\['extra', 'loss'\]\)\. Received: name='extra'",
    ):
        model.fit(x, y, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 0


def test_same_model_with_a_free_term_name_trains():
    """Companion: the weights-untouched check above can fail (training moves them)."""
    model, x, y = _tracked_metric_net("act")
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(x, y, verbose=0).history
    assert "act" in history
    assert max(float(np.max(np.abs(a - b)))
               for a, b in zip(before, model.get_weights())) > 1e-4


def _two_output_model():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, name="backbone_dense")(inputs)
    return kt.upgrade(keras.Model(inputs, {
        "o1": keras.layers.Dense(1, name="o1")(hidden),
        "o2": keras.layers.Dense(1, name="o2")(hidden),
    }))


@pytest.mark.parametrize("clash", ["compiled_metric", "per_output_loss"])
def test_term_name_clashing_with_a_compile_argument_fails_at_compile(clash):
    """Names visible in compile()'s arguments fail there, keeping the old compilation."""
    if clash == "compiled_metric":
        model = kt.upgrade(sequential_model())
        compile_kwargs = {"loss": CE, "metrics": ["accuracy"]}
        name = "accuracy"
    else:
        model = _two_output_model()
        compile_kwargs = {"loss": {"o1": "mse", "o2": "mse"}}
        name = "o1_loss"
    model.compile(optimizer="adam", **compile_kwargs)
    with pytest.raises(
        ValueError,
        match=rf"Loss term name {name!r} clashes with a metric or loss passed to "
        rf"compile\(\) \(.*{name!r}.*\)\. Received: name={name!r}",
    ):
        model.compile(optimizer="sgd", loss_terms=[_penalty(name)], **compile_kwargs)
    assert model.tapeops_options.loss_terms == ()
    assert isinstance(model.optimizer, keras.optimizers.Adam)


def test_term_name_clashing_with_a_name_keras_resolves_later_fails_in_the_first_step():
    """A list loss names its per-output losses only when Keras builds it (first
    traced step): the clash fails there, before any update, and compiling
    again with a free name makes the model usable."""
    x, y = classification_data()
    model = _two_output_model()
    targets = [y[:, None].astype("float32"), y[:, None] * 0.5]
    model.compile(optimizer="sgd", loss=["mse", "mse"], loss_terms=[_penalty("o1_loss")])
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(
        ValueError,
        match=r"Loss term name 'o1_loss' clashes with a metric of the model "
        r"\(.*'o1_loss'.*\)\. Received: name='o1_loss'",
    ):
        model.fit(x, targets, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    model.compile(optimizer="sgd", loss=["mse", "mse"], loss_terms=[_penalty("act")])
    history = model.fit(x, targets, verbose=0).history
    assert "act" in history and "o1_loss" in history
    assert max(float(np.max(np.abs(a - b)))
               for a, b in zip(before, model.get_weights())) > 1e-6


def test_compiled_metric_and_per_output_loss_keep_their_names_next_to_terms():
    """Companion: free term names train and are logged beside the metrics."""
    x, y = classification_data()
    model = kt.upgrade(sequential_model())
    model.compile(optimizer="sgd", loss=CE, metrics=["accuracy"],
                  loss_terms=[_penalty("act")])
    history = model.fit(x, y, verbose=0).history
    assert sorted(history) == ["accuracy", "act", "loss"]
