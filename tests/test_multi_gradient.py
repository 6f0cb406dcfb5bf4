"""The multi-gradient hook: an engine replaces the gradient pass and finalizes applied steps."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.multi_gradient import MultiGradientOption
from keras_tapeops.multi_gradient import MultiGradientState
from keras_tapeops.registration import register


@register
class _Scaled(MultiGradientOption):
    """Test option: the applied gradient times `factor`, counted in a metric."""

    option_name = "task_balancing"

    def __init__(self, factor=1.0):
        self.factor = float(factor)

    def bind(self, model, tree):
        return _ScaledState(self.factor)

    def get_config(self):
        return {"factor": self.factor}


class _ScaledState(MultiGradientState):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor
        self.passes = 0
        self.metrics = {"applied_steps": keras.metrics.Sum(name="applied_steps")}

    def batch_gradients(self, model, x, y, sample_weight, loss_multiplier=None):
        self.passes += 1  # counted at trace time
        return super().batch_gradients(model, x, y, sample_weight, loss_multiplier)

    def finalize(self, model, grads, variables):
        self.metrics["applied_steps"].update_state(1.0)
        return [g * self.factor for g in grads]


@register
class _Other(_Scaled):
    option_name = "sample_selection"


def _model():
    model = kt.upgrade(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    model.set_weights([np.full((3, 2), 0.1, "float32"), np.zeros(2, "float32")])
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")


def _fit(model, **options):
    x, y = _data()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **options)
    return model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)


def test_engine_with_unit_factor_trains_like_stock():
    stock, ours = _model(), _model()
    _fit(stock)
    history = _fit(ours, task_balancing=_Scaled(1.0))
    for a, b in zip(stock.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert history.history["applied_steps"] == [2.0]
    assert ours.tapeops_state.engine.passes >= 1


def test_engine_finalize_changes_the_applied_gradient():
    model = _model()
    before = model.get_weights()
    _fit(model, task_balancing=_Scaled(0.0))
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Companion: the same fit without the option moves the weights.
    moved = _model()
    _fit(moved)
    assert not np.allclose(before[0], moved.get_weights()[0])


def test_engine_metrics_are_training_only():
    model = _model()
    _fit(model, task_balancing=_Scaled(1.0))
    x, y = _data()
    assert "applied_steps" not in model.evaluate(x, y, verbose=0, return_dict=True)


def test_two_multi_gradient_options_are_refused_naming_both():
    with pytest.raises(ValueError, match="`task_balancing` cannot be combined with `sample_selection`.*Received: task_balancing="):
        _model().compile(
            optimizer="sgd", loss="mse",
            task_balancing=_Scaled(), sample_selection=_Other(),
        )


def test_multi_gradient_option_with_sam_is_refused():
    with pytest.raises(ValueError, match="`task_balancing` cannot be combined with `sharpness_aware`"):
        _model().compile(optimizer="sgd", loss="mse",
                         task_balancing=_Scaled(), sharpness_aware=kt.SAM(0.05))


def test_wrong_kind_of_option_is_refused():
    with pytest.raises(TypeError, match="Received: differential_privacy="):
        _model().compile(optimizer="sgd", loss="mse", differential_privacy=_Scaled())


def test_option_survives_save_and_load(tmp_path):
    model = _model()
    _fit(model, task_balancing=_Scaled(0.5))
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.tapeops_options.task_balancing, _Scaled)
    assert loaded.tapeops_options.task_balancing.factor == 0.5


def test_rows_jacobian_methods_agree():
    from keras_tapeops import rows

    w = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
    b = tf.Variable([0.5, -0.5])
    x = tf.constant([[1.0, -1.0]])
    with tf.GradientTape(persistent=True) as tape:
        out = tf.matmul(x, w) + b
        objectives = tf.stack([tf.reduce_sum(out ** 2), tf.reduce_sum(out)])
    pfor = rows.jacobian_rows(tape, objectives, [w, b], method="pfor")
    loop = rows.jacobian_rows(tape, objectives, [w, b], method="loop")
    np.testing.assert_allclose(pfor.numpy(), loop.numpy(), rtol=1e-6)
    out_np = np.array([[1.0, -1.0]]) @ w.numpy() + b.numpy()
    expected_first = np.concatenate([(np.array([[1.0], [-1.0]]) @ (2 * out_np)).ravel(), (2 * out_np).ravel()])
    np.testing.assert_allclose(pfor.numpy()[0], expected_first, rtol=1e-6)
    g = rows.gramian(pfor).numpy()
    np.testing.assert_allclose(g, pfor.numpy() @ pfor.numpy().T, rtol=1e-6)
    combined = rows.combine(tf.constant([1.0, 2.0]), pfor).numpy()
    np.testing.assert_allclose(combined, pfor.numpy()[0] + 2 * pfor.numpy()[1], rtol=1e-6)
    parts = rows.split_like(tf.constant(combined), [w, b])
    assert [tuple(p.shape) for p in parts] == [(2, 2), (2,)]
