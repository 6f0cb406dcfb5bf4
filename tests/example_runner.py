"""Runs an example script inside the test process, as `python <script> <args>` would.

The example tests used to start a new interpreter per script: each paid
TensorFlow's and Keras's import (about 8-9 s of CPU) before the example's
first line. Here the script runs with `runpy` in the test worker, which has
both imported already, with its own `sys.argv`, its folder first on
`sys.path`, the given working directory and its standard output captured.
The examples seed their own randomness and set what they need (dtype policy,
matplotlib's backend); the suite's autouse fixture (tests/conftest.py) resets
the dtype policy and the Keras session after each test, as it does for every
other test. A script that must have a process of its own (one that creates a
`tf.distribute` strategy, or starts workers) is not run this way: its test
starts it with `subprocess`.
"""

import contextlib
import io
import os
import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(script, cwd, *args):
    """Runs `script` (a path, or a file name in examples/) and returns what it printed.

    Args:
        script: the example's path, or its name under `examples/`.
        cwd: the working directory during the run (files the example writes land here).
        *args: its command-line arguments.

    Returns:
        Its standard output, as text.

    Raises:
        AssertionError: the script raised or exited with a non-zero status; the
            message carries the end of its output and the exception is chained.
    """
    path = Path(script)
    if not path.is_absolute():
        path = EXAMPLES / path
    saved_argv, saved_path, saved_cwd = sys.argv[:], sys.path[:], os.getcwd()
    printed = io.StringIO()
    sys.argv = [str(path), *map(str, args)]
    sys.path.insert(0, str(path.parent))
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise AssertionError(
                f"{path.name} exited with {exit_.code!r}; it printed:\n{printed.getvalue()[-3000:]}"
            ) from exit_
    except Exception as error:
        raise AssertionError(
            f"{path.name} raised {error!r}; it printed:\n{printed.getvalue()[-3000:]}"
        ) from error
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
    return printed.getvalue()
