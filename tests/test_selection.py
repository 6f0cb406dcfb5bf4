"""kt.TopLoss: fit equals a hand-written select-then-step loop; fraction=1 is stock fit."""

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from keras_tapeops.selection.base import SelectionDiagnostics
from tests.selection_oracle import data, select_then_step, tiny_model


def _fit(model, x, y, batch=8, epochs=1, **options):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **options)
    return model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)


def _close(a, b, tol=1e-6):
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(u, v, rtol=tol, atol=tol)


def test_top_loss_equals_select_then_step_loop():
    x, y = data()
    ours = tiny_model()
    history = _fit(ours, x, y, sample_selection=kt.TopLoss(fraction=0.25))
    oracle = select_then_step(tiny_model(), x, y, batch=8, fraction=0.25, lr=0.1)
    _close(ours, oracle)
    assert history.history["selection_fraction"] == [pytest.approx(0.25)]
    kept = history.history["selection_kept_loss"][0]
    assert kept > history.history["selection_batch_loss"][0]
    # One metric logs the three diagnostics, listed once among the model's metrics.
    assert sum(isinstance(m, SelectionDiagnostics) for m in ours.metrics) == 1
    # Companion: the stock step (all examples) ends elsewhere.
    stock = tiny_model()
    _fit(stock, x, y)
    assert not np.allclose(stock.get_weights()[0], oracle.get_weights()[0], atol=1e-4)


def test_top_loss_fraction_one_equals_stock_fit():
    x, y = data()
    stock, ours = tiny_model(), tiny_model()
    h_stock = _fit(stock, x, y, epochs=2)
    h_ours = _fit(ours, x, y, epochs=2, sample_selection=kt.TopLoss(fraction=1.0))
    _close(stock, ours)
    np.testing.assert_allclose(h_stock.history["loss"], h_ours.history["loss"], rtol=1e-6)


@pytest.mark.parametrize("compile_options", [{"jit_compile": True}, {"steps_per_execution": 2}],
                         ids=["jit_compile", "steps_per_execution"])
def test_top_loss_with_xla_and_steps_per_execution(compile_options):
    x, y = data()
    ours = tiny_model()
    _fit(ours, x, y, sample_selection=kt.TopLoss(fraction=0.25), **compile_options)
    oracle = select_then_step(tiny_model(), x, y, batch=8, fraction=0.25, lr=0.1)
    _close(ours, oracle)


def test_top_loss_with_micro_batches_selects_per_micro_batch():
    x, y = data()
    ours = tiny_model()
    _fit(ours, x, y, micro_batches=2, sample_selection=kt.TopLoss(fraction=0.25))
    oracle = select_then_step(tiny_model(), x, y, batch=8, fraction=0.25, lr=0.1, groups=2)
    _close(ours, oracle)


@pytest.mark.parametrize("fraction", [0, -0.5, 1.5, float("nan")])
def test_fraction_outside_unit_interval_is_refused(fraction):
    with pytest.raises(ValueError, match="Received: fraction="):
        kt.TopLoss(fraction=fraction)


def test_selection_with_differential_privacy_is_refused_naming_both():
    model = tiny_model()
    with pytest.raises(ValueError, match="`differential_privacy` cannot be combined with `sample_selection`.*Received:"):
        model.compile(optimizer="sgd", loss="mse", sample_selection=kt.TopLoss(0.5),
                      differential_privacy=kt.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0))
    # The selection refuses too (whichever option is asked first).
    reason = kt.TopLoss(0.5).combines_with("differential_privacy", None)
    assert "privacy" in reason


def test_loss_with_reduction_none_is_refused_at_the_first_batch():
    x, y = data()
    model = tiny_model()
    before = model.get_weights()
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="none"),
                  sample_selection=kt.TopLoss(0.5))
    with pytest.raises(ValueError, match="Received: reduction="):
        model.fit(x, y, batch_size=8, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_selection_diagnostics_equal_three_keras_means():
    """The fused metric logs what three `keras.metrics.Mean` would, to the bit."""
    rng = np.random.default_rng(0)
    ours = SelectionDiagnostics()
    means = {name: keras.metrics.Mean(name=name) for name in SelectionDiagnostics.NAMES}
    for present in [1.0, 1.0, 0.0, 1.0, 1.0]:  # an empty batch counts for nothing
        values = rng.uniform(0.0, 3.0, size=3).astype("float32")
        ours.update_state(*values, present)
        for name, value in zip(SelectionDiagnostics.NAMES, values):
            means[name].update_state(value, sample_weight=present)
    result = ours.result()
    assert sorted(result) == sorted(SelectionDiagnostics.NAMES)
    for name, mean in means.items():
        assert float(result[name]) == float(mean.result()), name
    # The check can fail: one more update to the Means alone moves them.
    means["selection_fraction"].update_state(5.0, sample_weight=1.0)
    assert float(result["selection_fraction"]) != float(means["selection_fraction"].result())
    ours.reset_state()
    assert all(float(v) == 0.0 for v in ours.result().values())
    # Keras's config round trip (a metric may be serialized with its model).
    again = SelectionDiagnostics.from_config(ours.get_config())
    assert again.name == ours.name and again.dtype == ours.dtype
