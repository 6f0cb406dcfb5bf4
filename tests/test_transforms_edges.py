"""Edge cases of the gradient transforms, called directly (no `fit`).

Covers what the other transform tests leave open: `kt.SkipNonFinite` checks
only the gradients its `where=` selects (and keeps a step where none of them
has a gradient); several gates must all keep a step; `kt.AdaptiveClip`
floors the gradient norm at 1e-6 in its clip factor (the NFNets/optax
formula) for tiny units; `kt.LogUpdateRatio` does not count a step whose
group had zero weights, and is handed only its own group's previous values;
`kt.LogGradientNorm(log_max=True)` keeps a non-finite step out of the max; a
rank-1 sparse gradient passes `kt.CentralizeGradients` unchanged (sparse).

Oracles: NumPy (`np.isfinite`, norms in float64, the AGC formula written
out) on the same gradients and weights.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.transforms.base import after_apply_in_order
from keras_tapeops.transforms.base import keep_step_decision

pytestmark = pytest.mark.unit


def make_net():
    """body (3, 4) -> head (4, 2): four trainable variables, two per layer."""
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="body")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))


def gradients(variables, seed=0, bad=None):
    """One float32 gradient per variable; `bad` (an index) holds a nan."""
    rng = np.random.default_rng(seed)
    grads = [rng.normal(size=v.shape).astype("float32") for v in variables]
    if bad is not None:
        grads[bad].flat[0] = np.nan
    return [tf.constant(g) for g in grads]


def selected_finite(grads, selected):
    """NumPy: every selected, present gradient is finite."""
    return all(
        np.all(np.isfinite(g.numpy())) for g, on in zip(grads, selected) if on and g is not None
    )


# ------------------------------------------------------------ SkipNonFinite
def test_skip_non_finite_checks_only_the_selected_gradients():
    model = make_net()
    variables = model.trainable_variables
    gate = kt.SkipNonFinite(where="head*")
    state = gate.bind(model, variables)
    assert state.selected == [False, False, True, True]
    skipped = 0
    for bad in (None, 0, 1, 2, 3):  # a nan in the body's kernel/bias, then the head's
        grads = gradients(variables, seed=bad or 0, bad=bad)
        expected = selected_finite(grads, state.selected)
        assert bool(gate.keep_step(grads, variables, state)) is expected
        skipped += not expected
    assert skipped == 2  # the check can fail: the head's nans are caught
    assert float(state.metrics["skipped_steps"].result()) == skipped


def test_skip_non_finite_keeps_a_step_where_no_selected_variable_has_a_gradient():
    model = make_net()
    variables = model.trainable_variables
    gate = kt.SkipNonFinite(where="head*", max_consecutive=1)
    state = gate.bind(model, variables)
    grads = gradients(variables, bad=0)[:2] + [None, None]  # head unused, body not finite
    assert bool(gate.keep_step(grads, variables, state)) is True
    assert float(state.metrics["skipped_steps"].result()) == 0.0
    assert float(state.variables["consecutive_skips"].numpy()) == 0.0


def test_every_gate_must_keep_the_step():
    """Two gates on different groups: a nan in either group skips the step."""
    model = make_net()
    variables = model.trainable_variables
    gates = [
        kt.SkipNonFinite(where="body*", name="body_skips"),
        kt.SkipNonFinite(where="head*", name="head_skips"),
    ]
    bound = [(gate, gate.bind(model, variables)) for gate in gates]
    for bad in (None, 0, 3):
        grads = gradients(variables, bad=bad)
        expected = all(selected_finite(grads, state.selected) for _, state in bound)
        assert bool(keep_step_decision(bound, grads, variables)) is expected
    # One step per group was not finite: each gate counted its own.
    assert [float(s.metrics[g.name].result()) for g, s in bound] == [1.0, 1.0]


# ------------------------------------------------------------- AdaptiveClip
def agc_numpy(grad, weight, clipping, eps):
    """NFNets/optax AGC in float64, Keras layout (unit = last axis), floor 1e-6."""
    grad = np.asarray(grad, np.float64)
    weight = np.asarray(weight, np.float64)
    axes = tuple(range(grad.ndim - 1)) if grad.ndim > 1 else None
    keep = axes is not None

    def norms(a):
        return np.sqrt(np.sum(np.square(a), axis=axes, keepdims=keep))

    max_norm = clipping * np.maximum(norms(weight), eps)
    grad_norm = norms(grad)
    clipped = grad * (max_norm / np.maximum(grad_norm, 1e-6))
    return np.where(grad_norm < max_norm, grad, clipped)


@pytest.mark.parametrize(
    "clipping, eps, unit_norms",
    [
        # bound 1e-5 (zero weights): units of norm 1e-5..1e-3 are clipped by
        # max_norm / grad_norm; the floor is not reached.
        (0.01, 1e-3, [2e-5, 1e-4, 9e-4]),
        # bound 1e-7: units of norm below 1e-6 are scaled by max_norm / 1e-6.
        (1e-4, 1e-3, [2e-7, 5e-7, 3e-6]),
    ],
)
def test_adaptive_clip_of_tiny_units_uses_the_1e_6_norm_floor(clipping, eps, unit_norms):
    rng = np.random.default_rng(3)
    weight = np.zeros((4, 3), "float32")  # fresh kernel: the bound is clipping * eps
    direction = rng.normal(size=(4, 3))
    grad = (direction / np.linalg.norm(direction, axis=0) * unit_norms).astype("float32")
    (got,) = kt.AdaptiveClip(clipping=clipping, eps=eps)(
        [tf.constant(grad)], [keras.Variable(weight)]
    )
    expected = agc_numpy(grad, weight, clipping, eps)
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=1e-6, atol=0)
    assert not np.allclose(expected, grad, rtol=1e-3)  # every unit was clipped


# ----------------------------------------------------------- LogUpdateRatio
def test_update_ratio_does_not_count_a_step_whose_group_had_zero_weights():
    model = make_net()
    variables = model.trainable_variables
    logger = kt.LogUpdateRatio()
    state = logger.bind(model, variables)
    old = [v.numpy() for v in variables]
    # Step 1 started from all-zero weights: ||W' - W|| / 0 is not counted.
    logger.after_apply(variables, [np.zeros_like(w) for w in old], state)
    # Step 2 moved the weights by `delta`.
    delta = [0.01 * (i + 1) * np.ones_like(w) for i, w in enumerate(old)]
    for v, w, d in zip(variables, old, delta):
        v.assign(w + d)
    logger.after_apply(variables, old, state)
    flat = np.concatenate([w.ravel() for w in old]).astype(np.float64)
    step = np.concatenate([d.ravel() for d in delta]).astype(np.float64)
    expected = np.linalg.norm(step) / np.linalg.norm(flat)
    np.testing.assert_allclose(float(state.metrics["update_ratio"].result()), expected, rtol=1e-6)


def test_after_apply_hands_a_transform_only_its_groups_previous_values():
    """The backend-neutral hook runner (the JAX step's): `where="head*"`."""
    model = make_net()
    variables = model.trainable_variables
    logger = kt.LogUpdateRatio(where="head*")
    bound = [(logger, logger.bind(model, variables))]
    rng = np.random.default_rng(4)
    old = [v.numpy() for v in variables]
    new = [w + rng.normal(scale=0.1, size=w.shape).astype("float32") for w in old]
    after_apply_in_order(bound, [tf.constant(w) for w in new], [tf.constant(w) for w in old])
    head = [2, 3]
    update = np.sqrt(sum(np.sum(np.square(new[i].astype(np.float64) - old[i])) for i in head))
    weights = np.sqrt(sum(np.sum(np.square(old[i].astype(np.float64))) for i in head))
    np.testing.assert_allclose(
        float(bound[0][1].metrics["update_ratio"].result()), update / weights, rtol=1e-6
    )


# ---------------------------------------------------------- LogGradientNorm
def test_gradient_norm_max_leaves_out_a_non_finite_step():
    model = make_net()
    variables = model.trainable_variables
    logger = kt.LogGradientNorm(log_max=True)
    state = logger.bind(model, variables)
    finite = gradients(variables, seed=5)
    expected = np.sqrt(sum(np.sum(np.square(g.numpy().astype(np.float64))) for g in finite))
    logger(finite, variables, state)
    logger(gradients(variables, seed=6, bad=1), variables, state)
    np.testing.assert_allclose(float(state.metrics["grad_norm"].result()), expected, rtol=1e-6)
    np.testing.assert_allclose(float(state.metrics["grad_norm_max"].result()), expected, rtol=1e-6)


# ------------------------------------------------------- CentralizeGradients
def test_centralize_passes_a_rank_one_sparse_gradient_through_unchanged():
    """Rank <= 1 is left alone, sparse included: the optimizer still gets the
    IndexedSlices (a sparse Adam update differs from the dense one)."""
    grad = tf.IndexedSlices(tf.constant([1.0, 2.0, 4.0]), tf.constant([3, 0, 3]), tf.constant([5]))
    (out,) = kt.CentralizeGradients()([grad], [keras.Variable(np.zeros((5,), "float32"))])
    assert isinstance(out, tf.IndexedSlices)
    np.testing.assert_array_equal(out.values.numpy(), [1.0, 2.0, 4.0])
    np.testing.assert_array_equal(out.indices.numpy(), [3, 0, 3])
