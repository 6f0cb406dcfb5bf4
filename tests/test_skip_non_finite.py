"""`kt.SkipNonFinite`: a step with a nan/inf gradient changes nothing.

What a skipped step must leave bit-identical, each checked after every batch
by a callback (`Snapshots`): every weight (BatchNormalization's moving
statistics included), every optimizer variable (Adam's slots and
`iterations`), and the learning rate of a schedule of the step. The
`skipped_steps` History entry counts the steps. Oracles: the same model fit
on the data without the bad batch (or window) ends bit-identical (float32),
and the steps around the bad one do change the weights (companions).
Covered: float32 nan and inf, MirroredStrategy x2 with the bad sample on one
replica only, `accumulation_steps` (the window is skipped), `micro_batches`,
`jit_compile`, `steps_per_execution`, `max_consecutive` (stops with its
message), mixed_float16 (the LossScaleOptimizer still halves its scale), and
the consecutive-skip counter through `model.save`/`load_model` and
`BackupAndRestore`.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

BATCH = 16
N_BATCHES = 6
N = BATCH * N_BATCHES
BAD = 2  # the non-finite batch


# ------------------------------------------------------------------ helpers
def make_net(bn=True):
    """hidden (tanh) -> [bn] -> head: a regression net."""
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    if bn:
        h = keras.layers.BatchNormalization(momentum=0.8, name="bn")(h)
    outputs = keras.layers.Dense(2, name="head")(h)
    return kt.upgrade(keras.Model(inputs, outputs, name="net"))


def make_optimizer():
    """Adam (two slots per variable) with a learning rate that halves every step."""
    schedule = keras.optimizers.schedules.ExponentialDecay(
        0.05, decay_steps=1, decay_rate=0.5
    )
    return keras.optimizers.Adam(schedule)


def make_data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    return x, y


def poison(x, y, batch, how, sample=3):
    """Puts a nan target or an inf input into sample `sample` of batch `batch`."""
    x, y = x.copy(), y.copy()
    i = batch * BATCH + sample
    if how == "nan_target":
        y[i, 0] = np.nan
    elif how == "inf_input":
        x[i, 1] = np.inf
    else:
        raise ValueError(how)
    return x, y


def without_batches(x, y, batches):
    keep = np.ones(len(x), bool)
    for b in batches:
        keep[b * BATCH:(b + 1) * BATCH] = False
    return x[keep], y[keep]


def compiled(weights, transforms, strategy=None, **kwargs):
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = make_net(bn=kwargs.pop("bn", True))
        model.set_weights(weights)
        model.compile(
            optimizer=kwargs.pop("optimizer", None) or make_optimizer(), loss="mse",
            gradient_transforms=transforms, **kwargs,
        )
    return model


def local_values(variable):
    """The variable's value on every replica (one value outside a strategy)."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    parts = getattr(value, "values", None) or (value,)
    return [np.array(p.numpy(), copy=True) for p in parts]


class Snapshots(keras.callbacks.Callback):
    """Values of the model's and the optimizer's variables before and after every batch.

    `states[0]` is before training, `states[k + 1]` after batch k (of the
    first epoch). The transforms' own variables (the skip counter) are
    left out: they are meant to change.
    """

    def __init__(self):
        super().__init__()
        self.states = []

    def _record(self):
        model = self.model
        own = {id(v) for v in model.tapeops_state.transform_variables}
        self.states.append({
            "weights": [local_values(v) for v in model.weights if id(v) not in own],
            "optimizer": [local_values(v) for v in model.optimizer.variables],
            "learning_rate": float(np.asarray(model.optimizer.learning_rate)),
            "iterations": int(model.optimizer.iterations.numpy()),
        })

    def on_train_begin(self, logs=None):
        self._record()

    def on_train_batch_end(self, batch, logs=None):
        self._record()


def identical(a, b, keys=("weights", "optimizer")):
    """Bit-identical (nan == nan) on every replica."""
    for key in keys:
        for u, v in zip(a[key], b[key]):
            for p, q in zip(u, v):
                if not np.array_equal(p, q, equal_nan=True):
                    return False
    return True


def any_non_finite(state):
    return any(
        not np.all(np.isfinite(p)) for values in state["weights"] for p in values
    )


def fit(model, x, y, epochs=1, callbacks=(), **kwargs):
    return model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
        callbacks=list(callbacks), **kwargs,
    )


def assert_bit_identical(actual, expected):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_array_equal(a, e, err_msg=f"weight {i}")


@pytest.fixture(scope="module")
def weights():
    keras.utils.set_random_seed(11)
    w = make_net().get_weights()
    keras.backend.clear_session()
    return w


