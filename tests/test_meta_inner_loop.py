"""`kt.MetaLearner`'s inner-loop options (issue 29 item 4), against oracles.

- keras.io's Reptile (examples/vision/reptile.py), ported line for line: a
  Conv/BatchNormalization model called without `training`, the per-example
  loss vector given to `tape.gradient` (so the mini-batch's losses are
  summed), `keras.optimizers.SGD` applied to the model's variables for each
  mini-batch of `dataset.shuffle(...).batch(inner_batch_size).repeat(inner_iters)`,
  then `old + (new - old) * cur_meta_step_size` with the step size decayed
  linearly; its inner step is a `tf.function`. `fit` of the MetaLearner
  configured as docs/meta_learning.md's recipe equals it (final weights,
  1e-6), with the oracle's shuffled order and with an unshuffled support set
  that the mini-batch size does not divide. A companion shows that the mean
  reduction (the library's default) fails the same check.
- `kt.meta.InnerSGD` with (Nesterov) momentum: Reptile against a fresh
  `keras.optimizers.SGD(momentum=...)` stepping a copy of the weights per task,
  and second-order MAML against a hand-written momentum loop under an outer
  tape; `adapted_weights` uses the same inner loop.
- `inner_training=False` with BatchNormalization (moving statistics far from
  0 and 1) equals a hand-written inference-mode loop; `True` does not.
- Saving and `get_config` keep the options; a config without them (a file
  saved before they existed) loads with the defaults; bad values raise
  Keras-style errors naming the argument.
"""

import copy
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.meta import inner_loop
from test_meta_learning_oracle import make_mlp
from test_meta_learning_oracle import max_difference
from test_meta_learning_oracle import mse
from test_meta_learning_oracle import sinusoid_tasks

ATOL = 1e-6
# keras.io's hyperparameters, scaled down (its learning_rate is 0.003; a
# larger one moves the tiny model's weights well beyond the tolerance).
LEARNING_RATE = 0.02
META_STEP_SIZE = 0.25
CLASSES, SHOTS, SIZE = 3, 4, 6


