"""`fit()` with `kt.optimizer_groups` against a hand-written two-optimizer tape loop.

Oracle: a `tf.GradientTape` loop (each step a `tf.function`, like fit's;
see `oracle_utils`) with two separately built Adam optimizers, one for the
backbone (a nested functional model) and one for the head, from the same
weights (`set_weights`) and the same batches (`shuffle=False`). Every
keras_tapeops option is written out by hand in the oracle: global-norm
clipping of the whole true gradient before the groups apply it, a loss term,
accumulation (one step on the window's large batch), micro-batches (one step
on the whole batch), mixed_float16 (loss scaled by 2**15, unscaled before
clipping), two replicas, and a group that starts training at step k.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops import _compat
from keras_tapeops.callbacks.gradual_unfreezing import GradualUnfreezing
from keras_tapeops.callbacks.gradual_unfreezing import optimizer_knows
from keras_tapeops.groups import optimizer_groups

from oracle_utils import graph_step

# MultiOptimizer is new in Keras 3.15 (`make test-oldest` runs Keras 3.10).
pytestmark = pytest.mark.skipif(
    _compat.multi_optimizer_class() is None,
    reason="keras.optimizers.MultiOptimizer needs Keras 3.15",
)

LR_BACKBONE = 1e-2
LR_HEAD = 5e-2
BATCH = 16
N = 64
EPOCHS = 2
STEPS_PER_EPOCH = N // BATCH
STEPS = EPOCHS * STEPS_PER_EPOCH
CLIP = 2.0  # clips on some steps, not all (the oracle tests assert it)
TERM_WEIGHT = 0.1
ATOL = 1e-6
LOSS_SCALE = 2.0**15  # LossScaleOptimizer's initial scale (no overflow here)


def make_data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (2.0 * rng.normal(size=(n, 2))).astype("float32")
    return x, y


def make_net():
    """backbone (nested functional: b1 -> b2) -> head, upgraded."""
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="b1")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="b2")(h)
    backbone = keras.Model(inputs, h, name="backbone")
    outer = keras.Input((6,))
    outputs = keras.layers.Dense(2, name="head")(backbone(outer))
    return kt.upgrade(keras.Model(outer, outputs, name="net"))


@keras.saving.register_keras_serializable(package="keras_tapeops_tests")
def output_l2(model, x, y, y_pred):
    return keras.ops.mean(keras.ops.square(keras.ops.cast(y_pred, "float32")))


def head_schedule():
    return keras.optimizers.schedules.ExponentialDecay(LR_HEAD, decay_steps=1, decay_rate=0.7)


# ------------------------------------------------------------------ oracle
def run_oracle(weights, x, y, *, clip=None, term_weight=None, window=BATCH,
               loss_scale=None, unfreeze_at=0, epochs=EPOCHS, head_lr=LR_HEAD,
               one_optimizer=False):
    """The hand loop; returns `(weights, clipped steps, steps, optimizers)`.

    `window` samples make one optimizer step (accumulation: the window's
    large batch). The backbone trains from step `unfreeze_at` on, with an
    optimizer that has not stepped before. `one_optimizer=True` is the wrong
    oracle (one Adam at the head's rate for everything).
    """
    model = make_net()
    model.set_weights(weights)
    backbone = model.get_layer("backbone").trainable_variables
    head = model.get_layer("head").trainable_variables
    opt_backbone = keras.optimizers.Adam(LR_BACKBONE)
    opt_head = keras.optimizers.Adam(head_lr)
    if one_optimizer:
        opt_head.build(backbone + head)
    else:
        opt_backbone.build(backbone)
        opt_head.build(head)
    scale = tf.constant(1.0 if loss_scale is None else loss_scale, "float32")

    def make_step(train_backbone):
        variables = (backbone if train_backbone else []) + head

        def batch_gradients(xb, yb, scale):
            with tf.GradientTape() as tape:
                pred = tf.cast(model(xb, training=True), "float32")
                loss = tf.reduce_mean(tf.square(pred - yb))
                if term_weight is not None:
                    loss = loss + term_weight * tf.reduce_mean(tf.square(pred))
                scaled = loss * scale
            return [g / scale for g in tape.gradient(scaled, variables)]

        @graph_step
        def step(xb, yb, scale):
            # A window of several batches: each batch's gradient on its own
            # (as fit computes them; under float16 the split is not exact),
            # averaged: the large-batch gradient.
            parts = window // BATCH
            shares = [
                batch_gradients(xs, ys, scale)
                for xs, ys in zip(tf.split(xb, parts), tf.split(yb, parts))
            ]
            grads = [tf.add_n(list(gs)) / parts for gs in zip(*shares)]
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            fired = tf.constant(False)
            if clip is not None:
                fired = tf.linalg.global_norm(grads) > clip
                grads, _ = tf.clip_by_global_norm(grads, clip)
            if one_optimizer:
                opt_head.apply(grads, variables)
            else:
                if train_backbone:
                    opt_backbone.apply(grads[: len(backbone)], backbone)
                opt_head.apply(grads[len(grads) - len(head):], head)
            return fired, finite

        return step

    steps = {False: make_step(False), True: make_step(True)}
    clipped, n = 0, 0
    for _ in range(epochs):
        for start in range(0, len(x), window):
            fired, finite = steps[n >= unfreeze_at](
                tf.constant(x[start:start + window]), tf.constant(y[start:start + window]), scale
            )
            assert bool(finite), "the oracle scenario must not overflow float16"
            clipped += int(bool(fired))
            n += 1
    return model.get_weights(), clipped, n, (opt_backbone, opt_head)


# --------------------------------------------------------------------- fit
def grouped_net(weights, head_lr=LR_HEAD):
    model = make_net()
    model.set_weights(weights)
    optimizer = optimizer_groups(model, [
        ("backbone/*", keras.optimizers.Adam(LR_BACKBONE, name="backbone")),
        ("head", keras.optimizers.Adam(head_lr, name="head")),
    ])
    return model, optimizer


def fit_groups(weights, x, y, *, strategy=None, head_lr=LR_HEAD, epochs=EPOCHS,
               callbacks=(), initial_epoch=0, **compile_kwargs):
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model, optimizer = grouped_net(weights, head_lr)
        model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks), initial_epoch=initial_epoch)
    return model


def max_diff(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))


def assert_close(actual, expected, atol=ATOL):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, atol=atol, rtol=0, err_msg=f"weight {i}")


def sub_optimizers(model):
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    return {o.name: o for o in optimizer.optimizers}


@pytest.fixture(scope="module")
def setup():
    keras.utils.set_random_seed(11)
    x, y = make_data()
    weights = make_net().get_weights()
    keras.backend.clear_session()
    return {"x": x, "y": y, "weights": weights}


# ------------------------------------------------------------------- tests
def test_two_groups_equal_two_separate_adams(setup):
    expected, _, _, _ = run_oracle(setup["weights"], setup["x"], setup["y"])
    model = fit_groups(setup["weights"], setup["x"], setup["y"])
    assert isinstance(model.optimizer, keras.optimizers.MultiOptimizer)
    assert_close(model.get_weights(), expected)
    subs = sub_optimizers(model)
    assert list(subs) == ["backbone", "head"]
    assert all(int(o.iterations.numpy()) == STEPS for o in subs.values())


def test_the_comparison_can_fail_with_one_optimizer_for_both_groups(setup):
    """One Adam (the head's rate) for every variable ends far from the groups' result."""
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, _, _, _ = run_oracle(w, x, y)
    wrong, _, _, _ = run_oracle(w, x, y, one_optimizer=True)
    assert max_diff(wrong, expected) > 1e-2
    model = make_net()
    model.set_weights(w)
    model.compile(optimizer=keras.optimizers.Adam(LR_HEAD), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_close(model.get_weights(), wrong)  # the oracle's wrong variant is right about that
    with pytest.raises(AssertionError):
        assert_close(model.get_weights(), expected)


def test_with_clip_by_global_norm_on_the_true_gradient(setup):
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, clipped, steps, _ = run_oracle(w, x, y, clip=CLIP)
    assert 0 < clipped < steps, f"clip fired on {clipped} of {steps} steps"
    model = fit_groups(w, x, y, gradient_transforms=[kt.ClipByGlobalNorm(CLIP)])
    assert_close(model.get_weights(), expected)
    # Clipping each group on its own (two norms) is another result.
    per_group = fit_groups(w, x, y, gradient_transforms=[
        kt.ClipByGlobalNorm(CLIP, where="backbone/*"), kt.ClipByGlobalNorm(CLIP, where="head")])
    assert max_diff(per_group.get_weights(), expected) > 1e-4


def test_with_a_loss_term(setup):
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, _, _, _ = run_oracle(w, x, y, term_weight=TERM_WEIGHT)
    model = fit_groups(w, x, y, loss_terms=[kt.LossTerm(output_l2, weight=TERM_WEIGHT)])
    assert_close(model.get_weights(), expected)


def test_accumulation_counts_applied_steps_in_every_group_and_schedule(setup):
    """Two batches per step: the large-batch step; iterations and schedules count steps."""
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, _, steps, (_, opt_head) = run_oracle(
        w, x, y, window=2 * BATCH, clip=CLIP, head_lr=head_schedule()
    )
    assert steps == STEPS // 2
    model = fit_groups(w, x, y, head_lr=head_schedule(), accumulation_steps=2,
                       gradient_transforms=[kt.ClipByGlobalNorm(CLIP)])
    assert_close(model.get_weights(), expected)
    subs = sub_optimizers(model)
    assert [int(o.iterations.numpy()) for o in subs.values()] == [steps, steps]
    assert int(model.optimizer.iterations.numpy()) == steps
    np.testing.assert_allclose(
        float(subs["head"].learning_rate), float(opt_head.learning_rate), rtol=1e-6
    )


def test_micro_batches_equal_the_whole_batch_step(setup):
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, _, _, _ = run_oracle(w, x, y, clip=CLIP)
    model = fit_groups(w, x, y, micro_batches=4, gradient_transforms=[kt.ClipByGlobalNorm(CLIP)])
    assert_close(model.get_weights(), expected)


def test_mixed_float16_clips_unscaled_gradients(setup):
    """LossScaleOptimizer wraps the MultiOptimizer; the clip sees unscaled gradients."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, clipped, steps, _ = run_oracle(w, x, y, clip=CLIP, loss_scale=LOSS_SCALE)
    assert 0 < clipped < steps
    model = fit_groups(w, x, y, gradient_transforms=[kt.ClipByGlobalNorm(CLIP)])
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.MultiOptimizer)
    assert float(model.optimizer.dynamic_scale.numpy()) == LOSS_SCALE  # no step skipped
    assert_close(model.get_weights(), expected)
    # Clipping the loss-scaled gradient (threshold CLIP * scale on unscaled) is far off.
    scaled, _, _, _ = run_oracle(w, x, y, clip=CLIP / LOSS_SCALE, loss_scale=LOSS_SCALE)
    assert max_diff(scaled, expected) > 1e-3


def test_mirrored_two_replicas_equal_single_device(setup, mirrored):
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, _, _, _ = run_oracle(w, x, y)
    model = fit_groups(w, x, y, strategy=mirrored)
    assert_close(model.get_weights(), expected)


def test_mirrored_two_replicas_with_transforms_equal_single_device(setup, mirrored):
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, clipped, steps, _ = run_oracle(w, x, y, clip=CLIP)
    assert 0 < clipped < steps
    model = fit_groups(w, x, y, strategy=mirrored,
                       gradient_transforms=[kt.ClipByGlobalNorm(CLIP)])
    assert_close(model.get_weights(), expected)


# -------------------------------------------------------------------- saving
def make_sequential():
    """A top-level Sequential: Keras drops its name from variable paths on reload."""
    return kt.upgrade(keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh", name="b1"),
        keras.layers.Dense(8, activation="tanh", name="b2"),
        keras.layers.Dense(2, name="head"),
    ], name="seqnet"))


