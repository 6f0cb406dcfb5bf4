"""Each aggregator equals a NumPy implementation of its algorithm (random and degenerate rows)."""

import numpy as np
import pytest
import tensorflow as tf

import test_aggregation_reference as ref
from keras_tapeops.aggregation import qp
from keras_tapeops.aggregation.aligned_mtl import aligned_mtl_weights
from keras_tapeops.aggregation.cagrad import cagrad_weights
from keras_tapeops.aggregation.imtlg import imtlg_weights
from keras_tapeops.aggregation.mgda import mgda_weights
from keras_tapeops.aggregation.pcgrad import pcgrad_weights
from keras_tapeops.aggregation.pcgrad import task_orders
from keras_tapeops.aggregation.upgrad import upgrad_weights


def _random(k, p, seed):
    return np.random.default_rng(seed).normal(size=(k, p))


def _matrices():
    g = np.array([1.0, -2.0, 0.5, 3.0, -1.0])
    h = np.array([-0.5, 1.0, 2.0, 0.0, 1.5])
    return {
        "random2": _random(2, 7, 0),
        "random3": _random(3, 7, 1),
        "random4": _random(4, 6, 2),
        "conflicting": np.stack([g, -0.3 * g + 0.2 * h]),
        "parallel": np.stack([g, 2.0 * g]),
        "opposite": np.stack([g, -g]),
        "zero_row": np.stack([g, np.zeros(5)]),
        "all_zero": np.zeros((2, 5)),
        "one_task": g[np.newaxis],
        "duplicate3": np.stack([g, g, h]),
    }


MATRICES = _matrices()


def _combine(weights_fn, J, *args):
    J32 = tf.constant(J, tf.float32)
    gramian = tf.matmul(J32, J32, transpose_b=True)
    weights = weights_fn(gramian, *args)
    return (weights.numpy().astype(np.float64) @ J.astype(np.float32).astype(np.float64))


def _close(actual, expected, scale_of, name=""):
    scale = max(1.0, float(np.abs(scale_of).max()))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-5 * scale, err_msg=name)


# One test per aggregator loops over every matrix (a test costs ~1 s of
# Keras session teardown here, a matrix a few milliseconds).
def test_pcgrad_equals_numpy_projection_loop():
    for name, J in MATRICES.items():
        for step in range(3):
            orders = task_orders(7, step, len(J))
            expected = ref.pcgrad(J, orders.numpy())
            _close(_combine(pcgrad_weights, J, orders), expected, J, name)


def test_pcgrad_task_order_is_per_task_and_changes_with_the_step():
    orders = [task_orders(0, step, 4).numpy() for step in range(20)]
    for o in orders:
        assert all(sorted(row) == [0, 1, 2, 3] for row in o)
    assert any(len({tuple(r) for r in o}) > 1 for o in orders)  # per-task orders differ
    assert len({o.tobytes() for o in orders}) > 1  # and change with the step
    np.testing.assert_array_equal(task_orders(0, 5, 4), task_orders(0, 5, 4))  # stateless


def test_pcgrad_result_depends_on_the_order_with_three_conflicting_tasks():
    J = np.array([[1.0, 0.0], [-0.8, 0.6], [-0.6, -0.8]])
    first = ref.pcgrad(J, [[0, 1, 2], [1, 0, 2], [2, 0, 1]])
    second = ref.pcgrad(J, [[0, 2, 1], [1, 2, 0], [2, 1, 0]])
    assert not np.allclose(first, second)
    for orders, expected in (([[0, 1, 2], [1, 0, 2], [2, 0, 1]], first),
                             ([[0, 2, 1], [1, 2, 0], [2, 1, 0]], second)):
        _close(_combine(pcgrad_weights, J, tf.constant(orders, tf.int32)), expected, J)


@pytest.mark.parametrize("normalization", ["none", "l2"])
def test_mgda_equals_exact_min_norm(normalization):
    for name, J in MATRICES.items():
        expected = ref.mgda(J, normalization=normalization)
        _close(_combine(mgda_weights, J, None, normalization), expected, J, name)


