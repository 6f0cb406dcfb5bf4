"""`fit` with each `task_balancing` method equals a hand-written persistent-tape loop.

The oracle is the seed's loop: one forward pass in a persistent tape, one
`tape.gradient` per task (and one for the regularization loss), run as a
`tf.function`; the method is then applied in NumPy (float64) from the
references of `test_aggregation_reference`, and plain SGD updates the
weights. Same initial weights, same batches (`shuffle=False`), 1e-6.
The trunk has a kernel regularizer (not a task: it gets its ordinary
gradient) and the losses have `loss_weights` and sample weights.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
import test_aggregation_reference as ref
from keras_tapeops.aggregation.pcgrad import task_orders

NAMES = ("a", "b", "c")
UNITS = {"a": 1, "b": 2, "c": 1}
LR = 0.1
LOSS_WEIGHTS = {"a": 0.5, "b": 2.0, "c": 1.0}


def build_model(k=2, regularize=True):
    """Trunk Dense(4) and `k` heads; deterministic, conflicting initial weights."""
    inputs = keras.Input((3,), name="x")
    trunk = keras.layers.Dense(
        4, activation="tanh", name="trunk",
        kernel_regularizer=keras.regularizers.L2(0.01) if regularize else None,
    )(inputs)
    outputs = {n: keras.layers.Dense(UNITS[n], name=n)(trunk) for n in NAMES[:k]}
    model = kt.upgrade(keras.Model(inputs, outputs))
    rng = np.random.default_rng(42)
    model.set_weights([rng.normal(scale=0.8, size=w.shape).astype("float32")
                       for w in model.get_weights()])
    return model


def make_data(k=2, n=16):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, 3)).astype("float32")
    ys = {name: rng.normal(size=(n, UNITS[name])).astype("float32") for name in NAMES[:k]}
    ys["a"] = ys["a"] + 2.0 * x[:, :1]
    if "b" in ys:
        ys["b"] = ys["b"] - 2.0 * x[:, :1]  # pulls the trunk against task a
    sample_weight = rng.uniform(0.5, 1.5, size=(n,)).astype("float32")
    return x, ys, sample_weight


def compile_and_fit(model, k=2, epochs=1, batch_size=8, task_balancing=None, **options):
    x, ys, sw = make_data(k)
    model.compile(
        optimizer=options.pop("optimizer", keras.optimizers.SGD(LR)),
        loss={n: "mse" for n in NAMES[:k]},
        loss_weights={n: LOSS_WEIGHTS[n] for n in NAMES[:k]},
        task_balancing=task_balancing, **options,
    )
    return model.fit(x, ys, sample_weight=sw, batch_size=batch_size, epochs=epochs,
                     shuffle=False, verbose=0)


# ------------------------------------------------------------------ oracle
class Oracle:
    """The hand-written loop: per-task gradients from one persistent tape, SGD in NumPy.

    `method(ingredients, oracle) -> full gradient vector` combines them.
    """

    def __init__(self, model, k, loss_scale=None):
        self.model = model
        self.k = k
        self.names = NAMES[:k]
        self.variables = list(model.trainable_variables)
        self.sizes = [int(np.prod(v.shape)) for v in self.variables]
        self.shared = np.concatenate([
            np.full(s, v.path.startswith("trunk/")) for v, s in zip(self.variables, self.sizes)
        ])
        self.step_index = 0
        self.epoch_losses = []  # per epoch: list of per-step task losses
        trunk = model.get_layer("trunk")
        self.probe = keras.Model(model.inputs, [trunk.output, model.outputs])
        mse = keras.losses.MeanSquaredError()

        @tf.function
        def ingredients(x, ys, sw):
            with tf.GradientTape(persistent=True) as tape:
                z, outputs = self.probe(x, training=True)
                outputs = dict(zip(model.output_names, outputs))
                losses = [LOSS_WEIGHTS[n] * mse(ys[n], outputs[n], sample_weight=sw)
                          for n in self.names]
                reg = tf.add_n(model.losses)
                scale = 1.0 if loss_scale is None else loss_scale  # mixed precision
                scaled = [l * scale for l in losses]
                scaled_reg = reg * scale
            flat = lambda gs: tf.concat(  # noqa: E731
                [tf.reshape(tf.zeros_like(v) if g is None else tf.cast(g, tf.float32), [-1])
                 for g, v in zip(gs, self.variables)], axis=0) / scale
            task_grads = tf.stack([flat(tape.gradient(l, self.variables)) for l in scaled])
            reg_grad = flat(tape.gradient(scaled_reg, self.variables))
            z_rows = tf.stack([tf.reshape(tf.cast(tape.gradient(l, z), tf.float32), [-1])
                               for l in scaled]) / scale
            return tf.stack(losses), task_grads, reg_grad, z_rows

        self.ingredients = ingredients

    def fit(self, method, epochs=1, batch_size=8):
        x, ys, sw = make_data(self.k)
        for _ in range(epochs):
            self.epoch_losses.append([])
            for start in range(0, len(x), batch_size):
                sl = slice(start, start + batch_size)
                out = self.ingredients(x[sl], {n: ys[n][sl] for n in self.names}, sw[sl])
                losses, task_grads, reg_grad, z_rows = (np.asarray(t, np.float64) for t in out)
                grad = method(losses, task_grads, reg_grad, z_rows, self)
                self.epoch_losses[-1].append(losses)
                self._apply(grad)
                self.step_index += 1
        return [v.numpy() for v in self.variables]

    def _apply(self, grad):
        start = 0
        for v, size in zip(self.variables, self.sizes):
            g = grad[start:start + size].reshape(v.shape)
            v.assign((v.numpy().astype(np.float64) - LR * g).astype(np.float32))
            start += size

    def completed_means(self):
        return [np.mean(e, axis=0) for e in self.epoch_losses[:-1]]


def plain_sum(losses, task_grads, reg_grad, z_rows, oracle):
    return task_grads.sum(0) + reg_grad


def rows_method(direction):
    """A gradient aggregator: `direction(J, losses, step)` on the shared part."""

    def method(losses, task_grads, reg_grad, z_rows, oracle):
        grad = task_grads.sum(0) + reg_grad
        shared = oracle.shared
        grad[shared] = direction(task_grads[:, shared], losses, oracle.step_index) + reg_grad[shared]
        return grad

    return method


def numpy_adam(state, name, grad, lr, weight_decay=0.0):
    grad = grad + weight_decay * state[name]
    t = state.get(name + "_t", 0) + 1
    m = 0.9 * state.get(name + "_m", 0) + 0.1 * grad
    v = 0.999 * state.get(name + "_v", 0) + 0.001 * grad**2
    state.update({name + "_t": t, name + "_m": m, name + "_v": v})
    state[name] = state[name] - lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)


def uncertainty_method(state, lr=0.01):
    def method(losses, task_grads, reg_grad, z_rows, oracle):
        weights = 0.5 * np.exp(-state["s"])
        grad = weights @ task_grads + reg_grad
        numpy_adam(state, "s", 0.5 - 0.5 * losses * np.exp(-state["s"]), lr)
        return grad

    return method


def dwa_method(temperature=2.0):
    def method(losses, task_grads, reg_grad, z_rows, oracle):
        means = oracle.completed_means()
        k = len(losses)
        if len(means) >= 2:
            r = means[-1] / means[-2] / temperature
            weights = k * np.exp(r) / np.exp(r).sum()
        else:
            weights = np.ones(k)
        return weights @ task_grads + reg_grad

    return method


def gradnorm_method(state, alpha=1.5, lr=0.01):
    def method(losses, task_grads, reg_grad, z_rows, oracle):
        k = len(losses)
        means = oracle.completed_means()
        if not means:
            return task_grads.sum(0) + reg_grad
        z = np.exp(state["p"]) / np.exp(state["p"]).sum()
        w = k * z
        grad = w @ task_grads + reg_grad
        norms = np.linalg.norm(task_grads[:, oracle.shared], axis=1)
        relative = losses / means[0]
        target = np.mean(w * norms) * (relative / relative.mean()) ** alpha
        d_w = np.sign(w * norms - target) * norms
        d_p = k * z * (d_w - z @ d_w)
        numpy_adam(state, "p", d_p, lr)
        return grad

    return method


def famo_method(state, lr=0.025, weight_decay=1e-3):
    def method(losses, task_grads, reg_grad, z_rows, oracle):
        if "previous" in state:
            delta = np.log(state["previous"] + 1e-8) - np.log(losses + 1e-8)
            z = np.exp(state["w"]) / np.exp(state["w"]).sum()
            numpy_adam(state, "w", z * (delta - z @ delta), lr, weight_decay)
        # (the library steps w after the gradient of this step is made)
        return None

    def ordered(losses, task_grads, reg_grad, z_rows, oracle):
        z = np.exp(state["w"]) / np.exp(state["w"]).sum()
        shifted = losses + 1e-8
        weights = z / ((z / shifted).sum() * shifted)
        grad = weights @ task_grads + reg_grad
        method(losses, task_grads, reg_grad, z_rows, oracle)
        state["previous"] = losses
        return grad

    return ordered


def mgda_representation(losses, task_grads, reg_grad, z_rows, oracle):
    alpha = ref.min_norm_weights(z_rows @ z_rows.T)
    grad = task_grads.sum(0) + reg_grad
    shared = oracle.shared
    grad[shared] = alpha @ task_grads[:, shared] + reg_grad[shared]
    return grad


SEED = 3
CASES = {
    "PCGrad": (lambda: kt.PCGrad(shared="trunk", seed=SEED), 2, 1,
               lambda: rows_method(lambda J, l, s: ref.pcgrad(J, task_orders(SEED, s, len(J)).numpy()))),
    "PCGrad_3_tasks": (lambda: kt.PCGrad(shared="trunk/*", seed=SEED), 3, 1,
                       lambda: rows_method(lambda J, l, s: ref.pcgrad(J, task_orders(SEED, s, len(J)).numpy()))),
    "MGDA": (lambda: kt.MGDA(shared="trunk"), 2, 1,
             lambda: rows_method(lambda J, l, s: ref.mgda(J))),
    "MGDA_loss+": (lambda: kt.MGDA(shared="trunk", normalization="loss+"), 2, 1,
                   lambda: rows_method(lambda J, l, s: ref.min_norm_weights(
                       (J / (l * np.linalg.norm(J, axis=1))[:, None])
                       @ (J / (l * np.linalg.norm(J, axis=1))[:, None]).T) @ J)),
    "MGDA_representation": (lambda: kt.MGDA(shared="trunk", on="representation"), 2, 1,
                            lambda: mgda_representation),
    "CAGrad": (lambda: kt.CAGrad(c=0.4, shared="trunk"), 2, 1,
               lambda: rows_method(lambda J, l, s: ref.cagrad(J, 0.4, 1)[0])),
    "IMTLG": (lambda: kt.IMTLG(shared="trunk"), 2, 1,
              lambda: rows_method(lambda J, l, s: ref.imtlg(J))),
    "AlignedMTL": (lambda: kt.AlignedMTL(shared="trunk"), 3, 1,
                   lambda: rows_method(lambda J, l, s: ref.aligned_mtl(J))),
    "UPGrad": (lambda: kt.UPGrad(shared="trunk"), 3, 1,
               lambda: rows_method(lambda J, l, s: ref.upgrad(J))),
    "UncertaintyWeighting": (lambda: kt.UncertaintyWeighting(), 2, 2,
                             lambda: uncertainty_method({"s": np.full(2, -0.5)})),
    "DWA": (lambda: kt.DWA(temperature=2.0), 2, 3, lambda: dwa_method()),
    "GradNorm": (lambda: kt.GradNorm(alpha=1.5, shared="trunk"), 2, 2,
                 lambda: gradnorm_method({"p": np.ones(2)})),
    "FAMO": (lambda: kt.FAMO(), 2, 2, lambda: famo_method({"w": np.zeros(2)})),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fit_equals_hand_written_persistent_tape_loop(case):
    make_option, k, epochs, make_method = CASES[case]
    model = build_model(k)
    oracle_model = build_model(k)
    history = compile_and_fit(model, k, epochs=epochs, task_balancing=make_option())
    expected = Oracle(oracle_model, k).fit(make_method(), epochs=epochs)
    for actual, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(actual, want, rtol=1e-6, atol=1e-6, err_msg=case)
    # Companion: the plain sum from the same start ends elsewhere.
    plain = Oracle(build_model(k), k).fit(plain_sum, epochs=epochs)
    assert max(np.abs(a - b).max() for a, b in zip(plain, expected)) > 1e-4, case
    assert all(np.all(np.isfinite(v)) for v in history.history.values())


def test_stock_fit_equals_the_plain_sum_oracle():
    """The oracle's plain sum is what stock Keras computes (the comparison can fail)."""
    model = build_model(2)
    compile_and_fit(model, 2)
    expected = Oracle(build_model(2), 2).fit(plain_sum)
    for actual, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(actual, want, rtol=1e-6, atol=1e-6)


