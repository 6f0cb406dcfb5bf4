"""The crash-and-resume column of the fault matrix; the resume runs in a fresh process.

`main("crash", DIR)` (the test calls it in its own process; also
`python fault_matrix_script.py crash DIR`): for every case, trains 2 epochs
with `BackupAndRestore(DIR/<case>)` and dies in the middle of epoch 2 (a
callback raises after its first batch). `python fault_matrix_script.py
resume DIR`: a new process builds each case again, trains 2 epochs with the
same `BackupAndRestore` (it restores the end of epoch 1 and runs epoch 2),
and writes the weights to `DIR/<case>.npz`. `tests/test_fault_matrix.py`
compares them with the uninterrupted run.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from fault_matrix_cases import CASES  # noqa: E402
from test_fault_matrix import make_dataset  # noqa: E402


class CrashMidEpoch(keras.callbacks.Callback):
    """Raises after the first batch of the second epoch."""

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch == 1:
            raise RuntimeError("crash")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


def main(phase, directory):
    for case in CASES:
        model = case.build()
        x, y = case.data(16)
        backup = keras.callbacks.BackupAndRestore(os.path.join(directory, case.name))
        callbacks = [backup] + ([CrashMidEpoch()] if phase == "crash" else [])
        try:
            model.fit(make_dataset(x, y, [8, 8]), epochs=2, shuffle=False, verbose=0,
                      callbacks=callbacks)
        except RuntimeError as error:
            if phase != "crash" or str(error) != "crash":
                raise
        else:
            if phase == "crash":
                raise AssertionError(f"{case.name}: the crash did not happen")
            np.savez(os.path.join(directory, f"{case.name}.npz"), *model.get_weights())
        keras.backend.clear_session()
        print(phase, case.name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