def test_mgda_loss_normalizations_equal_numpy():
    J = MATRICES["random3"]
    losses = np.array([0.5, 2.0, 1.3])
    for normalization in ("loss", "loss+"):
        expected = ref.mgda(J, losses, normalization)
        actual = _combine(mgda_weights, J, tf.constant(losses, tf.float32), normalization)
        _close(actual, expected, J)


def test_mgda_weights_are_on_the_simplex_and_optimal():
    J = _random(5, 9, 11)
    gramian = tf.constant(J @ J.T, tf.float32)
    w = qp.min_norm_weights(gramian).numpy()
    assert w.min() >= 0 and abs(w.sum() - 1) < 1e-6
    samples = np.random.default_rng(0).dirichlet(np.ones(5), size=3000)
    G = J @ J.T
    assert w @ G @ w <= np.min(np.einsum("ni,ij,nj->n", samples, G, samples)) + 1e-5


def test_cagrad_equals_numpy_search():
    for name, J in MATRICES.items():
        if len(J) > 3:
            continue
        for rescale in (0, 1):
            expected, _ = ref.cagrad(J, c=0.4, rescale=rescale)
            _close(_combine(cagrad_weights, J, 0.4, rescale), expected, J, f"{name} {rescale}")


def test_cagrad_with_zero_radius_is_the_mean_and_beats_random_points_for_four_tasks():
    J = MATRICES["random4"]
    _close(_combine(cagrad_weights, J, 0.0, 0), J.mean(axis=0), J)
    # K = 4: the face solution is no worse than any sampled simplex point.
    G = J @ J.T / np.trace(J @ J.T)
    b = np.full(4, 0.25)
    sqrt_phi = 0.4 * np.sqrt(b @ G @ b)

    def F(w):
        return w @ G @ b + sqrt_phi * np.sqrt(w @ G @ w)

    weights = cagrad_weights(tf.constant(J @ J.T, tf.float32), 0.4, 0).numpy().astype(np.float64)
    lam_w = weights - b  # = (sqrt_phi / ||g_w||) w
    w = lam_w / lam_w.sum()
    samples = np.random.default_rng(1).dirichlet(np.ones(4), size=5000)
    assert F(w) <= min(F(s) for s in samples) + 1e-6


def test_imtlg_equals_numpy():
    for name, J in MATRICES.items():
        _close(_combine(imtlg_weights, J), ref.imtlg(J), J, name)


def test_aligned_mtl_equals_numpy():
    for name, J in MATRICES.items():
        for mode in ("min", "median", "rmse"):
            expected = ref.aligned_mtl(J, mode)
            _close(_combine(aligned_mtl_weights, J, mode), expected, J, f"{name} {mode}")


def test_upgrad_equals_numpy_dual_cone_projection():
    for name, J in MATRICES.items():
        _close(_combine(upgrad_weights, J), ref.upgrad(J), J, name)


def test_upgrad_step_conflicts_with_no_task():
    J = MATRICES["conflicting"]
    d = _combine(upgrad_weights, J)
    assert np.all(J @ d >= -1e-6)
    assert (J @ J.sum(0)).min() < 0  # the plain sum does conflict


def test_dual_cone_solver_equals_numpy_for_random_bounds():
    rng = np.random.default_rng(5)
    J = rng.normal(size=(4, 6))
    G = J @ J.T + 0.01 * np.eye(4)
    U = np.abs(rng.normal(size=(3, 4))) * (rng.random((3, 4)) > 0.4)
    actual = qp.dual_cone_weights(tf.constant(G, tf.float32), tf.constant(U, tf.float32)).numpy()
    expected = np.stack([ref.dual_cone_projection(G, u) for u in U])
    np.testing.assert_allclose(actual, expected, atol=2e-5)


def test_one_task_is_its_own_gradient_for_every_aggregator():
    J = MATRICES["one_task"]
    for fn, args in ((pcgrad_weights, (tf.zeros([1, 1], tf.int32),)), (mgda_weights, ()),
                     (imtlg_weights, ()), (aligned_mtl_weights, ()), (upgrad_weights, ())):
        _close(_combine(fn, J, *args), J[0], J)
    _close(_combine(cagrad_weights, J, 0.4, 0), 1.4 * J[0], J)  # (1/K + c) g