@pytest.fixture(scope="module")
def plain_weights():
    """Weights of the net without BatchNormalization (for MirroredStrategy, where
    per-replica batch statistics differ from single-device ones)."""
    keras.utils.set_random_seed(12)
    w = make_net(bn=False).get_weights()
    keras.backend.clear_session()
    return w


def model_weights(model):
    """The model's weights without the transforms' own variables (the skip counter).

    `model.get_weights()` lists those too (they are saved with the model).
    """
    own = {id(v) for v in model.tapeops_state.transform_variables}
    return [v.numpy() for v in model.weights if id(v) not in own]


# ------------------------------------------------------- float32, one device
@pytest.mark.parametrize("how", ["nan_target", "inf_input"])
def test_skipped_step_changes_nothing(weights, how):
    x, y = poison(*make_data(), BAD, how)
    model = compiled(weights, [kt.SkipNonFinite()])
    snaps = Snapshots()
    history = fit(model, x, y, callbacks=[snaps])
    states = snaps.states
    # The bad step: weights (BN statistics included), slots, iterations and
    # the scheduled learning rate are exactly as before it.
    assert identical(states[BAD], states[BAD + 1])
    assert states[BAD + 1]["learning_rate"] == states[BAD]["learning_rate"]
    assert states[BAD + 1]["iterations"] == states[BAD]["iterations"] == BAD
    # Every other step changed all of them.
    for k in range(N_BATCHES):
        if k != BAD:
            assert not identical(states[k], states[k + 1]), k
            assert states[k + 1]["learning_rate"] == states[k]["learning_rate"] / 2
    assert int(model.optimizer.iterations.numpy()) == N_BATCHES - 1
    assert history.history["skipped_steps"] == [1.0]
    assert not any_non_finite(states[-1])


@pytest.mark.parametrize("how", ["nan_target", "inf_input"])
def test_equals_training_without_the_bad_batch(weights, how):
    """Bit-identical to the same model fit on the data minus that batch."""
    x, y = make_data()
    bad_x, bad_y = poison(x, y, BAD, how)
    model = compiled(weights, [kt.SkipNonFinite()])
    fit(model, bad_x, bad_y, epochs=2)
    reference = compiled(weights, [kt.SkipNonFinite()])
    fit(reference, *without_batches(x, y, [BAD]), epochs=2)
    assert_bit_identical(model_weights(model), model_weights(reference))
    assert int(model.optimizer.iterations.numpy()) == 2 * (N_BATCHES - 1)


def test_without_the_transform_the_bad_batch_poisons_everything(weights):
    """Companion: with stock `fit` (and without SkipNonFinite) one bad batch writes nan."""
    x, y = poison(*make_data(), BAD, "nan_target")
    model = compiled(weights, [kt.ClipByGlobalNorm(1e6)])
    snaps = Snapshots()
    fit(model, x, y, callbacks=[snaps])
    assert not identical(snaps.states[BAD], snaps.states[BAD + 1])
    assert any_non_finite(snaps.states[BAD + 1])
    stock = keras.Model.from_config(make_net().get_config())
    assert not isinstance(stock, kt.TapeOpsMixin)
    stock.set_weights(weights)
    stock.compile(optimizer=make_optimizer(), loss="mse")
    fit(stock, x, y)
    assert not all(np.all(np.isfinite(w)) for w in stock.get_weights())


def test_batch_norm_statistics_would_change_without_the_restore(weights):
    """Companion: the forward pass of the bad batch does move the moving statistics.

    The nan is in the target, so the batch's statistics are finite and
    differ from the stored ones; only the restore keeps them.
    """
    x, y = poison(*make_data(), BAD, "nan_target")
    model = compiled(weights, [kt.SkipNonFinite()])
    bn = model.get_layer("bn")
    fit(model, x[:BAD * BATCH], y[:BAD * BATCH])
    before = [v.numpy().copy() for v in (bn.moving_mean, bn.moving_variance)]
    model(x[BAD * BATCH:(BAD + 1) * BATCH], training=True)  # what the forward pass does
    after = [v.numpy() for v in (bn.moving_mean, bn.moving_variance)]
    assert all(np.all(np.isfinite(a)) and not np.array_equal(a, b)
               for a, b in zip(after, before))


