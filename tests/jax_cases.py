"""The JAX backend's cases, run in a process of their own (tests/test_jax_backend.py).

Run as `python tests/jax_cases.py OUT_DIR [INIT.npz]` with `KERAS_BACKEND=jax`
and two host devices (`XLA_FLAGS=--xla_force_host_platform_device_count=2`).
TensorFlow is made unimportable first: the JAX path must not need it. Each
case writes its final weights and History to `OUT_DIR/<case>.npz`, and
`OUT_DIR/report.json` holds the messages and facts the test checks. The
initial weights come from the test (INIT.npz), so the TensorFlow side starts
from the same ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path


class _NoTensorFlow:
    """A meta-path finder that refuses `import tensorflow` in this process."""

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ImportError(f"TensorFlow is unimportable in the JAX cases ({name})")
        return None


sys.meta_path.insert(0, _NoTensorFlow())
os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from jax_gan_cases import gan_cases  # noqa: E402
from jax_penalty_cases import penalty_function_cases  # noqa: E402
from jax_models import (  # noqa: E402
    compile_mixed_stop,
    DP_CLIP,
    dp_cases,
    dp_mixed_optimizer,
    step_decay_class,
    BATCH,
    EPOCHS,
    LR,
    data,
    decayed_optimizer,
    grouped_optimizers,
    group_schedule_callbacks,
    named_groups,
    logged_transforms,
    loss_terms,
    make_masked,
    masked_data,
    micro_batch_terms,
    make_batch_norm,
    make_mlp,
    make_regularized,
    nan_data,
    update_ratios,
    penalty_terms,
    sample_weights,
    sam_cases,
    scheduled_terms,
    transforms,
    two_nan_batches_data,
    with_extra_term,
)


@contextlib.contextmanager
def data_parallel(devices):
    """`keras.distribution.DataParallel` over `devices` inside the block, none after."""
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        yield
    finally:
        keras.distribution.set_distribution(None)


def fit(model, x, y, **kwargs):
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, **kwargs)
    return history.history


def save_case(out, name, model, history):
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    arrays.update({f"h_{k}": np.asarray(v) for k, v in history.items()})
    np.savez(out / f"{name}.npz", **arrays)


def compiled(model, jit_compile=True, optimizer=None, **options):
    model.compile(
        optimizer=optimizer or keras.optimizers.SGD(LR),
        loss="mse",
        jit_compile=jit_compile,
        **options,
    )
    return model


def refused(model, action):
    """`(message, weights_kept)`: the ValueError `action()` raised (None if none), and
    whether `model`'s weights are what they were before."""
    before = [w.copy() for w in model.get_weights()]
    try:
        action()
        message = None
    except ValueError as error:
        message = str(error)
    return message, all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def _clipped(grads, layers):
    """The three clip groups of `jax_models.transforms`, written out."""
    out = []
    body = [g for g, name in zip(grads, layers) if name.startswith("body")]
    global_norm = jax.numpy.sqrt(sum(jax.numpy.sum(g * g) for g in body))
    for g, name in zip(grads, layers):
        if name == "head":  # ClipByNorm(0.05, where="head")
            g = g * 0.05 / jax.numpy.maximum(jax.numpy.linalg.norm(g.ravel()), 0.05)
        if name.startswith("body"):  # ClipByGlobalNorm(0.5, where="body*")
            g = g * 0.5 / jax.numpy.maximum(global_norm, 0.5)
        if name == "body2":  # ClipByValue(0.01, where="body2")
            g = jax.numpy.clip(g, -0.01, 0.01)
        out.append(g)
    return out


def hand_written_clip_loop(init, x, y, window=1):
    """The seed-style JAX loop: `jax.grad`, clip per selection, SGD apply (jitted).

    With `window > 1` it accumulates: the sample-weighted mean of `window`
    batches' gradients (fewer at the end of an epoch) is clipped and applied.
    """
    model = make_mlp(init)
    loss_fn = keras.losses.MeanSquaredError()
    layers = [v.path.split("/")[-2] for v in model.trainable_variables]  # body1, ..., head

    def loss_of(trainable, non_trainable, xb, yb):
        y_pred, _ = model.stateless_call(trainable, non_trainable, xb)
        return loss_fn(yb, y_pred)

    grad_of = jax.jit(jax.grad(loss_of))

    @jax.jit
    def apply(trainable, grads):
        return [w - LR * g for w, g in zip(trainable, _clipped(grads, layers))]

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    starts = list(range(0, len(x), BATCH))
    for _ in range(EPOCHS):
        for first in range(0, len(starts), window):
            total, count = None, 0
            for start in starts[first : first + window]:
                xb, yb = x[start : start + BATCH], y[start : start + BATCH]
                grads = [g * len(xb) for g in grad_of(trainable, non_trainable, xb, yb)]
                total = grads if total is None else [a + b for a, b in zip(total, grads)]
                count += len(xb)
            trainable = apply(trainable, [g / count for g in total])
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    return model


