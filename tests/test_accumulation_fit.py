"""End-to-end `fit()` tests of micro_batches and accumulation_steps against oracles.

Oracles: stock Keras on the large batch (`train_on_batch`), a hand-written
`tf.GradientTape` loop that accumulates `loss * n_micro / n` gradients over the
micro-batches and applies once, and NumPy for BatchNormalization statistics.
Same initial weights, same batches (shuffle=False).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops import accumulation

from accumulation_utils import TOL
from accumulation_utils import assert_close
from accumulation_utils import make_data
from accumulation_utils import make_net
from accumulation_utils import max_diff
from accumulation_utils import to_int


@pytest.fixture(scope="module")
def initial_weights():
    keras.utils.set_random_seed(7)
    return make_net().get_weights()


def stock_on_batches(weights, x, y, sw, bounds, optimizer=None, strategy=None):
    """Stock Keras, one `train_on_batch` per [start, end) bound."""
    with strategy.scope() if strategy else _null():
        model = make_net()
        model.set_weights(weights)
        model.compile(optimizer or keras.optimizers.Adam(0.01), "mse")
    for start, end in bounds:
        model.train_on_batch(x[start:end], y[start:end],
                             sample_weight=None if sw is None else sw[start:end])
    return model


def fit_ours(weights, x, y, sw, batch_size, epochs=1, strategy=None, optimizer=None,
             **compile_kwargs):
    with strategy.scope() if strategy else _null():
        model = make_net()
        model.set_weights(weights)
        model.compile(optimizer or keras.optimizers.Adam(0.01), "mse", **compile_kwargs)
    history = model.fit(x, y, sample_weight=sw, batch_size=batch_size, epochs=epochs,
                        shuffle=False, verbose=0)
    return model, history


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def tape_micro_batch_loop(weights, x, y, sw, batch_size, k, lr=0.05):
    """Hand-written: per batch, sum grads of `loss_j * n_j / n` over micro-batches, SGD once."""
    model = make_net()
    model.set_weights(weights)
    variables = model.trainable_variables
    for start in range(0, len(x), batch_size):
        xb, yb, wb = x[start:start + batch_size], y[start:start + batch_size], sw[start:start + batch_size]
        n = len(xb)
        sums = [tf.zeros_like(v) for v in variables]
        offset = 0
        for size in accumulation.micro_batch_sizes(n, k):
            sl = slice(offset, offset + size)
            offset += size
            with tf.GradientTape() as tape:
                pred = model(xb[sl], training=True)
                per_sample = tf.reduce_mean(tf.square(pred - yb[sl]), axis=-1)
                loss = tf.reduce_sum(per_sample * wb[sl]) / size  # sum_over_batch_size
                loss = loss * size / n
            sums = [s + g for s, g in zip(sums, tape.gradient(loss, variables))]
        for v, g in zip(variables, sums):
            v.assign_sub(lr * g)
    return model.get_weights()


# ------------------------------------------------------------ micro_batches
@pytest.mark.parametrize("batch_size, k", [(64, 4), (50, 7)])
def test_micro_batches_equal_stock_large_batch(initial_weights, batch_size, k):
    x, y, sw = make_data()
    bounds = [(s, min(s + batch_size, 100)) for s in range(0, 100, batch_size)]
    stock = stock_on_batches(initial_weights, x, y, sw, bounds)
    ours, history = fit_ours(initial_weights, x, y, sw, batch_size, micro_batches=k)
    assert_close(ours.get_weights(), stock.get_weights())
    assert to_int(ours.optimizer.iterations) == len(bounds)
    # The logged loss equals stock fit's on the same batches.
    plain = make_net()
    plain.set_weights(initial_weights)
    plain.compile(keras.optimizers.Adam(0.01), "mse")
    stock_history = plain.fit(x, y, sample_weight=sw, batch_size=batch_size, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], stock_history.history["loss"], rtol=1e-5)


@pytest.mark.parametrize("k", [4, 3])
def test_micro_batches_equal_hand_written_accumulation_loop(initial_weights, k):
    x, y, sw = make_data(64)
    expected = tape_micro_batch_loop(initial_weights, x, y, sw, 32, k)
    ours, _ = fit_ours(initial_weights, x, y, sw, 32, optimizer=keras.optimizers.SGD(0.05),
                       micro_batches=k)
    assert_close(ours.get_weights(), expected)


def test_micro_batch_oracle_can_fail(initial_weights):
    """Averaging the micro-batch gradients with 1/k instead of n_j/n is detected."""
    x, y, sw = make_data(64)
    expected = tape_micro_batch_loop(initial_weights, x, y, sw, 32, 3)
    model = make_net()
    model.set_weights(initial_weights)
    for start in range(0, 64, 32):
        xb, yb, wb = x[start:start + 32], y[start:start + 32], sw[start:start + 32]
        grads, offset = None, 0
        for size in accumulation.micro_batch_sizes(32, 3):  # 10, 11, 11
            sl = slice(offset, offset + size)
            offset += size
            with tf.GradientTape() as tape:
                pred = model(xb[sl], training=True)
                loss = tf.reduce_sum(tf.reduce_mean(tf.square(pred - yb[sl]), -1) * wb[sl]) / size / 3
            g = tape.gradient(loss, model.trainable_variables)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for v, g in zip(model.trainable_variables, grads):
            v.assign_sub(0.05 * g)
    assert max_diff(model.get_weights(), expected) > 1e-4


def test_micro_batches_with_class_weight_equal_stock(initial_weights):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(48, 5)).astype("float32")
    labels = rng.integers(0, 2, size=(48,))
    class_weight = {0: 0.3, 1: 2.0}

    def run(**kwargs):
        model = make_net()
        model.set_weights(initial_weights)
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], **kwargs)
        h = model.fit(x, labels, class_weight=class_weight, batch_size=24, shuffle=False, verbose=0)
        return model.get_weights(), h.history

    w_stock, h_stock = run()
    w_ours, h_ours = run(micro_batches=5)
    assert_close(w_ours, w_stock)
    np.testing.assert_allclose(h_ours["loss"], h_stock["loss"], rtol=1e-5)
    assert h_ours["accuracy"] == h_stock["accuracy"]


def test_micro_batches_under_jit_with_steps_per_execution(initial_weights):
    x, y, sw = make_data()
    bounds = [(s, min(s + 40, 100)) for s in range(0, 100, 40)]
    stock = stock_on_batches(initial_weights, x, y, sw, bounds)
    ours, _ = fit_ours(initial_weights, x, y, sw, 40, micro_batches=3,
                       jit_compile=True, steps_per_execution=2)
    assert_close(ours.get_weights(), stock.get_weights())


def test_micro_batches_under_jit_with_an_even_split(initial_weights):
    """Every batch splits evenly: the loop over the empty group must still compile."""
    x, y, sw = make_data()
    bounds = [(s, min(s + 40, 100)) for s in range(0, 100, 40)]
    stock = stock_on_batches(initial_weights, x, y, sw, bounds)
    ours, _ = fit_ours(initial_weights, x, y, sw, 40, micro_batches=4, jit_compile=True)
    assert_close(ours.get_weights(), stock.get_weights())


def clipped_with_term_loop(weights, x, y, sw, batch_size, k, clip, l2, lr,
                           clip_each_micro_batch=False):
    """Hand-written: loss + l2 * mean(hidden^2) per micro-batch (times n_j / n),
    gradients summed, then clipped to global norm `clip` (or, the wrong way,
    each micro-batch's gradient clipped before the sum), SGD.

    Returns the final weights and the per-batch (loss, term) the step logs.
    """
    model = make_net()
    model.set_weights(weights)
    hidden, head = model.get_layer("hidden"), model.get_layer("head")
    variables = model.trainable_variables
    logged = []
    for start in range(0, len(x), batch_size):
        xb, yb, wb = (a[start:start + batch_size] for a in (x, y, sw))
        n = len(xb)
        sums = [tf.zeros_like(v) for v in variables]
        batch_loss = batch_term = 0.0
        offset = 0
        for size in accumulation.micro_batch_sizes(n, k):
            sl = slice(offset, offset + size)
            offset += size
            with tf.GradientTape() as tape:
                h = hidden(xb[sl])
                pred = head(h)
                task = tf.reduce_sum(tf.reduce_mean(tf.square(pred - yb[sl]), -1) * wb[sl]) / size
                term = l2 * tf.reduce_mean(tf.square(h))
                loss = (task + term) * size / n
            grads = tape.gradient(loss, variables)
            if clip_each_micro_batch:
                grads, _ = tf.clip_by_global_norm(grads, clip)
            sums = [s + g for s, g in zip(sums, grads)]
            batch_loss += float(loss)
            batch_term += float(term) * size / n
        if not clip_each_micro_batch:
            sums, norm = tf.clip_by_global_norm(sums, clip)
            assert float(norm) > clip  # the clip is active on every step
        for v, g in zip(variables, sums):
            v.assign_sub(lr * g)
        logged.append((n, batch_loss, batch_term))
    return model.get_weights(), logged


def epoch_mean(logged, column):
    """Sample-count-weighted epoch mean of a per-batch logged value, like Keras's."""
    total = sum(row[0] for row in logged)
    return sum(row[0] * row[column] for row in logged) / total


CLIP, L2 = 0.05, 0.3


def test_micro_batches_with_transform_and_term_see_the_accumulated_gradient(initial_weights):
    """The loss term is summed over micro-batches (n_j / n) and ClipByGlobalNorm
    acts once, on the accumulated gradient: equal to the hand-written loop."""
    x, y, sw = make_data(64)
    expected, logged = clipped_with_term_loop(initial_weights, x, y, sw, 32, 3, CLIP, L2, 0.5)
    ours, history = fit_ours(
        initial_weights, x, y, sw, 32, optimizer=keras.optimizers.SGD(0.5), micro_batches=3,
        gradient_transforms=[kt.ClipByGlobalNorm(CLIP)],
        loss_terms=[kt.ActivationPenalty("hidden", l2=L2, name="act_l2")])
    assert_close(ours.get_weights(), expected)
    np.testing.assert_allclose(history.history["loss"][0], epoch_mean(logged, 1), rtol=1e-5)
    np.testing.assert_allclose(history.history["act_l2"][0], epoch_mean(logged, 2), rtol=1e-5)


def test_clipping_each_micro_batch_separately_would_differ(initial_weights):
    """Companion: clip each micro-batch's gradient, then sum: not what the step does."""
    x, y, sw = make_data(64)
    expected, _ = clipped_with_term_loop(initial_weights, x, y, sw, 32, 3, CLIP, L2, 0.5)
    per_micro, _ = clipped_with_term_loop(initial_weights, x, y, sw, 32, 3, CLIP, L2, 0.5,
                                          clip_each_micro_batch=True)
    assert max_diff(per_micro, expected) > 1e-3


# ------------------------------------------------------- accumulation_steps
def test_accumulation_steps_equal_large_batches_and_count_applied_steps(initial_weights):
    x, y, _ = make_data()
    stock = stock_on_batches(initial_weights, x, y, None, [(0, 64), (64, 100)])
    ours, _ = fit_ours(initial_weights, x, y, None, 16, accumulation_steps=4)
    assert_close(ours.get_weights(), stock.get_weights())
    assert to_int(ours.optimizer.iterations) == 2
    # The comparison can fail: stock fit on the batches of 16 is different.
    small, _ = fit_ours(initial_weights, x, y, None, 16)
    assert max_diff(small.get_weights(), stock.get_weights()) > 1e-3


def test_accumulation_two_epochs_restart_windows(initial_weights):
    x, y, sw = make_data()
    bounds = [(0, 64), (64, 100)] * 2
    stock = stock_on_batches(initial_weights, x, y, sw, bounds)
    ours, _ = fit_ours(initial_weights, x, y, sw, 16, epochs=2, accumulation_steps=4)
    assert_close(ours.get_weights(), stock.get_weights())
    assert to_int(ours.optimizer.iterations) == 4


def test_accumulation_windows_spanning_epochs_would_differ(initial_weights):
    """Companion: if windows ran on across the epoch boundary the weights would differ.

    Epochs of 7 batches (6 x 16 + 4) in windows of 4 that ignore the boundary:
    64 samples, then 36 + the next epoch's first 16, then 64, then 20 left at
    the end: also 4 steps, on the two epochs concatenated.
    """
    x, y, sw = make_data()
    ours, _ = fit_ours(initial_weights, x, y, sw, 16, epochs=2, accumulation_steps=4)
    xx, yy, ww = (np.concatenate([a, a]) for a in (x, y, sw))
    spanning = stock_on_batches(initial_weights, xx, yy, ww,
                                [(0, 64), (64, 116), (116, 180), (180, 200)])
    assert to_int(spanning.optimizer.iterations) == to_int(ours.optimizer.iterations) == 4
    assert max_diff(spanning.get_weights(), ours.get_weights()) > 1e-3


def halving_schedule():
    # 0.1, 0.05, 0.025, ...: a different rate at every optimizer step.
    return keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)


class MicroStepSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The wrong semantics: the schedule read at the micro-step count (4 per step)."""

    def __call__(self, step):
        return halving_schedule()(step * 4)


def test_learning_rate_schedule_counts_applied_steps(initial_weights):
    x, y, sw = make_data()
    stock = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 100)],
                             optimizer=keras.optimizers.SGD(halving_schedule()))
    ours, _ = fit_ours(initial_weights, x, y, sw, 16, accumulation_steps=4,
                       optimizer=keras.optimizers.SGD(halving_schedule()))
    assert_close(ours.get_weights(), stock.get_weights())
    assert to_int(ours.optimizer.iterations) == 2
    np.testing.assert_allclose(float(ours.optimizer.learning_rate), 0.025, rtol=1e-6)


def test_learning_rate_schedule_counting_micro_steps_would_differ(initial_weights):
    """Companion: rates 0.1 then 0.00625 (micro-step 4) instead of 0.1 then 0.05."""
    x, y, sw = make_data()
    ours, _ = fit_ours(initial_weights, x, y, sw, 16, accumulation_steps=4,
                       optimizer=keras.optimizers.SGD(halving_schedule()))
    micro = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 100)],
                             optimizer=keras.optimizers.SGD(MicroStepSchedule()))
    assert max_diff(micro.get_weights(), ours.get_weights()) > 1e-3


def test_accumulation_under_jit_with_steps_per_execution(initial_weights):
    x, y, sw = make_data()
    stock = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 100)])
    ours, _ = fit_ours(initial_weights, x, y, sw, 16, accumulation_steps=4,
                       jit_compile=True, steps_per_execution=3)
    assert_close(ours.get_weights(), stock.get_weights())
    assert to_int(ours.optimizer.iterations) == 2


def test_partial_window_is_applied_before_validation(initial_weights):
    x, y, _ = make_data()
    seen = {}

    class Spy(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            seen["weights"] = self.model.get_weights()
            seen["iterations"] = to_int(self.model.optimizer.iterations)

    model = make_net()
    model.set_weights(initial_weights)
    model.compile(keras.optimizers.Adam(0.01), "mse", accumulation_steps=4)
    history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0,
                        validation_data=(x[:20], y[:20]), callbacks=[Spy()])
    stock = stock_on_batches(initial_weights, x, y, None, [(0, 64), (64, 100)])
    assert seen["iterations"] == 2
    assert_close(seen["weights"], stock.get_weights())
    val = stock.evaluate(x[:20], y[:20], verbose=0)
    np.testing.assert_allclose(history.history["val_loss"][0], val, rtol=1e-5)


def test_micro_batches_and_accumulation_steps_combine(initial_weights):
    x, y, sw = make_data()
    stock = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 100)])
    ours, _ = fit_ours(initial_weights, x, y, sw, 32, accumulation_steps=2, micro_batches=3)
    assert_close(ours.get_weights(), stock.get_weights())


# ------------------------------------------------------------- distribution
def test_micro_batches_under_mirrored_strategy_equal_single_device(initial_weights, mirrored):
    x, y, sw = make_data(96)
    stock = stock_on_batches(initial_weights, x, y, sw, [(0, 48), (48, 96)])
    ours, _ = fit_ours(initial_weights, x, y, sw, 48, strategy=mirrored, micro_batches=3)
    assert_close(ours.get_weights(), stock.get_weights())


def test_accumulation_under_mirrored_strategy_equal_single_device(initial_weights, mirrored):
    # steps_per_execution > 1 is not combined with MirroredStrategy here: stock
    # Keras 3.15 / TF 2.21 fails on that combination (placeholder error).
    x, y, sw = make_data(96)
    stock = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 96)] * 2)
    ours, _ = fit_ours(initial_weights, x, y, sw, 16, epochs=2, strategy=mirrored,
                       accumulation_steps=4)
    assert_close(ours.get_weights(), stock.get_weights())
    assert to_int(ours.optimizer.iterations) == 4


class ReductionRecorder:
    """Records every cross-replica reduction traced while it is installed.

    Patches (through pytest's `monkeypatch`, undone after the test) the
    replica-context `ReplicaContext.all_reduce` (and the no-merge_call path
    `_replica_ctx_all_reduce`), the cross-replica `batch_reduce_to` and
    `reduce_to` of the strategy, and the optimizer's
    `_all_reduce_sum_gradients`. Each call is stored with the shapes it
    reduces and the chain of graphs it was traced in (innermost first:
    `while_body_*` for a `tf.while_loop` body, `cond_true_*` for a `tf.cond`
    branch, `one_step_on_data` for Keras's train step, `flush_step` for the
    accumulator's flush). A call inside a while body, or inside a function
    the body calls, is traced once however many times the loop runs, so it is
    caught by its graph, not by counting: any graph nested in the step other
    than a `tf.cond` branch counts as per-micro-batch.
    """

    STEP_GRAPHS = ("one_step_on_data", "flush_step")

    def __init__(self, monkeypatch, strategy, optimizer):
        from tensorflow.python.distribute import distribute_lib

        self.calls = []
        self.steps = []  # graph chains of the traced train_step calls
        extended = type(strategy.extended)
        # (owner, method, label, index of the reduced argument, its tensors)
        for owner, name, label, index, tensors in [
            (distribute_lib.ReplicaContext, "all_reduce", "replica", 2, tf.nest.flatten),
            # Reached from all_reduce when the strategy skips merge_call: its
            # own label, so that one all_reduce is not counted twice.
            (extended, "_replica_ctx_all_reduce", "replica_direct", 2, list),
            (extended, "batch_reduce_to", "cross", 2, lambda pairs: [v for v, _ in pairs]),
            (extended, "reduce_to", "cross", 2, tf.nest.flatten),
            (type(optimizer), "_all_reduce_sum_gradients", "optimizer", 1,
             lambda pairs: [g for g, _ in pairs]),
        ]:
            self._wrap(monkeypatch, owner, name, label, index, tensors)

    def _wrap(self, monkeypatch, owner, name, label, index, tensors):
        original = getattr(owner, name)
        calls = self.calls

        def recording(*args, **kwargs):
            args = list(args)
            if isinstance(args[index], zip):
                args[index] = list(args[index])
            shapes = [_shape(t) for t in tensors(args[index])]
            calls.append((label, shapes, graph_chain()))
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, recording)

    def watch_train_step(self, monkeypatch, model):
        original = model.train_step

        def train_step(data):
            self.steps.append(graph_chain())
            return original(data)

        monkeypatch.setattr(model, "train_step", train_step)

    def gradient_calls(self, variables, label):
        shapes = [tuple(v.shape) for v in variables]
        return [chain for lab, got, chain in self.calls if lab == label and got == shapes]

    def violations(self, variables, replicas, in_cond):
        """Returns a list of broken rules (empty when the reductions are right)."""
        problems = []
        for label, shapes, chain in self.calls:
            inner = _inside_step(chain)
            # A while body, or a function traced once and called from one (the
            # micro-batch pass is a concrete function the loop calls): anything
            # nested in the step other than a tf.cond branch runs per micro-batch.
            if any(not _name(g).startswith("cond_") for g in inner):
                problems.append(f"{label} reduction of {shapes} inside a while loop "
                                f"or a function it calls ({[_name(g) for g in chain]})")
        traced = {id(_step_graph(chain)): _step_graph(chain) for chain in self.steps}
        for _, _, chain in self.calls:  # the flush of a partial window applies too
            if _name(_step_graph(chain)).startswith("flush_step"):
                traced[id(_step_graph(chain))] = _step_graph(chain)
        by_step = {}
        for label in ("replica", "cross"):
            for chain in self.gradient_calls(variables, label):
                step = _step_graph(chain)
                by_step.setdefault((id(step), label), []).append(chain)
                if in_cond and _name(step).startswith("one_step_on_data") and not any(
                    _name(g).startswith("cond_true") for g in _inside_step(chain)
                ):
                    problems.append(f"gradient {label} reduction outside the conditional "
                                    f"apply ({[_name(g) for g in chain]})")
        for key, step in traced.items():
            for label, expected in (("replica", replicas), ("cross", 1)):
                got = len(by_step.get((key, label), []))
                if got != expected:
                    problems.append(f"{got} gradient {label} reductions in traced step "
                                    f"{_name(step)} (expected {expected})")
        return problems


def graph_chain():
    """The default graph and its outer graphs, innermost first."""
    graph = tf.compat.v1.get_default_graph()
    chain = []
    while graph is not None:
        chain.append(graph)
        graph = getattr(graph, "outer_graph", None)
    return chain


def _step_graph(chain):
    for graph in chain:
        if _name(graph).startswith(ReductionRecorder.STEP_GRAPHS):
            return graph
    return chain[-1]


def _inside_step(chain):
    step = _step_graph(chain)
    return chain[: chain.index(step)]


def _name(graph):
    return getattr(graph, "name", "eager")  # a FuncGraph's name; the eager graph has none


def _shape(value):
    if hasattr(value, "values") and not isinstance(value, tf.IndexedSlices):
        value = value.values[0]  # PerReplica in cross-replica context
    return tuple(value.shape)


REDUCTION_CASES = {
    "micro_batches=4": dict(micro_batches=4),
    "micro_batches=4, clip": dict(micro_batches=4,
                                  gradient_transforms=[kt.ClipByGlobalNorm(1.0)]),
    "accumulation_steps=2": dict(accumulation_steps=2),
    "accumulation_steps=2, clip": dict(accumulation_steps=2,
                                       gradient_transforms=[kt.ClipByGlobalNorm(1.0)]),
}


@pytest.mark.parametrize("case", list(REDUCTION_CASES))
def test_gradients_are_all_reduced_once_per_applied_step(initial_weights, mirrored,
                                                         monkeypatch, case):
    """One gradient all-reduce per traced step: none per micro-batch or per batch.

    With accumulation it sits in the conditional apply (a `cond_true` branch)
    of the train step, and once more in the flush of the partial window.
    """
    kwargs = REDUCTION_CASES[case]
    with mirrored.scope():
        model = make_net()
        model.set_weights(initial_weights)
        model.compile(keras.optimizers.SGD(0.1), "mse", **kwargs)
    recorder = ReductionRecorder(monkeypatch, mirrored, model.optimizer)
    recorder.watch_train_step(monkeypatch, model)
    x, y, _ = make_data(80)  # 5 batches of 16: with accumulation, a partial window
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    replicas = mirrored.num_replicas_in_sync
    assert recorder.steps, "the train step was not traced"
    assert recorder.violations(model.trainable_variables, replicas,
                               in_cond="accumulation_steps" in kwargs) == []
    grads = recorder.gradient_calls(model.trainable_variables, "cross")
    flushes = [c for c in grads if _name(_step_graph(c)).startswith("flush_step")]
    assert len(flushes) == (1 if "accumulation_steps" in kwargs else 0)
    optimizer_calls = recorder.gradient_calls(model.trainable_variables, "optimizer")
    if "gradient_transforms" in kwargs:
        # The mixin reduces once itself; the optimizer's own reduction is skipped.
        assert not optimizer_calls
    else:
        assert optimizer_calls  # the stock path: the optimizer's reduction


class ReducesPerBatch(kt.TapeOpsMixin, keras.Sequential):
    """Wrong on purpose: all-reduces the gradients of every batch it computes."""

    def compute_gradients(self, x, y, sample_weight):
        grads, y_pred = super().compute_gradients(x, y, sample_weight)
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.SUM, grads), y_pred


class ReducesPerMicroBatch(kt.TapeOpsMixin, keras.Sequential):
    """Wrong on purpose: all-reduces the gradients of every micro-batch."""

    def batch_gradients(self, *args, **kwargs):
        grads, y_pred = super().batch_gradients(*args, **kwargs)
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.SUM, grads), y_pred


@pytest.mark.parametrize("cls, kwargs", [
    (ReducesPerBatch, dict(micro_batches=4)),
    (ReducesPerBatch, dict(accumulation_steps=2)),
    (ReducesPerMicroBatch, dict(micro_batches=4)),
], ids=["per-batch-micro_batches", "per-batch-accumulation", "per-micro-batch"])
def test_reduction_recorder_catches_extra_all_reduces(initial_weights, mirrored,
                                                      monkeypatch, cls, kwargs):
    """The check can fail: a model reducing per batch or per micro-batch is caught."""
    with mirrored.scope():
        model = cls([keras.Input((5,)), keras.layers.Dense(6, activation="tanh", name="hidden"),
                     keras.layers.Dense(2, name="head")])
        model.set_weights(initial_weights)
        model.compile(keras.optimizers.SGD(0.1), "mse", **kwargs)
    recorder = ReductionRecorder(monkeypatch, mirrored, model.optimizer)
    recorder.watch_train_step(monkeypatch, model)
    x, y, _ = make_data(64)
    if cls is ReducesPerMicroBatch:
        # tf.distribute cannot even run it (merge_call inside the while body);
        # the recorder has seen the call, traced once, before TF refused it.
        with pytest.raises(RuntimeError, match="merge_call"):
            model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        expected = "inside a while loop"
    else:
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        expected = "2 gradient cross reductions"
    problems = recorder.violations(model.trainable_variables, mirrored.num_replicas_in_sync,
                                   in_cond="accumulation_steps" in kwargs)
    assert any(expected in p for p in problems), problems


# ---------------------------------------------------------- mixed precision
def test_micro_batches_and_accumulation_under_mixed_float16(initial_weights):
    """Equal to stock mixed_float16 on the large batches, at the float32 tolerance."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y, sw = make_data()
    stock = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 100)])
    micro, _ = fit_ours(initial_weights, x, y, sw, 64, micro_batches=4)
    accum, _ = fit_ours(initial_weights, x, y, sw, 16, accumulation_steps=4)
    assert isinstance(micro.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_close(micro.get_weights(), stock.get_weights())
    assert_close(accum.get_weights(), stock.get_weights())
    assert to_int(accum.optimizer.iterations) == 2


@pytest.mark.parametrize("mode", ["micro", "window"])
def test_mixed_float16_stepping_every_micro_batch_would_differ(initial_weights, mode):
    """Companion: one step per micro-batch (per batch of the window) is far from ours."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y, sw = make_data()
    if mode == "micro":
        ours, _ = fit_ours(initial_weights, x, y, sw, 64, micro_batches=4)
        sizes = (accumulation.micro_batch_sizes(64, 4) + accumulation.micro_batch_sizes(36, 4))
    else:
        ours, _ = fit_ours(initial_weights, x, y, sw, 16, accumulation_steps=4)
        sizes = [16] * 6 + [4]
    ends = np.cumsum(sizes)
    wrong = stock_on_batches(initial_weights, x, y, sw, list(zip(ends - sizes, ends)))
    assert max_diff(wrong.get_weights(), ours.get_weights()) > 100 * TOL


@pytest.mark.parametrize("mode", ["micro", "window"])
def test_non_finite_micro_batch_skips_the_whole_window(initial_weights, mode):
    keras.config.set_dtype_policy("mixed_float16")
    x, y, _ = make_data(64)
    y = y.copy()
    y[40] = np.inf  # one bad sample: its micro-batch / batch is non-finite
    model = make_net()
    model.set_weights(initial_weights)
    kwargs = {"micro_batches": 4} if mode == "micro" else {"accumulation_steps": 4}
    model.compile(keras.optimizers.SGD(0.1), "mse", **kwargs)
    scale = 2.0 ** 15  # LossScaleOptimizer's initial scale
    model.fit(x, y, batch_size=64 if mode == "micro" else 16, shuffle=False, verbose=0)
    assert_close(model.get_weights(), initial_weights, tol=0)
    assert float(model.optimizer.scale_loss(tf.constant(1.0))) == scale / 2
    assert to_int(model.optimizer.iterations) == 0
    # Without the bad sample the same run moves the weights (the check can fail).
    y[40] = 0.0
    model.fit(x, y, batch_size=64 if mode == "micro" else 16, shuffle=False, verbose=0)
    assert max_diff(model.get_weights(), initial_weights) > 1e-4


# ------------------------------------------------------- BatchNormalization
def bn_oracle(x, batch, k, mode, momentum=0.9):
    mean, var = np.zeros(x.shape[1]), np.ones(x.shape[1])
    for start in range(0, len(x), batch):
        xb = x[start:start + batch].astype("float64")
        if mode == "large_batch":
            pieces = [xb]
        else:
            sizes = accumulation.micro_batch_sizes(len(xb), k)
            pieces = np.split(xb, np.cumsum(sizes)[:-1])
        for p in pieces:
            mean = mean * momentum + p.mean(0) * (1 - momentum)
            var = var * momentum + p.var(0) * (1 - momentum)
    return mean, var


@pytest.mark.parametrize("mode", ["large_batch", "per_micro_batch"])
def test_batch_norm_moving_statistics_follow_the_chosen_mode(mode):
    """BN is the first layer, so its statistics depend on x only: NumPy is exact."""
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(90, 5)) * [1, 2, 3, 4, 5] + [0, 1, -1, 2, 5]).astype("float32")
    y = rng.normal(size=(90, 2)).astype("float32")
    model = make_net(bn=True)
    model.compile(keras.optimizers.SGD(0.01), "mse", micro_batches=4, batch_norm_updates=mode)
    model.fit(x, y, batch_size=45, shuffle=False, verbose=0)
    bn = model.get_layer("bn")
    mean, var = bn_oracle(x, 45, 4, mode)
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), var, atol=1e-4, rtol=1e-5)
    other = "per_micro_batch" if mode == "large_batch" else "large_batch"
    other_mean, _ = bn_oracle(x, 45, 4, other)
    assert np.abs(other_mean - mean).max() > 1e-3  # the two modes differ
    assert bn.momentum == 0.9  # restored after tracing


def test_batch_norm_large_batch_mode_equals_stock_moving_statistics(initial_weights):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(64, 5)).astype("float32") * 3 + 1
    y = rng.normal(size=(64, 2)).astype("float32")
    stock = make_net(bn=True)
    stock.compile(keras.optimizers.SGD(0.01), "mse")
    stock.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    ours = make_net(bn=True)
    ours.compile(keras.optimizers.SGD(0.01), "mse", micro_batches=2, jit_compile=True)
    ours.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(getattr(ours.get_layer("bn"), name).numpy(),
                                   getattr(stock.get_layer("bn"), name).numpy(), atol=1e-5)


# ------------------------------------------------------------ saving, backup
def test_save_and_load_keep_the_options_and_training_continues_identically(initial_weights, tmp_path):
    x, y, sw = make_data()
    model, _ = fit_ours(initial_weights, x, y, sw, 16, micro_batches=2, accumulation_steps=4,
                        batch_norm_updates="per_micro_batch", optimizer=keras.optimizers.SGD(0.1))
    path = str(tmp_path / "acc.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    options = loaded.tapeops_options
    assert (options.micro_batches, options.accumulation_steps, options.batch_norm_updates) == (
        2, 4, "per_micro_batch")
    assert_close(loaded.get_weights(), model.get_weights(), tol=0)
    model.fit(x, y, sample_weight=sw, batch_size=16, shuffle=False, verbose=0)
    loaded.fit(x, y, sample_weight=sw, batch_size=16, shuffle=False, verbose=0)
    assert_close(loaded.get_weights(), model.get_weights())
    assert to_int(loaded.optimizer.iterations) == 4


def test_backup_and_restore_resumes_with_fresh_windows(initial_weights, tmp_path):
    """Windows are flushed before the epoch's backup, so a resumed run is identical."""
    x, y, _ = make_data()

    class StopAt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    def new_model():
        model = make_net()
        model.set_weights(initial_weights)
        model.compile(keras.optimizers.Adam(0.01), "mse", accumulation_steps=4)
        return model

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model = new_model()
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[backup, StopAt()])
    resumed = new_model()
    resumed.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    straight = new_model()
    straight.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_close(resumed.get_weights(), straight.get_weights())


