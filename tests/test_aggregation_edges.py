"""Aggregator edges against the NumPy references of tests/test_aggregation_reference.py.

- CAGrad's `rescale=2` (the official code's `d / (1 + c)`);
- the aggregators' defaults through the public `aggregate` (CAGrad c=0.4,
  rescale=1; UPGrad norm_eps = reg_eps = 1e-4 as torchjd; AlignedMTL
  scale_mode="min"; MGDA normalization="none"), and PCGrad's `seed`;
- nearly dependent task rows: eigenvalues between float32 noise and the
  documented cutoff (`keras_tapeops.gramian.RCOND = 1e-4` x the largest) are
  dropped by IMTL-G and Aligned-MTL;
- PCGrad never projects a task on itself (torchjd), even when its projected
  gradient has come to conflict with its own gradient;
- zero rows: MGDA's documented uniform weights for a zero Gramian, and a
  zero loss under `normalization="loss"` counts as scale 1.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
import test_aggregation_reference as ref
from keras_tapeops.aggregation.aligned_mtl import aligned_mtl_weights
from keras_tapeops.aggregation.cagrad import cagrad_weights
from keras_tapeops.aggregation.imtlg import imtlg_weights
from keras_tapeops.aggregation.mgda import mgda_weights
from keras_tapeops.aggregation.pcgrad import pcgrad_weights
from keras_tapeops.aggregation.pcgrad import task_orders

pytestmark = pytest.mark.unit

G_ROW = np.array([1.0, -2.0, 0.5, 3.0, -1.0])
H_ROW = np.array([-0.5, 1.0, 2.0, 0.0, 1.5])


def _random(k, p, seed):
    return np.random.default_rng(seed).normal(size=(k, p))


def _combine(weights_fn, J, *args):
    J32 = tf.constant(J, tf.float32)
    weights = weights_fn(tf.matmul(J32, J32, transpose_b=True), *args)
    return weights.numpy().astype(np.float64) @ J.astype(np.float32).astype(np.float64)


def _close(actual, expected, scale_of, name=""):
    scale = max(1.0, float(np.abs(scale_of).max()))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-5 * scale, err_msg=name)


CONFLICTING = {
    "random2": _random(2, 7, 0),
    "random3": _random(3, 7, 1),
    "conflicting": np.stack([G_ROW, -0.3 * G_ROW + 0.2 * H_ROW]),
}


def test_cagrad_rescale_two_divides_by_one_plus_c():
    for name, J in CONFLICTING.items():
        expected, _ = ref.cagrad(J, c=0.4, rescale=2)
        _close(_combine(cagrad_weights, J, 0.4, 2), expected, J, name)
        # Companion: rescale=1 (1 + c^2) is another step.
        assert np.abs(ref.cagrad(J, c=0.4, rescale=1)[0] - expected).max() > 1e-2 * np.abs(J).max()


def test_public_aggregators_default_to_the_reference_settings():
    """`aggregate(rows)` with default arguments equals each reference's defaults."""
    cases = [
        (kt.CAGrad(shared="trunk/*"), lambda J: ref.cagrad(J, c=0.4, rescale=1)[0]),
        (kt.UPGrad(shared="trunk/*"), lambda J: ref.upgrad(J, norm_eps=1e-4, reg_eps=1e-4)),
        (kt.AlignedMTL(shared="trunk/*"), lambda J: ref.aligned_mtl(J, "min")),
        (kt.MGDA(shared="trunk/*"), lambda J: ref.mgda(J, normalization="none")),
    ]
    for aggregator, reference in cases:
        for name, J in CONFLICTING.items():
            actual = aggregator.aggregate(tf.constant(J, tf.float32)).numpy().astype(np.float64)
            _close(actual, reference(J), J, f"{type(aggregator).__name__} {name}")
    # Companions: other settings move these steps by more than the tolerance.
    J = CONFLICTING["conflicting"]
    assert np.abs(ref.cagrad(J, c=0.5)[0] - ref.cagrad(J, c=0.4)[0]).max() > 1e-3
    assert np.abs(ref.upgrad(J, reg_eps=1e-2) - ref.upgrad(J)).max() > 1e-3


