"""The JAX backend (issue 32, first part): the step, the gradient transforms, refusals.

The JAX side runs in its own process (tests/jax_cases.py, KERAS_BACKEND=jax,
two host devices, TensorFlow unimportable); this process is the TensorFlow
side. Both start from the same NumPy weights and see the same batches
(tests/jax_models.py). Oracles: stock JAX `fit` (no options), a hand-written
jitted JAX loop (`jax.grad`, clip, SGD), the same options on TensorFlow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from jax_gan_models import (
    compared_cases,
    fit_gan,
    penalty_critic,
    penalty_inputs,
    players_state,
    points,
    r1_gan,
)
from jax_models import (
    compile_mixed_stop,
    BATCH,
    DP_CLIP,
    dp_cases,
    dp_mixed_optimizer,
    step_decay_class,
    EPOCHS,
    LR,
    data,
    decayed_optimizer,
    grouped_optimizers,
    group_schedule_callbacks,
    named_groups,
    initial_weights,
    logged_transforms,
    loss_terms,
    micro_batch_terms,
    make_batch_norm,
    make_mlp,
    make_regularized,
    nan_data,
    update_ratios,
    penalty_terms,
    sam_cases,
    scheduled_terms,
    transforms,
    two_nan_batches_data,
    with_extra_term,
)

pytest.importorskip("jax")

# The JAX step reads a few private attributes of Keras's JAX trainer, checked
# on Keras 3.15 (keras_tapeops/_keras/jax_trainer.py), and the cases use
# kt.optimizer_groups (Keras 3.15); `make test-oldest` runs Keras 3.10.
pytestmark = pytest.mark.skipif(
    tuple(int(p) for p in keras.version().split(".")[:2]) < (3, 15),
    reason="the JAX backend is supported on Keras >= 3.15",
)

HERE = Path(__file__).parent


def _tf_case(make, init, x, y, validation=None, optimizer=None, loss="mse", **options):
    """`(weights, History)` of `make(init)` compiled with `options` and fit on TensorFlow.

    `optimizer` is an optimizer, a function of the model, or None (SGD);
    `validation` is a `(x, y)` pair, True for the first 32 examples, or None.
    """
    model = make(init)
    if callable(optimizer) and not isinstance(optimizer, keras.optimizers.Optimizer):
        optimizer = optimizer(model)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(LR), loss=loss, **options)
    if validation is True:
        validation = (x[:32], y[:32])
    extra = {} if validation is None else {"validation_data": validation}
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, **extra
    ).history
    return model.get_weights(), history


def _tf_mixed_precision_runs(init, x, y):
    """The TensorFlow runs under `mixed_float16` that the JAX ones are compared with."""
    clip = {"gradient_transforms": transforms(kt)}
    cases = {
        "clip_mixed": (make_mlp, x, y, clip),
        "micro3_clip_mixed": (make_mlp, x, y, {**clip, "micro_batches": 3}),
        "terms_mixed": (make_mlp, x, y, {"loss_terms": loss_terms(kt)}),
        "sam_mixed": (make_mlp, x, y, sam_cases(kt)["sam"]),
        "clip_value_mixed": (make_mlp, x, y, {"gradient_transforms": [kt.ClipByValue(0.01)]}),
        "skip_mixed": (
            make_mlp,
            *nan_data(),
            {"gradient_transforms": [kt.SkipNonFinite(), *transforms(kt)]},
        ),
        "accumulation3_mixed": (make_mlp, x, y, {**clip, "accumulation_steps": 3}),
        "dp_mixed": (make_mlp, x, y, {**dp_cases(kt)["dp"], "optimizer": dp_mixed_optimizer()}),
    }
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return {
            name: _tf_case(make, init, xx, yy, **options)
            for name, (make, xx, yy, options) in cases.items()
        }
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _tf_runs(init, x, y):
    """The float32 TensorFlow runs the JAX ones are compared with."""
    clip = {"gradient_transforms": transforms(kt)}
    nan_x, nan_y = nan_data()
    clean = np.r_[0:BATCH, 2 * BATCH : 4 * BATCH]
    runs = {
        "micro3_clip": _tf_case(make_mlp, init, x, y, **clip, micro_batches=3),
        "scheduled_validation": _tf_case(
            make_mlp, init, x, y, True, loss_terms=scheduled_terms(kt)
        ),
        "batch_norm_micro": _tf_case(
            make_batch_norm, init, x, y, micro_batches=4, batch_norm_updates="per_micro_batch"
        ),
        "batch_norm_micro_large": _tf_case(make_batch_norm, init, x, y, micro_batches=3),
        "groups": _tf_case(
            make_mlp, init, x, y, optimizer=lambda m: grouped_optimizers(kt, m), **clip
        ),
        "terms": _tf_case(make_mlp, init, x, y, True, **clip, loss_terms=loss_terms(kt)),
        "log_norms": _tf_case(
            make_mlp, init, x, y, True, gradient_transforms=logged_transforms(kt)
        ),
        "penalties": _tf_case(make_mlp, init, x, y, True, loss_terms=penalty_terms(kt)),
        "terms_micro3": _tf_case(
            make_mlp, init, x, y, True, loss_terms=micro_batch_terms(kt), micro_batches=3
        ),
        "extra_term_micro2": _tf_case(
            lambda i: with_extra_term(kt, i),
            init,
            x,
            y,
            loss_terms=loss_terms(kt)[:1],
            micro_batches=2,
        ),
        "extra_term": _tf_case(
            lambda i: with_extra_term(kt, i), init, x, y, loss_terms=loss_terms(kt)[:1]
        ),
        "lr_decay_micro": _tf_case(
            make_mlp, init, x, y, optimizer=lambda m: decayed_optimizer(kt, m), micro_batches=2
        ),
        "skip": _tf_case(
            make_mlp,
            init,
            nan_x,
            nan_y,
            (nan_x[clean[-32:]], nan_y[clean[-32:]]),
            gradient_transforms=[kt.SkipNonFinite(), *transforms(kt)],
        ),
        "update_ratio": _tf_case(
            make_mlp,
            init,
            nan_x,
            nan_y,
            (nan_x[clean[-32:]], nan_y[clean[-32:]]),
            gradient_transforms=update_ratios(kt),
        ),
        "skip_batch_norm": _tf_case(
            make_batch_norm, init, nan_x, nan_y, gradient_transforms=[kt.SkipNonFinite()]
        ),
        "accumulation3": _tf_case(make_mlp, init, x, y, True, **clip, accumulation_steps=3),
        "accumulation2_micro2": _tf_case(
            make_mlp, init, x, y, accumulation_steps=2, micro_batches=2
        ),
        "accumulation3_sum": _tf_case(
            make_mlp,
            init,
            x,
            y,
            optimizer=keras.optimizers.SGD(LR / 16),
            loss=keras.losses.MeanSquaredError(reduction="sum"),
            accumulation_steps=3,
        ),
    }
    for name, options in sam_cases(kt).items():
        runs[name] = _tf_case(make_mlp, init, x, y, **options)
    for name, options in dp_cases(kt).items():
        runs[name] = _tf_case(make_mlp, init, x, y, True, **options)
    dp = dp_cases(kt)["dp"]
    runs["dp_nan"] = _tf_case(make_mlp, init, nan_x, nan_y, **dp)
    runs["dp_micro3"] = _tf_case(make_mlp, init, x, y, True, **dp, micro_batches=3)
    runs["dp_accum3_regularized"] = _tf_case(
        lambda w: make_regularized(w, activity=False), init, x, y, True, **dp, accumulation_steps=3
    )
    runs["dp_regularized"] = _tf_case(
        lambda w: make_regularized(w, activity=False), init, x, y, **dp
    )
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs the JAX cases in their own process while the TensorFlow side runs here."""
    out = tmp_path_factory.mktemp("jax")
    init = initial_weights()
    np.savez(out / "init.npz", *init)
    x, y = data()
    # The file the JAX cases load is written first; the rest runs alongside them.
    model = make_mlp(init)
    model.compile(
        optimizer=keras.optimizers.SGD(LR), loss="mse", gradient_transforms=transforms(kt)
    )
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    tf_runs = {"clip": (model.get_weights(), history)}
    model.save(out / "from_tf.keras")
    decay = step_decay_class(kt)
    model = make_mlp(init)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", gradient_transforms=[decay()])
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.save(out / "state_from_tf.keras")
    gan = r1_gan()
    fit_gan(gan, points(), epochs=1)
    gan.save(out / "gan_from_tf.keras")
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        # Two host devices (DataParallel x2); XLA's CPU kernels on one thread
        # each: for these tiny models the thread pool only costs CPU time that
        # the other xdist worker needs (about 8% of this process's).
        XLA_FLAGS=(
            f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
            " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        ),
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONPATH=str(HERE.parent),
    )
    with open(out / "jax_cases.log", "w+") as log:
        process = subprocess.Popen(
            [sys.executable, str(HERE / "jax_cases.py"), str(out), str(out / "init.npz")],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            continued = keras.saving.load_model(out / "from_tf.keras")
            continued.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
            tf_runs["tf_file_continued"] = (continued.get_weights(), None)
            tf_runs["state_uninterrupted"] = _tf_case(
                make_mlp, init, x, y, gradient_transforms=[decay()]
            )
            tf_runs.update(_tf_mixed_precision_runs(init, x, y))
            tf_runs.update(_tf_runs(init, x, y))
            returncode = process.wait(timeout=600)
            jax_file = out / "state_from_jax.keras"
            if returncode == 0 and jax_file.exists():
                continued = keras.saving.load_model(jax_file)
                continued.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
                tf_runs["state_jax_file_continued"] = (continued.get_weights(), None)
        finally:
            if process.poll() is None:
                process.kill()
        log.seek(0)
        assert returncode == 0, log.read()[-8000:]
    return out, tf_runs


def _jax(out, name):
    stored = np.load(out / f"{name}.npz")
    weights = [stored[f"w{i}"] for i in range(sum(k.startswith("w") for k in stored))]
    history = {k[2:]: stored[k] for k in stored if k.startswith("h_")}
    return weights, history


def _max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def _equal_jax_runs(out, name, reference):
    """The JAX runs `name` and `reference`: weights within 1e-6, History loss rtol 1e-6."""
    weights, history = _jax(out, name)
    expected, expected_history = _jax(out, reference)
    assert _max_diff(weights, expected) <= 1e-6, name
    np.testing.assert_allclose(history["loss"], expected_history["loss"], rtol=1e-6)


def _equals_tensorflow(out, tf_runs, name):
    """The JAX run `name` against TensorFlow's: weights within 1e-5, the same
    History keys, each entry within rtol 1e-5. Returns the JAX `(weights, history)`."""
    weights, history = _jax(out, name)
    tf_weights, tf_history = tf_runs[name]
    assert _max_diff(weights, tf_weights) <= 1e-5, name
    assert sorted(history) == sorted(tf_history), name
    for key in tf_history:
        np.testing.assert_allclose(
            history[key], tf_history[key], rtol=1e-5, err_msg=f"{name}: {key}"
        )
    return weights, history


def test_jax_path_runs_without_tensorflow_on_two_devices(runs):
    out, _ = runs
    report = json.loads((out / "report.json").read_text())
    assert report["backend"] == "jax" and report["devices"] == 2
    assert report["tensorflow_imported"] is False


def test_no_options_equals_stock_jax_fit_weights_and_history(runs):
    out, _ = runs
    _equal_jax_runs(out, "no_options", "stock")


def test_three_clip_groups_equal_the_hand_written_jax_loop(runs):
    out, _ = runs
    clipped, _ = _jax(out, "clip")
    hand, _ = _jax(out, "clip_hand")
    assert _max_diff(clipped, hand) <= 1e-6


def test_the_oracle_check_can_fail(runs):
    # Without the transforms the weights are far from the clipped loop's.
    out, _ = runs
    plain, _ = _jax(out, "no_options")
    hand, _ = _jax(out, "clip_hand")
    assert _max_diff(plain, hand) > 1e-3


def test_jax_clips_equal_the_same_options_on_tensorflow(runs):
    out, tf_runs = runs
    clipped, history = _jax(out, "clip")
    tf_weights, tf_history = tf_runs["clip"]
    assert _max_diff(clipped, tf_weights) <= 1e-5
    np.testing.assert_allclose(history["loss"], tf_history["loss"], rtol=1e-5)


def test_eager_and_steps_per_execution_equal_the_jitted_step(runs):
    out, _ = runs
    clipped, _ = _jax(out, "clip")
    assert _max_diff(_jax(out, "clip_eager")[0], clipped) <= 1e-6
    assert _max_diff(_jax(out, "clip_spe2")[0], clipped) <= 1e-6


def test_static_loss_scale_factor_is_divided_out_before_the_transforms(runs):
    # SGD(loss_scale_factor=8): Keras multiplies the loss by 8 and the optimizer
    # divides the gradients by 8; the clip thresholds act on true gradients.
    out, _ = runs
    _equal_jax_runs(out, "clip_static_scale", "clip")


def test_subclassed_model_and_transform_gradients_override(runs):
    out, _ = runs
    clipped, _ = _jax(out, "clip")
    assert _max_diff(_jax(out, "clip_subclassed")[0], clipped) <= 1e-6
    # Halving every gradient in the hook is SGD at half the learning rate.
    halved, _ = _jax(out, "halved_hook")
    assert _max_diff(halved, _jax(out, "half_learning_rate")[0]) <= 1e-6


def test_log_update_ratio_equals_tensorflow_with_skipped_steps(runs):
    # after_apply hooks on JAX: the ratio of the applied update (0 for the
    # step SkipNonFinite skips), in training only, on one device and two.
    out, tf_runs = runs
    weights, history = _equals_tensorflow(out, tf_runs, "update_ratio")
    assert {"update_ratio", "head_update_ratio", "skipped_steps"} <= set(history)
    assert "val_update_ratio" not in history
    assert np.all(history["update_ratio"] > 0)
    parallel, parallel_history = _jax(out, "update_ratio_data_parallel")
    assert _max_diff(parallel, weights) <= 1e-5
    np.testing.assert_allclose(parallel_history["update_ratio"], history["update_ratio"], rtol=1e-5)


def test_skip_non_finite_max_consecutive_stops_fit_as_on_tensorflow(runs):
    # Batches 1 and 2 are non-finite: with max_consecutive=2 fit stops with
    # the transform's message after the second, keeping the weights of batch
    # 0's step (RuntimeError on JAX, InvalidArgumentError on TensorFlow),
    # also when the run ends inside an execution of two steps.
    import tensorflow as tf

    out, _ = runs
    report = json.loads((out / "report.json").read_text())
    message = "SkipNonFinite: 2 steps in a row had non-finite true gradients"
    x, y = two_nan_batches_data()
    for name in ("stop", "stop_spe2"):
        assert report[f"{name}_error"].startswith(message), report[f"{name}_error"]
        assert report[f"{name}_iterations"] == 1
    model = make_mlp(initial_weights())
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss="mse",
        gradient_transforms=[kt.SkipNonFinite(max_consecutive=2)],
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    for name in ("stop", "stop_spe2"):
        stopped, _ = _jax(out, name)
        assert _max_diff(stopped, model.get_weights()) <= 1e-6, name
    # train_on_batch raises at the second nan batch and trains on after it.
    assert report["stop_train_on_batch"][:2] == ["trained", "trained"]
    assert report["stop_train_on_batch"][2] == message[:60]
    assert report["stop_train_on_batch"][3] == "trained"
    assert report["stop_train_on_batch_iterations"] == 2
    # Mixed precision, one execution of 4 steps: TensorFlow's assertion ends
    # the execution at batch 2 (whose overflow still halves the scale, as
    # batch 1's did: 1 -> 0.25); on JAX batch 3 then changes nothing, not
    # even the loss scale.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        mixed = compile_mixed_stop(kt, make_mlp(initial_weights()))
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            mixed.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert report["stop_mixed_error"].startswith(message)
    assert report["stop_mixed_scale"] == float(mixed.optimizer.dynamic_scale.numpy()) == 0.25
    assert report["stop_mixed_iterations"] == int(mixed.optimizer.iterations.numpy()) == 1
    assert _max_diff(_jax(out, "stop_mixed")[0], mixed.get_weights()) <= 1e-3
    # The check can fail: a limit of 3 is never reached (4 clean steps in 2 epochs).
    assert report["no_stop_error"] is None and report["no_stop_iterations"] == 4
    # After a stop, clean data trains on (the count resets) and the nan
    # batches stop it again after one more step.
    assert report["stop_then_clean_error"].startswith(message)
    assert report["clean_after_stop_error"] is None
    assert report["again_error"].startswith(message)
    assert [report[f"{n}_iterations"] for n in ("stop_then_clean", "clean_after_stop", "again")] == [
        1,
        5,
        6,
    ]


def test_skip_non_finite_equals_tensorflow_and_training_without_the_batch(runs):
    # Batch 1 of each epoch has a nan target: its step is skipped (weights,
    # optimizer and BatchNormalization statistics), which is training on the
    # three other batches; History logs `skipped_steps` (training only).
    out, tf_runs = runs
    weights, history = _equals_tensorflow(out, tf_runs, "skip")
    assert sorted(history) == ["loss", "skipped_steps", "val_loss"]
    np.testing.assert_array_equal(history["skipped_steps"], [1.0, 1.0])
    assert _max_diff(weights, _jax(out, "skip_oracle")[0]) <= 1e-6
    assert _max_diff(weights, _jax(out, "clip")[0]) > 1e-4  # the check can fail
    report = json.loads((out / "report.json").read_text())
    assert report["skip_iterations"] == 6
    batch_norm, _ = _jax(out, "skip_batch_norm")
    assert _max_diff(batch_norm, _jax(out, "skip_batch_norm_oracle")[0]) <= 1e-6
    assert _max_diff(batch_norm, tf_runs["skip_batch_norm"][0]) <= 1e-5
    assert _max_diff(_jax(out, "skip_data_parallel")[0], weights) <= 1e-5
    assert _max_diff(_jax(out, "skip_mixed")[0], tf_runs["skip_mixed"][0]) <= 5e-3


def test_data_parallel_on_two_devices_equals_one_device(runs):
    out, _ = runs
    clipped, _ = _jax(out, "clip")
    assert _max_diff(_jax(out, "clip_data_parallel")[0], clipped) <= 1e-5


def test_mixed_precision_transforms_see_unscaled_gradients(runs):
    # Scaled gradients (x 32768) would be clipped far harder than TF's.
    out, tf_runs = runs
    mixed, _ = _jax(out, "clip_mixed")
    assert _max_diff(mixed, tf_runs["clip_mixed"][0]) <= 5e-3
    # With micro-batches the float16 gradients overflow in fewer steps (one
    # fewer skipped step here, on both backends): compare with TF's micro run.
    micro = _jax(out, "micro3_clip_mixed")[0]
    assert _max_diff(micro, tf_runs["micro3_clip_mixed"][0]) <= 5e-3
    # ClipByValue alone would make an overflow finite: the LossScaleOptimizer
    # still skips it (fewer applied steps than batches), as on TensorFlow.
    clipped = _jax(out, "clip_value_mixed")[0]
    assert _max_diff(clipped, tf_runs["clip_value_mixed"][0]) <= 5e-3
    report = json.loads((out / "report.json").read_text())
    assert report["clip_value_mixed_applied"] < EPOCHS * 64 // BATCH


def test_saving_crosses_backends(runs):
    out, tf_runs = runs
    # A file saved on JAX loads here with its options and weights.
    loaded = keras.saving.load_model(out / "from_jax.keras")
    assert [repr(t) for t in loaded.tapeops_options.gradient_transforms] == [
        repr(t) for t in transforms(kt)
    ]
    assert _max_diff(loaded.get_weights(), _jax(out, "clip")[0]) <= 1e-6
    # TF's file, loaded on JAX and trained on, equals TF training on from it.
    report = json.loads((out / "report.json").read_text())
    assert report["loaded_options"] == [repr(t) for t in transforms(kt)]
    continued, _ = _jax(out, "tf_file_continued")
    assert _max_diff(continued, tf_runs["tf_file_continued"][0]) <= 1e-5


def test_micro_batches_equal_the_whole_batch(runs):
    out, _ = runs
    assert _max_diff(_jax(out, "micro4")[0], _jax(out, "stock")[0]) <= 1e-6
    np.testing.assert_allclose(
        _jax(out, "micro4")[1]["loss"], _jax(out, "stock")[1]["loss"], rtol=1e-6
    )
    clipped, _ = _jax(out, "clip")
    for name in ("micro3_clip", "micro3_clip_eager", "micro3_clip_data_parallel"):
        assert _max_diff(_jax(out, name)[0], clipped) <= 1e-6, name


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size", "mean_with_sample_weight"])
def test_micro_batches_are_exact_for_every_reduction(runs, reduction):
    # Sample weights, an L2 kernel regularizer and an L1 activity regularizer,
    # micro-batches of 5, 5 and 6.
    out, _ = runs
    micro, micro_history = _jax(out, f"{reduction}_micro")
    whole, whole_history = _jax(out, f"{reduction}_whole")
    assert _max_diff(micro, whole) <= 1e-6
    np.testing.assert_allclose(micro_history["loss"], whole_history["loss"], rtol=1e-6)
    other = "sum_over_batch_size" if reduction == "sum" else "sum"
    assert _max_diff(micro, _jax(out, f"{other}_whole")[0]) > 1e-4  # the check can fail


def test_micro_batches_keep_the_keras_mask_of_the_outputs(runs):
    # Embedding(mask_zero=True) -> Dense -> Dense: the compiled loss weights
    # the padded steps out on the whole batch and in micro-batches of 5, 5, 6
    # (before the masks travelled through the scan: 0.035 apart).
    out, _ = runs
    micro, micro_history = _jax(out, "masked_micro3")
    whole, whole_history = _jax(out, "masked_whole")
    assert _max_diff(micro, whole) <= 1e-6
    np.testing.assert_allclose(micro_history["loss"], whole_history["loss"], rtol=1e-6)


def test_micro_batches_equal_tensorflow_with_clips_and_batch_norm(runs):
    out, tf_runs = runs
    for name in ("micro3_clip", "batch_norm_micro"):
        assert _max_diff(_jax(out, name)[0], tf_runs[name][0]) <= 1e-5, name


def test_batch_norm_large_batch_merge_on_jax(runs):
    # The default batch_norm_updates="large_batch": one moving-statistics
    # update per batch with the whole batch's mean and variance. After one
    # step the moving statistics are stock Keras's (the weights are not: each
    # micro-batch is normalized with its own statistics); after two epochs
    # (micro-batches 5/5/6) the model equals TensorFlow's, and two devices
    # equal one.
    out, tf_runs = runs
    moving = slice(4, 6)  # the norm layer's moving mean and variance in get_weights()
    large = _jax(out, "batch_norm_one_step_large")[0]
    stock = _jax(out, "batch_norm_one_step_stock")[0]
    assert _max_diff(large[moving], stock[moving]) <= 1e-6  # measured: 5e-10
    assert _max_diff(large, stock) > 1e-4  # the weights differ: the check can fail
    weights = _jax(out, "batch_norm_micro_large")[0]
    assert _max_diff(weights, tf_runs["batch_norm_micro_large"][0]) <= 1e-5  # measured: 4e-7
    assert _max_diff(_jax(out, "batch_norm_micro_large_data_parallel")[0], weights) <= 1e-5
    # One update per micro-batch is another result.
    assert _max_diff(weights[moving], _jax(out, "batch_norm_micro")[0][moving]) > 1e-3


def test_optimizer_groups_and_layerwise_decay_equal_tensorflow(runs):
    out, tf_runs = runs
    for name in ("groups", "lr_decay_micro"):
        assert _max_diff(_jax(out, name)[0], tf_runs[name][0]) <= 1e-5, name


def test_loss_terms_equal_tensorflow_with_history_and_validation(runs):
    # An ActivationPenalty, a LossTerm(layers=[...]) reading the model's
    # weights, a training-only LossTerm; with the three clip groups.
    out, tf_runs = runs
    weights, history = _equals_tensorflow(out, tf_runs, "terms")
    tf_weights = tf_runs["terms"][0]
    assert "mean_output" in history and "val_mean_output" not in history
    assert _max_diff(_jax(out, "clip")[0], tf_weights) > 1e-4  # the terms change the result
    for name in ("terms_eager", "terms_data_parallel"):
        assert _max_diff(_jax(out, name)[0], weights) <= 1e-5, name
    assert _max_diff(_jax(out, "terms_mixed")[0], tf_runs["terms_mixed"][0]) <= 5e-3
    # A compute_terms override adds its own value on both backends.
    assert _max_diff(_jax(out, "extra_term")[0], tf_runs["extra_term"][0]) <= 1e-5


def test_log_gradient_norm_equals_tensorflow_and_is_training_only(runs):
    out, tf_runs = runs
    weights, history = _equals_tensorflow(out, tf_runs, "log_norms")
    assert sorted(history) == ["clipped_body_norm", "loss", "raw_norm", "raw_norm_max", "val_loss"]
    assert np.all(history["raw_norm_max"] > history["raw_norm"])
    data_parallel, data_parallel_history = _jax(out, "log_norms_data_parallel")
    assert _max_diff(data_parallel, weights) <= 1e-5
    np.testing.assert_allclose(data_parallel_history["raw_norm"], history["raw_norm"], rtol=1e-5)
    report = json.loads((out / "report.json").read_text())
    assert report["log_norms_evaluate"] == ["loss"]


@pytest.mark.parametrize("case", ["sam", "asam_where_clip", "sam_micro", "sam_terms"])
def test_sharpness_aware_equals_tensorflow(runs, case):
    out, tf_runs = runs
    weights, history = _equals_tensorflow(out, tf_runs, case)


def test_sharpness_aware_on_two_devices_in_mixed_precision_and_can_fail(runs):
    out, tf_runs = runs
    sam, _ = _jax(out, "sam")
    assert _max_diff(_jax(out, "sam_data_parallel")[0], sam) <= 1e-5
    assert _max_diff(_jax(out, "sam_mixed")[0], tf_runs["sam_mixed"][0]) <= 5e-3
    assert _max_diff(sam, _jax(out, "stock")[0]) > 1e-3  # SAM is not the plain step


def test_input_gradient_terms_equal_tensorflow(runs):
    # kt.GradientPenalty (in validation too) and an own term reading
    # context.input_gradients() with the default target (all outputs).
    out, tf_runs = runs
    weights, history = _equals_tensorflow(out, tf_runs, "penalties")
    assert {"gradient_penalty", "val_gradient_penalty", "input_gradient_square"} <= set(history)


def test_loss_terms_in_micro_batches_equal_tensorflow(runs):
    # Each term on its micro-batch, weighted by its size (5, 5, 6 of 16), as
    # on TensorFlow: input gradients, layer outputs, the compute_terms hook.
    out, tf_runs = runs
    weights, history = _equals_tensorflow(out, tf_runs, "terms_micro3")
    assert {"gradient_penalty", "batch_mean_square", "val_batch_mean_square"} <= set(history)
    assert _max_diff(_jax(out, "terms_micro3_data_parallel")[0], weights) <= 1e-5
    _equals_tensorflow(out, tf_runs, "extra_term_micro2")
    # The same terms on whole batches give another result: the check can fail.
    assert _max_diff(_jax(out, "terms_micro3_whole")[0], weights) > 1e-4


def test_loss_terms_saved_on_jax_load_on_tensorflow(runs):
    out, _ = runs
    loaded = keras.saving.load_model(out / "terms_from_jax.keras")
    assert [repr(t) for t in loaded.tapeops_options.loss_terms] == [repr(t) for t in loss_terms(kt)]


def test_scheduled_term_weight_in_validation_equals_tensorflow(runs):
    # weight = 0.5 / (1 + step), in_validation=True: the validation logs (and
    # evaluate() after fit) read the step training reached, as TensorFlow's.
    out, tf_runs = runs
    report = json.loads((out / "report.json").read_text())
    _, history = _equals_tensorflow(out, tf_runs, "scheduled_validation")
    assert "val_activation_penalty_body1" in history
    model = make_mlp(initial_weights())
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", loss_terms=scheduled_terms(kt))
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    expected = model.evaluate(x[:32], y[:32], verbose=0, return_dict=True)
    for key, value in expected.items():
        np.testing.assert_allclose(report["scheduled_evaluate"][key], value, rtol=1e-5, err_msg=key)
    # The check can fail: a step traced in as a constant would give one weight
    # for both epochs (after 4 steps it is 0.5 / 5, after 8 it is 0.5 / 9).
    first, last = history["val_activation_penalty_body1"]
    assert first / last > 1.5


def test_accumulation_equals_tensorflow_and_the_hand_written_loop(runs):
    # Windows of 3 batches and a flushed window of 1 each epoch, with the
    # three clip groups and validation; the hand loop clips each window's
    # sample-weighted mean gradient.
    out, tf_runs = runs
    weights, history = _equals_tensorflow(out, tf_runs, "accumulation3")
    assert sorted(history) == ["loss", "val_loss"]
    assert _max_diff(weights, _jax(out, "accumulation3_hand")[0]) <= 1e-6
    assert _max_diff(weights, _jax(out, "clip")[0]) > 1e-4  # the check can fail
    report = json.loads((out / "report.json").read_text())
    assert report["accumulation3_iterations"] == report["accumulation3_eager_iterations"] == 4
    assert _max_diff(_jax(out, "accumulation3_eager")[0], weights) <= 1e-6
    assert _max_diff(_jax(out, "accumulation3_data_parallel")[0], weights) <= 1e-5


def test_accumulation_sum_micro_batches_and_mixed_precision_equal_tensorflow(runs):
    out, tf_runs = runs
    for name in ("accumulation3_sum", "accumulation2_micro2"):
        assert _max_diff(_jax(out, name)[0], tf_runs[name][0]) <= 1e-5, name
    mixed = _jax(out, "accumulation3_mixed")[0]
    assert _max_diff(mixed, tf_runs["accumulation3_mixed"][0]) <= 5e-3


def test_group_learning_rate_callbacks_on_jax_equal_tensorflow(runs):
    # GroupLearningRateScheduler (the body's rate halved each epoch, logged)
    # and GroupReduceLROnPlateau (the head's halved when the loss does not
    # drop by 10) on kt.optimizer_groups: the same weights and History.
    out, _ = runs
    model = make_mlp(initial_weights())
    model.compile(optimizer=named_groups(kt, model), loss="mse")
    history = model.fit(
        *data(), batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
        callbacks=group_schedule_callbacks(kt),
    ).history
    weights, logged = _jax(out, "group_schedules")
    assert _max_diff(weights, model.get_weights()) <= 1e-5
    for key, values in history.items():
        np.testing.assert_allclose(logged[key], values, rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(logged["lr/body"], [0.005, 0.0025, 0.000625], rtol=1e-6)
    np.testing.assert_allclose(logged["lr/head"], [0.05, 0.05, 0.025], rtol=1e-6)


def test_accumulation_weighted_and_masked_windows_equal_stock_large_batches(runs):
    # Windows of 3 batches normalized by the sum of the sample weights, or by
    # the unmasked entries (Embedding(mask_zero=True), both mean reductions),
    # equal stock Keras on batches 3x the size. The masked case was 0.003
    # off before: its masks did not leave the traced loss, so the window
    # weighted the batches by their sample counts.
    out, _ = runs
    for name in ("weighted", "masked", "masked_weighted"):
        window = _jax(out, f"accumulation3_{name}")[0]
        stock = _jax(out, f"accumulation3_{name}_stock")[0]
        assert _max_diff(window, stock) <= 1e-6, name  # measured: 6e-8
    # The check can fail: stock large batches without the sample weights.
    unweighted = _jax(out, "accumulation3_unweighted_stock")[0]
    assert _max_diff(_jax(out, "accumulation3_weighted")[0], unweighted) > 1e-3


@pytest.mark.parametrize(
    "case, message",
    [
        ("weighted_terms", "a 'mean_with_sample_weight' loss with sample weights (normalized "
         "by the sum of the weights) next to more than one output or loss, loss terms"),
        ("sum_regularized", "({'loss': 'sum'} and regularization losses)"),
        ("unreduced", "cannot split a loss that is not reduced"),
    ],
)
def test_accumulation_refuses_what_it_cannot_weight_before_training(runs, case, message):
    out, _ = runs
    refusals = json.loads((out / "report.json").read_text())["accumulation_refusals"]
    assert refusals[case] is not None and message in refusals[case], case
    assert "accumulation_steps=3" in refusals[case]
    assert refusals[f"{case}_weights_kept"]


@pytest.mark.parametrize(
    "option",
    [
        "task_balancing",
        "sample_selection",
        "adversarial_training",
    ],
)
def test_options_jax_lacks_are_refused_by_name(runs, option):
    out, _ = runs
    report = json.loads((out / "report.json").read_text())
    message = report["refusals"][option]
    assert message is not None, option
    assert message.startswith(f"`{option}` is not available on the JAX backend yet")
    assert "Received: " + option in message
    assert all(report["weights_kept"])
    assert "kt.PCGrad is not available on the jax backend" in report["missing_name"]
    assert report["missing_callback"].startswith(
        "kt.callbacks.Sharpness is not available on the jax backend yet"
    )
    assert "kt.callbacks.GroupLearningRateScheduler" in report["missing_callback"]


# ---------------------------------------------------------------- DP-SGD
@pytest.mark.parametrize("name", ["dp", "dp_clip_transforms", "dp_regularized"])
def test_dp_sgd_equals_tensorflow_with_the_noise_off(runs, name):
    """Per-example gradients by jax.vmap equal TensorFlow's ghost norms (and its
    vectorized fallback, with the clip groups after), History included."""
    out, tf_runs = runs
    _equals_tensorflow(out, tf_runs, name)


def test_dp_sgd_in_mixed_precision_equals_tensorflow_to_float16_rounding(runs):
    """Under mixed_float16 (a loss scale that overflows neither backend) the runs agree
    to float16 rounding: JAX forms each example's gradient in float16, TensorFlow's
    ghost norms contract in float32. (At a higher scale JAX overflows first and its
    LossScaleOptimizer skips a step TensorFlow applies: docs/backends.md.)"""
    out, tf_runs = runs
    weights, history = _jax(out, "dp_mixed")
    tf_weights, tf_history = tf_runs["dp_mixed"]
    assert json.loads((out / "report.json").read_text())["dp_mixed_iterations"] == 8
    assert _max_diff(weights, tf_weights) <= 1e-4
    assert sorted(history) == sorted(tf_history)
    for key in tf_history:
        np.testing.assert_allclose(history[key], tf_history[key], rtol=1e-4, err_msg=key)


def test_dp_sgd_equals_the_hand_written_per_example_loop_and_can_fail(runs):
    out, _ = runs
    weights, history = _jax(out, "dp")
    hand, _ = _jax(out, "dp_hand")
    assert _max_diff(weights, hand) <= 1e-6
    assert _max_diff(_jax(out, "dp_eager")[0], hand) <= 1e-6  # jit_compile=False
    assert history["dp_nonfinite_examples"].tolist() == [0.0, 0.0]
    # Without clipping (C = 1e6) the run ends elsewhere: the clip acts.
    unclipped, _ = _jax(out, "dp_unclipped")
    assert _max_diff(unclipped, hand) > 1e-2


def test_dp_sgd_equals_jax_privacy_clipped_grad(runs):
    """The same run with `jax_privacy.clipping.clipped_grad` (the test extra installs it):
    the mean of the clipped per-example gradients, SGD, noise off."""
    out, _ = runs
    report = json.loads((out / "report.json").read_text())
    if not report["jax_privacy_installed"]:
        pytest.skip("jax_privacy is not installed")
    reference, _ = _jax(out, "dp_jax_privacy")
    assert _max_diff(_jax(out, "dp")[0], reference) <= 1e-6
    assert _max_diff(_jax(out, "dp_unclipped")[0], reference) > 1e-2  # the check can fail


def test_dp_sgd_zeroes_a_nan_example_like_tensorflow(runs):
    out, tf_runs = runs
    weights, history = _equals_tensorflow(out, tf_runs, "dp_nan")
    assert all(np.isfinite(w).all() for w in weights)
    assert history["dp_nonfinite_examples"].tolist() == [1.0, 1.0]


def test_dp_sgd_in_micro_batches_equals_the_whole_batch_and_tensorflow(runs):
    # The per-example gradients of 5, 5 and 6 examples at a time: the same
    # clipped sum, seeded noise and zeroed NaN example as in one pass, and
    # TensorFlow's micro-batched DP-SGD (History with validation too).
    out, tf_runs = runs
    weights, _ = _equals_tensorflow(out, tf_runs, "dp_micro3")
    assert _max_diff(weights, _jax(out, "dp")[0]) <= 1e-6
    assert _max_diff(_jax(out, "dp_micro3_data_parallel")[0], weights) <= 1e-6
    noisy, _ = _jax(out, "dp_noise_micro3")
    assert _max_diff(noisy, _jax(out, "dp_noise")[0]) <= 1e-6
    nan_weights, nan_history = _jax(out, "dp_nan_micro3")
    assert _max_diff(nan_weights, _jax(out, "dp_nan")[0]) <= 1e-6
    assert nan_history["dp_nonfinite_examples"].tolist() == [1.0, 1.0]
    np.testing.assert_allclose(nan_history["loss"], _jax(out, "dp_nan")[1]["loss"], rtol=1e-6)


def test_dp_sgd_accumulation_noises_once_per_applied_step(runs):
    # Windows of 2 batches of 8 are the steps of batches of 16: the same
    # clipped sum, and the same noise, drawn once per applied step and
    # divided by the window's samples. Windows of 3 (the epoch's last batch
    # flushed alone) with a regularizer equal TensorFlow's.
    out, tf_runs = runs
    assert _max_diff(_jax(out, "dp_accum2_b8")[0], _jax(out, "dp")[0]) <= 1e-6
    noisy, _ = _jax(out, "dp_noise_accum2_b8")
    assert _max_diff(noisy, _jax(out, "dp_noise")[0]) <= 1e-6
    assert _max_diff(_jax(out, "dp_noise_accum2_b8_static")[0], noisy) <= 1e-6
    assert _max_diff(noisy, _jax(out, "dp_accum2_b8")[0]) > 1e-2  # the noise is there
    weights, _ = _equals_tensorflow(out, tf_runs, "dp_accum3_regularized")
    assert _max_diff(weights, tf_runs["dp_regularized"][0]) > 1e-4  # windows change the steps


def test_dp_sgd_on_two_devices_equals_one_device_with_and_without_noise(runs):
    out, _ = runs
    for one, two in [("dp", "dp_data_parallel"), ("dp_noise", "dp_noise_data_parallel")]:
        assert _max_diff(_jax(out, one)[0], _jax(out, two)[0]) <= 1e-6, two


def test_dp_sgd_noise_is_seeded_and_has_the_promised_scale(runs):
    """A seed reproduces the run; one step's noise is N(0, (C sigma)^2) per weight."""
    out, _ = runs
    noisy, _ = _jax(out, "dp_noise")
    assert _max_diff(noisy, _jax(out, "dp_noise_again")[0]) == 0.0
    # SGD(loss_scale_factor=8): the clip and the noise act on true gradients.
    assert _max_diff(noisy, _jax(out, "dp_noise_static_scale")[0]) <= 1e-6
    assert _max_diff(noisy, _jax(out, "dp")[0]) > 1e-2  # the noise is there
    stats = json.loads((out / "report.json").read_text())["dp_noise"]
    stddev = DP_CLIP * 2.0
    assert abs(stats["std"] / stddev - 1.0) < 0.15, stats
    assert abs(stats["mean"]) < 5 * stddev / np.sqrt(stats["n"]), stats


@pytest.mark.parametrize(
    "case, message",
    [
        ("loss_terms", "DPSGD cannot be combined with `loss_terms`"),
        ("sum_loss", "DPSGD needs mean-reduced losses"),
        ("batch_norm", "DPSGD cannot train layers that mix the examples of a batch"),
        ("activity_regularizer", "DPSGD cannot clip losses added in the forward pass"),
        ("sample_weight", "DPSGD does not support sample_weight or class_weight"),
    ],
)
def test_dp_sgd_refusals_on_jax_name_the_cause_before_any_weight_changes(runs, case, message):
    out, _ = runs
    report = json.loads((out / "report.json").read_text())
    assert report["dp_refusals"][case] is not None and message in report["dp_refusals"][case]
    assert "Received:" in report["dp_refusals"][case]
    assert report["dp_weights_kept"][case], case


# ------------------------------------------------------ transform training state
def test_transform_training_state_is_saved_on_jax_and_crosses_backends(runs):
    """A transform's state (StepDecay's step count) comes back with `load_model`:
    resumed on JAX, JAX's file on TensorFlow and TensorFlow's on JAX all equal the
    uninterrupted run; the weights alone (state reset) end elsewhere."""
    out, tf_runs = runs
    uninterrupted, _ = _jax(out, "state_uninterrupted")
    tf_uninterrupted, _ = tf_runs["state_uninterrupted"]
    assert _max_diff(uninterrupted, tf_uninterrupted) <= 1e-5
    assert _max_diff(_jax(out, "state_resumed")[0], uninterrupted) <= 1e-6
    report = json.loads((out / "report.json").read_text())
    assert report["state_steps"] == 2 * 64 / BATCH
    assert _max_diff(_jax(out, "state_tf_file_continued")[0], uninterrupted) <= 1e-5
    assert _max_diff(tf_runs["state_jax_file_continued"][0], tf_uninterrupted) <= 1e-5
    assert _max_diff(_jax(out, "state_weights_only")[0], uninterrupted) > 1e-3


# ------------------------------------------------------------------ GANs
def _gan_weights(out, name):
    stored = np.load(out / f"{name}.npz")
    return [stored[f"w{i}"] for i in range(sum(k.startswith("w") for k in stored))]


@pytest.fixture(scope="module")
def tf_gans():
    """The TensorFlow runs of the GAN cases (same weights, batches and draws)."""
    runs = {}
    for name, make, x, targets in compared_cases():
        gan = make()
        history = fit_gan(gan, x, targets)
        runs[name] = (gan.get_weights(), history)
    return runs


@pytest.mark.parametrize(
    "name", ["gan_wgangp", "gan_r1", "gan_conditional", "gan_hinge", "gan_stateful"]
)
def test_gan_equals_tensorflow(runs, tf_gans, name):
    # WGANGP (2 critic steps, penalty, clipped critic), R1 with Adam and a
    # clipped generator, a conditional hinge GAN, the players' stateful
    # transforms on data with a nan (a gate skipping the discriminator's
    # updates, a logged norm, an after_apply hook): the same weights and
    # History as TensorFlow.
    out, _ = runs
    weights, history = tf_gans[name]
    assert _max_diff(_gan_weights(out, name), weights) <= 1e-6  # measured: at most 6e-8
    stored = np.load(out / f"{name}.npz")
    for key, values in history.items():
        np.testing.assert_allclose(stored[f"h_{key}"], values, rtol=1e-5, atol=1e-6, err_msg=key)


def test_gan_equals_the_hand_written_jax_loop(runs):
    # The seed-style loop: jax.grad of each player's hinge loss, SGD, jitted.
    out, _ = runs
    hand = np.load(out / "gan_hinge_hand.npz")
    hand = [hand[f"arr_{i}"] for i in range(len(hand.files))]
    fitted = _gan_weights(out, "gan_hinge")
    assert _max_diff(fitted, hand) <= 1e-6
    # The check can fail: another model's run is far from it.
    assert _max_diff(_gan_weights(out, "gan_wgangp"), hand) > 1e-2


def test_gan_on_two_devices_and_in_mixed_precision(runs):
    out, _ = runs
    report = json.loads((out / "report.json").read_text())
    for name in ("gan_wgangp", "gan_r1", "gan_stateful"):
        one = _gan_weights(out, name)
        assert _max_diff(_gan_weights(out, f"{name}_data_parallel"), one) <= 1e-6, name
    stateful = np.load(out / "gan_stateful.npz")
    assert list(stateful["h_d_skipped"]) == [2.0, 2.0]  # the nan batch, each epoch
    assert all(np.all(np.isfinite(w)) for w in _gan_weights(out, "gan_stateful"))
    assert report["gan_mixed_optimizer"] == "LossScaleOptimizer"
    mixed = _gan_weights(out, "gan_r1_mixed")
    assert all(np.all(np.isfinite(w)) for w in mixed)
    assert _max_diff(mixed, _gan_weights(out, "gan_r1")) <= 1e-3  # measured: 1.4e-4
    assert report["gan_evaluate"].keys() == {"discriminator_loss", "generator_loss"}


def test_gan_player_static_loss_scale_factor_is_divided_out(runs):
    # SGD(loss_scale_factor=8) for the clipped generator: ClipByNorm acts on
    # its true gradients, so the run equals the one without the factor.
    out, _ = runs
    plain = _gan_weights(out, "gan_clip_sgd")
    assert _max_diff(_gan_weights(out, "gan_clip_sgd_static_scale"), plain) <= 1e-6


def test_gan_files_cross_backends(runs, tf_gans, tmp_path):
    # One epoch, save, load, one more: equal to two epochs uninterrupted,
    # whichever backend saved and whichever continued (Adam state included).
    out, _ = runs
    uninterrupted, _ = tf_gans["gan_r1"]
    assert _max_diff(_gan_weights(out, "gan_r1_resumed"), uninterrupted) <= 1e-5
    assert _max_diff(_gan_weights(out, "gan_tf_file_continued"), uninterrupted) <= 1e-5
    continued = keras.saving.load_model(out / "gan_from_jax.keras")
    fit_gan(continued, points(), epochs=1)
    assert _max_diff(continued.get_weights(), uninterrupted) <= 1e-5


def test_gan_players_transform_state_is_saved_and_restored(runs):
    # As test_gan_general's TensorFlow test: every discriminator update of two
    # all-NaN batches is skipped, the count survives a reload on JAX and goes
    # on (2 -> 3), and the JAX file continues the count on TensorFlow too.
    out, _ = runs
    report = json.loads((out / "report.json").read_text())
    key = "discriminator.0.SkipNonFinite.consecutive_skips"
    assert report["gan_skips_saved"] == report["gan_skips_loaded"] == {key: 2.0}
    assert report["gan_skips_continued"] == {key: 3.0}
    on_tensorflow = keras.saving.load_model(out / "gan_skips.keras")
    assert players_state(on_tensorflow) == {key: 2.0}
    fit_gan(on_tensorflow, np.full((4, 2), np.nan, "float32"), epochs=1)
    assert players_state(on_tensorflow) == {key: 3.0}


def test_gan_default_noise_and_refusals(runs):
    out, _ = runs
    report = json.loads((out / "report.json").read_text())
    assert report["gan_default_noise_repeats"] and report["gan_default_noise_finite"]
    assert len(set(report["gan_default_noise_losses"])) == 2
    assert report["gan_unseeded_error"] is not None  # unseeded keras.random under jit
    assert report["gan_unseeded_weights_kept"]
    assert report["gan_hook_refusal"].startswith(
        "`discriminator_train_step` is a hook of the TensorFlow GAN step"
    )
    assert "Received: TapeHook.discriminator_train_step" in report["gan_hook_refusal"]
    assert report["gan_transform_refusal"].startswith(
        "A GAN player's kt.SkipNonFinite(max_consecutive=...) stops training"
    )


# ------------------------------------------------ kt.gradient_penalty on JAX
def test_gradient_penalty_function_on_jax_equals_tensorflow(runs):
    # The same critic, inputs and alpha: the value and its gradient w.r.t.
    # the critic's weights (JAX: jax.grad through the input gradient, under
    # jit; TensorFlow: nested tapes).
    import tensorflow as tf

    out, _ = runs
    stored = np.load(out / "penalty_function.npz")
    critic = penalty_critic()
    real, fake, alpha = penalty_inputs()
    with tf.GradientTape() as tape:
        value = kt.gradient_penalty(critic, real, fake, alpha=alpha)
    grads = tape.gradient(value, critic.trainable_variables)
    np.testing.assert_allclose(stored["value"], value.numpy(), rtol=1e-6)
    np.testing.assert_allclose(stored["eager"], value.numpy(), rtol=1e-6)
    # The last bias does not reach the input gradient: None on TensorFlow, zeros on JAX.
    assert grads[-1] is None and not np.any(stored[f"g{len(grads) - 1}"])
    for i, grad in enumerate(grads[:-1]):
        np.testing.assert_allclose(stored[f"g{i}"], grad.numpy(), rtol=1e-5, atol=1e-7)
    # The check can fail: another target is another value.
    other = kt.gradient_penalty(critic, real, fake, alpha=alpha, target=0.0)
    assert abs(float(other) - float(stored["value"])) > 1e-2


def test_gradient_penalty_function_in_a_custom_jax_train_step(runs):
    # A custom JAX train_step (stateless_call, jax.value_and_grad) adding
    # kt.gradient_penalty to its loss trains in fit like the hand-written
    # jax.grad loop of the same formulas.
    out, _ = runs
    report = json.loads((out / "report.json").read_text())
    fitted = np.load(out / "penalty_in_fit.npz")
    hand = np.load(out / "penalty_hand.npz")
    fitted = [fitted[f"arr_{i}"] for i in range(len(fitted.files))]
    hand = [hand[f"arr_{i}"] for i in range(len(hand.files))]
    assert _max_diff(fitted, hand) <= 1e-6  # measured: 1.5e-8
    assert _max_diff(penalty_critic().get_weights(), hand) > 1e-3  # it trained
    # alpha=None with an int seed: the same draw under jit and eagerly, and
    # another seed draws another; unseeded under jit: Keras's JAX RNG error.
    jitted, eager, other = report["penalty_seeded"]
    assert abs(jitted - eager) <= 1e-6 and abs(other - eager) > 1e-4
    assert report["penalty_unseeded_error"].startswith("ValueError: [JAX RNG]")


def test_privacy_budget_on_jax_stops_where_tensorflow_does(runs):
    # tests/test_privacy_accounting.py's run on JAX: epsilon after each epoch,
    # and no step past the target (the 7th would exceed it), with the rate
    # inferred from the steps, and given with steps_per_execution=2; with
    # accumulation_steps=2 on batches of 4 (the window's 8 examples per step).
    out, _ = runs
    report = json.loads((out / "report.json").read_text())
    target = kt.privacy.epsilon(6, 0.25, 0.8, accountant="rdp")
    first = kt.privacy.epsilon(4, 0.25, 0.8, accountant="rdp")
    for key in ("budget_spe1", "budget_spe2", "budget_accum2"):
        assert report[key]["iterations"] == 6, key
        np.testing.assert_allclose(report[key]["epsilon"], [first, target], rtol=1e-12)
        assert report[key]["loss_logged"] == 2  # the stopped epoch logs its metrics
    assert report["budget_mask_refusal"].startswith(
        "PrivacyBudget cannot infer the sampling rate of masked batches"
    )
    assert report["budget_mask_weights_kept"]
