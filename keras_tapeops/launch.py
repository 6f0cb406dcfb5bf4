"""Run a training script as N local `MultiWorkerMirroredStrategy` workers.

```bash
python -m keras_tapeops.launch --workers 2 examples/multi_worker.py [script args]
```

Each worker is a separate Python process on this machine with its own
`TF_CONFIG` (a cluster of `127.0.0.1` ports picked free, and its task index);
their output is streamed line by line with a `[worker i]` prefix. If one
worker fails, or on Ctrl-C, or when `--timeout` passes, every worker is
stopped. The exit code is 0 when all workers succeed, else the first
failure's code. On several machines, set `TF_CONFIG` per host instead (see
docs/distributed.md).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time


def free_ports(n):
    """Returns `n` distinct free TCP ports on 127.0.0.1.

    Args:
        n: how many.

    Returns:
        A list of ints.

    Example:
    ```python
    free_ports(2)  # [40123, 40567]
    ```
    """
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(ports, index):
    """The `TF_CONFIG` JSON of worker `index` in a local cluster on `ports`."""
    return json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
            "task": {"type": "worker", "index": index},
        }
    )


def launch(command, workers, timeout=None, env=None, out=None):
    """Starts `workers` processes running `command`; waits for all of them.

    Args:
        command: argv list run by every worker (e.g. `[python, script]`).
        workers: int >= 1.
        timeout: seconds before every worker is stopped (None: no limit).
        env: extra environment variables for the workers.
        out: a text stream for the prefixed output (default: stdout).

    Returns:
        0 if every worker exited 0, else the first non-zero exit code
        (124 on timeout, 130 on Ctrl-C).

    Example:
    ```python
    launch([sys.executable, "examples/multi_worker.py"], workers=2, timeout=300)
    ```
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"`workers` must be an integer >= 1. Received: workers={workers!r}")
    out = out or sys.stdout
    ports = free_ports(workers)
    lock = threading.Lock()
    processes, threads = [], []
    for index in range(workers):
        worker_env = dict(os.environ, **(env or {}))
        worker_env["TF_CONFIG"] = tf_config(ports, index)
        worker_env.setdefault("PYTHONUNBUFFERED", "1")
        process = subprocess.Popen(
            command,
            env=worker_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        processes.append(process)
        thread = threading.Thread(
            target=_stream,
            args=(process, f"[worker {index}] ", out, lock),
            daemon=True,
        )
        thread.start()
        threads.append(thread)
    code = _wait(processes, timeout)
    for thread in threads:
        thread.join(timeout=5)
    return code


def _stream(process, prefix, out, lock):
    for line in process.stdout:
        with lock:
            out.write(prefix + line)
            out.flush()


def _wait(processes, timeout):
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(processes)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                _stop(processes)
                return 124
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(processes)
        return 130


def _stop(processes, grace=3.0):
    # TensorFlow's multi-worker runtime installs a SIGTERM handler (its
    # preemption notifier), so a worker usually outlives terminate(): give
    # them all `grace` seconds together, then kill the rest.
    for p in processes:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m keras_tapeops.launch",
        description="Run a script as N local MultiWorkerMirroredStrategy workers.",
    )
    parser.add_argument("--workers", type=int, default=2, help="number of workers")
    parser.add_argument("--timeout", type=float, default=None, help="seconds")
    parser.add_argument("script", help="the Python script every worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    options = parser.parse_args(argv)
    command = [sys.executable, options.script, *options.args]
    return launch(command, options.workers, timeout=options.timeout)


if __name__ == "__main__":
    sys.exit(main())
