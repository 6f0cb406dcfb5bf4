"""`make test-keras`: Keras's own tests, stock and with `TapeOpsMixin` in every model.

Runs the trainer, model, callback, saving and distillation test files that
ship with the installed `keras` package twice, in separate pytest processes:
once stock, once with the mixin inserted into `keras.Model`'s bases (see
`mixin_plugin.py`). Prints the tests that fail only with the mixin (exit
status 1 if there is one), the tests that fail in both runs (Keras's own
failures in this environment, not ours), and how many tests ran the mixin's
`train_step`/`test_step` (exit status 1 if none did: the mixin was not in the
models).

Usage:
```bash
.venv/bin/python tools/keras_tests/run.py            # both runs, 2 workers each
.venv/bin/python tools/keras_tests/run.py -n 0 -k sequential_test
```
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent

#: Test files (relative to `keras/src`), as globs.
TEST_FILES = (
    "trainers/*_test.py",
    "models/*_test.py",
    "callbacks/*_test.py",
    "saving/*_test.py",
    "distillation/*_test.py",
)

FAILED = ("failed", "error")


def keras_test_files():
    """The Keras test files of `TEST_FILES` in the installed package, sorted."""
    import importlib.util

    spec = importlib.util.find_spec("keras.src")
    root = pathlib.Path(spec.origin).parent
    files = sorted({p for pattern in TEST_FILES for p in root.glob(pattern)})
    if not files:
        raise SystemExit(f"No Keras test files found under {root}.")
    return files


def run_pytest(mode, files, workdir, workers, extra):
    """Runs pytest on `files` in `mode`; returns (results dict, seconds).

    The rootdir is `keras/src` (test ids read `models/model_test.py::...`);
    pytest writes nothing there (no cache), and runs in `workdir`.
    """
    report = workdir / f"{mode}.json"
    root = files[0].parents[1]
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "mixin_plugin",
        "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(root),
        f"--keras-tapeops={mode}", f"--keras-tapeops-report={report}",
        "-W", "ignore::DeprecationWarning",
    ]
    if workers:
        command += ["-n", str(workers)]
    command += list(extra) + [str(f) for f in files]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.setdefault("KERAS_BACKEND", "tensorflow")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    (workdir / f"{mode}.log").write_text(done.stdout + done.stderr)
    if not report.exists():
        sys.stdout.write(done.stdout[-5000:] + done.stderr[-5000:])
        raise SystemExit(f"pytest ({mode}) wrote no report (exit {done.returncode}).")
    return json.loads(report.read_text())["results"], seconds


def compare(stock, mixin):
    """Returns (failing only with the mixin, failing in both, missing in one run)."""
    only_mixin, both, missing = [], [], []
    for nodeid in sorted(set(stock) | set(mixin)):
        if nodeid not in stock or nodeid not in mixin:
            missing.append(nodeid)
            continue
        bad_stock = stock[nodeid]["outcome"] in FAILED
        bad_mixin = mixin[nodeid]["outcome"] in FAILED
        if bad_mixin and not bad_stock:
            only_mixin.append(nodeid)
        elif bad_mixin and bad_stock:
            both.append(nodeid)
    return only_mixin, both, missing


def summary(results):
    counts = {}
    for entry in results.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--workers", type=int, default=2,
                        help="pytest-xdist workers per run (0: none).")
    parser.add_argument("--keep", default=None,
                        help="Directory for the logs and JSON reports (default: a temporary one).")
    args, extra = parser.parse_known_args(argv)
    files = keras_test_files()
    workdir = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="keras_tests_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"{len(files)} Keras test files; logs in {workdir}")
    total = time.perf_counter()
    runs = {}
    for mode in ("stock", "mixin"):
        results, seconds = run_pytest(mode, files, workdir, args.workers, extra)
        runs[mode] = results
        print(f"{mode:>5}: {summary(results)} in {seconds:.0f} s")
    stock, mixin = runs["stock"], runs["mixin"]
    only_mixin, both, missing = compare(stock, mixin)
    trained = [n for n, e in mixin.items() if e["steps"].get("train_step")]
    evaluated = [n for n, e in mixin.items() if e["steps"].get("test_step")]
    print(f"The mixin's train_step ran in {len(trained)} tests, its test_step in "
          f"{len(evaluated)}.")
    for nodeid in both:
        print(f"fails stock and with the mixin (not ours): {nodeid}")
    for nodeid in missing:
        print(f"ran in one run only: {nodeid}")
    for nodeid in only_mixin:
        print(f"FAILS ONLY WITH THE MIXIN: {nodeid}")
    print(f"{len(only_mixin)} tests fail only with the mixin "
          f"(total {time.perf_counter() - total:.0f} s).")
    if only_mixin or missing or not trained:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
