"""Physics-informed network for viscous Burgers' equation (Raissi et al. 2019), trained with `fit`.

    u_t + u u_x = (0.01 / pi) u_xx,   x in [-1, 1], t in [0, 1],
    u(0, x) = -sin(pi x),   u(t, -1) = u(t, 1) = 0.

The network u(x, t) (8 tanh layers of 20 units, as in the paper) is trained
by `fit` on the initial condition (the compiled MSE loss on `(x, 0) -> u0`)
with two loss terms: `kt.PDEResidual` (the residual above on 10000 points
drawn from the box by a `kt.physics.BoxSampler`, new ones every step) and
`kt.ConditionLoss` (u = 0 on both walls). Adam runs for a few hundred steps,
then `kt.physics.lbfgs` refines the same objective (its points are those of
the last Adam step), as the paper does with L-BFGS.

The reference solution is the Cole-Hopf formula,

    u(t, x) = -int sin(pi (x - s)) f(x - s) G(s) ds / int f(x - s) G(s) ds,
    f(y) = exp(-cos(pi y) / (2 pi nu)),  G(s) = exp(-s^2 / (4 nu t)),

with s = sqrt(4 nu t) z, evaluated by 100-point Gauss-Hermite quadrature
(NumPy; no download). The script prints the relative L2 error on a 256 x 101
grid and the wall and CPU times, and writes `pinn_burgers.png` (prediction,
reference, absolute error).

Usage:
    python examples/pinn_burgers.py [--quick] [--out pinn_burgers.png]
      [--adam-steps 500] [--lbfgs-iterations 2000] [--json numbers.json]
`--quick` is a smoke test (a small network, a few steps, seconds). `--json`
writes the printed numbers (relative L2 error after Adam, during and after
L-BFGS) to a JSON file; `make figures` keeps it next to the documentation's
copy of the PNG (docs/figures/).
"""

import argparse
import json
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402

NU = 0.01 / np.pi


def burgers_reference(x, t, nu=NU, nodes=100):
    """Cole-Hopf solution at points `(x, t)` (broadcast arrays), by Gauss-Hermite quadrature."""
    z, w = np.polynomial.hermite.hermgauss(nodes)
    x, t = np.broadcast_arrays(np.asarray(x, "float64"), np.asarray(t, "float64"))
    u = -np.sin(np.pi * x)  # t = 0: the initial condition
    later = t > 0
    y = x[later][:, None] - np.sqrt(4 * nu * t[later])[:, None] * z
    log_f = -np.cos(np.pi * y) / (2 * np.pi * nu)
    f = w * np.exp(log_f - log_f.max(axis=1, keepdims=True))  # exp(50) scaled away
    u[later] = -(np.sin(np.pi * y) * f).sum(axis=1) / f.sum(axis=1)
    return u


@keras.saving.register_keras_serializable(package="pinn_burgers")
def burgers_residual(points, u, du, d2u):
    """u_t + u u_x - nu u_xx at `points = (x, t)`; derivatives indexed [point, output, coordinate]."""
    return du[:, 0, 1] + u[:, 0] * du[:, 0, 0] - NU * d2u[:, 0, 0]


def network(width, depth):
    return kt.upgrade(keras.Sequential(
        [keras.Input((2,))]
        + [keras.layers.Dense(width, activation="tanh") for _ in range(depth)]
        + [keras.layers.Dense(1)]
    ))


def training_data(n_initial=256, n_wall=101):
    """The initial condition (fit's data) and the wall points (a ConditionLoss)."""
    x = np.linspace(-1, 1, n_initial, dtype="float32")
    initial = np.stack([x, np.zeros_like(x)], axis=1)
    t = np.linspace(0, 1, n_wall, dtype="float32")
    walls = np.concatenate([np.stack([-np.ones_like(t), t], 1), np.stack([np.ones_like(t), t], 1)])
    return initial, -np.sin(np.pi * initial[:, :1]), walls


def evaluation_grid():
    x, t = np.linspace(-1, 1, 256), np.linspace(0, 1, 101)
    xx, tt = np.meshgrid(x, t)
    return xx, tt, burgers_reference(xx, tt)


