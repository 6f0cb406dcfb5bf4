"""Physics-informed terms in `fit` (`kt.PDEResidual`, `kt.ConditionLoss`) against a nested-tape loop.

The oracle is the textbook PINN step written by hand: a `tf.function` with an
outer tape (weights) around two nested tapes (first and second derivatives
w.r.t. the collocation points), Burgers' residual `u_t + u u_x - nu u_xx`,
a boundary mismatch and the data MSE. Its collocation points are drawn here
with `tf.random.stateless_uniform(seed=(SEED, step))`, not by the sampler, so
the test also pins the sampler's "keyed by the optimizer step" contract.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

from oracle_utils import graph_step

NU, LR, BATCH, EPOCHS = 0.05, 0.1, 16, 2
W_PDE, W_BC = 0.7, 0.3
SEED, N_COL = 3, 25          # odd: the two-replica split is uneven
LOW, HIGH = (-1.0, 0.0), (1.0, 1.0)


@keras.saving.register_keras_serializable(package="test_physics_fit")
def burgers(x, u, du, d2u):
    """u_t + u u_x - nu u_xx, with x = (x, t)."""
    return du[:, 0, 1] + u[:, 0] * du[:, 0, 0] - NU * d2u[:, 0, 0]


@keras.saving.register_keras_serializable(package="test_physics_fit")
def initial_values(points):
    return -tf.sin(np.pi * points[:, :1])


def data():
    x = np.linspace(-1.0, 1.0, 32, dtype="float32")
    inputs = np.stack([x, np.zeros_like(x)], axis=1)
    return inputs, -np.sin(np.pi * inputs[:, :1]).astype("float32")


def boundary_points():
    t = np.linspace(0.0, 1.0, 7, dtype="float32")
    return np.concatenate(
        [np.stack([-np.ones_like(t), t], 1), np.stack([np.ones_like(t), t], 1)]
    )


FIXED = np.random.default_rng(5).uniform(LOW, HIGH, (N_COL, 2)).astype("float32")


def plain_model():
    return keras.Sequential([
        keras.Input((2,)),
        keras.layers.Dense(6, activation="tanh", name="hidden"),
        keras.layers.Dense(1, name="out"),
    ])


def collocation(kind):
    if kind == "box":
        return kt.physics.BoxSampler(LOW, HIGH, n=N_COL, seed=SEED)
    return FIXED


def terms(kind="box", pde_weight=W_PDE, mode="auto", diagonal=(0,)):
    # diagonal=(0,): burgers reads u_xx only (the array case computes u_tt too).
    diagonal = list(diagonal) if kind == "box" else None
    return [
        kt.PDEResidual(burgers, collocation(kind), weight=pde_weight, mode=mode,
                       diagonal=diagonal, name="pde"),
        kt.ConditionLoss(boundary_points(), values=0.0, weight=W_BC, name="boundary"),
    ]


def tapeops_model(initial, kind="box", pde_weight=W_PDE, extra_terms=(), **compile_kwargs):
    model = kt.upgrade(plain_model())
    model.set_weights(initial)
    model.compile(
        optimizer=keras.optimizers.SGD(LR), loss="mse",
        loss_terms=terms(kind, pde_weight) + list(extra_terms), **compile_kwargs,
    )
    return model


def oracle_points(kind, step):
    if kind == "array":
        return tf.constant(FIXED)
    unit = tf.random.stateless_uniform(
        (N_COL, 2), seed=tf.stack([tf.constant(SEED, "int64"), step]), dtype="float32",
        alg="philox",
    )
    return tf.constant(LOW) + (tf.constant(HIGH) - tf.constant(LOW)) * unit


def oracle_fit(model, kind="box", pde_weight=W_PDE, loss_scale=False, frozen_step=None,
               jit_compile=False):
    """The hand-written PINN loop; returns History-style per-epoch logs.

    `frozen_step`: draw the collocation points of that step at every step
    (the companion test: the keyed resampling matters). `jit_compile`:
    compile the step with XLA, like `fit(jit_compile=True)`: the points are
    drawn inside it from the step passed at run time (XLA's Philox gives
    other numbers than TensorFlow's kernel for a run-time seed).
    """
    x, y = data()
    optimizer = keras.optimizers.SGD(LR)
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(model.trainable_variables)
    wall = tf.constant(boundary_points())

    def step(xb, yb, key):
        points = oracle_points(kind, key)
        with tf.GradientTape() as tape:
            pred = tf.cast(model(xb, training=True), "float32")
            mse = tf.reduce_mean(tf.square(yb - pred))
            with tf.GradientTape() as second:
                second.watch(points)
                with tf.GradientTape() as first:
                    first.watch(points)
                    u = tf.cast(model(points, training=True), "float32")
                grad = first.gradient(u, points)
                u_x, u_t = grad[:, 0], grad[:, 1]
            u_xx = second.gradient(u_x, points)[:, 0]
            residual = u_t + u[:, 0] * u_x - NU * u_xx
            pde = pde_weight * tf.reduce_mean(tf.square(residual))
            wall_u = tf.cast(model(wall, training=True), "float32")
            boundary = W_BC * tf.reduce_mean(tf.square(wall_u))
            total = mse + pde + boundary
            scaled = optimizer.scale_loss(total) if loss_scale else total
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return pde, boundary, total

    step = tf.function(step, jit_compile=True) if jit_compile else graph_step(step)
    logs = {"pde": [], "boundary": [], "loss": []}
    k = 0
    for _ in range(EPOCHS):
        epoch = {key: [] for key in logs}
        for start in range(0, len(x), BATCH):
            key = k if frozen_step is None else frozen_step
            values = step(tf.constant(x[start:start + BATCH]),
                          tf.constant(y[start:start + BATCH]), tf.constant(key, "int64"))
            for name, value in zip(("pde", "boundary", "loss"), values):
                epoch[name].append(float(value))
            k += 1
        for name, values in epoch.items():
            logs[name].append(float(np.mean(values)))
    return logs


def fit(model, **kwargs):
    x, y = data()
    return model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                     **kwargs).history


def max_difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


def assert_logs_close(history, expected, atol):
    for key in ("pde", "boundary", "loss"):
        np.testing.assert_allclose(history[key], expected[key], rtol=0, atol=atol, err_msg=key)


@pytest.mark.parametrize("kind", ["box", "array"])
def test_fit_equals_nested_tape_loop(kind):
    oracle = plain_model()
    initial = oracle.get_weights()
    expected = oracle_fit(oracle, kind)
    model = tapeops_model(initial, kind)
    history = fit(model)
    assert max_difference(model, oracle) < 1e-6
    assert_logs_close(history, expected, atol=1e-6)
    assert expected["pde"][0] > 1e-3 and expected["boundary"][0] > 1e-3


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_both_derivative_modes_train_alike(mode):
    oracle = plain_model()
    initial = oracle.get_weights()
    oracle_fit(oracle, "box")
    model = kt.upgrade(plain_model())
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse",
                  loss_terms=terms("box", mode=mode))
    fit(model)
    assert max_difference(model, oracle) < 1e-6


@pytest.mark.parametrize("wrong", ["frozen_points", "no_pde"])
def test_comparison_can_fail(wrong):
    # Points drawn once (not per step), or the residual dropped, move the
    # weights far beyond the 1e-6 used above.
    oracle = plain_model()
    initial = oracle.get_weights()
    oracle_fit(oracle, "box", frozen_step=0 if wrong == "frozen_points" else None)
    model = tapeops_model(initial, "box", pde_weight=0.0 if wrong == "no_pde" else W_PDE)
    fit(model)
    assert max_difference(model, oracle) > 1e-4


def test_mirrored_strategy_equals_one_device(mirrored):
    # 25 collocation points split 13/12 between two replicas, 14 boundary
    # points 7/7, 9 initial points with an array of values 5/4: the update
    # and the logs equal one device's.
    initial = plain_model().get_weights()
    start = FIXED[:9] * np.array([1.0, 0.0], "float32")

    def extra():
        return [kt.ConditionLoss(start, initial_values(start).numpy(), name="initial")]

    single = tapeops_model(initial, extra_terms=extra())
    expected = fit(single)
    with mirrored.scope():
        model = tapeops_model(initial, extra_terms=extra())
    history = fit(model)
    assert max_difference(model, single) < 1e-6
    assert_logs_close(history, expected, atol=1e-6)
    np.testing.assert_allclose(history["initial"], expected["initial"], atol=1e-6)


def mixed_run(initial, frozen_step=None):
    """The oracle and fit under mixed_float16 from `initial`."""
    keras.config.set_dtype_policy("mixed_float16")
    oracle = plain_model()
    oracle.set_weights(initial)
    expected = oracle_fit(oracle, "box", loss_scale=True, frozen_step=frozen_step)
    model = tapeops_model(initial)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    history = fit(model)
    assert int(model.optimizer.iterations) == EPOCHS * 2  # no step skipped
    return model, oracle, history, expected


# Under mixed_float16 the model runs in float16 (the derivatives and the
# residual are float32): the term's backward passes and the hand-written ones
# accumulate float16 rounding in a different order, 1.2e-5 apart after four
# steps (measured); a wrong run (points frozen, the residual dropped) is
# more than 1e-2 away.
MIXED_ATOL = 1e-4


def test_mixed_float16_equals_nested_tape_loop():
    model, oracle, history, expected = mixed_run(plain_model().get_weights())
    assert max_difference(model, oracle) < MIXED_ATOL
    assert_logs_close(history, expected, atol=MIXED_ATOL)


def test_mixed_float16_comparison_can_fail():
    model, oracle, _, _ = mixed_run(plain_model().get_weights(), frozen_step=0)
    assert max_difference(model, oracle) > 10 * MIXED_ATOL


@pytest.mark.parametrize("options", [{"jit_compile": True}, {"steps_per_execution": 2}])
def test_jit_compile_and_steps_per_execution(options):
    jit = options.get("jit_compile", False)
    oracle = plain_model()
    initial = oracle.get_weights()
    expected = oracle_fit(oracle, "box", jit_compile=jit)
    model = tapeops_model(initial, **options)
    history = fit(model)
    assert max_difference(model, oracle) < 1e-6
    assert_logs_close(history, expected, atol=1e-6)
    if jit:
        # The documented caveat: under XLA the sampler's points are still a
        # pure function of (seed, step), but not the ones drawn without XLA,
        # so the same loop without XLA ends far away.
        other = plain_model()
        other.set_weights(initial)
        oracle_fit(other, "box")
        assert max_difference(model, other) > 1e-4


def test_save_load_keeps_the_terms_and_resumes(tmp_path):
    model = kt.upgrade(plain_model())
    sampler = kt.physics.BoxSampler(LOW, (1.0, 0.0), n=9, seed=1)   # t = 0
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", loss_terms=terms() + [
        kt.ConditionLoss(sampler, values=initial_values, name="initial"),
    ])
    fit(model)
    path = str(tmp_path / "pinn.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    saved = [t.get_config() for t in model.tapeops_options.terms]
    assert [t.get_config() for t in loaded.tapeops_options.terms] == saved
    assert loaded.tapeops_options.terms[0].residual_fn is burgers
    a, b = fit(model), fit(loaded)   # resumes at the same optimizer step
    assert max_difference(model, loaded) < 1e-6
    for key in ("pde", "boundary", "initial"):
        np.testing.assert_allclose(a[key], b[key], atol=1e-6)


def test_validation_skips_the_terms_unless_asked():
    x, y = data()
    model = tapeops_model(plain_model().get_weights())
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(logs) == {"loss"}
    np.testing.assert_allclose(
        logs["loss"], np.mean((model.predict(x, verbose=0) - y) ** 2), rtol=1e-5
    )
    model.compile(optimizer="sgd", loss="mse", loss_terms=[
        kt.ConditionLoss(boundary_points(), 0.0, name="boundary", in_validation=True)])
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    wall = np.mean(model.predict(boundary_points(), verbose=0) ** 2)
    np.testing.assert_allclose(logs["boundary"], wall, rtol=1e-5)


def test_condition_values_array_and_callable_agree():
    points = np.random.default_rng(2).uniform(LOW, (1.0, 0.0), (10, 2)).astype("float32")
    model = kt.upgrade(plain_model())
    model.compile(optimizer="sgd", loss="mse", loss_terms=[
        kt.ConditionLoss(points, initial_values(points).numpy(), name="array",
                         in_validation=True),
        kt.ConditionLoss(points, initial_values, name="callable", in_validation=True),
    ])
    x, y = data()
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    expected = np.mean((model.predict(points, verbose=0) + np.sin(np.pi * points[:, :1])) ** 2)
    np.testing.assert_allclose([logs["array"], logs["callable"]], expected, rtol=1e-5)


def test_model_input_dimension_is_checked_at_compile():
    model = kt.upgrade(plain_model())
    before = [w.copy() for w in model.get_weights()]
    sampler = kt.physics.BoxSampler([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], n=4)
    with pytest.raises(ValueError, match="Received: collocation=BoxSampler"):
        model.compile(optimizer="sgd", loss="mse",
                      loss_terms=[kt.PDEResidual(burgers, sampler)])
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_lbfgs_objective_is_the_fit_loss_at_the_current_step():
    # The first loss lbfgs reports is the training objective fit minimizes
    # (data MSE + weighted terms, points of the optimizer's current step),
    # computed here by the hand-written loop's math.
    oracle = plain_model()
    initial = oracle.get_weights()
    model = tapeops_model(initial)
    fit(model)   # 4 steps: the sampler is now at step 4
    x, y = data()
    k = int(model.optimizer.iterations)
    points = oracle_points("box", tf.constant(k, "int64"))
    with tf.GradientTape() as second:
        second.watch(points)
        with tf.GradientTape() as first:
            first.watch(points)
            u = model(points)
        grad = first.gradient(u, points)
        u_x = grad[:, 0]
    u_xx = second.gradient(u_x, points)[:, 0]
    residual = grad[:, 1] + u[:, 0] * u_x - NU * u_xx
    expected = (np.mean((model.predict(x, verbose=0) - y) ** 2)
                + W_PDE * float(tf.reduce_mean(residual ** 2))
                + W_BC * np.mean(model.predict(boundary_points(), verbose=0) ** 2))
    before = [v.numpy() for v in model.metrics_variables]
    history = kt.physics.lbfgs(model, x, y, iterations=5)
    np.testing.assert_allclose(history["loss"][0], expected, rtol=1e-5)
    assert history["loss"][-1] < history["loss"][0]
    assert int(model.optimizer.iterations) == k   # no optimizer step, nothing logged
    for a, b in zip(before, model.metrics_variables):
        np.testing.assert_array_equal(a, b.numpy())


def test_lbfgs_solves_least_squares_like_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3 + 0.1 * rng.normal(size=(40, 1))).astype("float32")
    model = kt.upgrade(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    model.compile(optimizer="sgd", loss="mse")
    history = kt.physics.lbfgs(model, x, y, iterations=100)
    design = np.concatenate([x, np.ones((40, 1))], 1).astype("float64")
    solution = np.linalg.lstsq(design, y.astype("float64"), rcond=None)[0]
    kernel, bias = model.get_weights()
    np.testing.assert_allclose(np.concatenate([kernel.ravel(), bias]), solution.ravel(), atol=1e-4)
    assert history["stopped"] in ("gradient", "no_progress")


@pytest.mark.parametrize("kwargs, message", [
    ({"iterations": 0}, "Received: iterations=0"),
    ({"history_size": -1}, "Received: history_size=-1"),
    ({"tolerance": -1.0}, "Received: tolerance=-1.0"),
    ({"callback": 3}, "Received: callback=3"),
])
def test_lbfgs_bad_arguments(kwargs, message):
    model = tapeops_model(plain_model().get_weights())
    x, y = data()
    with pytest.raises((TypeError, ValueError), match=message):
        kt.physics.lbfgs(model, x, y, **kwargs)


def test_lbfgs_needs_a_compiled_tapeops_model():
    x, y = data()
    with pytest.raises(ValueError, match="Received: model=Sequential"):
        kt.physics.lbfgs(plain_model(), x, y)
    with pytest.raises(ValueError, match="compiled=False"):
        kt.physics.lbfgs(kt.upgrade(plain_model()), x, y)


def round_trip(obj):
    config = keras.saving.serialize_keras_object(obj)
    restored = keras.saving.deserialize_keras_object(config)
    assert type(restored) is type(obj)
    assert restored.get_config() == obj.get_config()
    return restored


def test_config_round_trips():
    box = kt.physics.BoxSampler([-1, 0.0], [1, 1.0], n=5, seed=7, resample_every=3)
    restored = round_trip(box)
    np.testing.assert_array_equal(restored.sample(4), box.sample(5))  # same key: 4 // 3 == 5 // 3
    fixed = round_trip(kt.physics.FixedPoints(FIXED))
    np.testing.assert_array_equal(fixed.points, FIXED)
    residual = round_trip(kt.PDEResidual(burgers, box, order=2, mode="forward", mixed=[(0, 1)],
                                         diagonal=[1, 0], weight=0.5, name="pde",
                                         in_validation=True))
    assert residual.residual_fn is burgers and residual.mixed == [[0, 1]]
    assert residual.diagonal == [0, 1]
    assert isinstance(round_trip(kt.PDEResidual(burgers, FIXED)).collocation, kt.physics.FixedPoints)
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, 10, 0.5)
    assert isinstance(round_trip(kt.PDEResidual(burgers, box, weight=schedule)).weight,
                      keras.optimizers.schedules.ExponentialDecay)
    for values in (0.5, initial_values, np.arange(14.0)):
        restored = round_trip(kt.ConditionLoss(boundary_points(), values, name="c"))
        if isinstance(values, np.ndarray):
            np.testing.assert_array_equal(restored.values, values.astype("float32"))
    assert repr(box) == "BoxSampler(low=[-1.0, 0.0], high=[1.0, 1.0], n=5, seed=7, resample_every=3)"
    assert repr(kt.physics.FixedPoints(FIXED)) == "FixedPoints(n=25, dim=2)"


def test_points_change_with_the_step_and_stay_in_the_box():
    box = kt.physics.BoxSampler([-1.0, 2.0], [1.0, 2.0], n=50, seed=1)
    a, b = box.sample(0).numpy(), box.sample(1).numpy()
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, box.sample(tf.constant(0, "int64")))
    assert a[:, 0].min() >= -1 and a[:, 0].max() <= 1 and np.all(a[:, 1] == 2.0)


@pytest.mark.parametrize("build, error, message", [
    (lambda: kt.physics.BoxSampler([0.0], [1.0, 2.0], 4), ValueError, "Received: low=[0.0], high=[1.0, 2.0]"),
    (lambda: kt.physics.BoxSampler([1.0], [0.0], 4), ValueError, "Received: low=[1.0], high=[0.0]"),
    (lambda: kt.physics.BoxSampler([0.0], [np.nan], 4), ValueError, "Received: high[0]=nan"),
    (lambda: kt.physics.BoxSampler("a", [1.0], 4), TypeError, "Received: low='a'"),
    (lambda: kt.physics.BoxSampler([0.0], [1.0], 0), ValueError, "Received: n=0"),
    (lambda: kt.physics.BoxSampler([0.0], [1.0], 4, seed=-1), ValueError, "Received: seed=-1"),
    (lambda: kt.physics.BoxSampler([0.0], [1.0], 4, seed=1.5), TypeError, "Received: seed=1.5"),
    (lambda: kt.physics.BoxSampler([0.0], [1.0], 4, resample_every=0), ValueError,
     "Received: resample_every=0"),
    (lambda: kt.physics.FixedPoints(np.zeros(3)), ValueError, "Received: points of shape (3,)"),
    (lambda: kt.physics.FixedPoints([["a"]]), TypeError, "Received: points of dtype <U1"),
    (lambda: kt.physics.FixedPoints([[np.inf]]), ValueError, "Received: points with 1 non-finite"),
    (lambda: kt.PDEResidual(3, FIXED), TypeError, "Received: residual_fn=3"),
    (lambda: kt.PDEResidual(burgers, "box"), TypeError, "Received: collocation='box'"),
    (lambda: kt.PDEResidual(burgers, np.zeros((4, 2), "float32")[:, 0]), ValueError,
     "Received: collocation of shape (4,)"),
    (lambda: kt.PDEResidual(burgers, FIXED, order=3), ValueError, "Received: order=3"),
    (lambda: kt.PDEResidual(burgers, FIXED, mode="fast"), ValueError, "Received: mode='fast'"),
    (lambda: kt.PDEResidual(burgers, FIXED, order=1, mixed=[(0, 1)]), ValueError,
     "Received: order=1, mixed=[(0, 1)]"),
    (lambda: kt.PDEResidual(burgers, FIXED, mixed=[(0, 2)]), ValueError, "Received: mixed=[(0, 2)]"),
    (lambda: kt.PDEResidual(burgers, FIXED, diagonal=[2]), ValueError, "Received: diagonal=[2]"),
    (lambda: kt.PDEResidual(burgers, FIXED, order=1, diagonal=[0]), ValueError,
     "Received: order=1, diagonal=[0]"),
    (lambda: kt.PDEResidual(burgers, FIXED, weight=-np.inf), ValueError, "Received: weight=-inf"),
    (lambda: kt.PDEResidual(burgers, FIXED, name=""), ValueError, "Received: name=''"),
    (lambda: kt.ConditionLoss(FIXED, "zero"), TypeError, "Received: values='zero'"),
    (lambda: kt.ConditionLoss(FIXED, np.nan), ValueError, "Received: values=nan"),
    (lambda: kt.ConditionLoss(FIXED, np.zeros(3)), ValueError, "Received: values of shape (3,) for 25"),
    (lambda: kt.ConditionLoss(kt.physics.BoxSampler([0.0], [1.0], 3), np.zeros(3)), ValueError,
     "Received: values of shape (3,), points=BoxSampler"),
])
def test_bad_arguments_raise_with_received(build, error, message):
    with pytest.raises(error) as info:
        build()
    assert message in str(info.value)


def test_saving_an_unregistered_residual_fails_clearly(tmp_path):
    model = kt.upgrade(plain_model())
    model.compile(optimizer="sgd", loss="mse", loss_terms=[
        kt.PDEResidual(lambda x, u, du, d2u: du[:, 0, 1], FIXED, name="pde")])
    with pytest.raises(ValueError, match="PDEResidual 'pde' cannot be saved"):
        model.save(str(tmp_path / "m.keras"))
