"""`kt.LogGradientNorm` and `kt.LogUpdateRatio` against a hand-written loop.

Oracle (`hand_loop`): a `tf.GradientTape` step run as a `tf.function`
returns the true gradient of each batch (the loss scale divided out; under
"replicas=2", the sum of the two half-batch gradients MirroredStrategy
computes); NumPy takes the L2 norms of the groups in float64, clips the
global norm, and applies SGD with momentum in float32 exactly as Keras's
SGD does; the update ratio is `||w_new - w_old|| / ||w_old||` of the group.
History must hold each epoch's mean over steps (and max for `log_max`).

Groups: all variables, `backbone*` (two layers) and `head`, logged before a
`ClipByGlobalNorm`; the global norm is logged again after it. The clip fires
on some steps, not all (checked). Variants: MirroredStrategy x2 (equal to the
single-device values), mixed_float16 (against a float16 loop with the same
loss scale), micro_batches, accumulation_steps, steps_per_execution,
jit_compile. Companion tests show each comparison can fail.
"""

import contextlib
import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.transforms.update_ratio import LogUpdateRatio

from oracle_utils import graph_step

LR = 0.05
MOMENTUM = 0.9
BATCH = 16
EPOCHS = 2
N = 64
CLIP = 6.0
TOL = 1e-5

GROUPS = {
    "grad_norm": lambda v: True,
    "backbone_norm": lambda v: v.path.startswith("backbone"),
    "head_norm": lambda v: v.path.startswith("head/"),
}
RATIOS = {
    "backbone_update": GROUPS["backbone_norm"],
    "head_update": GROUPS["head_norm"],
}


def make_net():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="backbone_1")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="backbone_2")(h)
    outputs = keras.layers.Dense(2, name="head")(h)
    return kt.upgrade(keras.Model(inputs, outputs, name="net"))


def make_data(n=N, seed=0):
    """Targets of the second batch 3x larger: the clip fires there, not everywhere."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (2.0 * rng.normal(size=(n, 2))).astype("float32")
    y[BATCH:2 * BATCH] *= 3.0
    return x, y


def transforms():
    return [
        kt.LogGradientNorm(name="grad_norm", log_max=True),
        kt.LogGradientNorm(where="backbone*", name="backbone_norm"),
        kt.LogGradientNorm(where="head", name="head_norm"),
        kt.ClipByGlobalNorm(CLIP),
        kt.LogGradientNorm(name="clipped_norm", log_max=True),
        LogUpdateRatio(where="backbone*", name="backbone_update"),
        LogUpdateRatio(where="head", name="head_update"),
    ]


LOGGED = ["grad_norm", "grad_norm_max", "backbone_norm", "head_norm", "clipped_norm",
          "clipped_norm_max", "backbone_update", "head_update"]


# ------------------------------------------------------------------- oracle
def hand_loop(weights, x, y, batch=BATCH, replicas=1, loss_scale=None, epochs=EPOCHS,
              clip=CLIP):
    """Returns `(per-epoch lists of per-step records, final weights)`.

    A record maps each logged name to that step's value (None: not counted).
    """
    model = make_net()
    model.set_weights(weights)
    variables = model.trainable_variables
    scale = tf.constant(1.0 if loss_scale is None else loss_scale, "float32")

    @graph_step
    def gradients(xb, yb):
        total = None
        for xr, yr in zip(tf.split(xb, replicas), tf.split(yb, replicas)):
            with tf.GradientTape() as tape:
                pred = tf.cast(model(xr, training=True), "float32")
                loss = tf.reduce_mean(tf.square(pred - yr)) / replicas * scale
            grads = [g / scale for g in tape.gradient(loss, variables)]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        return total

    momenta = [np.zeros(v.shape, "float32") for v in variables]
    epochs_records = []
    for _ in range(epochs):
        records = []
        for start in range(0, len(x), batch):
            grads = gradients(tf.constant(x[start:start + batch]),
                              tf.constant(y[start:start + batch]))
            grads = [g.numpy() for g in grads]
            record = {}
            for name, selects in GROUPS.items():
                record[name] = group_norm(grads, variables, selects)
            finite = np.isfinite(record["grad_norm"])
            factor = clip / max(record["grad_norm"], clip) if finite else 1.0
            grads = [(g.astype(np.float64) * factor).astype("float32") for g in grads]
            record["clipped_norm"] = group_norm(grads, variables, GROUPS["grad_norm"])
            record["clipped"] = finite and factor < 1.0
            old = [v.numpy() for v in variables]
            if finite:
                for i, (v, g) in enumerate(zip(variables, grads)):
                    momenta[i] = momenta[i] * np.float32(MOMENTUM) - g * np.float32(LR)
                    v.assign(old[i] + momenta[i])
            new = [v.numpy() for v in variables]
            for name, selects in RATIOS.items():
                record[name] = update_ratio(old, new, variables, selects)
            records.append(record)
        epochs_records.append(records)
    return epochs_records, [v.numpy() for v in variables]


def group_norm(grads, variables, selects):
    return float(np.sqrt(sum(
        np.sum(np.square(g.astype(np.float64)))
        for g, v in zip(grads, variables) if selects(v)
    )))


def update_ratio(old, new, variables, selects):
    picked = [i for i, v in enumerate(variables) if selects(v)]
    update = np.sqrt(sum(np.sum(np.square(new[i].astype(np.float64) - old[i])) for i in picked))
    weights = np.sqrt(sum(np.sum(np.square(old[i].astype(np.float64))) for i in picked))
    return float(update / weights)


def expected_history(epochs_records, names=LOGGED):
    """Each epoch's mean over steps of the finite values; `_max`: the largest."""
    out = {}
    for name in names:
        values = []
        for records in epochs_records:
            base = name[:-4] if name.endswith("_max") else name
            finite = [r[base] for r in records if np.isfinite(r[base])]
            values.append(max(finite) if name.endswith("_max") else float(np.mean(finite)))
        out[name] = values
    return out


