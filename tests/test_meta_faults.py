"""`kt.MetaLearner` faults (issue 28): saving under a strategy, meta-batches of one task.

- Meta-SGD trained under MirroredStrategy, saved to `.keras` and loaded on one
  device or under the strategy: every optimizer slot (SGD momentum, Adam's
  moments) sits on the variable it was made for and keeps its value, and one
  more epoch equals one more epoch of the learner that was never saved. The
  optimizer's saved state is a list in build order, so the order must be the
  same in every context (weights, then rates). A companion shows the slot
  check fails on a permuted slot list and on the order the learner used to
  have under a strategy (rates first).
- A Conv2D model whose last meta-batch holds one task (5 tasks, batch_size=2):
  fit, evaluate and predict run and equal a hand-written oracle.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from test_meta_learning_oracle import make_mlp
from test_meta_learning_oracle import max_difference
from test_meta_learning_oracle import sinusoid_tasks

INNER_LR = 0.02
ATOL = 1e-6
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.002, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-3),
}


# ------------------------------------------------------- slots after a reload
def slot_values(meta):
    """`{(i, slot kind): (variable shape, slot value)}`, i indexing `outer_variables()`.

    A slot is found by its name (Keras names it after its variable's path), so
    this reads where each slot sits, whatever the optimizer's list order.
    (Paths are not compared across a reload: a loaded model's paths may differ.)
    """
    per_variable = {}
    for i, variable in enumerate(meta.outer_variables()):
        prefix = variable.path.replace("/", "_") + "_"
        slots = [s for s in meta.optimizer.variables if s.name.startswith(prefix)]
        assert slots, f"no optimizer slot for {variable.path}"
        for slot in slots:
            key = (i, slot.name[len(prefix):])
            per_variable[key] = (tuple(variable.shape), slot.numpy())
    return per_variable


def slot_mismatches(expected, meta):
    """Slots of `meta` that are missing, shaped unlike their variable or valued unlike `expected`.

    Args:
        expected: `slot_values` of the learner before saving.
        meta: the learner to check (e.g. the reloaded one).

    Returns:
        `{slot key: max abs difference (inf for a missing or misshaped slot)}`.
    """
    found = slot_values(meta)
    out = {}
    for key, (shape, value) in expected.items():
        if key not in found or found[key][0] != shape or found[key][1].shape != shape:
            out[key] = float("inf")
            continue
        error = float(np.max(np.abs(found[key][1] - value)))
        if error > ATOL:
            out[key] = error
    return out


def make_meta_sgd(optimizer):
    meta = kt.MetaLearner(make_mlp(), inner_learning_rate=INNER_LR, inner_steps=1,
                          learn_inner_learning_rate=True)
    meta.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse")
    return meta


def state(meta):
    return meta.model.get_weights() + [r.numpy() for r in meta.learned_rates]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_meta_sgd_saved_under_mirrored_restores_every_slot(tmp_path, mirrored, optimizer):
    # 8 tasks in meta-batches of 4: two steps, 2 + 2 tasks per replica.
    data = sinusoid_tasks(8, support=5, query=6)
    fit = dict(batch_size=4, shuffle=False, verbose=0)
    with mirrored.scope():
        meta = make_meta_sgd(optimizer)
    meta.fit(data[:3], data[3], **fit)
    expected = slot_values(meta)
    # Rates and weights have the same shapes: a wrong order loads silently.
    assert len(expected) == len(meta.outer_variables()) * (1 if optimizer == "sgd_momentum"
                                                           else 2)
    path = str(tmp_path / "meta.keras")
    meta.save(path)
    one_device = keras.models.load_model(path)
    with mirrored.scope():
        replicated = keras.models.load_model(path)
    for loaded in (one_device, replicated):
        assert slot_mismatches(expected, loaded) == {}
        assert max_difference(state(loaded), state(meta)) == 0.0
    # One more epoch: the reloaded learners continue as the never-saved one.
    meta.fit(data[:3], data[3], **fit)
    one_device.fit(data[:3], data[3], **fit)
    replicated.fit(data[:3], data[3], **fit)
    for loaded in (one_device, replicated):
        assert max_difference(state(loaded), state(meta)) < ATOL
        assert slot_mismatches(slot_values(meta), loaded) == {}
    assert max_difference(state(meta), state(make_meta_sgd(optimizer))) > 1e-3


def test_slot_check_detects_a_permuted_or_rates_first_slot_list(tmp_path):
    data = sinusoid_tasks(4, support=5, query=6)
    meta = make_meta_sgd("sgd_momentum")
    meta.fit(data[:3], data[3], batch_size=4, shuffle=False, verbose=0)
    expected = slot_values(meta)
    assert slot_mismatches(expected, meta) == {}
    # A permuted slot list (the weights' momentums swapped with the rates').
    slots = [s for s in meta.optimizer.variables if s.name.endswith("_momentum")]
    half = len(slots) // 2
    values = [s.numpy() for s in slots]
    for slot, value in zip(slots, values[half:] + values[:half]):
        slot.assign(value)
    assert set(slot_mismatches(expected, meta)) == set(expected)
    # The order the learner's optimizer had under a strategy before the fix:
    # built from `trainable_variables` (the learner's rates first). Saved that
    # way, the file loads into the weights-first optimizer with swapped slots.
    rates_first = make_meta_sgd("sgd_momentum")
    optimizer = keras.optimizers.SGD(0.002, momentum=0.9)
    optimizer.build(rates_first.learned_rates + rates_first.model.trainable_variables)
    rates_first.compile(optimizer=optimizer, loss="mse")
    rates_first.fit(data[:3], data[3], batch_size=4, shuffle=False, verbose=0)
    before = slot_values(rates_first)
    path = str(tmp_path / "rates_first.keras")
    rates_first.save(path)
    errors = slot_mismatches(before, keras.models.load_model(path))
    assert set(errors) == set(before) and min(errors.values()) > 1e-4


# ----------------------------------------------- a meta-batch of one task (Conv2D)
def make_conv(seed=0):
    """`(4, 4, 1) -> Conv2D(2, 3, same) -> Flatten -> Dense(1)`."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((4, 4, 1)),
        keras.layers.Conv2D(2, 3, padding="same", activation="tanh", name="conv"),
        keras.layers.Flatten(),
        keras.layers.Dense(1, name="head"),
    ], name="cnn")


