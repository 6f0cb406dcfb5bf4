"""Benchmark: physics-informed training step, and forward vs reverse input derivatives.

1. `kt.PDEResidual` + `kt.ConditionLoss` in `fit` vs a hand-written nested-tape
   `train_step` (the keras.io "customize what happens in fit()" pattern) doing
   the same math: Burgers' residual on collocation points drawn by the same
   stateless RNG keyed by the optimizer step, a wall condition, the data MSE.
   Same network, same data, `steps_per_execution` alike; rounds interleaved
   in one process; the median ratio of epoch times is printed, wall and CPU
   time (the CPU ratio is the reliable one on shared cores; target <= 1.05).
2. `kt.input_derivatives(order=2)`: forward mode (forward over reverse) vs
   reverse mode (reverse over reverse), at 1, 2 and 3 input coordinates,
   inside a training step (differentiated again w.r.t. the weights) and
   alone (no outer tape); then `order=1` with 1 and 4 outputs. These are the
   tables `mode="auto"` follows (CPU time: the machine may be shared).

Run: python bench/pinn.py [--quick]   (a few minutes on 2 CPU cores)
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_on  # noqa: E402
from common import interleaved_wall_and_cpu  # noqa: E402


NU = 0.01 / np.pi
LOW, HIGH, SEED = (-1.0, 0.0), (1.0, 1.0), 0


def burgers(points, u, du, d2u):
    return du[:, 0, 1] + u[:, 0] * du[:, 0, 0] - NU * d2u[:, 0, 0]


def layers(width, depth):
    return ([keras.layers.Dense(width, activation="tanh") for _ in range(depth)]
            + [keras.layers.Dense(1)])


class HandWritten(keras.Model):
    """The same PINN step written by hand: nested tapes inside `train_step`."""

    def __init__(self, width, depth, n_points, walls):
        super().__init__()
        self.body = keras.Sequential([keras.Input((2,))] + layers(width, depth))
        self.n_points = n_points
        self.walls = tf.constant(walls)
        self.trackers = {name: keras.metrics.Mean(name=name) for name in ("loss", "pde", "walls")}

    def call(self, x):
        return self.body(x)

    @property
    def metrics(self):
        return list(self.trackers.values())

    def train_step(self, data):
        x, y = data
        seed = tf.stack([tf.constant(SEED, "int64"), tf.cast(self.optimizer.iterations, "int64")])
        unit = tf.random.stateless_uniform((self.n_points, 2), seed=seed, alg="philox")
        points = tf.constant(LOW) + (tf.constant(HIGH) - tf.constant(LOW)) * unit
        with tf.GradientTape() as tape:
            mse = tf.reduce_mean(tf.square(y - self(x, training=True)))
            with tf.GradientTape() as second:
                second.watch(points)
                with tf.GradientTape() as first:
                    first.watch(points)
                    u = self(points, training=True)
                grad = first.gradient(u, points)
                u_x, u_t = grad[:, 0], grad[:, 1]
            u_xx = second.gradient(u_x, points)[:, 0]
            pde = tf.reduce_mean(tf.square(u_t + u[:, 0] * u_x - NU * u_xx))
            walls = tf.reduce_mean(tf.square(self(self.walls, training=True)))
            loss = mse + pde + walls
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        for name, value in (("loss", loss), ("pde", pde), ("walls", walls)):
            self.trackers[name].update_state(value)
        return {name: t.result() for name, t in self.trackers.items()}


def step_benchmark(width, depth, n_points, steps, rounds):
    x0 = np.linspace(-1, 1, 256, dtype="float32")
    initial = np.stack([x0, np.zeros_like(x0)], 1)
    u0 = -np.sin(np.pi * initial[:, :1])
    t = np.linspace(0, 1, 101, dtype="float32")
    walls = np.concatenate([np.stack([-np.ones_like(t), t], 1), np.stack([np.ones_like(t), t], 1)])
    data = tf.data.Dataset.from_tensors((initial, u0)).repeat()

    keras.utils.set_random_seed(0)
    ours = kt.upgrade(keras.Sequential([keras.Input((2,))] + layers(width, depth)))
    ours.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", steps_per_execution=10,
                 loss_terms=[kt.PDEResidual(burgers, kt.physics.BoxSampler(LOW, HIGH, n_points, SEED),
                                            diagonal=[0], name="pde"),
                             kt.ConditionLoss(walls, 0.0, name="walls")])
    hand = HandWritten(width, depth, n_points, walls)
    hand.set_weights(ours.get_weights())
    hand.compile(optimizer=keras.optimizers.Adam(1e-3), steps_per_execution=10)

    def run(model):
        return lambda: model.fit(data, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0)

    candidates = {"hand-written nested tapes": run(hand), "kt.PDEResidual in fit": run(ours)}
    for fn in candidates.values():
        fn()  # trace and warm up
    a = ours.fit(data, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0).history
    b = hand.fit(data, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0).history
    same = max(float(np.abs(u - v).max()) for u, v in zip(ours.get_weights(), hand.get_weights()))
    print(f"\nPINN step: {depth}x{width} tanh, {n_points} collocation points, "
          f"{steps} steps per epoch, {rounds} rounds (weights after the same steps "
          f"differ by {same:.1e}; last pde {a['pde'][-1]:.4e} vs {b['pde'][-1]:.4e})")
    times = dict(zip(("wall", "cpu"), interleaved_wall_and_cpu(candidates, rounds)))
    for name in candidates:
        line = f"  {name:<28}"
        for clock, on_clock in times.items():
            base = on_clock["hand-written nested tapes"]
            ratios = [v / b for v, b in zip(on_clock[name], base)]
            line += (f"  {clock} {statistics.median(on_clock[name]) / steps * 1000:7.2f} ms/step "
                     f"{statistics.median(ratios):.3f}x")
        print(line + "  (vs hand-written)")


def mode_benchmark(n_points, width, depth, repeats, rounds, order=2, n_out=1):
    print(f"\n{'Second' if order == 2 else 'First'} derivatives (order={order}), "
          f"{n_out} output(s), {n_points} points, {depth}x{width} tanh, "
          "CPU ms per call (median of rounds):")
    print(f"  {'inputs':>6}  {'setting':<15} {'forward':>9} {'reverse':>9}  forward/reverse")
    for n_in in (1, 2, 3):
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((n_in,))] + layers(width, depth)[:-1]
                               + [keras.layers.Dense(n_out)])
        x = tf.constant(np.random.default_rng(0).uniform(-1, 1, (n_points, n_in)).astype("float32"))
        for setting in ("training step", "alone"):
            candidates = {}
            for mode in ("forward", "reverse"):
                if setting == "training step":
                    @tf.function
                    def fn(x, mode=mode):
                        with tf.GradientTape() as tape:
                            out = kt.input_derivatives(net, x, order=order, mode=mode)
                            loss = tf.reduce_mean(tf.square(tf.reduce_sum(out[-1], -1) + out[0]))
                        return tape.gradient(loss, net.trainable_variables)
                else:
                    fn = tf.function(lambda x, mode=mode: kt.input_derivatives(net, x, order, mode))
                fn(x)
                candidates[mode] = lambda fn=fn: [fn(x) for _ in range(repeats)]
            cpu = interleaved_on("cpu", candidates, rounds)
            f, r = (statistics.median(cpu[m]) / repeats * 1000
                    for m in ("forward", "reverse"))
            print(f"  {n_in:>6}  {setting:<15} {f:9.2f} {r:9.2f}  {f / r:.2f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        step_benchmark(width=10, depth=2, n_points=500, steps=20, rounds=3)
        mode_benchmark(n_points=200, width=10, depth=2, repeats=3, rounds=3)
        mode_benchmark(n_points=200, width=10, depth=2, repeats=3, rounds=3, order=1, n_out=4)
        return
    step_benchmark(width=20, depth=8, n_points=4000, steps=50, rounds=15)
    for n_points in (1000, 10000):
        mode_benchmark(n_points=n_points, width=20, depth=4, repeats=10, rounds=7)
    for n_out in (1, 4):
        mode_benchmark(n_points=10000, width=20, depth=4, repeats=10, rounds=7, order=1,
                       n_out=n_out)


if __name__ == "__main__":
    main()