def assert_history(history, expected, tol=TOL):
    for name, values in expected.items():
        np.testing.assert_allclose(history[name], values, rtol=tol, atol=0, err_msg=name)


def fit_history(weights, x, y, strategy=None, batch=BATCH, optimizer=None, **kwargs):
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = make_net()
        model.set_weights(weights)
        model.compile(
            optimizer=optimizer or keras.optimizers.SGD(LR, momentum=MOMENTUM),
            loss="mse", gradient_transforms=kwargs.pop("transforms", None) or transforms(),
            **kwargs,
        )
    history = model.fit(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0)
    return history.history, model


@pytest.fixture(scope="module")
def oracle():
    keras.utils.set_random_seed(5)
    x, y = make_data()
    weights = make_net().get_weights()
    records, final = hand_loop(weights, x, y)
    keras.backend.clear_session()
    return {"x": x, "y": y, "weights": weights, "records": records, "final": final,
            "history": expected_history(records)}


# -------------------------------------------------------------------- tests
def test_the_clip_fires_on_some_steps_not_all(oracle):
    clipped = [r["clipped"] for records in oracle["records"] for r in records]
    assert any(clipped) and not all(clipped), clipped


def test_logged_norms_equal_numpy_norms_of_true_gradients(oracle):
    history, model = fit_history(oracle["weights"], oracle["x"], oracle["y"])
    assert set(LOGGED) | {"loss"} == set(history)
    assert_history(history, oracle["history"])
    for a, e in zip(model.get_weights(), oracle["final"]):
        np.testing.assert_allclose(a, e, atol=1e-6, rtol=0)


def test_clipped_norm_is_the_norm_after_the_clip(oracle):
    """After ClipByGlobalNorm(6) each step's norm is min(norm, 6): means differ, max <= 6."""
    h = oracle["history"]
    assert max(h["clipped_norm_max"]) == pytest.approx(CLIP, rel=1e-6)
    assert max(h["grad_norm_max"]) > CLIP
    assert all(c <= g for c, g in zip(h["clipped_norm"], h["grad_norm"]))
    assert h["clipped_norm"][0] < h["grad_norm"][0]


def test_history_check_can_fail(oracle):
    """The oracle's values of another group, without the clip, or of the first epoch only."""
    history, _ = fit_history(oracle["weights"], oracle["x"], oracle["y"])
    unclipped = expected_history(
        hand_loop(oracle["weights"], oracle["x"], oracle["y"], clip=1e9)[0])
    h = oracle["history"]
    for wrong in (
        {"grad_norm": h["backbone_norm"]},
        {"clipped_norm": h["grad_norm"]},
        {"head_update": unclipped["head_update"]},
        {"grad_norm": [h["grad_norm"][0]] * EPOCHS},
        {"grad_norm_max": h["grad_norm"]},
    ):
        with pytest.raises(AssertionError):
            assert_history(history, wrong)


