"""NumPy reference implementations of the aggregators (float64), and checks of the references.

Written from the papers and the reference code, independently of the TF
implementation: PCGrad projects the actual gradient vectors; the QP-based
methods are solved by enumerating supports with explicit KKT certificates
(exact, with no solver tolerance), CAGrad by nested golden-section search over
the simplex (exact for K <= 3). The other test modules import these.
"""

import itertools

import numpy as np

NORM_EPS = 1e-4
REG_EPS = 1e-4
RCOND = 1e-4  # the library's documented rank cutoff (keras_tapeops.gramian.RCOND)


def pcgrad(J, orders):
    """Sum of the projected gradients; `orders[i]` is task i's visiting order (torchjd)."""
    J = np.asarray(J, np.float64)
    out = np.zeros(J.shape[1])
    for i in range(len(J)):
        g = J[i].copy()
        for j in orders[i]:
            if j == i:
                continue
            inner = g @ J[j]
            norm2 = J[j] @ J[j]
            if inner < 0 and norm2 > 0:
                g = g - inner / norm2 * J[j]
        out += g
    return out


def _subsets(k):
    for size in range(1, k + 1):
        yield from itertools.combinations(range(k), size)


def min_norm_weights(G):
    """argmin a^T G a on the simplex, with a KKT certificate (raises if none found)."""
    G = np.asarray(G, np.float64)
    k = len(G)
    scale = max(np.trace(G), 1e-300)
    best, best_value = None, np.inf
    for S in _subsets(k):
        S = list(S)
        m = len(S)
        A = np.zeros((m + 1, m + 1))
        A[:m, :m] = G[np.ix_(S, S)]
        A[:m, m] = 1.0
        A[m, :m] = 1.0
        rhs = np.zeros(m + 1)
        rhs[m] = 1.0
        sol = np.linalg.lstsq(A, rhs, rcond=None)[0]
        a = np.zeros(k)
        a[S] = sol[:m]
        if a.min() < -1e-12 or abs(a.sum() - 1) > 1e-9:
            continue
        value = a @ G @ a
        # KKT: (G a)_j >= a^T G a for every j (equality on the support).
        if np.all(G @ a >= value - 1e-9 * scale) and value < best_value - 1e-15 * scale:
            best, best_value = a, value
    assert best is not None, "no KKT point found"
    return best


def mgda(J, losses=None, normalization="none"):
    """MGDA's step: weights from the normalized rows, applied to the raw rows."""
    J = np.asarray(J, np.float64)
    if normalization == "none":
        scale = np.ones(len(J))
    elif normalization == "l2":
        scale = np.linalg.norm(J, axis=1)
    elif normalization == "loss":
        scale = np.asarray(losses, np.float64)
    else:
        scale = np.asarray(losses, np.float64) * np.linalg.norm(J, axis=1)
    scale = np.where(scale > 0, scale, 1.0)
    normalized = J / scale[:, None]
    return min_norm_weights(normalized @ normalized.T) @ J


def dual_cone_projection(G, u):
    """argmin v^T G v s.t. v >= u, G positive definite, with a KKT certificate."""
    k = len(G)
    for free_size in range(k + 1):
        for F in itertools.combinations(range(k), free_size):
            F = list(F)
            B = [i for i in range(k) if i not in F]
            v = np.array(u, np.float64)
            if F:
                v[F] = np.linalg.solve(G[np.ix_(F, F)], -G[np.ix_(F, B)] @ v[B])
            gradient = G @ v
            if np.all(v[F] >= u[F] - 1e-12) and np.all(gradient[B] >= -1e-12):
                return v
    raise AssertionError("no KKT point found")


def upgrad(J, norm_eps=NORM_EPS, reg_eps=REG_EPS):
    J = np.asarray(J, np.float64)
    k = len(J)
    G = J @ J.T
    trace = np.trace(G)
    G = np.zeros_like(G) if trace < norm_eps else G / trace
    G = G + reg_eps * np.eye(k)
    weights = sum(dual_cone_projection(G, np.eye(k)[i] / k) for i in range(k))
    return weights @ J