# ----------------------------------------------------- keras.io's Reptile
def conv_bn(x):
    x = keras.layers.Conv2D(filters=4, kernel_size=3, strides=2, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.ReLU()(x)


def keras_io_model(seed=0):
    """keras.io's model, smaller: two conv_bn blocks, Flatten, Dense(softmax)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.layers.Input(shape=(SIZE, SIZE, 1))
    x = conv_bn(conv_bn(inputs))
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(CLASSES, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def few_shot_tasks(count, shots, seed=0):
    """`count` tasks: `(images, labels, test_images, test_labels)` as keras.io's
    `get_mini_dataset(..., split=True)` returns them (labels 0..classes-1 in
    blocks of `shots`), with synthetic images (a class centre plus noise)."""
    rng = np.random.default_rng(seed)
    tasks = []
    for _ in range(count):
        centres = rng.normal(size=(CLASSES, SIZE, SIZE, 1))
        labels = np.repeat(np.arange(CLASSES), shots)
        images = centres[labels] + 0.5 * rng.normal(size=(CLASSES * shots, SIZE, SIZE, 1))
        test_images = centres + 0.5 * rng.normal(size=(CLASSES, SIZE, SIZE, 1))
        tasks.append((images.astype("float32"), labels.astype("int32"),
                      test_images.astype("float32"), np.arange(CLASSES, dtype="int32")))
    return tasks


def keras_io_reptile(model, tasks, inner_batch_size, inner_iters, shuffle_seed):
    """keras.io's meta-training loop on `tasks` (one task per meta-iteration).

    Returns the mini-batches each meta-iteration saw, in order. The only
    changes: the tasks are given, the shuffle has a seed, and there is no
    evaluation phase (it restores the weights it changes).
    """
    optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE)

    @tf.function
    def inner_step(images, labels):
        with tf.GradientTape() as tape:
            preds = model(images)
            loss = keras.losses.sparse_categorical_crossentropy(labels, preds)
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))

    meta_iters = len(tasks)
    seen = []
    for meta_iter in range(meta_iters):
        frac_done = meta_iter / meta_iters
        cur_meta_step_size = (1 - frac_done) * META_STEP_SIZE
        old_vars = model.get_weights()
        dataset = tf.data.Dataset.from_tensor_slices(tasks[meta_iter][:2])
        if shuffle_seed is not None:
            dataset = dataset.shuffle(100, seed=shuffle_seed + meta_iter)
        mini_dataset = dataset.batch(inner_batch_size).repeat(inner_iters)
        batches = []
        for images, labels in mini_dataset:
            batches.append((images.numpy(), labels.numpy()))
            inner_step(images, labels)
        seen.append(batches)
        new_vars = model.get_weights()
        for var in range(len(new_vars)):
            new_vars[var] = old_vars[var] + (
                (new_vars[var] - old_vars[var]) * cur_meta_step_size
            )
        model.set_weights(new_vars)
    return seen


def reptile_recipe(model, inner_steps, inner_batch_size, meta_iters,
                   inner_loss_reduction="sum"):
    """The MetaLearner as docs/meta_learning.md's keras.io recipe configures it."""
    meta = kt.MetaLearner(
        model, algorithm="reptile", inner_learning_rate=LEARNING_RATE,
        inner_steps=inner_steps, inner_batch_size=inner_batch_size,
        inner_training=False, inner_loss_reduction=inner_loss_reduction,
    )
    schedule = keras.optimizers.schedules.PolynomialDecay(
        META_STEP_SIZE, decay_steps=meta_iters, end_learning_rate=0.0, power=1.0
    )
    meta.compile(optimizer=keras.optimizers.SGD(schedule),
                 loss="sparse_categorical_crossentropy")
    return meta


def run_keras_io_pair(shuffled, inner_loss_reduction="sum"):
    """Returns `(learner weights, oracle weights, start weights)`."""
    meta_iters, inner_iters = 3, 2
    if shuffled:  # 12 examples, mini-batches of 4, a new order every pass
        shots, batch, seed = SHOTS, 4, 7
    else:  # 9 examples, mini-batches of 4, 4 and 1, in order
        shots, batch, seed = 3, 4, None
    tasks = few_shot_tasks(meta_iters, shots)
    oracle = keras_io_model()
    start = oracle.get_weights()
    seen = keras_io_reptile(oracle, tasks, batch, inner_iters, seed)
    steps = len(seen[0])
    assert steps == inner_iters * math.ceil(CLASSES * shots / batch)
    if shuffled:
        # The support set is what the shuffled dataset yielded, in its order:
        # the learner's in-order mini-batches are the oracle's.
        support_x = np.stack([np.concatenate([b[0] for b in s]) for s in seen])
        support_y = np.stack([np.concatenate([b[1] for b in s]) for s in seen])
    else:
        support_x = np.stack([t[0] for t in tasks])
        support_y = np.stack([t[1] for t in tasks])
        assert [len(b[1]) for b in seen[0]] == [4, 4, 1, 4, 4, 1]
    for s, batches in enumerate(seen[0]):
        cut_x, cut_y = inner_loop.mini_batch(support_x[0], support_y[0], s, batch)
        np.testing.assert_array_equal(cut_x, batches[0])
        np.testing.assert_array_equal(cut_y, batches[1])
    query_x = np.stack([t[2] for t in tasks])
    query_y = np.stack([t[3] for t in tasks])
    model = keras_io_model()
    meta = reptile_recipe(model, steps, batch, meta_iters, inner_loss_reduction)
    moving = [v.numpy().copy() for v in model.non_trainable_variables]
    meta.fit((support_x, support_y, query_x), query_y, batch_size=1, shuffle=False,
             verbose=0)
    assert int(meta.optimizer.iterations) == meta_iters
    # Called without `training`, BatchNormalization never updates its statistics.
    assert max_difference([v.numpy() for v in model.non_trainable_variables], moving) == 0.0
    return model.get_weights(), oracle.get_weights(), start


@pytest.mark.parametrize("shuffled", [True, False], ids=["shuffled", "uneven_batches"])
def test_keras_io_reptile_is_reproduced(shuffled):
    learned, expected, start = run_keras_io_pair(shuffled)
    assert max_difference(learned, expected) < ATOL
    assert max_difference(expected, start) > 1e-3  # training moved the weights


def test_keras_io_check_fails_with_the_mean_reduction():
    """Companion: the library's default reduction (the mean) is not keras.io's step."""
    learned, expected, _ = run_keras_io_pair(True, inner_loss_reduction="mean")
    assert max_difference(learned, expected) > 1e-4


# ------------------------------------------------------------- momentum
INNER_LR, OUTER_LR, BATCH, STEPS = 0.02, 0.05, 2, 4   # K = 5: batches of 2, 2, 1, then 2


def support_batch(x, y, step):
    count = -(-x.shape[0] // BATCH)
    j = step % count
    return x[j * BATCH:(j + 1) * BATCH], y[j * BATCH:(j + 1) * BATCH]


def keras_sgd_adapt(params, x, y, momentum, nesterov):
    """A fresh `keras.optimizers.SGD` stepping a copy of `params` on the mini-batches."""
    variables = [keras.Variable(p) for p in params]
    optimizer = keras.optimizers.SGD(INNER_LR, momentum=momentum, nesterov=nesterov)
    for step in range(STEPS):
        bx, by = support_batch(x, y, step)
        with tf.GradientTape() as tape:
            loss = mse([v.value for v in variables], tf.constant(bx), tf.constant(by))
        grads = tape.gradient(loss, [v.value for v in variables])
        optimizer.apply_gradients(zip(grads, variables))
    return [v.numpy() for v in variables]


def hand_reptile(weights, data, momentum, nesterov, tasks_per_batch=2):
    params = [w.copy() for w in weights]
    sx, sy = data[:2]
    for start in range(0, len(sx), tasks_per_batch):
        tasks = range(start, min(start + tasks_per_batch, len(sx)))
        deltas = [[p - a for p, a in zip(params, keras_sgd_adapt(params, sx[t], sy[t],
                                                                 momentum, nesterov))]
                  for t in tasks]
        mean = [np.sum(np.stack(d), axis=0) / np.float32(len(deltas)) for d in zip(*deltas)]
        params = [p - np.float32(OUTER_LR) * d for p, d in zip(params, mean)]
    return params


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_reptile_with_momentum_equals_keras_sgd_per_task(nesterov):
    data = sinusoid_tasks(4, support=5, query=6)
    model = make_mlp()
    expected = hand_reptile(model.get_weights(), data, 0.9, nesterov)
    meta = kt.MetaLearner(model, algorithm="reptile", inner_learning_rate=INNER_LR,
                          inner_steps=STEPS, inner_batch_size=BATCH,
                          inner_optimizer=kt.meta.InnerSGD(momentum=0.9, nesterov=nesterov))
    meta.compile(optimizer=keras.optimizers.SGD(OUTER_LR), loss="mse")
    meta.fit(data[:3], data[3], batch_size=2, shuffle=False, verbose=0)
    assert max_difference(model.get_weights(), expected) < ATOL
    # adapt() runs the same inner loop (momentum, mini-batches).
    adapted = meta.adapted_weights(data[0][0], data[1][0])
    hand = keras_sgd_adapt(model.get_weights(), data[0][0], data[1][0], 0.9, nesterov)
    assert max_difference([a.numpy() for a in adapted], hand) < ATOL
    # Companion: without momentum the result is far from it.
    plain = hand_reptile(make_mlp().get_weights(), data, 0.0, False)
    assert max_difference(plain, expected) > 1e-3


def hand_momentum_inner(params, x, y, momentum, nesterov):
    """Keras SGD's momentum formulas written out, differentiable (second order)."""
    params, velocity = list(params), [tf.zeros_like(p) for p in params]
    for step in range(STEPS):
        bx, by = support_batch(x, y, step)
        with tf.GradientTape() as tape:
            tape.watch(params)
            loss = mse(params, bx, by)
        for i, g in enumerate(tape.gradient(loss, params)):
            velocity[i] = momentum * velocity[i] - INNER_LR * g
            step_ = momentum * velocity[i] - INNER_LR * g if nesterov else velocity[i]
            params[i] = params[i] + step_
    return params


def test_second_order_maml_with_momentum_equals_hand_written_loop():
    data = sinusoid_tasks(4, support=5, query=6)
    model = make_mlp()
    params = [tf.Variable(w) for w in model.get_weights()]

    @tf.function
    def hand_step(sx, sy, qx, qy):
        with tf.GradientTape() as outer:
            losses = [mse(hand_momentum_inner(params, sx[t], sy[t], 0.9, True), qx[t], qy[t])
                      for t in range(2)]
            loss = tf.add_n(losses) / 2.0
        for p, g in zip(params, outer.gradient(loss, params)):
            p.assign_sub(OUTER_LR * g)

    for start in (0, 2):
        hand_step(*(tf.constant(a[start:start + 2]) for a in data))
    meta = kt.MetaLearner(model, inner_learning_rate=INNER_LR, inner_steps=STEPS,
                          inner_batch_size=BATCH,
                          inner_optimizer=kt.meta.InnerSGD(momentum=0.9, nesterov=True))
    meta.compile(optimizer=keras.optimizers.SGD(OUTER_LR), loss="mse")
    meta.fit(data[:3], data[3], batch_size=2, shuffle=False, verbose=0)
    expected = [p.numpy() for p in params]
    assert max_difference(model.get_weights(), expected) < ATOL
    assert max_difference(expected, make_mlp().get_weights()) > 1e-3


# --------------------------------------------------------- inner_training
def bn_mlp(seed=0):
    """1 -> Dense(8) -> BatchNormalization -> tanh -> Dense(1), moving statistics set."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((1,)), keras.layers.Dense(8, name="hidden"),
        keras.layers.BatchNormalization(name="bn"), keras.layers.Activation("tanh"),
        keras.layers.Dense(1, name="head"),
    ])
    bn = model.get_layer("bn")
    rng = np.random.default_rng(seed)
    bn.moving_mean.assign(rng.normal(size=8).astype("float32"))
    bn.moving_variance.assign(rng.uniform(0.2, 3.0, size=8).astype("float32"))
    return model


def test_inner_training_false_uses_moving_statistics_like_a_hand_written_loop():
    data = sinusoid_tasks(4, support=5, query=6)
    model = bn_mlp()
    bn = model.get_layer("bn")
    mean, variance = bn.moving_mean.numpy(), bn.moving_variance.numpy()

    def forward(p, x):  # BatchNormalization in inference mode, written out
        w1, b1, gamma, beta, w2, b2 = p
        h = tf.nn.batch_normalization(tf.matmul(x, w1) + b1, mean, variance, beta, gamma,
                                      bn.epsilon)
        return tf.matmul(tf.tanh(h), w2) + b2

    params = [v.numpy() for v in model.trainable_variables]
    sx, sy = data[:2]
    for start in (0, 2):
        deltas = []
        for t in (start, start + 1):
            adapted = [tf.constant(p) for p in params]
            for _ in range(2):
                with tf.GradientTape() as tape:
                    tape.watch(adapted)
                    loss = tf.reduce_mean(tf.square(forward(adapted, sx[t]) - sy[t]))
                adapted = [a - INNER_LR * g for a, g in zip(adapted, tape.gradient(loss, adapted))]
            deltas.append([p - a.numpy() for p, a in zip(params, adapted)])
        params = [p - np.float32(OUTER_LR) * ((d0 + d1) / np.float32(2))
                  for p, d0, d1 in zip(params, *deltas)]

    def fit(inner_training):
        net = bn_mlp()
        meta = kt.MetaLearner(net, algorithm="reptile", inner_learning_rate=INNER_LR,
                              inner_steps=2, inner_training=inner_training)
        meta.compile(optimizer=keras.optimizers.SGD(OUTER_LR), loss="mse")
        meta.fit(data[:3], data[3], batch_size=2, shuffle=False, verbose=0)
        assert max_difference([net.get_layer("bn").moving_mean.numpy()], [mean]) == 0.0
        return [v.numpy() for v in net.trainable_variables]

    assert max_difference(fit(False), params) < ATOL
    # Companion: the default (training mode: batch statistics) is another loop.
    assert max_difference(fit(True), params) > 1e-3


# ------------------------------------------------------------- saving
OPTIONS = dict(inner_batch_size=2, inner_optimizer=kt.meta.InnerSGD(momentum=0.5),
               inner_training=False, inner_loss_reduction="sum")


def test_save_load_keeps_the_inner_options_and_training_resumes(tmp_path):
    data = sinusoid_tasks(4, support=5, query=6)
    meta = kt.MetaLearner(make_mlp(), algorithm="reptile", inner_steps=3, **OPTIONS)
    meta.compile(optimizer=keras.optimizers.SGD(OUTER_LR, momentum=0.9), loss="mse")
    meta.fit(data[:3], data[3], batch_size=2, shuffle=False, verbose=0)
    path = str(tmp_path / "meta.keras")
    meta.save(path)
    loaded = keras.models.load_model(path)
    assert (loaded.inner_batch_size, loaded.inner_optimizer, loaded.inner_training,
            loaded.inner_loss_reduction) == tuple(OPTIONS.values())
    assert max_difference(loaded.model.get_weights(), meta.model.get_weights()) == 0.0
    meta.fit(data[:3], data[3], batch_size=2, shuffle=False, verbose=0)
    loaded.fit(data[:3], data[3], batch_size=2, shuffle=False, verbose=0)
    assert max_difference(loaded.model.get_weights(), meta.model.get_weights()) < ATOL


def test_get_config_round_trip_and_configs_saved_before_the_options():
    meta = kt.MetaLearner(make_mlp(), **OPTIONS)
    config = meta.get_config()
    assert config["inner_optimizer"]["config"] == {"momentum": 0.5, "nesterov": False}
    again = kt.MetaLearner.from_config(copy.deepcopy(config))
    assert again.get_config() == config
    assert again.inner_optimizer == kt.meta.InnerSGD(momentum=0.5)
    # A config written before these options existed loads with the defaults.
    old = {k: v for k, v in config.items() if not k.startswith("inner_") or
           k in ("inner_learning_rate", "inner_steps")}
    default = kt.MetaLearner.from_config(copy.deepcopy(old))
    assert (default.inner_batch_size, default.inner_optimizer, default.inner_training,
            default.inner_loss_reduction) == (None, None, True, "mean")
    sgd = kt.meta.InnerSGD(momentum=np.float32(0.25), nesterov=np.bool_(True))
    assert kt.meta.InnerSGD.from_config(sgd.get_config()) == sgd
    assert repr(sgd) == "InnerSGD(momentum=0.25, nesterov=True)"
    assert keras.saving.get_registered_name(kt.meta.InnerSGD) == "keras_tapeops>InnerSGD"


# ---------------------------------------------------- defaults and mini_batch
def test_mini_batch_cuts_in_order_and_wraps():
    x = np.arange(10, dtype="float32")[:, None]
    cuts = [inner_loop.mini_batch(x, x, s, 4)[0][:, 0].tolist() for s in range(4)]
    assert cuts == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]
    assert inner_loop.mini_batch(x, x, 3, None)[0] is x
    # Unknown K (a traced function without a static example count).
    spec = tf.TensorSpec((None, 1), "float32")
    cut = tf.function(lambda t: inner_loop.mini_batch(t, t, 2, 4)[0], input_signature=[spec])
    assert cut(tf.constant(x))[:, 0].numpy().tolist() == [8, 9]


def test_explicit_defaults_equal_the_default_learner():
    data = sinusoid_tasks(4, support=5, query=6)
    weights = []
    for options in ({}, dict(inner_batch_size=5, inner_optimizer=kt.meta.InnerSGD(),
                             inner_training=True, inner_loss_reduction="mean")):
        meta = kt.MetaLearner(make_mlp(), inner_learning_rate=INNER_LR, inner_steps=2,
                              **options)
        meta.compile(optimizer=keras.optimizers.SGD(OUTER_LR), loss="mse")
        meta.fit(data[:3], data[3], batch_size=2, shuffle=False, verbose=0)
        weights.append(meta.model.get_weights())
    assert max_difference(*weights) == 0.0


# ------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, error, message", [
    ({"inner_batch_size": 0}, ValueError, "Received: inner_batch_size=0"),
    ({"inner_batch_size": 2.5}, TypeError, "Received: inner_batch_size=2.5"),
    ({"inner_batch_size": True}, TypeError, "Received: inner_batch_size=True"),
    ({"inner_optimizer": "adam"}, TypeError, "Received: inner_optimizer='adam'"),
    ({"inner_optimizer": keras.optimizers.SGD(0.1)}, TypeError,
     "kt.meta.InnerSGD.*Received: inner_optimizer=<keras"),
    ({"inner_training": "no"}, TypeError, "Received: inner_training='no'"),
    ({"inner_training": None}, TypeError, "Received: inner_training=None"),
    ({"inner_loss_reduction": "avg"}, ValueError,
     r"\['mean', 'sum'\]. Received: inner_loss_reduction='avg'"),
])
def test_bad_inner_options_raise(kwargs, error, message):
    model = make_mlp()
    before = model.get_weights()
    with pytest.raises(error, match=message):
        kt.MetaLearner(model, **kwargs)
    assert max_difference(model.get_weights(), before) == 0.0


@pytest.mark.parametrize("kwargs, error, message", [
    ({"momentum": 1.5}, ValueError, r"\[0, 1\]. Received: momentum=1.5"),
    ({"momentum": -0.1}, ValueError, "Received: momentum=-0.1"),
    ({"momentum": "0.9"}, TypeError, "Received: momentum='0.9'"),
    ({"nesterov": "yes"}, TypeError, "Received: nesterov='yes'"),
])
def test_bad_inner_sgd_raises(kwargs, error, message):
    with pytest.raises(error, match=message):
        kt.meta.InnerSGD(**kwargs)
