"""The new-process half of tests/test_keras_io_resume.py.

`python keras_io_resume_script.py DIR`: for every case of keras_io_cases,
loads `DIR/<case>.keras` (saved by the test process after one epoch), puts
back the state Keras does not save (`DIR/<case>.carry.npz`, if any), trains
one more epoch and writes the weights to `DIR/<case>.npz`. One process for
all the cases keeps the test cheap.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_io_cases import CASES  # noqa: E402


def main(directory):
    for case in CASES:
        model = keras.models.load_model(os.path.join(directory, f"{case.name}.keras"))
        if case.restore is not None:
            case.restore(model, np.load(os.path.join(directory, f"{case.name}.carry.npz")))
        case.fit(model, 1)
        np.savez(os.path.join(directory, f"{case.name}.npz"), *model.get_weights())
        print("resumed", case.name, type(model).__name__, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