def imtlg(J):
    J = np.asarray(J, np.float64)
    G = J @ J.T
    G = G / np.trace(G) if np.trace(G) > 0 else G
    v = np.linalg.pinv(G, rcond=RCOND, hermitian=True) @ np.sqrt(np.diag(G))
    weights = np.zeros_like(v) if abs(v.sum()) < 1e-12 else v / v.sum()
    return weights @ J


def aligned_mtl(J, scale_mode="min"):
    J = np.asarray(J, np.float64)
    k = len(J)
    G = J @ J.T
    G = G / np.trace(G) if np.trace(G) > 0 else G
    values, vectors = np.linalg.eigh(G)
    rank = int(np.sum(values > RCOND * max(values.max(), 0)))
    preference = np.full(k, 1.0 / k)
    if rank == 0:
        return preference @ J
    order = np.argsort(values)[::-1][:rank]
    values, vectors = values[order], vectors[:, order]
    if scale_mode == "min":
        scale = values[-1]
    elif scale_mode == "median":
        scale = np.sort(values)[(rank - 1) // 2]
    else:
        scale = values.mean()
    B = np.sqrt(scale) * vectors @ np.diag(1 / np.sqrt(values)) @ vectors.T
    return (B @ preference) @ J


def _golden(f, lo, hi, iterations=90):
    ratio = (np.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iterations):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    x = (a + b) / 2
    return x, f(x)


def _simplex_minimum(F, k):
    """min of a convex F over the simplex by nested golden sections (k <= 3)."""
    if k == 1:
        return np.ones(1), F(np.ones(1))
    if k == 2:
        t, value = _golden(lambda t: F(np.array([t, 1 - t])), 0.0, 1.0)
        return np.array([t, 1 - t]), value
    assert k == 3

    def inner(t):
        rest = 1 - t
        s, value = _golden(lambda s: F(np.array([t, s * rest, (1 - s) * rest])), 0.0, 1.0, 60)
        return value, s

    t, _ = _golden(lambda t: inner(t)[0], 0.0, 1.0, 60)
    s = inner(t)[1]
    w = np.array([t, s * (1 - t), (1 - s) * (1 - t)])
    return w, F(w)


def cagrad(J, c=0.4, rescale=1):
    """CAGrad's step (official code's formula) with its sub-problem solved by search."""
    J = np.asarray(J, np.float64)
    k = len(J)
    G = J @ J.T
    G = G / np.trace(G) if np.trace(G) > 0 else G
    b = np.full(k, 1.0 / k)
    sqrt_phi = c * np.sqrt(max(b @ G @ b, 0))

    def F(w):
        return w @ G @ b + sqrt_phi * np.sqrt(max(w @ G @ w, 0))

    w, _ = _simplex_minimum(F, k)
    g_w = np.sqrt(max(w @ G @ w, 0))
    weights = (b + sqrt_phi / (g_w + 1e-8) * w) / {0: 1, 1: 1 + c**2, 2: 1 + c}[rescale]
    return weights @ J, F


# ------------------------------------------------------------- self-checks
def test_min_norm_reference_matches_closed_form_for_two_tasks():
    g1, g2 = np.array([1.0, 0.0]), np.array([0.0, 2.0])
    # min ||t g1 + (1 - t) g2||: t = |g2|^2 / |g1 - g2|^2
    t = 4.0 / 5.0
    np.testing.assert_allclose(mgda(np.stack([g1, g2])), t * g1 + (1 - t) * g2, atol=1e-12)


def test_dual_cone_reference_is_optimal_against_random_feasible_points():
    rng = np.random.default_rng(3)
    J = rng.normal(size=(3, 5))
    G = J @ J.T + 1e-3 * np.eye(3)
    u = np.array([1 / 3, 0.0, 0.0])
    v = dual_cone_projection(G, u)
    others = u + np.abs(rng.normal(size=(2000, 3)))
    assert v @ G @ v <= np.min(np.einsum("ni,ij,nj->n", others, G, others)) + 1e-12


def test_golden_section_reference_beats_random_simplex_points():
    rng = np.random.default_rng(4)
    J = rng.normal(size=(3, 4))
    _, F = cagrad(J)
    w, value = _simplex_minimum(F, 3)
    samples = rng.dirichlet(np.ones(3), size=5000)
    assert value <= min(F(s) for s in samples) + 1e-9