def image_tasks(tasks, support=3, query=4, seed=0):
    rng = np.random.default_rng(seed)
    sx = rng.normal(size=(tasks, support, 4, 4, 1)).astype("float32")
    qx = rng.normal(size=(tasks, query, 4, 4, 1)).astype("float32")
    scale = rng.uniform(0.5, 2.0, (tasks, 1, 1)).astype("float32")
    target = lambda x: scale * x.mean(axis=(2, 3))  # noqa: E731
    return sx, target(sx), qx, target(qx)


def conv_forward(params, x):
    kernel, bias, w, b = params
    h = tf.tanh(tf.nn.conv2d(x, kernel, strides=1, padding="SAME") + bias)
    return tf.matmul(tf.reshape(h, (tf.shape(h)[0], -1)), w) + b


def conv_mse(params, x, y):
    return tf.reduce_mean(tf.square(conv_forward(params, x) - y))


class HandConvMAML:
    """Second-order MAML by hand for `make_conv`'s network, outer SGD, one task at a time."""

    def __init__(self, weights, inner_lr, steps, outer_lr):
        self.params = [tf.Variable(w) for w in weights]
        self.inner_lr, self.steps, self.outer_lr = inner_lr, steps, outer_lr
        self.step = tf.function(self._step)

    def inner(self, params, x, y):
        params = list(params)
        for _ in range(self.steps):
            with tf.GradientTape() as tape:
                tape.watch(params)
                loss = conv_mse(params, x, y)
            params = [p - self.inner_lr * g for p, g in zip(params, tape.gradient(loss, params))]
        return params

    def _step(self, sx, sy, qx, qy):
        with tf.GradientTape() as outer:
            losses = [conv_mse(self.inner(self.params, sx[t], sy[t]), qx[t], qy[t])
                      for t in range(sx.shape[0])]
            loss = tf.add_n(losses) / len(losses)
        for p, g in zip(self.params, outer.gradient(loss, self.params)):
            p.assign_sub(self.outer_lr * g)
        return tf.stack(losses)

    def fit(self, data, batch_size):
        losses = []
        for start in range(0, len(data[0]), batch_size):
            losses.extend(self.step(*[tf.constant(a[start:start + batch_size])
                                      for a in data]).numpy())
        return float(np.mean(losses))

    def weights(self):
        return [p.numpy() for p in self.params]

    def predict(self, data):
        sx, sy, qx, _ = data
        return np.stack([conv_forward(self.inner(self.params, sx[t], sy[t]), qx[t]).numpy()
                         for t in range(len(sx))])