@pytest.mark.parametrize("variant", ["jit_compile", "steps_per_execution", "micro_batches"])
def test_variants_equal_training_without_the_bad_batch(weights, variant):
    kwargs = {
        "jit_compile": {"jit_compile": True},
        "steps_per_execution": {"steps_per_execution": 4},
        "micro_batches": {"micro_batches": 2},
    }[variant]
    x, y = make_data()
    bad_x, bad_y = poison(x, y, BAD, "nan_target", sample=12)  # 2nd micro-batch
    model = compiled(weights, [kt.SkipNonFinite()], **kwargs)
    history = fit(model, bad_x, bad_y, epochs=2)
    reference = compiled(weights, [kt.SkipNonFinite()], **kwargs)
    fit(reference, *without_batches(x, y, [BAD]), epochs=2)
    assert_bit_identical(model_weights(model), model_weights(reference))
    assert history.history["skipped_steps"] == [1.0, 1.0]
    assert int(model.optimizer.iterations.numpy()) == 2 * (N_BATCHES - 1)


def test_micro_batches_skip_the_whole_batch_and_restore_statistics(weights):
    x, y = poison(*make_data(), BAD, "nan_target", sample=12)  # 2nd micro-batch only
    model = compiled(weights, [kt.SkipNonFinite()], micro_batches=2)
    snaps = Snapshots()
    fit(model, x, y, callbacks=[snaps])
    assert identical(snaps.states[BAD], snaps.states[BAD + 1])
    assert not identical(snaps.states[BAD + 1], snaps.states[BAD + 2])


# ---------------------------------------------------------------- accumulation
def test_accumulation_skips_the_window(weights):
    """accumulation_steps=2: a bad batch in the second window skips that window.

    Trainable weights and the optimizer after window [2, 3] are those after
    window [0, 1], and training on equals training without that window
    (trainable weights; the moving statistics of a skipped window's batches
    are not restored, as documented, and the forward pass in training uses
    batch statistics, so the trainable weights do not depend on them).
    """
    x, y = make_data()
    bad_x, bad_y = poison(x, y, BAD, "nan_target")  # batch 2: window [2, 3]
    model = compiled(weights, [kt.SkipNonFinite()], accumulation_steps=2)
    trainable = TrainableSnapshots()
    history = fit(model, bad_x, bad_y, callbacks=[trainable])
    states = trainable.states
    assert identical(states[2], states[4])
    assert not identical(states[0], states[2])
    assert states[4]["iterations"] == 1
    assert history.history["skipped_steps"] == [1.0]
    assert int(model.optimizer.iterations.numpy()) == 2

    fit(model, bad_x, bad_y)
    reference = compiled(weights, [kt.SkipNonFinite()], accumulation_steps=2)
    fit(reference, *without_batches(x, y, [2, 3]), epochs=2)
    assert_bit_identical(
        [v.numpy() for v in model.trainable_weights],
        [v.numpy() for v in reference.trainable_weights],
    )


class TrainableSnapshots(Snapshots):
    """Like `Snapshots`, with only the trainable weights."""

    def _record(self):
        super()._record()
        self.states[-1]["weights"] = [
            local_values(v) for v in self.model.trainable_weights
        ]


def test_accumulation_companion_window_of_good_batches_is_applied(weights):
    """Companion: the same run without the nan takes 3 steps, not 2."""
    model = compiled(weights, [kt.SkipNonFinite()], accumulation_steps=2)
    history = fit(model, *make_data())
    assert history.history["skipped_steps"] == [0.0]
    assert int(model.optimizer.iterations.numpy()) == 3