def test_measure_conflict_trains_like_stock_and_logs_the_measured_steps():
    model, stock = build_model(2), build_model(2)
    history = compile_and_fit(model, 2, epochs=2, task_balancing=kt.MeasureConflict(every=2, shared="trunk"))
    compile_and_fit(stock, 2, epochs=2)
    for a, b in zip(model.get_weights(), stock.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    measured = {}

    def record(losses, task_grads, reg_grad, z_rows, oracle):
        if oracle.step_index % 2 == 0:
            J = task_grads[:, oracle.shared]
            norms = np.linalg.norm(J, axis=1)
            measured[oracle.step_index] = (norms, J[0] @ J[1] / (norms[0] * norms[1]))
        return plain_sum(losses, task_grads, reg_grad, z_rows, oracle)

    Oracle(build_model(2), 2).fit(record, epochs=2)
    # two steps per epoch: epoch 1 measures step 0, epoch 2 measures step 2
    for epoch, step in ((0, 0), (1, 2)):
        norms, cosine = measured[step]
        np.testing.assert_allclose(history.history["cosine_a_b"][epoch], cosine, rtol=1e-5)
        np.testing.assert_allclose(history.history["a_grad_norm"][epoch], norms[0], rtol=1e-5)
        np.testing.assert_allclose(history.history["b_grad_norm"][epoch], norms[1], rtol=1e-5)


def test_logged_weights_norms_and_cosines_match_the_oracle():
    model = build_model(2)
    history = compile_and_fit(model, 2, task_balancing=kt.MGDA(shared="trunk"))
    seen = []

    def record(losses, task_grads, reg_grad, z_rows, oracle):
        J = task_grads[:, oracle.shared]
        alpha = ref.min_norm_weights(J @ J.T)
        norms = np.linalg.norm(J, axis=1)
        seen.append((alpha, norms, J[0] @ J[1] / (norms[0] * norms[1])))
        return rows_method(lambda J, l, s: ref.mgda(J))(losses, task_grads, reg_grad, z_rows, oracle)

    Oracle(build_model(2), 2).fit(record)
    alpha, norms, cosine = (np.mean(v, axis=0) for v in zip(*seen))
    logs = history.history
    np.testing.assert_allclose([logs["a_weight"][0], logs["b_weight"][0]], alpha, rtol=1e-4)
    np.testing.assert_allclose([logs["a_grad_norm"][0], logs["b_grad_norm"][0]], norms, rtol=1e-5)
    np.testing.assert_allclose(logs["cosine_a_b"][0], cosine, rtol=1e-4)
    assert "a_weight" not in model.evaluate(*make_data(2)[:2], verbose=0, return_dict=True)
