PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo lint test test-fast test-oldest bench clean

# The oldest supported pair (the floors in pyproject.toml), pinned exactly.
OLDEST_VENV := .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_TENSORFLOW ?= 2.18.0
OLDEST_KERAS ?= 3.10.0
OLDEST_STAMP := $(OLDEST_VENV)/.installed-tensorflow-$(OLDEST_TENSORFLOW)-keras-$(OLDEST_KERAS)
# The test extra without jax_privacy: it needs jax>=0.7.1, whose ml_dtypes
# tensorflow 2.18 refuses, and pip then fails with "resolution-too-deep"
# after ten minutes. The one test that compares with it skips without it.
OLDEST_TEST_REQUIREMENTS = $(shell $(PYTHON) -c 'import tomllib; extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]; print(" ".join(repr(r) for r in extra if not r.startswith("jax_privacy")))')

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# ruff (pycodestyle + pyflakes and the formatter's check, [tool.ruff] in
# pyproject.toml) and mypy (the type check, [tool.mypy]) over the package;
# `make test` runs it first.
lint: $(STAMP)
	$(PY) -m ruff check keras_tapeops
	$(PY) -m ruff format --check keras_tapeops
	$(PY) -m mypy

# --dist loadfile: each test file runs in one worker, so a file's module-scoped
# fixture (the JAX cases' process, multi-worker jobs, oracle fits, the fault
# matrix's references) runs once, not once per worker. (xdist's loadgroup
# marks do not group on pytest 9: xdist 3.8 rewrites a node id attribute
# pytest 9 no longer reads.) Three workers on the two cores: a worker waiting
# on TensorFlow's threads, a subprocess or a file lock leaves a core idle that
# the third one uses (measured on 2 cores: 7 fit-test files 224 s with two
# workers, 182 s with three, 251 s with four).
TEST_WORKERS ?= 3
test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -q --durations=25 tests

# The fast tier (tests marked `unit`: no fit, seconds each) plus a few smoke
# fits, for the edit-test loop (tests/tiers.json, CONTRIBUTING.md).
test-fast: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -q -m "unit or smoke" tests

# Keras's own trainer, model, callback, saving and distillation tests, stock and
# with kt.TapeOpsMixin in every model: fails if a test fails only with the mixin
# (tools/keras_tests/). Not part of `make test`: about 10-25 min on 2 cores.
.PHONY: test-keras
test-keras: $(STAMP)
	$(PY) tools/keras_tests/run.py

# The documentation site into build/site: a strict mkdocs build (README home
# page, docs/*.md, API reference from docstrings) with the committed figures of
# docs/figures/. Runs no example (seconds).
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The documentation's figures: every example that draws one, trained as its page
# describes (no --quick; matplotlib, scikit-learn and dp-accounting come with
# .[test]), writes docs/figures/<name>.png and <name>.json (the
# numbers the page quotes; tests/test_figures.py checks them). Commit both.
# About 15-25 min on 2 cores; FIGURES="maml_sinusoid pinn_burgers" redraws some.
.PHONY: figures
figures: $(STAMP)
	$(PY) docs/gen_figures.py $(if $(FIGURES),--only $(FIGURES))

$(OLDEST_STAMP): pyproject.toml
	test -x $(OLDEST_PY) || $(PYTHON) -m venv $(OLDEST_VENV)
	rm -f $(OLDEST_VENV)/.installed-*
	$(OLDEST_PY) -m pip install --quiet --upgrade pip
	$(OLDEST_PY) -m pip install --quiet "tensorflow==$(OLDEST_TENSORFLOW)" "keras==$(OLDEST_KERAS)" -e . $(OLDEST_TEST_REQUIREMENTS)
	TF_CPP_MIN_LOG_LEVEL=3 $(OLDEST_PY) -c "import keras, tensorflow as tf; assert (tf.__version__, keras.__version__) == ('$(OLDEST_TENSORFLOW)', '$(OLDEST_KERAS)'), (tf.__version__, keras.__version__)"
	touch $(OLDEST_STAMP)

# The suite on the oldest supported tensorflow/keras pair, in its own venv.
test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -m pytest -n 2 --dist loadfile -q tests

bench: $(STAMP)
	@for f in bench/*.py; do [ "$$f" = bench/common.py ] && continue; echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) build dist *.egg-info
