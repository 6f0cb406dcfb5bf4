"""`keras_tapeops.launch`: local worker processes, their TF_CONFIG, their output.

The workers here are tiny Python scripts without TensorFlow (fast); the real
TensorFlow workers run in tests/test_multi_worker.py.
"""

import json
import os
import re
import signal
import socket
import sys
import threading
import time

import pytest

from keras_tapeops import launch as launcher


def script(tmp_path, body, name="worker.py"):
    """Writes a worker script; `INDEX` is its task index from TF_CONFIG."""
    path = tmp_path / name
    path.write_text(
        "import json, os, sys, time\n"
        "INDEX = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        + body
    )
    return [sys.executable, str(path)]


def run(command, workers=2, **kwargs):
    """`launch()` with its output captured; returns (code, lines, seconds)."""
    out = _Capture()
    start = time.monotonic()
    code = launcher.launch(command, workers, out=out, **kwargs)
    return code, out.getvalue().splitlines(), time.monotonic() - start


class _Capture:
    def __init__(self):
        self.parts = []

    def write(self, text):
        self.parts.append(text)

    def flush(self):
        pass

    def getvalue(self):
        return "".join(self.parts)


def worker_lines(lines, index):
    prefix = f"[worker {index}] "
    return [line[len(prefix):] for line in lines if line.startswith(prefix)]


def is_running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -------------------------------------------------------------- free ports
def test_free_ports_are_distinct_and_bindable_on_localhost():
    ports = launcher.free_ports(8)
    assert len(ports) == len(set(ports)) == 8
    assert all(isinstance(p, int) and 1024 <= p < 65536 for p in ports)
    sockets = []
    try:
        for port in ports:
            s = socket.socket()
            s.bind(("127.0.0.1", port))  # free after free_ports returned
            sockets.append(s)
    finally:
        for s in sockets:
            s.close()


# --------------------------------------------------------------- TF_CONFIG
def test_tf_config_format():
    config = json.loads(launcher.tf_config([1111, 2222, 3333], 1))
    assert config == {
        "cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:2222", "127.0.0.1:3333"]},
        "task": {"type": "worker", "index": 1},
    }


def test_each_worker_gets_the_cluster_and_its_own_index(tmp_path):
    command = script(tmp_path, "print(os.environ['TF_CONFIG'])\n")
    code, lines, _ = run(command, workers=3)
    assert code == 0
    configs = [json.loads(worker_lines(lines, i)[0]) for i in range(3)]
    assert [c["task"] for c in configs] == [
        {"type": "worker", "index": i} for i in range(3)
    ]
    cluster = configs[0]["cluster"]["worker"]
    assert all(c["cluster"]["worker"] == cluster for c in configs)
    assert len(set(cluster)) == 3
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", address) for address in cluster)


def test_extra_environment_reaches_the_workers(tmp_path):
    command = script(tmp_path, "print(os.environ['EXTRA'], os.environ['PYTHONUNBUFFERED'])\n")
    code, lines, _ = run(command, env={"EXTRA": "hello"})
    assert code == 0
    assert worker_lines(lines, 0) == worker_lines(lines, 1) == ["hello 1"]


# ------------------------------------------------------------------ output
def test_every_line_is_prefixed_with_its_worker(tmp_path):
    command = script(
        tmp_path,
        "for i in range(50):\n"
        "    print(f'line {i} of worker {INDEX}', flush=True)\n"
        "print('to stderr', file=sys.stderr, flush=True)\n",
    )
    code, lines, _ = run(command)
    assert code == 0
    assert all(re.match(r"\[worker [01]\] ", line) for line in lines), lines
    for index in (0, 1):
        mine = worker_lines(lines, index)
        assert mine[:50] == [f"line {i} of worker {index}" for i in range(50)]
        assert "to stderr" in mine  # stderr is streamed too


# ------------------------------------------------------------- exit codes
def test_success_returns_zero(tmp_path):
    code, _, _ = run(script(tmp_path, "sys.exit(0)\n"))
    assert code == 0


def test_a_failing_worker_stops_the_others_and_returns_its_code(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    command = script(
        tmp_path,
        f"open(os.path.join({str(pids)!r}, str(INDEX)), 'w').write(str(os.getpid()))\n"
        "if INDEX == 1:\n"
        "    time.sleep(0.5)\n"
        "    sys.exit(7)\n"
        "time.sleep(60)\n"
        "print('never printed')\n",
    )
    code, lines, seconds = run(command, workers=3, timeout=50)
    assert code == 7
    assert seconds < 10
    assert not any("never printed" in line for line in lines)
    for index in (0, 2):
        assert not is_running(int((pids / str(index)).read_text()))


def test_a_worker_that_ignores_sigterm_is_killed(tmp_path):
    # TensorFlow's MultiWorkerMirroredStrategy installs a SIGTERM handler
    # (its preemption notifier), so a real worker outlives terminate().
    pid_file = tmp_path / "pid"
    command = script(
        tmp_path,
        "import signal\n"
        "if INDEX == 0:\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(120)\n"
        "time.sleep(1)\n"
        "sys.exit(5)\n",
    )
    code, _, seconds = run(command, timeout=100)
    assert code == 5
    assert seconds < 20
    assert not is_running(int(pid_file.read_text()))


def test_timeout_stops_every_worker_and_returns_124(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    command = script(
        tmp_path,
        f"open(os.path.join({str(pids)!r}, str(INDEX)), 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n",
    )
    code, _, seconds = run(command, timeout=1.5)
    assert code == 124
    assert 1.5 <= seconds < 10
    for index in (0, 1):
        assert not is_running(int((pids / str(index)).read_text()))


def test_ctrl_c_stops_every_worker_and_returns_130(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    command = script(
        tmp_path,
        f"open(os.path.join({str(pids)!r}, str(INDEX)), 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n",
    )

    def interrupt():
        deadline = time.monotonic() + 20
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # A real SIGINT to this process (Ctrl-C's), handled by Python's default
        # handler in the main thread: KeyboardInterrupt in launch()'s wait loop.
        os.kill(os.getpid(), signal.SIGINT)

    # Whatever the test runner installed for SIGINT, Ctrl-C raises KeyboardInterrupt here.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        code, _, seconds = run(command, timeout=50)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130
    assert seconds < 30
    for index in (0, 1):
        assert not is_running(int((pids / str(index)).read_text()))


# ------------------------------------------------------------- arguments
@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_workers_must_be_a_positive_integer(workers):
    with pytest.raises(ValueError, match=re.escape(f"Received: workers={workers!r}")):
        launcher.launch([sys.executable, "-c", "pass"], workers)


def test_command_line_passes_the_script_and_its_arguments(tmp_path, capsys):
    path = tmp_path / "echo.py"
    path.write_text(
        "import json, os, sys\n"
        "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "print(index, sys.argv[1:])\n"
        "sys.exit(3 if index == 1 and '--fail' in sys.argv else 0)\n"
    )
    code = launcher.main(["--workers", "2", str(path), "a", "--flag", "b"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert sorted(lines) == [
        "[worker 0] 0 ['a', '--flag', 'b']",
        "[worker 1] 1 ['a', '--flag', 'b']",
    ]
    assert launcher.main(["--workers", "2", "--timeout", "30", str(path), "--fail"]) == 3