def accumulation_cases(out, init, x, y, report):
    """accumulation_steps: 4 batches an epoch in windows of 3 and 1 (flushed)."""
    validation = {"validation_data": (x[:32], y[:32])}
    for name, kwargs in [("accumulation3", {}), ("accumulation3_eager", {"jit_compile": False})]:
        model = compiled(
            make_mlp(init), gradient_transforms=transforms(kt), accumulation_steps=3, **kwargs
        )
        save_case(out, name, model, fit(model, x, y, **validation))
        report[f"{name}_iterations"] = int(model.optimizer.iterations.numpy())
    save_case(out, "accumulation3_hand", hand_written_clip_loop(init, x, y, window=3), {})
    model = compiled(make_mlp(init), accumulation_steps=2, micro_batches=2)
    save_case(out, "accumulation2_micro2", model, fit(model, x, y))
    model = make_mlp(init)
    model.compile(
        optimizer=keras.optimizers.SGD(LR / 16),
        loss=keras.losses.MeanSquaredError(reduction="sum"),
        accumulation_steps=3,
    )
    save_case(out, "accumulation3_sum", model, fit(model, x, y))
    with data_parallel(jax.devices()):
        model = compiled(make_mlp(init), gradient_transforms=transforms(kt), accumulation_steps=3)
        save_case(out, "accumulation3_data_parallel", model, fit(model, x, y, **validation))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = compiled(make_mlp(init), gradient_transforms=transforms(kt), accumulation_steps=3)
        save_case(out, "accumulation3_mixed", model, fit(model, x, y))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # Windows normalized by the sum of the sample weights and by the
    # unmasked entries: 3 batches make the step stock Keras takes on their
    # concatenation (stock fit with 3x the batch: windows 3 + 1 flushed).
    weighted = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    for name, window, batch, weights in [
        ("weighted", 3, BATCH, sample_weights()),
        ("weighted_stock", None, 3 * BATCH, sample_weights()),
        ("unweighted_stock", None, 3 * BATCH, None),
    ]:
        model = make_mlp(init, upgrade=window is not None)
        options = {} if window is None else {"accumulation_steps": window}
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=weighted, **options)
        history = model.fit(
            x, y, sample_weight=weights, batch_size=batch, epochs=EPOCHS,
            shuffle=False, verbose=0,
        )
        save_case(out, f"accumulation3_{name}", model, {"loss": history.history["loss"]})
    mx, my = masked_data()
    for name, window, batch, reduction in [
        ("masked", 3, 4, "sum_over_batch_size"),
        ("masked_stock", None, 12, "sum_over_batch_size"),
        ("masked_weighted", 3, 4, "mean_with_sample_weight"),
        ("masked_weighted_stock", None, 12, "mean_with_sample_weight"),
    ]:
        model = make_masked()
        options = {} if window is None else {"accumulation_steps": window}
        model.compile(
            optimizer=keras.optimizers.SGD(LR),
            loss=keras.losses.MeanSquaredError(reduction=reduction),
            **options,
        )
        model.fit(mx, my, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0)
        save_case(out, f"accumulation3_{name}", model, {})
    # What the window cannot weight exactly is refused before any weight changes.
    refusals = {}
    for name, make, loss, kwargs in [
        (
            "weighted_terms",
            lambda w: with_extra_term(kt, w),  # a compute_terms override: loss terms
            keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
            {"sample_weight": sample_weights()},
        ),
        ("sum_regularized", make_regularized, keras.losses.MeanSquaredError(reduction="sum"), {}),
        ("unreduced", make_mlp, keras.losses.MeanSquaredError(reduction=None), {}),
    ]:
        model = make(init)

        def compile_and_fit(model=model, loss=loss, kwargs=kwargs):
            model.compile(optimizer="sgd", loss=loss, accumulation_steps=3)
            fit(model, x, y, **kwargs)

        refusals[name], refusals[f"{name}_weights_kept"] = refused(model, compile_and_fit)
    report["accumulation_refusals"] = refusals


