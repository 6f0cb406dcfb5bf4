"""task_balancing with the rest of the step: MirroredStrategy, mixed precision, accumulation, SAM."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
import test_aggregation_reference as ref
from keras_tapeops.aggregation.pcgrad import task_orders
from keras_tapeops.multitask.engine import TaskEngine
from test_multi_task import Oracle
from test_multi_task import build_model
from test_multi_task import compile_and_fit
from test_multi_task import make_data
from test_multi_task import rows_method


def _weights_close(a, b, atol=1e-6):
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=atol, atol=atol)


def _engine_state(model):
    return {k: v.numpy() for k, v in model.tapeops_state.engine.state.items()}


@pytest.mark.parametrize("make", [
    lambda: kt.GradNorm(shared="trunk", learning_rate=0.1),
    lambda: kt.MGDA(shared="trunk", on="representation"),
    lambda: kt.MeasureConflict(every=2, shared="trunk"),
], ids=["GradNorm", "MGDA_representation", "MeasureConflict"])
def test_two_replicas_equal_one_device(mirrored, make):
    single = build_model(2)
    history = compile_and_fit(single, 2, epochs=2, task_balancing=make())
    with mirrored.scope():
        distributed = build_model(2)
        distributed_history = compile_and_fit(distributed, 2, epochs=2, task_balancing=make())
    _weights_close(distributed.get_weights(), single.get_weights())
    for key, values in history.history.items():
        np.testing.assert_allclose(distributed_history.history[key], values, rtol=1e-5, err_msg=key)
    for name, value in _engine_state(single).items():
        np.testing.assert_allclose(_engine_state(distributed)[name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("by_layer", [False, True], ids=["rows", "layer_by_layer"])
def test_mixed_float16_rows_are_unscaled_and_aggregated_in_float32(monkeypatch, by_layer):
    """Layer by layer, the trunk's task gradients are combined in float32 from float16
    output gradients where the oracle's `tape.gradient` multiplies in float16: 3e-4."""
    if not by_layer:
        monkeypatch.setattr(TaskEngine, "_by_layer", lambda self, model: False)
    seed = 2
    keras.config.set_dtype_policy("mixed_float16")
    model = build_model(2)
    oracle_model = build_model(2)
    history = compile_and_fit(
        model, 2, task_balancing=kt.PCGrad(shared="trunk", seed=seed),
        optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=128.0
        ),
    )
    seen = []

    def pcgrad(J, losses, step):
        seen.append(np.linalg.norm(J, axis=1))
        return ref.pcgrad(J, task_orders(seed, step, 2).numpy())

    expected = Oracle(oracle_model, 2, loss_scale=128.0).fit(rows_method(pcgrad))
    _weights_close(model.get_weights(), expected, atol=3e-4 if by_layer else 1e-5)
    # The logged norms are those of the unscaled rows (not 128 times them).
    np.testing.assert_allclose(history.history["a_grad_norm"][0], np.mean(seen, 0)[0], rtol=1e-3)
    assert model.tapeops_state.engine.task_metrics.total.dtype == "float32"


@pytest.mark.parametrize("make", [
    lambda: kt.PCGrad(shared="trunk", seed=1),
    lambda: kt.UncertaintyWeighting(),
    lambda: kt.GradNorm(shared="trunk"),
], ids=["PCGrad", "UncertaintyWeighting", "GradNorm"])
def test_micro_batches_and_accumulation_equal_the_large_batch(make):
    """Rows (and losses) are accumulated; the aggregate is taken once per applied step."""
    large = build_model(2)
    compile_and_fit(large, 2, epochs=2, batch_size=8, task_balancing=make())
    micro = build_model(2)
    compile_and_fit(micro, 2, epochs=2, batch_size=8, task_balancing=make(), micro_batches=2)
    _weights_close(micro.get_weights(), large.get_weights())
    window = build_model(2)
    compile_and_fit(window, 2, epochs=2, batch_size=4, task_balancing=make(), accumulation_steps=2)
    _weights_close(window.get_weights(), large.get_weights())
    for name, value in _engine_state(large).items():
        np.testing.assert_allclose(_engine_state(micro)[name], value, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(_engine_state(window)[name], value, rtol=1e-5, atol=1e-7)
    # Companion: aggregating each half-batch on its own is a different step.
    halves = build_model(2)
    compile_and_fit(halves, 2, epochs=2, batch_size=4, task_balancing=make())
    assert max(np.abs(a - b).max() for a, b in zip(halves.get_weights(), large.get_weights())) > 1e-5


def test_famo_refuses_micro_batches_before_any_weight_changes():
    model = build_model(2)
    before = model.get_weights()
    with pytest.raises(ValueError, match="cannot be combined with `micro_batches`.*Received: micro_batches=2"):
        compile_and_fit(model, 2, task_balancing=kt.FAMO(), micro_batches=2)
    _weights_close(model.get_weights(), before, atol=0)


def test_sam_and_other_multi_gradient_options_are_refused_naming_both():
    model = build_model(2)
    with pytest.raises(ValueError, match="`task_balancing` cannot be combined with `sharpness_aware`.*Received:"):
        model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"},
                      task_balancing=kt.PCGrad(shared="trunk"), sharpness_aware=kt.SAM(0.05))


def test_jit_compile_equals_graph_mode():
    graph, xla = build_model(2), build_model(2)
    compile_and_fit(graph, 2, task_balancing=kt.IMTLG(shared="trunk"))
    compile_and_fit(xla, 2, task_balancing=kt.IMTLG(shared="trunk"), jit_compile=True)
    _weights_close(xla.get_weights(), graph.get_weights(), atol=1e-5)


def test_pfor_and_loop_rows_give_the_same_training():
    loop, pfor = build_model(3), build_model(3)
    compile_and_fit(loop, 3, task_balancing=kt.UPGrad(shared="trunk"))
    pfor.compile(optimizer=keras.optimizers.SGD(0.1), loss={n: "mse" for n in "abc"},
                 loss_weights={"a": 0.5, "b": 2.0, "c": 1.0},
                 task_balancing=kt.UPGrad(shared="trunk"))
    pfor.tapeops_state.engine.jacobian_method = "pfor"
    x, ys, sw = make_data(3)
    pfor.fit(x, ys, sample_weight=sw, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert loop.tapeops_state.engine.jacobian_method == "loop"
    _weights_close(pfor.get_weights(), loop.get_weights(), atol=1e-6)