def test_update_ratio_is_the_applied_update_not_the_gradient(oracle):
    """The first step (no momentum yet, not clipped) moves lr * g; later ones more."""
    model = make_net()
    model.set_weights(oracle["weights"])
    head = [v for v in model.trainable_variables if GROUPS["head_norm"](v)]
    weights_norm = np.sqrt(sum(np.sum(np.square(v.numpy().astype(np.float64))) for v in head))
    first = oracle["records"][0][0]
    assert not first["clipped"]
    assert first["head_update"] == pytest.approx(LR * first["head_norm"] / weights_norm,
                                                 rel=1e-5)
    # Momentum makes the applied update larger than plain SGD's lr * g.
    history, _ = fit_history(oracle["weights"], oracle["x"], oracle["y"],
                             optimizer=keras.optimizers.SGD(LR))
    assert history["head_update"][1] < oracle["history"]["head_update"][1] / 2


@pytest.mark.parametrize("variant", ["jit_compile", "steps_per_execution", "micro_batches"])
def test_variants_log_the_same(oracle, variant):
    kwargs = {
        "jit_compile": {"jit_compile": True},
        "steps_per_execution": {"steps_per_execution": 3},
        "micro_batches": {"micro_batches": 2},
    }[variant]
    history, _ = fit_history(oracle["weights"], oracle["x"], oracle["y"], **kwargs)
    assert_history(history, oracle["history"])


def test_accumulation_logs_one_value_per_window(oracle):
    """accumulation_steps=2 of batches of 16 = steps on batches of 32."""
    x, y, weights = oracle["x"], oracle["y"], oracle["weights"]
    history, _ = fit_history(weights, x, y, accumulation_steps=2)
    records, _ = hand_loop(weights, x, y, batch=2 * BATCH)
    assert_history(history, expected_history(records))
    with pytest.raises(AssertionError):  # not the per-batch values
        assert_history(history, oracle["history"])


def test_mirrored_logs_the_single_device_values(oracle, mirrored):
    x, y, weights = oracle["x"], oracle["y"], oracle["weights"]
    history, _ = fit_history(weights, x, y, strategy=mirrored)
    single, _ = fit_history(weights, x, y)
    assert_history(history, {k: single[k] for k in LOGGED})
    split, _ = hand_loop(weights, x, y, replicas=2)
    assert_history(history, expected_history(split))
    assert_history(history, oracle["history"])