def skip_cases(out, init, report):
    """SkipNonFinite: batch 1 of every epoch has a nan target (its step is skipped)."""
    x, y = nan_data()
    clean = np.r_[0:BATCH, 2 * BATCH : 4 * BATCH]  # the batches without the nan
    validation = {"validation_data": (x[clean[-32:]], y[clean[-32:]])}
    skip = [kt.SkipNonFinite(), *transforms(kt)]
    model = compiled(make_mlp(init), gradient_transforms=skip)
    save_case(out, "skip", model, fit(model, x, y, **validation))
    report["skip_iterations"] = int(model.optimizer.iterations.numpy())
    # The oracle: stock training on the three clean batches of each epoch.
    model = compiled(make_mlp(init), gradient_transforms=transforms(kt))
    save_case(out, "skip_oracle", model, fit(model, x[clean], y[clean]))
    model = make_batch_norm(init)
    model.compile(
        optimizer=keras.optimizers.SGD(LR), loss="mse", gradient_transforms=[kt.SkipNonFinite()]
    )
    save_case(out, "skip_batch_norm", model, fit(model, x, y))
    model = make_batch_norm(init)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    save_case(out, "skip_batch_norm_oracle", model, fit(model, x[clean], y[clean]))
    model = compiled(make_mlp(init), gradient_transforms=update_ratios(kt))
    save_case(out, "update_ratio", model, fit(model, x, y, **validation))
    with data_parallel(jax.devices()):
        model = compiled(make_mlp(init), gradient_transforms=skip)
        save_case(out, "skip_data_parallel", model, fit(model, x, y))
        model = compiled(make_mlp(init), gradient_transforms=update_ratios(kt))
        save_case(out, "update_ratio_data_parallel", model, fit(model, x, y))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = compiled(make_mlp(init), gradient_transforms=skip)
        save_case(out, "skip_mixed", model, fit(model, x, y))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    stop_cases(out, init, report)


