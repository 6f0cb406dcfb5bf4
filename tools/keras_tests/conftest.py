"""Stands in for the `conftest.py` at the root of Keras's repository.

Some of Keras's test files do `from conftest import skip_if_backend`; the
installed `keras` package ships the tests but not that file. `run.py` puts
this directory on `PYTHONPATH`, so the import finds this module.
"""

import pytest
from keras.src.backend import backend


def skip_if_backend(given_backend, reason):
    """A skip marker for tests that do not apply to `given_backend`."""
    return pytest.mark.skipif(backend() == given_backend, reason=reason)