def relative_l2(model, xx, tt, reference):
    grid = np.stack([xx.ravel(), tt.ravel()], axis=1).astype("float32")
    prediction = model.predict(grid, batch_size=len(grid), verbose=0).reshape(xx.shape)
    return float(np.linalg.norm(prediction - reference) / np.linalg.norm(reference)), prediction


def plot(path, xx, tt, prediction, reference):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("prediction u(t, x)", prediction, "RdBu_r"), ("reference (Cole-Hopf)", reference, "RdBu_r"),
              ("|prediction - reference|", np.abs(prediction - reference), "viridis")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, (title, values, cmap) in zip(axes, panels):
        image = ax.pcolormesh(tt, xx, values, cmap=cmap, shading="auto")
        ax.set(title=title, xlabel="t", ylabel="x")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny and short")
    parser.add_argument("--out", default="pinn_burgers.png")
    parser.add_argument("--adam-steps", type=int, default=None)
    parser.add_argument("--lbfgs-iterations", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    width, depth, points, adam_steps, lbfgs_iterations = (
        (8, 2, 500, 50, 20) if args.quick else (20, 8, 10000, 500, 2000)
    )
    adam_steps = args.adam_steps if args.adam_steps is not None else adam_steps
    lbfgs_iterations = (
        args.lbfgs_iterations if args.lbfgs_iterations is not None else lbfgs_iterations
    )
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    keras.utils.set_random_seed(0)
    xx, tt, reference = evaluation_grid()
    initial, u0, walls = training_data()
    model = network(width, depth)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss="mse", steps_per_execution=50,
        loss_terms=[
            kt.PDEResidual(
                burgers_residual, name="pde", diagonal=[0],  # the residual reads u_xx only
                collocation=kt.physics.BoxSampler(low=[-1.0, 0.0], high=[1.0, 1.0], n=points, seed=0),
            ),
            kt.ConditionLoss(walls, values=0.0, name="walls"),
        ],
    )
    # One batch per step: the whole initial condition, repeated.
    data = tf.data.Dataset.from_tensors((initial, u0)).repeat()
    history = model.fit(data, steps_per_epoch=max(adam_steps, 1), epochs=1, shuffle=False,
                        verbose=0)
    logs = {k: f"{v[-1]:.3e}" for k, v in history.history.items()}
    error, _ = relative_l2(model, xx, tt, reference)
    numbers = dict(width=width, depth=depth, collocation_points=points, adam_steps=adam_steps,
                   lbfgs_iterations=lbfgs_iterations, quick=args.quick,
                   adam_error=float(error), adam_seconds=time.perf_counter() - start_wall,
                   lbfgs_progress=[])
    print(f"Adam, {adam_steps} steps in fit: {logs}; relative L2 error {error:.2e}; "
          f"{time.perf_counter() - start_wall:.0f} s", flush=True)

    def progress(iteration, loss):
        if iteration % 250 == 0:
            error = relative_l2(model, xx, tt, reference)[0]
            seconds = time.perf_counter() - start_wall
            numbers["lbfgs_progress"].append(dict(iteration=iteration, loss=float(loss),
                                                  error=float(error), seconds=seconds))
            print(f"  L-BFGS {iteration}: loss {loss:.3e}, relative L2 error "
                  f"{error:.2e}, {seconds:.0f} s", flush=True)

    refined = kt.physics.lbfgs(model, initial, u0, iterations=lbfgs_iterations,
                               callback=progress)
    error, prediction = relative_l2(model, xx, tt, reference)
    wall, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    print(f"L-BFGS: {len(refined['loss']) - 1} iterations, {refined['evaluations']} "
          f"evaluations, stopped: {refined['stopped']}, loss {refined['loss'][-1]:.3e}")
    print(f"relative L2 error: {error:.2e}")
    print(f"wall time: {wall:.0f} s (CPU time {cpu:.0f} s)")
    if args.json:
        numbers.update(error=float(error), lbfgs_done=len(refined["loss"]) - 1,
                       evaluations=int(refined["evaluations"]), stopped=str(refined["stopped"]),
                       final_loss=float(refined["loss"][-1]), seconds=wall, cpu_seconds=cpu)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(numbers, f, indent=2)
        print(f"wrote {args.json}")
    try:
        plot(args.out, xx, tt, prediction, reference)
        print(f"wrote {args.out}")
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install keras-tapeops[examples])")
    return error


if __name__ == "__main__":
    main()