def test_per_replica_norms_would_differ(oracle):
    """Companion: the norm of one replica's half-batch gradient is not the logged norm."""
    x, y, weights = oracle["x"], oracle["y"], oracle["weights"]
    model = make_net()
    model.set_weights(weights)
    with tf.GradientTape() as tape:
        half = tf.reduce_mean(tf.square(model(x[:BATCH // 2]) - y[:BATCH // 2])) / 2
    grads = [g.numpy() for g in tape.gradient(half, model.trainable_variables)]
    norm = group_norm(grads, model.trainable_variables, GROUPS["grad_norm"])
    first_step = oracle["records"][0][0]["grad_norm"]
    assert abs(norm - first_step) > 1e-2 * first_step


def test_mixed_float16_logs_true_gradient_norms(oracle):
    keras.config.set_dtype_policy("mixed_float16")
    x, y, weights = oracle["x"], oracle["y"], oracle["weights"]
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(LR, momentum=MOMENTUM), initial_scale=2.0**10,
        dynamic_growth_steps=1000,
    )
    history, _ = fit_history(weights, x, y, optimizer=optimizer)
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**10  # no overflow
    records, _ = hand_loop(weights, x, y, loss_scale=2.0**10)
    assert_history(history, expected_history(records))
    # Close to the float32 values (true gradients), far from the scaled ones.
    assert_history(history, {"grad_norm": oracle["history"]["grad_norm"]}, tol=1e-2)
    with pytest.raises(AssertionError):
        assert_history(history, {"grad_norm": [
            g * 2.0**10 for g in oracle["history"]["grad_norm"]]}, tol=1e-2)
    with pytest.raises(AssertionError):  # float16 is not float32
        assert_history(history, {"grad_norm": oracle["history"]["grad_norm"]})


def test_skipped_step_norm_not_counted_and_update_ratio_zero(oracle):
    """A nan batch under SkipNonFinite: its norm is left out, its update ratio is 0."""
    x, y, weights = oracle["x"], oracle["y"].copy(), oracle["weights"]
    y[2 * BATCH + 1, 0] = np.nan
    names = ["grad_norm", "head_update"]
    history, _ = fit_history(weights, x, y, transforms=[
        kt.SkipNonFinite(), kt.LogGradientNorm(name="grad_norm"),
        LogUpdateRatio(where="head", name="head_update"),
    ], optimizer=keras.optimizers.SGD(LR, momentum=MOMENTUM))
    records, _ = hand_loop(weights, x, y, clip=1e9)
    skipped = records[0][2]
    assert np.isnan(skipped["grad_norm"]) and skipped["head_update"] == 0.0
    assert history["skipped_steps"] == [1.0, 1.0]
    assert_history(history, expected_history(records, names))
    # Companion: leaving the skipped step out of the ratio's mean is another value.
    no_zero = [[r for r in recs if r["head_update"] > 0] for recs in records]
    with pytest.raises(AssertionError):
        assert_history(history, expected_history(no_zero, ["head_update"]))


def test_logged_in_progress_bar_and_tensorboard(oracle, tmp_path, capsys):
    x, y, weights = oracle["x"], oracle["y"], oracle["weights"]
    model = make_net()
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=MOMENTUM), loss="mse",
                  gradient_transforms=transforms())
    logs = str(tmp_path / "logs")
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=2,
                        callbacks=[keras.callbacks.TensorBoard(logs)])
    out = capsys.readouterr().out
    for name in LOGGED:
        assert f" {name}: " in out, name
    scalars = {}
    for path in glob.glob(os.path.join(logs, "train", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(
                    float(tf.make_ndarray(value.tensor)))
    for name in LOGGED:
        np.testing.assert_allclose(scalars[f"epoch_{name}"], history.history[name],
                                   rtol=1e-6)


def test_training_only_metrics_are_not_reported_by_evaluate(oracle):
    """Gradient norms, update ratios and skip counts exist only in training.

    `evaluate()` (and fit's validation) runs no optimizer step: it must not
    report them (stock Keras reports only what its test step computes), not
    as `grad_norm: 0` nor as `val_grad_norm` in History.
    """
    x, y, weights = oracle["x"], oracle["y"], oracle["weights"]
    model = make_net()
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse",
                  gradient_transforms=[kt.SkipNonFinite(), *transforms()])
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        validation_data=(x, y))
    results = model.evaluate(x, y, return_dict=True, verbose=0)
    assert set(results) == {"loss"}
    assert set(history.history) == {"loss", "val_loss", "skipped_steps", *LOGGED}


def test_metric_names_must_be_unique():
    model = make_net()
    with pytest.raises(ValueError, match=r"named 'grad_norm'.*already taken"):
        model.compile(optimizer="sgd", loss="mse", gradient_transforms=[
            kt.LogGradientNorm(), kt.LogGradientNorm(where="head")])
    with pytest.raises(ValueError, match=r"named 'loss'"):
        model.compile(optimizer="sgd", loss="mse",
                      gradient_transforms=[LogUpdateRatio(name="loss")])


def test_one_object_serves_two_models(oracle):
    """Configuration is not state: two models compiled with the same objects log their own."""
    x, y, weights = oracle["x"], oracle["y"], oracle["weights"]
    shared = transforms()
    first, _ = fit_history(weights, x, y, transforms=shared)
    second, _ = fit_history(weights, x, y, transforms=shared)
    assert_history(first, oracle["history"])
    assert_history(second, oracle["history"])


def test_update_ratio_config_and_errors():
    obj = LogUpdateRatio(where=["backbone*"], name="bb")
    assert LogUpdateRatio.from_config(obj.get_config()).get_config() == {
        "where": ["backbone*"], "name": "bb",
    }
    with pytest.raises(ValueError, match=r"Received: name=''"):
        LogUpdateRatio(name="")
    with pytest.raises(TypeError, match=r"where=3"):
        LogUpdateRatio(where=3)
