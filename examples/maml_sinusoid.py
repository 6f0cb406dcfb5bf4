"""MAML on Finn et al.'s sinusoid regression, with `fit()`: MAML vs a pretrained model.

Finn, Abbeel & Levine (2017), section 5.1: every task is a sine wave
`y = A sin(x - phase)` with amplitude `A` in [0.1, 5], phase in [0, pi], and
inputs `x` in [-5, 5]; a learner sees K = 5 or 10 points of a new task and
must fit the whole wave. The network is theirs (1 -> 40 -> 40 -> 1, ReLU), as
are the inner rule (one SGD step with rate 0.01 during meta-training) and
the meta-batch of 25 tasks with Adam; only the number of meta-steps is far
smaller, to run in a few minutes on a CPU.

Compared, for K = 5 and K = 10, on the same 500 held-out tasks:

- MAML: `kt.MetaLearner(model, inner_learning_rate=0.01, inner_steps=1)`
  trained with `fit` on meta-batches of K-shot tasks;
- pretrained: the same network trained with `fit` to regress points of
  random tasks (it learns the average wave), "pretrained on all tasks" in
  the paper.

Both are then adapted to each held-out task by 1 and 10 steps of SGD (rate
0.01) on its K points (`MetaLearner.evaluate` with `inner_steps` 1 and 10,
vectorized over the tasks) and scored by the MSE on 100 query points of the
task. The figure (`maml_sinusoid.png`, like the paper's Figure 2) shows one
held-out task: the true wave, the K points, and each model before and after
1 and 10 adaptation steps (`MetaLearner.adapt`).

Usage: python examples/maml_sinusoid.py [--quick] [--out maml_sinusoid.png]
           [--meta-steps N] [--json numbers.json]

`--json` writes the table (query MSE per model, K and number of steps) to a
JSON file; `make figures` keeps it next to the documentation's copy of the
PNG (docs/figures/).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402

INNER_LR = 0.01
META_BATCH = 25
TEST_TASKS = 500
QUERY = 100


def sample_tasks(rng, tasks, support, query):
    """`(support_x, support_y, query_x, query_y, amplitude, phase)` of `tasks` sine tasks."""
    amplitude = rng.uniform(0.1, 5.0, (tasks, 1, 1))
    phase = rng.uniform(0.0, np.pi, (tasks, 1, 1))
    sx = rng.uniform(-5.0, 5.0, (tasks, support, 1))
    qx = rng.uniform(-5.0, 5.0, (tasks, query, 1))
    wave = lambda x: amplitude * np.sin(x - phase)  # noqa: E731
    arrays = [a.astype("float32") for a in (sx, wave(sx), qx, wave(qx))]
    return (*arrays, amplitude[:, 0, 0], phase[:, 0, 0])


def make_network(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((1,)),
        keras.layers.Dense(40, activation="relu"),
        keras.layers.Dense(40, activation="relu"),
        keras.layers.Dense(1),
    ])


def train_maml(shots, meta_steps, seed):
    """Meta-trains with `fit`: `meta_steps` meta-batches of 25 K-shot tasks."""
    rng = np.random.default_rng(seed)
    sx, sy, qx, qy, _, _ = sample_tasks(rng, meta_steps * META_BATCH, shots, shots)
    meta = kt.MetaLearner(make_network(seed), inner_learning_rate=INNER_LR, inner_steps=1)
    meta.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    start = time.perf_counter()
    meta.fit((sx, sy, qx), qy, batch_size=META_BATCH, epochs=1, verbose=0)
    return meta.model, time.perf_counter() - start


def train_pretrained(steps, seed):
    """Plain regression on points of random tasks (the same number of points as MAML sees)."""
    rng = np.random.default_rng(seed + 1)
    sx, sy, _, _, _, _ = sample_tasks(rng, steps * META_BATCH, 10, 1)
    model = make_network(seed)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    start = time.perf_counter()
    model.fit(sx.reshape(-1, 1), sy.reshape(-1, 1), batch_size=META_BATCH * 10,
              epochs=1, shuffle=True, verbose=0)
    return model, time.perf_counter() - start


def adapted_mse(model, test, steps):
    """Mean query MSE over the test tasks after `steps` SGD steps on each support set."""
    learner = kt.MetaLearner(model, inner_learning_rate=INNER_LR, inner_steps=steps)
    learner.compile(optimizer="sgd", loss="mse")  # the loss the inner loop minimizes
    sx, sy, qx, qy = test
    return learner.evaluate((sx, sy, qx), qy, batch_size=100, verbose=0)


def plot(path, models, shots_list, rng):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.linspace(-5, 5, 200, dtype="float32")[:, None]
    fig, axes = plt.subplots(len(shots_list), 2, figsize=(11, 4 * len(shots_list)),
                             squeeze=False)
    for row, shots in enumerate(shots_list):
        sx, sy, _, _, amplitude, phase = sample_tasks(rng, 1, shots, 1)
        for col, (title, model) in enumerate((("MAML", models[shots]),
                                              ("pretrained", models["pretrained"]))):
            ax = axes[row, col]
            learner = kt.MetaLearner(model, inner_learning_rate=INNER_LR)
            learner.compile(optimizer="sgd", loss="mse")
            ax.plot(x, amplitude[0] * np.sin(x - phase[0]), "r", label="ground truth")
            ax.plot(x, model(x), ":", color="lightgreen", label="pre-update")
            for steps, color in ((1, "seagreen"), (10, "darkgreen")):
                adapted = learner.adapt(sx[0], sy[0], steps=steps)
                ax.plot(x, adapted(x), "--", color=color,
                        label=f"{steps} grad step{'s' if steps > 1 else ''}")
            ax.plot(sx[0], sy[0], "^", color="purple", label=f"{shots} points used")
            ax.set_title(f"{title}, K={shots}")
            ax.set_ylim(-5.5, 5.5)
            ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps (smoke test)")
    parser.add_argument("--meta-steps", type=int, default=None,
                        help="meta-batches of 25 tasks per MAML model (default 6000)")
    parser.add_argument("--out", default="maml_sinusoid.png", help="the figure's path")
    parser.add_argument("--json", default=None, help="also write the table to this JSON file")
    args = parser.parse_args()
    meta_steps = args.meta_steps or (20 if args.quick else 6000)
    test_tasks = 50 if args.quick else TEST_TASKS
    shots_list = (5, 10)

    models = {}
    models["pretrained"], seconds = train_pretrained(meta_steps, seed=0)
    print(f"pretrained: {meta_steps} steps of 250 points in {seconds:.1f} s")
    for shots in shots_list:
        models[shots], seconds = train_maml(shots, meta_steps, seed=0)
        print(f"MAML K={shots}: {meta_steps} meta-steps of {META_BATCH} tasks in {seconds:.1f} s "
              f"({seconds / meta_steps * 1e3:.1f} ms per meta-step)")

    rng = np.random.default_rng(1234)
    print(f"\nquery MSE on {test_tasks} held-out tasks after k SGD steps "
          f"(rate {INNER_LR}) on K points:")
    print(f"{'model':<12}{'K':>4}{'0 steps':>10}{'1 step':>10}{'10 steps':>10}")
    results = {}
    for shots in shots_list:
        test = sample_tasks(rng, test_tasks, shots, QUERY)[:4]
        for name in (shots, "pretrained"):
            model = models[name]
            before = float(np.mean((model(test[2].reshape(-1, 1)) - test[3].reshape(-1, 1)) ** 2))
            one, ten = adapted_mse(model, test, 1), adapted_mse(model, test, 10)
            label = "MAML" if name == shots else "pretrained"
            results[(label, shots)] = (before, one, ten)
            print(f"{label:<12}{shots:>4}{before:>10.3f}{one:>10.3f}{ten:>10.3f}")
    for shots in shots_list:
        maml, pre = results[("MAML", shots)], results[("pretrained", shots)]
        print(f"K={shots}: MAML after 1 step is {pre[1] / maml[1]:.1f}x lower than pretrained "
              f"after 1 step, {pre[2] / maml[1]:.1f}x lower than pretrained after 10")
    try:
        plot(args.out, models, shots_list, np.random.default_rng(7))
    except ImportError:
        print("matplotlib is not installed (pip install keras_tapeops[examples]): no figure")
    if args.json:
        numbers = dict(
            meta_steps=meta_steps, meta_batch=META_BATCH, test_tasks=test_tasks,
            query_points=QUERY, inner_learning_rate=INNER_LR, quick=args.quick,
            query_mse=[dict(model=label, shots=shots, steps_0=before, steps_1=one, steps_10=ten)
                       for (label, shots), (before, one, ten) in results.items()],
        )
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(numbers, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
