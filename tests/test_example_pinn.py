"""examples/pinn_burgers.py: its Cole-Hopf reference is right, and `--quick` runs end to end."""

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from example_runner import run_example

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pinn_burgers.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("pinn_burgers", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_matches_the_published_steepest_slope(example):
    # Basdevant et al. (1986), the classic check of Burgers solvers at
    # nu = 0.01/pi: max |u_x| at x = 0 is 152.00516, reached at t = 1.6037/pi.
    h = 1e-6
    u = example.burgers_reference(np.array([-h, h]), 1.6037 / np.pi)
    np.testing.assert_allclose((u[1] - u[0]) / (2 * h), -152.00516, rtol=1e-6)


def test_reference_initial_boundary_symmetry_and_residual(example):
    x = np.linspace(-1, 1, 41)
    np.testing.assert_allclose(example.burgers_reference(x, 0.0), -np.sin(np.pi * x))
    t = np.linspace(0.05, 1.0, 9)
    np.testing.assert_allclose(example.burgers_reference(1.0, t), 0.0, atol=1e-12)
    np.testing.assert_allclose(example.burgers_reference(-1.0, t), 0.0, atol=1e-12)
    np.testing.assert_allclose(example.burgers_reference(-x, 0.7),
                               -example.burgers_reference(x, 0.7), atol=1e-12)
    # The PDE by central differences where the solution is smooth (t <= 0.3).
    xs, ts = np.meshgrid(np.linspace(-0.9, 0.9, 7), np.linspace(0.1, 0.3, 3))
    dx = dt = 1e-4
    u = lambda a, b: example.burgers_reference(a, b)  # noqa: E731
    u_t = (u(xs, ts + dt) - u(xs, ts - dt)) / (2 * dt)
    u_x = (u(xs + dx, ts) - u(xs - dx, ts)) / (2 * dx)
    u_xx = (u(xs + dx, ts) - 2 * u(xs, ts) + u(xs - dx, ts)) / dx**2
    residual = u_t + u(xs, ts) * u_x - example.NU * u_xx
    assert np.max(np.abs(residual)) < 1e-5


def test_residual_function_is_burgers(example):
    # u = x t: u_t = x, u_x = t, u_xx = 0, so the residual is x + x t^2.
    import tensorflow as tf

    import keras_tapeops as kt

    points = np.array([[0.5, 0.2], [-0.3, 0.9]], "float32")
    derivatives = kt.input_derivatives(lambda p: p[:, :1] * p[:, 1:], points, order=2)
    residual = example.burgers_residual(tf.constant(points), *derivatives)
    x, t = points[:, 0], points[:, 1]
    np.testing.assert_allclose(residual, x + x * t**2, rtol=1e-6)


def test_quick_run_prints_error_and_time_and_writes_the_png(tmp_path):
    out = run_example(EXAMPLE, tmp_path, "--quick", "--out", "burgers.png")
    error = float(re.search(r"relative L2 error: ([0-9.e+-]+)", out).group(1))
    assert 0 < error < 2.0
    assert re.search(r"wall time: \d+ s \(CPU time \d+ s\)", out)
    assert re.search(r"Adam, 50 steps in fit: \{'loss': .*'pde': .*'walls': ", out)
    if HAS_MATPLOTLIB:
        assert (tmp_path / "burgers.png").stat().st_size > 10_000