def test_conv_model_with_a_one_task_meta_batch_equals_the_oracle():
    data = image_tasks(5)  # meta-batches of 2, 2 and 1 task
    model = make_conv()
    oracle = HandConvMAML(model.get_weights(), INNER_LR, steps=2, outer_lr=0.05)
    meta = kt.MetaLearner(model, inner_learning_rate=INNER_LR, inner_steps=2)
    meta.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = meta.fit(data[:3], data[3], batch_size=2, shuffle=False, verbose=0)
    expected_loss = oracle.fit(data, batch_size=2)
    assert max_difference(meta.model.get_weights(), oracle.weights()) < ATOL
    np.testing.assert_allclose(history.history["loss"], [expected_loss], rtol=1e-6)
    assert max_difference(meta.model.get_weights(), make_conv().get_weights()) > 1e-3
    expected = oracle.predict(data)
    predicted = meta.predict(data[:3], batch_size=2, verbose=0)
    assert predicted.shape == expected.shape == (5, 4, 1)
    np.testing.assert_allclose(predicted, expected, atol=ATOL)
    result = meta.evaluate(data[:3], data[3], batch_size=2, verbose=0, return_dict=True)
    np.testing.assert_allclose(result["loss"], np.mean((expected - data[3]) ** 2), rtol=1e-5)
    # A meta-batch of one task from the start (a single-task dataset).
    one = tuple(a[:1] for a in data)
    np.testing.assert_allclose(meta.predict(one[:3], batch_size=1, verbose=0), expected[:1],
                               atol=ATOL)


def test_conv_model_under_mirrored_with_one_and_no_task_per_replica(mirrored):
    # 5 tasks in meta-batches of 4: replicas get 2 + 2 tasks, then 1 + 0.
    data = image_tasks(5)
    oracle = HandConvMAML(make_conv().get_weights(), INNER_LR, steps=1, outer_lr=0.05)
    expected_loss = oracle.fit(data, batch_size=4)
    with mirrored.scope():
        meta = kt.MetaLearner(make_conv(), inner_learning_rate=INNER_LR, inner_steps=1)
        meta.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = meta.fit(data[:3], data[3], batch_size=4, shuffle=False, verbose=0)
    assert max_difference(meta.model.get_weights(), oracle.weights()) < ATOL
    np.testing.assert_allclose(history.history["loss"], [expected_loss], rtol=1e-6)
    np.testing.assert_allclose(meta.predict(data[:3], batch_size=4, verbose=0),
                               oracle.predict(data), atol=ATOL)


# ------------------------------------------- map_tasks: a static task axis stays static
def conv_on_tasks(layer, tasks):
    """`layer` on each task's images through `map_tasks`, traced with `tasks`' static shape."""
    from keras_tapeops.meta.tasks import map_tasks

    @tf.function(input_signature=[tf.TensorSpec(tasks.shape, tasks.dtype)])
    def run(x):
        return map_tasks(lambda t: layer(t[0]), (x,))

    return run.get_concrete_function().structured_outputs.shape, run(tasks).numpy()


def per_task(layer, images):
    """`layer` on each task's images, one task at a time (the oracle)."""
    outputs = [layer(task).numpy() for task in images]
    return np.stack(outputs) if outputs else np.zeros((0, 3, 4, 4, 2), "float32")


@pytest.mark.parametrize("tasks", [3, 1, 0])
def test_map_tasks_keeps_a_static_task_count_static(tasks):
    # A known count needs no run-time padding: a `tf.cond` on the count made the
    # task axis unknown, and the vectorized step 1.15-1.2x a hand-written one.
    # One task (Conv2D's bias add squeezes a size-1 axis) and none are padded
    # to two at trace time and cut back.
    layer = make_conv().get_layer("conv")
    images = np.random.default_rng(0).normal(size=(tasks, 3, 4, 4, 1)).astype("float32")
    shape, outputs = conv_on_tasks(layer, tf.constant(images))
    assert shape.as_list() == [tasks, 3, 4, 4, 2]
    np.testing.assert_allclose(outputs, per_task(layer, images), atol=1e-6)


def test_map_tasks_with_an_unknown_task_count_pads_at_run_time():
    from keras_tapeops.meta.tasks import map_tasks

    layer = make_conv().get_layer("conv")

    @tf.function(input_signature=[tf.TensorSpec([None, 3, 4, 4, 1], "float32")])
    def run(x):
        return map_tasks(lambda t: layer(t[0]), (x,))

    assert run.get_concrete_function().structured_outputs.shape.as_list() == [None, 3, 4, 4, 2]
    images = np.random.default_rng(1).normal(size=(2, 3, 4, 4, 1)).astype("float32")
    for tasks in (2, 1, 0):
        np.testing.assert_allclose(run(images[:tasks]).numpy(), per_task(layer, images[:tasks]),
                                   atol=1e-6)