def sequential_groups(model):
    return optimizer_groups(model, [
        (["b1", "b2"], keras.optimizers.Adam(LR_BACKBONE, name="backbone")),
        ("head", keras.optimizers.Adam(LR_HEAD, name="head")),
    ])


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_save_load_keeps_every_sub_optimizer_state_and_continues_exactly(setup, kind, tmp_path):
    x, y = setup["x"], setup["y"]

    def build():
        if kind == "functional":
            model, optimizer = grouped_net(setup["weights"])
        else:
            keras.utils.set_random_seed(3)
            model = make_sequential()
            optimizer = sequential_groups(model)
        model.compile(optimizer=optimizer, loss="mse")
        return model

    def fit(model, epochs, initial_epoch=0):
        model.fit(x, y, batch_size=BATCH, epochs=epochs, initial_epoch=initial_epoch,
                  shuffle=False, verbose=0)

    uninterrupted = build()
    fit(uninterrupted, 2)
    first = build()
    fit(first, 1)
    first.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, keras.optimizers.MultiOptimizer)
    assert [o.name for o in loaded.optimizer.optimizers] == ["backbone", "head"]
    for a, b in zip(first.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # Every variable is in the same group after loading (paths may change).
    for v_first, v_loaded in zip(first.trainable_variables, loaded.trainable_variables):
        group = [n for n, o in sub_optimizers(first).items() if optimizer_knows(o, v_first)]
        again = [n for n, o in sub_optimizers(loaded).items() if optimizer_knows(o, v_loaded)]
        assert group == again and len(group) == 1, (v_first.path, v_loaded.path)
    fit(loaded, 2, initial_epoch=1)
    assert_close(loaded.get_weights(), uninterrupted.get_weights())


class Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("unfreezing", [False, True])
def test_backup_and_restore_resumes_exactly(setup, unfreezing, tmp_path):
    """Interrupted at epoch 1 and resumed in a new model: equals one run.

    With `unfreezing`, the backbone is frozen until epoch 2, so the backup
    is written while it is frozen and the resumed run unfreezes it.
    """
    x, y, w = setup["x"], setup["y"], setup["weights"]
    epochs = 3

    def extra():
        return [GradualUnfreezing([("backbone/*", 2)])] if unfreezing else []

    uninterrupted = fit_groups(w, x, y, epochs=epochs, callbacks=extra())
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        fit_groups(w, x, y, epochs=epochs, callbacks=[
            keras.callbacks.BackupAndRestore(backup), *extra(), Interrupt(1)])
    resumed = fit_groups(w, x, y, epochs=epochs, callbacks=[
        keras.callbacks.BackupAndRestore(backup), *extra()])
    assert_close(resumed.get_weights(), uninterrupted.get_weights())
    if unfreezing:
        expected, _, _, _ = run_oracle(w, x, y, epochs=epochs, unfreeze_at=2 * STEPS_PER_EPOCH)
        assert_close(uninterrupted.get_weights(), expected)


# --------------------------------------------------------------- unfreezing
class TrainableCount(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.counts = []

    def on_train_batch_begin(self, batch, logs=None):
        self.counts.append(len(self.model.trainable_weights))


@pytest.mark.parametrize("k", [3, 4])
def test_unfreezing_at_step_k_equals_a_loop_that_starts_the_group_at_k(setup, k):
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, _, _, _ = run_oracle(w, x, y, unfreeze_at=k)
    counts = TrainableCount()
    model = fit_groups(w, x, y, callbacks=[
        GradualUnfreezing([("backbone/*", k)], unit="step"), counts])
    assert_close(model.get_weights(), expected)
    # While frozen the step differentiates with respect to the head only.
    assert counts.counts == [2] * k + [6] * (STEPS - k)
    subs = sub_optimizers(model)
    assert int(subs["backbone"].iterations.numpy()) == STEPS - k
    assert int(subs["head"].iterations.numpy()) == STEPS
    # Training as if the backbone were never frozen is another result.
    never, _, _, _ = run_oracle(w, x, y)
    assert max_diff(never, expected) > 1e-3
    # After fit the backbone is trainable again and a plain fit works.
    assert len(model.trainable_weights) == 6
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def test_unfreezing_under_mirrored_strategy(setup, mirrored):
    """Keras builds the optimizer before fit under a strategy (everything
    trainable then); the freeze and the unfreeze re-bind it in scope."""
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, _, _, _ = run_oracle(w, x, y, unfreeze_at=3)
    model = fit_groups(w, x, y, strategy=mirrored,
                       callbacks=[GradualUnfreezing([("backbone/*", 3)], unit="step")])
    assert_close(model.get_weights(), expected)
    assert int(sub_optimizers(model)["backbone"].iterations.numpy()) == STEPS - 3


def test_unfreezing_at_an_epoch_with_accumulation_and_mixed_float16(setup):
    keras.config.set_dtype_policy("mixed_float16")
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, _, _, _ = run_oracle(
        w, x, y, window=2 * BATCH, loss_scale=LOSS_SCALE, clip=CLIP, unfreeze_at=2
    )
    model = fit_groups(w, x, y, accumulation_steps=2,
                       gradient_transforms=[kt.ClipByGlobalNorm(CLIP)],
                       callbacks=[GradualUnfreezing([("backbone/*", 1)], unit="epoch")])
    assert_close(model.get_weights(), expected)
    assert int(sub_optimizers(model)["backbone"].iterations.numpy()) == 2


# ------------------------------------------- changes needed outside this module
def test_unfreezing_with_a_transform_on_the_frozen_group(setup):
    x, y, w = setup["x"], setup["y"], setup["weights"]
    expected, _, _, _ = run_oracle(w, x, y, unfreeze_at=3)
    model = fit_groups(
        w, x, y,
        gradient_transforms=[kt.ClipByGlobalNorm(100.0, where="backbone/*")],
        callbacks=[GradualUnfreezing([("backbone/*", 3)], unit="step")],
    )
    assert_close(model.get_weights(), expected)


@pytest.mark.parametrize("argument", [{"clipnorm": 1.0}, {"gradient_accumulation_steps": 2}])
def test_a_sub_optimizer_clipping_or_accumulating_conflicts_at_compile(setup, argument):
    model = make_net()
    optimizer = optimizer_groups(model, [
        ("backbone/*", keras.optimizers.Adam(LR_BACKBONE, name="backbone", **argument)),
        ("head", keras.optimizers.Adam(LR_HEAD, name="head")),
    ])
    name = next(iter(argument))
    with pytest.raises(ValueError, match=rf"Received: {name}="):
        model.compile(optimizer=optimizer, loss="mse",
                      gradient_transforms=[kt.ClipByGlobalNorm(CLIP)], accumulation_steps=2)