# ------------------------------------------------------------ MirroredStrategy
def test_mirrored_both_replicas_skip(plain_weights, mirrored):
    """The nan is in replica 1's half of the batch only; both replicas skip.

    Replica 0's own gradient is finite: the decision is taken on the
    gradient summed over replicas, so both skip and stay equal.
    """
    x, y = make_data()
    bad_x, bad_y = poison(x, y, BAD, "nan_target", sample=BATCH // 2 + 3)
    model = compiled(plain_weights, [kt.SkipNonFinite()], strategy=mirrored, bn=False)
    snaps = Snapshots()
    history = fit(model, bad_x, bad_y, callbacks=[snaps])
    states = snaps.states
    assert len(states[0]["weights"][0]) == 2  # two replicas' copies checked
    assert identical(states[BAD], states[BAD + 1])
    assert states[BAD + 1]["learning_rate"] == states[BAD]["learning_rate"]
    assert not identical(states[BAD + 1], states[BAD + 2])
    for state in states:  # the replicas never disagree
        for values in state["weights"] + state["optimizer"]:
            assert np.array_equal(values[0], values[-1], equal_nan=True)
    assert history.history["skipped_steps"] == [1.0]

    reference = compiled(plain_weights, [kt.SkipNonFinite()], strategy=mirrored, bn=False)
    fit(reference, *without_batches(x, y, [BAD]))
    assert_bit_identical(model_weights(model), model_weights(reference))


def test_mirrored_equals_single_device(plain_weights, mirrored):
    x, y = poison(*make_data(), BAD, "nan_target", sample=BATCH // 2 + 3)
    model = compiled(plain_weights, [kt.SkipNonFinite()], strategy=mirrored, bn=False)
    fit(model, x, y, epochs=2)
    single = compiled(plain_weights, [kt.SkipNonFinite()], bn=False)
    fit(single, x, y, epochs=2)
    for a, b in zip(model_weights(model), model_weights(single)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------- max_consecutive
def bad_batches(batches, how="nan_target"):
    x, y = make_data()
    for b in batches:
        x, y = poison(x, y, b, how)
    return x, y


def test_max_consecutive_stops_training_with_the_message(weights):
    x, y = bad_batches([2, 3])
    model = compiled(weights, [kt.SkipNonFinite(max_consecutive=2)])
    snaps = Snapshots()
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"SkipNonFinite: 2 steps in a row had non-finite true gradients "
              r"\(loss-scale overflows of mixed precision are not counted\), so "
              r"training stops.*Received: max_consecutive=2",
    ):
        fit(model, x, y, callbacks=[snaps])
    # It stopped in batch 3, with the weights of before batch 2.
    assert len(snaps.states) == 4
    assert identical(snaps.states[2], snaps.states[3])
    now = Snapshots()
    now.set_model(model)
    now._record()
    assert identical(now.states[0], snaps.states[2])


@pytest.mark.parametrize("batches, max_consecutive", [([1, 3], 2), ([2, 3], 3)])
def test_max_consecutive_not_reached_trains_on(weights, batches, max_consecutive):
    """Companion: skips that are not in a row, or fewer than the limit, do not stop."""
    model = compiled(weights, [kt.SkipNonFinite(max_consecutive=max_consecutive)])
    history = fit(model, *bad_batches(batches))
    assert history.history["skipped_steps"] == [2.0]


def counter(model):
    (value,) = [
        s.variables["consecutive_skips"] for t, s in model.tapeops_state.transforms
        if isinstance(t, kt.SkipNonFinite)
    ]
    return float(value.numpy())


def test_counter_counts_in_a_row_and_resets(weights):
    model = compiled(weights, [kt.SkipNonFinite()])
    fit(model, *bad_batches([4, 5]))
    assert counter(model) == 2.0
    fit(model, *bad_batches([5]))
    assert counter(model) == 1.0
    fit(model, *make_data())
    assert counter(model) == 0.0


# ------------------------------------------------------------ mixed precision
def test_mixed_float16_skips_and_the_loss_scale_still_halves(weights):
    keras.config.set_dtype_policy("mixed_float16")
    x, y = poison(*make_data(), BAD, "nan_target")
    optimizer = keras.optimizers.LossScaleOptimizer(
        make_optimizer(), initial_scale=2.0**15, dynamic_growth_steps=1000,
    )
    model = compiled(weights, [kt.SkipNonFinite()], optimizer=optimizer)
    optimizer.build(model.trainable_variables)  # the scale exists before fit

    class Scales(Snapshots):
        def _record(self):
            super()._record()
            self.states[-1]["scale"] = float(self.model.optimizer.dynamic_scale.numpy())

    snaps = Scales()
    history = fit(model, x, y, callbacks=[snaps])
    states = snaps.states
    assert [s["scale"] for s in states] == [2.0**15] * (BAD + 1) + [2.0**14] * (N_BATCHES - BAD)
    assert identical(states[BAD], states[BAD + 1], keys=("weights",))
    assert states[BAD + 1]["iterations"] == states[BAD]["iterations"] == BAD
    assert states[BAD + 1]["learning_rate"] == states[BAD]["learning_rate"]
    assert not identical(states[BAD + 1], states[BAD + 2], keys=("weights",))
    assert history.history["skipped_steps"] == [1.0]
    # Companion: the same run without SkipNonFinite halves the scale the same way.
    keras.config.set_dtype_policy("mixed_float16")
    plain_optimizer = keras.optimizers.LossScaleOptimizer(
        make_optimizer(), initial_scale=2.0**15, dynamic_growth_steps=1000,
    )
    plain = compiled(weights, [kt.ClipByGlobalNorm(1e6)], optimizer=plain_optimizer)
    plain_optimizer.build(plain.trainable_variables)
    fit(plain, x, y)
    assert float(plain_optimizer.dynamic_scale.numpy()) == 2.0**14
    assert_bit_identical(
        [v.numpy() for v in plain.trainable_weights],
        [v.numpy() for v in model.trainable_weights],
    )
    # ... but only SkipNonFinite puts back the moving statistics of the skipped batch.
    bn, plain_bn = model.get_layer("bn"), plain.get_layer("bn")
    assert not np.array_equal(bn.moving_mean.numpy(), plain_bn.moving_mean.numpy())


# ---------------------------------------------------- state: save / restore
def test_counter_survives_save_and_load(weights, tmp_path):
    """The consecutive count is saved: a loaded model stops where the original would."""
    x, y = bad_batches([N_BATCHES - 1])  # the epoch ends on a skipped step
    model = compiled(weights, [kt.SkipNonFinite(max_consecutive=2)])
    fit(model, x, y)
    assert counter(model) == 1.0
    model.save(tmp_path / "skip.keras")
    loaded = keras.models.load_model(tmp_path / "skip.keras")
    assert counter(loaded) == 1.0
    starts_bad = bad_batches([0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="2 steps in a row"):
        fit(loaded, *starts_bad)
    with pytest.raises(tf.errors.InvalidArgumentError, match="2 steps in a row"):
        fit(model, *starts_bad)
    # Companion: the same weights with a fresh counter train on.
    fresh = compiled(model_weights(loaded), [kt.SkipNonFinite(max_consecutive=2)])
    assert counter(fresh) == 0.0
    fit(fresh, *starts_bad)


class Interrupt(keras.callbacks.Callback):
    """Raises at the start of epoch `epoch` (after the previous epoch's backup)."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumed_run_equals_uninterrupted(weights, tmp_path):
    x, y = bad_batches([0, N_BATCHES - 1])  # skips at both ends of every epoch
    transforms = [kt.SkipNonFinite()]
    uninterrupted = compiled(weights, transforms)
    expected = fit(uninterrupted, x, y, epochs=3).history

    backup = str(tmp_path / "backup")
    first = compiled(weights, transforms)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(first, x, y, epochs=3,
            callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt(1)])
    resumed = compiled(weights, transforms)
    history = fit(resumed, x, y, epochs=3,
                  callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert_bit_identical(model_weights(resumed), model_weights(uninterrupted))
    assert_bit_identical(
        [v.numpy() for v in resumed.optimizer.variables],
        [v.numpy() for v in uninterrupted.optimizer.variables],
    )
    assert counter(resumed) == counter(uninterrupted) == 1.0
    assert history.history["skipped_steps"] == expected["skipped_steps"][1:] == [2.0, 2.0]


def test_backup_and_restore_restores_the_counter(weights, tmp_path):
    """With max_consecutive=2 the run stops in epoch 2's first batch, resumed or not.

    Epoch 1 ends on a skipped step (count 1) and epoch 2 starts with one
    (count 2). The resumed run stops there only if the count was restored.
    """
    x, y = bad_batches([0, N_BATCHES - 1])
    transforms = [kt.SkipNonFinite(max_consecutive=2)]
    first_epoch_ok = bad_batches([N_BATCHES - 1])  # epoch 1 cannot stop

    uninterrupted = compiled(weights, transforms)
    fit(uninterrupted, *first_epoch_ok)
    assert counter(uninterrupted) == 1.0
    with pytest.raises(tf.errors.InvalidArgumentError, match="2 steps in a row"):
        fit(uninterrupted, x, y, epochs=2, initial_epoch=1)

    backup = str(tmp_path / "backup")
    first = compiled(weights, transforms)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(first, *first_epoch_ok, epochs=2,
            callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt(1)])
    resumed = compiled(weights, transforms)
    assert counter(resumed) == 0.0
    with pytest.raises(tf.errors.InvalidArgumentError, match="2 steps in a row"):
        fit(resumed, x, y, epochs=2,
            callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert counter(resumed) == 2.0
    # Companion: without the backup, the same model and data train on.
    fresh = compiled(weights, transforms)
    fit(fresh, x, y, epochs=2, initial_epoch=1)


# ---------------------------------------------------------- configuration
def test_get_config_round_trip_and_errors():
    obj = kt.SkipNonFinite(max_consecutive=np.int64(4), where="head", name="skips")
    again = kt.SkipNonFinite.from_config(obj.get_config())
    assert again.get_config() == obj.get_config() == {
        "max_consecutive": 4, "name": "skips", "where": "head",
    }
    with pytest.raises(ValueError, match=r"Received: max_consecutive=0"):
        kt.SkipNonFinite(max_consecutive=0)
    with pytest.raises(TypeError, match=r"Received: max_consecutive=1.5"):
        kt.SkipNonFinite(max_consecutive=1.5)
    with pytest.raises(ValueError, match=r"Received: name=''"):
        kt.SkipNonFinite(name="")