def test_pcgrad_aggregate_draws_the_task_orders_from_its_seed():
    J = np.array([[1.0, 0.0], [-0.8, 0.6], [-0.6, -0.8]])  # the result depends on the order
    results = []
    for seed in range(6):
        actual = kt.PCGrad(shared="trunk/*", seed=seed).aggregate(tf.constant(J, tf.float32))
        expected = ref.pcgrad(J, task_orders(seed, 0, 3).numpy())
        _close(actual.numpy().astype(np.float64), expected, J, f"seed {seed}")
        results.append(np.round(expected, 5).tobytes())
    assert len(set(results)) > 1  # the seeds draw different orders and steps


@pytest.mark.parametrize(
    "weights_fn,reference",
    [
        (imtlg_weights, ref.imtlg),
        (aligned_mtl_weights, ref.aligned_mtl),
    ],
    ids=["imtlg", "aligned_mtl"],
)
def test_nearly_dependent_rows_drop_eigenvalues_below_the_cutoff(weights_fn, reference):
    """Rows whose Gramian's eigenvalue ratio is about 1e-5: below the library's
    cutoff (1e-4), above float32 round-off and above a pinv's default cutoff
    (10 K eps = 2.4e-6): the small direction is dropped, as in the reference."""
    h = H_ROW - (H_ROW @ G_ROW) / (G_ROW @ G_ROW) * G_ROW  # orthogonal to g
    J = np.stack([G_ROW, -2.0 * G_ROW + 0.024 * h])
    values = np.linalg.eigvalsh(J @ J.T)
    assert 3e-6 < values[0] / values[-1] < 3e-5
    expected = reference(J)
    _close(_combine(weights_fn, J), expected, J)
    # Companion: keeping the small direction is another step.
    J_kept = np.stack([G_ROW, -2.0 * G_ROW + 0.5 * h])  # same rows, well conditioned
    assert np.abs(reference(J_kept) - expected).max() > 1e-2


def test_pcgrad_never_projects_a_task_on_itself():
    """Task 0 visits 1, then 2, then itself; after two projections its gradient
    conflicts with g_0, and torchjd's PCGrad still skips the task itself."""
    J = np.array(
        [
            [1.0, 0.0],
            [-np.sqrt(0.5), np.sqrt(0.5)],
            [np.cos(np.radians(200)), np.sin(np.radians(200))],
        ]
    )
    orders = np.array([[1, 2, 0], [2, 0, 1], [0, 2, 1]])
    g = J[0].copy()
    for j in (1, 2):
        if g @ J[j] < 0:
            g = g - (g @ J[j]) / (J[j] @ J[j]) * J[j]
    assert g @ J[0] < -0.05  # the case a self-projection would change
    expected = ref.pcgrad(J, orders)
    _close(_combine(pcgrad_weights, J, tf.constant(orders, tf.int32)), expected, J)


def test_mgda_weights_of_zero_rows_are_uniform():
    """Every point of the simplex is a min-norm point of zero rows; the
    documented choice is the uniform weights (logged as each task's weight)."""
    weights = mgda_weights(tf.zeros([3, 3])).numpy()
    np.testing.assert_allclose(weights, np.full(3, 1 / 3), rtol=1e-6)


def test_mgda_loss_normalization_treats_a_zero_loss_as_scale_one():
    J = _random(3, 6, 4)
    losses = np.array([0.0, 1.3, 0.4])
    expected = ref.mgda(J, losses, "loss")
    actual = _combine(mgda_weights, J, tf.constant(losses, tf.float32), "loss")
    _close(actual, expected, J)
    # Companion: a tiny positive scale instead of 1 is another step.
    assert np.abs(ref.mgda(J, np.array([1e-3, 1.3, 0.4]), "loss") - expected).max() > 1e-2