class StopAfterBatch(keras.callbacks.Callback):
    """Interrupts training after batch `batch` of epoch `epoch` (0-based)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.stop_at = (epoch, batch)
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.stop_at:
            raise RuntimeError("interrupted")


def test_backup_every_n_batches_resumes_from_the_last_applied_step(initial_weights, tmp_path):
    """`BackupAndRestore(save_freq=3)`, interrupted mid-window, as docs/accumulation.md says.

    100 samples in batches of 16 (7 per epoch), windows of 4 batches, 2
    epochs. Backups after the 3rd, 6th, 9th and 12th batch: the last one
    before the interruption (epoch 1, after its 5th batch, index 4) is taken
    mid-window, with one batch accumulated on top of the weights of step 3
    (epoch 0's two steps and epoch 1's first window). The resumed fit starts
    epoch 1 again with a fresh window: in all, steps on 64, 36, 64 samples,
    then 64 and 36 samples of the re-run epoch 1.
    """
    x, y, _ = make_data()
    backup_dir = str(tmp_path / "backup")

    def new_model():
        model = make_net()
        model.set_weights(initial_weights)
        model.compile(keras.optimizers.Adam(0.01), "mse", accumulation_steps=4)
        return model

    model = new_model()
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup_dir, save_freq=3),
                             StopAfterBatch(epoch=1, batch=5)])
    assert to_int(model.optimizer.iterations) == 3  # the window of batch 4..5 is pending
    epochs_run, restored = [], {}

    class Epochs(keras.callbacks.Callback):  # runs after BackupAndRestore has loaded
        def on_train_begin(self, logs=None):
            restored["weights"] = self.model.get_weights()
            restored["iterations"] = to_int(self.model.optimizer.iterations)

        def on_epoch_begin(self, epoch, logs=None):
            epochs_run.append(epoch)

    resumed = new_model()
    resumed.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup_dir, save_freq=3), Epochs()])
    assert epochs_run == [1]
    # The backup held the weights (and Adam state) of the last applied step.
    three_steps = stock_on_batches(initial_weights, x, y, None, [(0, 64), (64, 100), (0, 64)])
    assert restored["iterations"] == 3
    assert_close(restored["weights"], three_steps.get_weights())
    documented = stock_on_batches(initial_weights, x, y, None,
                                  [(0, 64), (64, 100), (0, 64), (0, 64), (64, 100)])
    assert_close(resumed.get_weights(), documented.get_weights())
    assert to_int(resumed.optimizer.iterations) == 5
    # Companion: the uninterrupted run (4 steps) is a different result.
    straight = stock_on_batches(initial_weights, x, y, None, [(0, 64), (64, 100)] * 2)
    assert max_diff(straight.get_weights(), resumed.get_weights()) > 1e-3



def _two_dtype_net(momenta=(0.9, 0.5)):
    """x -> Dense (float32) + Dense (float64), plus two BatchNorm branches on x
    (float32 and float64, their own momenta) times zero: their statistics depend
    on x alone, and the model's gradient equals the large batch's."""
    inputs = keras.Input((5,))
    main = keras.layers.Dense(2, name="head")(inputs)
    side = keras.layers.Dense(2, dtype="float64", name="head64")(inputs)
    bn32 = keras.layers.BatchNormalization(momentum=momenta[0], name="bn32")(inputs)
    bn64 = keras.layers.BatchNormalization(momentum=momenta[1], dtype="float64",
                                           name="bn64")(inputs)
    zero = keras.layers.Lambda(lambda t: 0.0 * keras.ops.sum(t, -1, keepdims=True))
    outputs = keras.layers.Add()([main, side, zero(bn32), zero(bn64)])
    return kt.upgrade(keras.Model(inputs, outputs))


def test_packed_sums_and_statistics_keep_each_dtype_and_momentum():
    """The loop carries gradient sums and BN statistics packed per dtype
    (accumulation/flat.py): a float64 Dense and BN next to float32 ones, two
    momenta, against stock's large-batch step and NumPy's statistics."""
    rng = np.random.default_rng(8)
    x = (rng.normal(size=(90, 5)) * [1, 2, 3, 4, 5] + [0, 1, -1, 2, 5]).astype("float32")
    y = rng.normal(size=(90, 2)).astype("float32")
    keras.utils.set_random_seed(3)
    start = _two_dtype_net().get_weights()
    results = {}
    for k in (1, 4):
        model = _two_dtype_net()
        model.set_weights(start)
        model.compile(keras.optimizers.SGD(0.05), "mse", micro_batches=k)
        model.fit(x, y, batch_size=45, shuffle=False, verbose=0)
        results[k] = model
    ours, stock = results[4], results[1]
    assert ours.get_layer("head64").kernel.dtype == "float64"
    for name in ("head", "head64"):
        for got, want in zip(ours.get_layer(name).get_weights(),
                             stock.get_layer(name).get_weights()):
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    for name, momentum, tol in (("bn32", 0.9, 1e-5), ("bn64", 0.5, 1e-12)):
        layer = ours.get_layer(name)
        mean, var = bn_oracle(x, 45, 4, "large_batch", momentum=momentum)
        np.testing.assert_allclose(layer.moving_mean.numpy(), mean, atol=tol, rtol=tol)
        np.testing.assert_allclose(layer.moving_variance.numpy(), var, atol=10 * tol, rtol=tol)
    # the other momentum's statistics differ (the check can fail)
    other, _ = bn_oracle(x, 45, 4, "large_batch", momentum=0.9)
    assert np.abs(ours.get_layer("bn64").moving_mean.numpy() - other).max() > 1e-2


def _structured_net(structure):
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(inputs)
    a = keras.layers.Dense(2, name="a")(hidden)
    b = keras.layers.Dense(1, name="b")(hidden)
    outputs = {"single": a, "list_of_one": [a], "pair": (a, b), "dict": {"a": a, "b": b}}
    return keras.Model(inputs, outputs[structure])


@pytest.mark.parametrize("structure", ["single", "list_of_one", "pair", "dict"])
def test_micro_batches_build_the_compiled_loss_for_every_output_structure(structure):
    """The compiled loss is built from a functional model's `output` (no
    symbolic trace of the model): every output structure trains and logs as
    stock Keras does on the whole batch."""
    rng = np.random.default_rng(9)
    x = rng.normal(size=(48, 5)).astype("float32")
    ya = rng.normal(size=(48, 2)).astype("float32")
    yb = rng.normal(size=(48, 1)).astype("float32")
    targets = {"single": ya, "list_of_one": [ya], "pair": (ya, yb), "dict": {"a": ya, "b": yb}}
    losses = {"single": "mse", "list_of_one": ["mse"], "pair": ("mse", "mae"),
              "dict": {"a": "mse", "b": "mae"}}
    keras.utils.set_random_seed(4)
    start = _structured_net(structure).get_weights()
    histories, weights = {}, {}
    for name in ("stock", "ours"):
        model = _structured_net(structure)
        model.set_weights(start)
        kwargs = {}
        if name == "ours":
            model, kwargs = kt.upgrade(model), {"micro_batches": 3}
        model.compile(keras.optimizers.SGD(0.1), losses[structure], **kwargs)
        histories[name] = model.fit(x, targets[structure], batch_size=24, epochs=2,
                                    shuffle=False, verbose=0).history
        weights[name] = model.get_weights()
    assert_close(weights["ours"], weights["stock"], tol=1e-6)
    assert histories["ours"].keys() == histories["stock"].keys()
    for key, values in histories["stock"].items():
        np.testing.assert_allclose(histories["ours"][key], values, rtol=1e-6, atol=1e-6)
    assert max_diff(weights["ours"], start) > 1e-3  # it trained (the check can fail)