def stop_cases(out, init, report):
    """SkipNonFinite(max_consecutive=2): batches 1 and 2 are non-finite, so fit stops."""
    x, y = two_nan_batches_data()
    for name, limit, steps_per_execution in [
        ("stop", 2, 1),
        ("stop_spe2", 2, 2),  # the run ends inside the second execution
        ("no_stop", 3, 1),
    ]:
        model = make_mlp(init)
        model.compile(
            optimizer=keras.optimizers.SGD(LR),
            loss="mse",
            steps_per_execution=steps_per_execution,
            gradient_transforms=[kt.SkipNonFinite(max_consecutive=limit)],
        )
        try:
            history = fit(model, x, y)
            report[f"{name}_error"] = None
        except RuntimeError as error:
            history, report[f"{name}_error"] = {}, str(error)
        report[f"{name}_iterations"] = int(model.optimizer.iterations.numpy())
        save_case(out, name, model, history)
    # Under mixed precision with the loss scale at 1 (overflows count) and
    # one execution per epoch: the stop at batch 2 changes nothing after it,
    # not even the loss scale (batch 1's overflow halved it once).
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        stopped = compile_mixed_stop(kt, make_mlp(init))
        try:
            fit(stopped, x, y)
            report["stop_mixed_error"] = None
        except RuntimeError as error:
            report["stop_mixed_error"] = str(error)
        report["stop_mixed_scale"] = float(stopped.optimizer.dynamic_scale.numpy())
        report["stop_mixed_iterations"] = int(stopped.optimizer.iterations.numpy())
        save_case(out, "stop_mixed", stopped, {})
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # train_on_batch checks too: batches 0 (clean), 1, 2 (nan), then 3 (clean).
    stepped = make_mlp(init)
    stepped.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss="mse",
        gradient_transforms=[kt.SkipNonFinite(max_consecutive=2)],
    )
    outcomes = []
    for batch in range(4):
        rows = slice(batch * BATCH, (batch + 1) * BATCH)
        try:
            stepped.train_on_batch(x[rows], y[rows])
            outcomes.append("trained")
        except RuntimeError as error:
            outcomes.append(str(error)[:60])
    report["stop_train_on_batch"] = outcomes
    report["stop_train_on_batch_iterations"] = int(stepped.optimizer.iterations.numpy())
    # After a stop: clean data trains on; the nan batches stop it again.
    clean = np.nan_to_num(y)
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss="mse",
        gradient_transforms=[kt.SkipNonFinite(max_consecutive=2)],
    )
    for name, targets in [("stop_then_clean", y), ("clean_after_stop", clean), ("again", y)]:
        try:
            model.fit(x, targets, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            report[f"{name}_error"] = None
        except RuntimeError as error:
            report[f"{name}_error"] = str(error)
        report[f"{name}_iterations"] = int(model.optimizer.iterations.numpy())


def hand_written_dp_loop(init, x, y):
    """DP-SGD written out: `jax.grad` example by example (no vmap), clip, sum, mean, SGD."""
    model = make_mlp(init, upgrade=False)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(values, x_i, y_i):
        pred, _ = model.stateless_call(values, non_trainable, x_i[None])
        return jax.numpy.mean((pred - y_i[None]) ** 2)

    grad = jax.jit(jax.grad(loss))
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            total = [jax.numpy.zeros_like(w) for w in trainable]
            for i in range(start, start + BATCH):
                g = grad(trainable, x[i], y[i])
                norm = jax.numpy.sqrt(sum(jax.numpy.sum(t**2) for t in g))
                factor = jax.numpy.minimum(1.0, DP_CLIP / norm)
                total = [a + factor * b for a, b in zip(total, g)]
            trainable = [w - LR * t / BATCH for w, t in zip(trainable, total)]
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    return model


def jax_privacy_loop(init, x, y):
    """The DP-SGD run with `jax_privacy.clipped_grad` (noise off), or None without it."""
    try:
        from jax_privacy.clipping import clipped_grad
    except ImportError:
        return None
    model = make_mlp(init, upgrade=False)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(values, x_batch, y_batch):  # called on one example (batch axis kept)
        pred, _ = model.stateless_call(values, non_trainable, x_batch)
        return jax.numpy.mean((pred - y_batch) ** 2)

    mean_clipped = jax.jit(
        clipped_grad(loss, l2_clip_norm=DP_CLIP, batch_argnums=(1, 2), normalize_by=BATCH)
    )
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            g = mean_clipped(trainable, x[start : start + BATCH], y[start : start + BATCH])
            trainable = [w - LR * t for w, t in zip(trainable, g)]
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    return model


def privacy_cases(out, init, x, y, report):
    """DP-SGD: noise off (against TF and the hand loop), noise on, two devices, refusals."""
    validation = {"validation_data": (x[:32], y[:32])}
    for name, options in dp_cases(kt).items():
        model = compiled(make_mlp(init), **options)
        save_case(out, name, model, fit(model, x, y, **validation))
    save_case(out, "dp_hand", hand_written_dp_loop(init, x, y), {})
    reference = jax_privacy_loop(init, x, y)
    report["jax_privacy_installed"] = reference is not None
    if reference is not None:
        save_case(out, "dp_jax_privacy", reference, {})
    model = compiled(make_mlp(init), jit_compile=False, **dp_cases(kt)["dp"])
    save_case(out, "dp_eager", model, fit(model, x, y))
    model = compiled(make_mlp(init), differential_privacy=kt.DPSGD(1e6, 0.0))
    save_case(out, "dp_unclipped", model, fit(model, x, y))
    model = compiled(
        make_regularized(init, activity=False), differential_privacy=kt.DPSGD(DP_CLIP, 0.0)
    )
    save_case(out, "dp_regularized", model, fit(model, x, y))
    model = compiled(make_mlp(init), differential_privacy=kt.DPSGD(DP_CLIP, 0.0))
    save_case(out, "dp_nan", model, fit(model, *nan_data()))
    seeded = kt.DPSGD(DP_CLIP, 2.0, seed=11)
    for name in ("dp_noise", "dp_noise_again"):
        model = compiled(make_mlp(init), differential_privacy=seeded)
        save_case(out, name, model, fit(model, x, y))
    # micro_batches=3 (5, 5, 6 of 16): the same clipped sum, noise and zeroing.
    model = compiled(make_mlp(init), **dp_cases(kt)["dp"], micro_batches=3)
    save_case(out, "dp_micro3", model, fit(model, x, y, **validation))
    model = compiled(make_mlp(init), differential_privacy=seeded, micro_batches=3)
    save_case(out, "dp_noise_micro3", model, fit(model, x, y))
    model = compiled(make_mlp(init), **dp_cases(kt)["dp"], micro_batches=3)
    save_case(out, "dp_nan_micro3", model, fit(model, *nan_data()))
    # accumulation_steps: batches of 8 in windows of 2 make the steps of
    # batches of 16, with the same noise; windows of 3 (the epoch's fourth
    # batch flushed alone) with a regularizer.
    # With SGD(loss_scale_factor=8) the window's noise is added to true gradients.
    for name, privacy, optimizer in [
        ("dp_accum2_b8", dp_cases(kt)["dp"]["differential_privacy"], None),
        ("dp_noise_accum2_b8", seeded, None),
        ("dp_noise_accum2_b8_static", seeded, keras.optimizers.SGD(LR, loss_scale_factor=8.0)),
    ]:
        model = compiled(
            make_mlp(init), optimizer=optimizer, differential_privacy=privacy, accumulation_steps=2
        )
        history = model.fit(x, y, batch_size=BATCH // 2, epochs=EPOCHS, shuffle=False, verbose=0)
        save_case(out, name, model, history.history)
    model = compiled(
        make_regularized(init, activity=False),
        differential_privacy=kt.DPSGD(DP_CLIP, 0.0),
        accumulation_steps=3,
    )
    save_case(out, "dp_accum3_regularized", model, fit(model, x, y, **validation))
    # A static loss_scale_factor: each example's gradient is clipped unscaled.
    model = compiled(
        make_mlp(init),
        optimizer=keras.optimizers.SGD(LR, loss_scale_factor=8.0),
        differential_privacy=seeded,
    )
    save_case(out, "dp_noise_static_scale", model, fit(model, x, y))
    devices = jax.devices()
    with data_parallel(devices):
        model = compiled(make_mlp(init), **dp_cases(kt)["dp"])
        save_case(out, "dp_data_parallel", model, fit(model, x, y, **validation))
        model = compiled(make_mlp(init), differential_privacy=seeded)
        save_case(out, "dp_noise_data_parallel", model, fit(model, x, y))
        model = compiled(make_mlp(init), **dp_cases(kt)["dp"], micro_batches=3)
        save_case(out, "dp_micro3_data_parallel", model, fit(model, x, y))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_mlp(init)
        model.compile(optimizer=dp_mixed_optimizer(), loss="mse", **dp_cases(kt)["dp"])
        save_case(out, "dp_mixed", model, fit(model, x, y))
        report["dp_mixed_iterations"] = int(model.optimizer.iterations)
    finally:
        keras.mixed_precision.set_global_policy("float32")

    # The noise of one step, alone: (no noise - noise) * batch / lr, per weight.
    after = []
    for sigma in (0.0, 2.0):
        model = make_mlp(init)
        model.compile(
            optimizer=keras.optimizers.SGD(1.0),
            loss="mse",
            differential_privacy=kt.DPSGD(DP_CLIP, sigma, seed=5),
        )
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        after.append(np.concatenate([w.ravel() for w in model.get_weights()]))
    drawn = (after[0] - after[1]) * BATCH
    report["dp_noise"] = {"mean": float(drawn.mean()), "std": float(drawn.std()), "n": drawn.size}

    refusals, kept = {}, {}
    for name, make, options, fit_kwargs in [
        ("loss_terms", make_mlp, {"loss_terms": loss_terms(kt)[:1]}, None),
        ("sum_loss", make_mlp, {"loss": keras.losses.MeanSquaredError(reduction="sum")}, None),
        ("batch_norm", make_batch_norm, {}, None),
        ("activity_regularizer", make_regularized, {}, {}),
        ("sample_weight", make_mlp, {}, {"sample_weight": sample_weights()}),
    ]:
        model = make(init)

        def compile_and_fit(model=model, options=options, fit_kwargs=fit_kwargs):
            model.compile(
                **{"optimizer": keras.optimizers.SGD(LR), "loss": "mse", **options},
                differential_privacy=kt.DPSGD(DP_CLIP, 1.0),
            )
            if fit_kwargs is not None:
                fit(model, x, y, **fit_kwargs)

        refusals[name], kept[name] = refused(model, compile_and_fit)
    report["dp_refusals"], report["dp_weights_kept"] = refusals, kept


def training_state_cases(out, init, x, y, report):
    """A transform's training state is saved and loaded on JAX, and crosses backends."""
    decay = step_decay_class(kt)
    model = compiled(make_mlp(init), gradient_transforms=[decay()])
    save_case(out, "state_uninterrupted", model, fit(model, x, y))
    model = compiled(make_mlp(init), gradient_transforms=[decay()])
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.save(out / "state_from_jax.keras")
    loaded = keras.saving.load_model(out / "state_from_jax.keras")
    loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    save_case(out, "state_resumed", loaded, {})
    report["state_steps"] = float(loaded.tapeops_state.training_state_items()[0][1].numpy())
    # Weights alone (a fresh transform state) end elsewhere: the state matters.
    fresh = compiled(make_mlp(model.get_weights()), gradient_transforms=[decay()])
    fresh.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    save_case(out, "state_weights_only", fresh, {})
    tf_file = out / "state_from_tf.keras"
    if tf_file.exists():
        loaded = keras.saving.load_model(tf_file)
        loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        save_case(out, "state_tf_file_continued", loaded, {})


def budget_cases(report):
    """kt.callbacks.PrivacyBudget: epsilon logged, training stopped before the target."""
    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    y = np.random.default_rng(1).integers(0, 2, size=32)
    target = kt.privacy.epsilon(6, 0.25, 0.8, accountant="rdp")  # the 7th step exceeds it
    # Last: windows of two batches of 4 are the steps of batches of 8 (rate
    # inferred from the window's examples).
    for key, steps_per_execution, rate, accumulation in [
        ("budget_spe1", 1, None, 1),
        ("budget_spe2", 2, 0.25, 1),
        ("budget_accum2", 1, None, 2),
    ]:
        model = kt.upgrade(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
            differential_privacy=kt.DPSGD(1.0, 0.8),
            accumulation_steps=accumulation,
        )
        budget = kt.callbacks.PrivacyBudget(
            32, target_epsilon=target, accountant="rdp", sampling_rate=rate
        )
        history = model.fit(
            x, y, batch_size=8 // accumulation, epochs=5, callbacks=[budget], verbose=0
        ).history
        report[key] = {
            "iterations": int(model.optimizer.iterations.numpy()),
            "epsilon": [float(e) for e in history["epsilon"]],
            "loss_logged": len(history["loss"]),
        }
    # Masked batches: the rate cannot be inferred, so the first one is refused.
    mask = np.ones(32, bool)
    mask[::5] = False
    budget = kt.callbacks.PrivacyBudget(32, accountant="rdp")
    report["budget_mask_refusal"], report["budget_mask_weights_kept"] = refused(
        model,
        lambda: model.fit(
            x, y, sample_weight=mask, batch_size=8, callbacks=[budget], verbose=0
        ),
    )


def main():
    out = Path(sys.argv[1])
    init = list(np.load(sys.argv[2]).values())
    x, y = data()
    report = {"devices": len(jax.devices()), "backend": keras.backend.backend()}

    # Parity: no options is the stock JAX step (weights and History).
    stock = compiled(make_mlp(init, upgrade=False))
    save_case(out, "stock", stock, fit(stock, x, y))
    plain = compiled(kt.upgrade(make_mlp(init, upgrade=False)))
    save_case(out, "no_options", plain, fit(plain, x, y))

    # Three clip groups: fit, not jitted, steps_per_execution=2, and the hand loop.
    for name, kwargs in [
        ("clip", {}),
        ("clip_eager", {"jit_compile": False}),
    ]:
        model = compiled(make_mlp(init), gradient_transforms=transforms(kt), **kwargs)
        save_case(out, name, model, fit(model, x, y))
    model = make_mlp(init)
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss="mse",
        steps_per_execution=2,
        gradient_transforms=transforms(kt),
    )
    save_case(out, "clip_spe2", model, fit(model, x, y))
    # A static loss_scale_factor: the transforms see the unscaled gradients
    # (the optimizer divides the factor out again), as on TensorFlow.
    model = compiled(
        make_mlp(init),
        optimizer=keras.optimizers.SGD(LR, loss_scale_factor=8.0),
        gradient_transforms=transforms(kt),
    )
    save_case(out, "clip_static_scale", model, fit(model, x, y))
    save_case(out, "clip_hand", hand_written_clip_loop(init, x, y), {})

    # A mixed-precision run: the transforms see unscaled gradients.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = compiled(make_mlp(init), gradient_transforms=transforms(kt))
        save_case(out, "clip_mixed", model, fit(model, x, y))
        model = compiled(make_mlp(init), gradient_transforms=transforms(kt), micro_batches=3)
        save_case(out, "micro3_clip_mixed", model, fit(model, x, y))
        # ClipByValue alone makes an overflow finite: the step must still be skipped.
        model = compiled(make_mlp(init), gradient_transforms=[kt.ClipByValue(0.01)])
        save_case(out, "clip_value_mixed", model, fit(model, x, y))
        report["clip_value_mixed_applied"] = int(model.optimizer.inner_optimizer.iterations)
    finally:
        keras.mixed_precision.set_global_policy("float32")

    # DataParallel across the two host devices equals one device.
    devices = jax.devices()
    with data_parallel(devices):
        model = compiled(make_mlp(init), gradient_transforms=transforms(kt))
        save_case(out, "clip_data_parallel", model, fit(model, x, y))

    # micro_batches: even (4 of 4) and uneven (16 = 5 + 5 + 6) splits, jitted
    # and eager, on two devices; with the clip groups.
    model = compiled(make_mlp(init), micro_batches=4)
    save_case(out, "micro4", model, fit(model, x, y))
    for name, kwargs in [("micro3_clip", {}), ("micro3_clip_eager", {"jit_compile": False})]:
        model = compiled(
            make_mlp(init), gradient_transforms=transforms(kt), micro_batches=3, **kwargs
        )
        save_case(out, name, model, fit(model, x, y))
    with data_parallel(devices):
        model = compiled(make_mlp(init), gradient_transforms=transforms(kt), micro_batches=3)
        save_case(out, "micro3_clip_data_parallel", model, fit(model, x, y))

    # Every reduction, with sample weights and both regularizer kinds: the
    # micro-batch gradient is the whole batch's.
    weights = sample_weights()
    for reduction in ("sum", "sum_over_batch_size", "mean_with_sample_weight"):
        for name, kwargs in [("whole", {}), ("micro", {"micro_batches": 3})]:
            model = make_regularized(init)
            model.compile(
                optimizer=keras.optimizers.SGD(LR / 16),
                loss=keras.losses.MeanSquaredError(reduction=reduction),
                **kwargs,
            )
            save_case(out, f"{reduction}_{name}", model, fit(model, x, y, sample_weight=weights))

    # BatchNormalization: "large_batch" (the default: one merged update per
    # batch, uneven micro-batches 5/5/6), on two devices; one step against
    # stock; and one update per micro-batch (per_micro_batch).
    model = compiled(make_batch_norm(init), micro_batches=3)
    save_case(out, "batch_norm_micro_large", model, fit(model, x, y))
    with data_parallel(jax.devices()):
        model = compiled(make_batch_norm(init), micro_batches=3)
        save_case(out, "batch_norm_micro_large_data_parallel", model, fit(model, x, y))
    for name, options in [("large", {"micro_batches": 3}), ("stock", {})]:
        model = compiled(make_batch_norm(init), **options)
        model.train_on_batch(x[:BATCH], y[:BATCH])
        save_case(out, f"batch_norm_one_step_{name}", model, {})
    model = make_batch_norm(init)
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss="mse",
        micro_batches=4,
        batch_norm_updates="per_micro_batch",
    )
    save_case(out, "batch_norm_micro", model, fit(model, x, y))
    # A masked output (Embedding(mask_zero=True)): the masks travel through the scan.
    for name, k in [("masked_micro3", 3), ("masked_whole", 1)]:
        model = compiled(make_masked(), micro_batches=k)
        save_case(out, name, model, fit(model, *masked_data()))

    # Loss terms (History with validation, a compute_terms override), jitted
    # and eager, on two devices, in mixed precision; saved with the terms.
    for name, kwargs in [("terms", {}), ("terms_eager", {"jit_compile": False})]:
        model = compiled(
            make_mlp(init),
            gradient_transforms=transforms(kt),
            loss_terms=loss_terms(kt),
            **kwargs,
        )
        save_case(out, name, model, fit(model, x, y, validation_data=(x[:32], y[:32])))
    model.save(out / "terms_from_jax.keras")
    with data_parallel(devices):
        model = compiled(
            make_mlp(init), gradient_transforms=transforms(kt), loss_terms=loss_terms(kt)
        )
        save_case(
            out, "terms_data_parallel", model, fit(model, x, y, validation_data=(x[:32], y[:32]))
        )
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = compiled(make_mlp(init), loss_terms=loss_terms(kt))
        save_case(out, "terms_mixed", model, fit(model, x, y))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model = compiled(with_extra_term(kt, init), loss_terms=loss_terms(kt)[:1])
    save_case(out, "extra_term", model, fit(model, x, y))

    # Input-gradient terms (double backprop through a jax.vjp of the forward pass).
    model = compiled(make_mlp(init), loss_terms=penalty_terms(kt))
    save_case(out, "penalties", model, fit(model, x, y, validation_data=(x[:32], y[:32])))

    # Loss terms inside the micro-batch scan (an uneven split: 5, 5, 6), each
    # on its micro-batch; on two devices; the compute_terms hook; the same
    # terms on whole batches (differs: the check can fail).
    for name, options in [
        ("terms_micro3", {"micro_batches": 3}),
        ("terms_micro3_whole", {}),
    ]:
        model = compiled(make_mlp(init), loss_terms=micro_batch_terms(kt), **options)
        save_case(out, name, model, fit(model, x, y, validation_data=(x[:32], y[:32])))
    with data_parallel(devices):
        model = compiled(make_mlp(init), loss_terms=micro_batch_terms(kt), micro_batches=3)
        save_case(out, "terms_micro3_data_parallel", model, fit(model, x, y))
    model = compiled(with_extra_term(kt, init), loss_terms=loss_terms(kt)[:1], micro_batches=2)
    save_case(out, "extra_term_micro2", model, fit(model, x, y))

    # A weight scheduled on the step, in validation too: evaluation reads the
    # step the training reached (carried into the evaluation step).
    model = compiled(make_mlp(init), loss_terms=scheduled_terms(kt))
    save_case(out, "scheduled_validation", model, fit(model, x, y, validation_data=(x[:32], y[:32])))
    report["scheduled_evaluate"] = model.evaluate(x[:32], y[:32], verbose=0, return_dict=True)

    # LogGradientNorm: logged in training only, on one device and two.
    model = compiled(make_mlp(init), gradient_transforms=logged_transforms(kt))
    save_case(out, "log_norms", model, fit(model, x, y, validation_data=(x[:32], y[:32])))
    report["log_norms_evaluate"] = sorted(model.evaluate(x, y, verbose=0, return_dict=True))
    with data_parallel(devices):
        model = compiled(make_mlp(init), gradient_transforms=logged_transforms(kt))
        save_case(out, "log_norms_data_parallel", model, fit(model, x, y))

    # SAM: plain, adaptive on a selection with the clip groups, with
    # micro-batches, with loss terms; on two devices; in mixed precision.
    for name, options in sam_cases(kt).items():
        model = compiled(make_mlp(init), **options)
        save_case(out, name, model, fit(model, x, y))
    with data_parallel(devices):
        model = compiled(make_mlp(init), **sam_cases(kt)["sam"])
        save_case(out, "sam_data_parallel", model, fit(model, x, y))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = compiled(make_mlp(init), **sam_cases(kt)["sam"])
        save_case(out, "sam_mixed", model, fit(model, x, y))
    finally:
        keras.mixed_precision.set_global_policy("float32")

    # Optimizer groups and layer-wise decay (stock MultiOptimizer underneath).
    model = make_mlp(init)
    model.compile(
        optimizer=grouped_optimizers(kt, model), loss="mse", gradient_transforms=transforms(kt)
    )
    save_case(out, "groups", model, fit(model, x, y))
    model = make_mlp(init)
    model.compile(optimizer=decayed_optimizer(kt, model), loss="mse", micro_batches=2)
    save_case(out, "lr_decay_micro", model, fit(model, x, y))

    # Saving on JAX (the TF side loads it) and loading TF's file.
    model = compiled(make_mlp(init), gradient_transforms=transforms(kt))
    fit(model, x, y)
    model.save(out / "from_jax.keras")
    tf_file = out / "from_tf.keras"
    if tf_file.exists():
        loaded = keras.saving.load_model(tf_file)
        report["loaded_options"] = [repr(t) for t in loaded.tapeops_options.gradient_transforms]
        save_case(out, "tf_file_continued", loaded, fit(loaded, x, y))

    # A subclassed model (mixin first) and a transform_gradients override.
    class Net(kt.TapeOpsMixin, keras.Model):
        def __init__(self):
            super().__init__()
            self.body1 = keras.layers.Dense(16, activation="tanh", name="body1")
            self.body2 = keras.layers.Dense(16, activation="tanh", name="body2")
            self.head = keras.layers.Dense(1, name="head")

        def call(self, inputs):
            return self.head(self.body2(self.body1(inputs)))

    net = Net()
    net(x[:1])
    net.set_weights(init)
    save_case(
        out, "clip_subclassed", compiled(net, gradient_transforms=transforms(kt)), fit(net, x, y)
    )

    class Halved(kt.TapeOpsSequential):
        def transform_gradients(self, grads, variables):
            return [g * 0.5 for g in super().transform_gradients(grads, variables)]

    halved = Halved(make_mlp(init, upgrade=False).layers)
    halved.build((None, 8))
    halved.set_weights(init)
    save_case(out, "halved_hook", compiled(halved), fit(halved, x, y))
    stock_half = make_mlp(init, upgrade=False)
    stock_half.compile(optimizer=keras.optimizers.SGD(LR / 2), loss="mse")
    save_case(out, "half_learning_rate", stock_half, fit(stock_half, x, y))

    # The group learning-rate callbacks (kt.optimizer_groups) on JAX.
    model = make_mlp(init)
    model.compile(optimizer=named_groups(kt, model), loss="mse")
    history = model.fit(
        x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
        callbacks=group_schedule_callbacks(kt),
    )
    save_case(out, "group_schedules", model, history.history)
    accumulation_cases(out, init, x, y, report)
    skip_cases(out, init, report)
    privacy_cases(out, init, x, y, report)
    training_state_cases(out, init, x, y, report)
    gan_cases(out, report)
    penalty_function_cases(out, report)
    budget_cases(report)

    # Refusals: each option the JAX step lacks, named with the backend.
    refusals = {}
    for option, value in [
        ("task_balancing", "a PCGrad"),
        ("sample_selection", "a TopLoss"),
        ("adversarial_training", "an attack"),
    ]:
        refusals[option], kept = refused(
            plain, lambda: plain.compile(optimizer="sgd", loss="mse", **{option: value})
        )
        report.setdefault("weights_kept", []).append(kept)
    report["refusals"] = refusals
    try:
        kt.PCGrad  # noqa: B018
    except AttributeError as error:
        report["missing_name"] = str(error)
    try:
        kt.callbacks.Sharpness  # noqa: B018
    except AttributeError as error:
        report["missing_callback"] = str(error)
    report["tensorflow_imported"] = "tensorflow" in sys.modules
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
