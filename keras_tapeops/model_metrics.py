"""What a keras_tapeops model logs: its metrics list, results and evaluation flag.

`MetricsMethods` is a base of `TapeOpsMixin` (before `keras.Model`). The
term trackers and transform/engine metrics follow Keras's own; they are
hidden where nothing updates them (an overriding step that does not reach
the mixin's) and, while evaluating, where they are training-only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras

from keras_tapeops import step_watch
from keras_tapeops.typing_aliases import ModelMixinBase


class MetricsMethods(ModelMixinBase):
    """The mixin's `metrics`, `get_metrics_result`, `evaluate` and plain flags."""

    _tapeops_evaluating = False  # True while evaluate()/test_on_batch() run
    _tapeops_logging = True  # False while SAM's second pass is traced

    @property
    def _stock_metrics(self):
        """Keras's own `metrics` (loss tracker, compiled metrics), without ours."""
        return super().metrics

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        """Stock metrics, then the term trackers and transform/engine metrics.

        The keras_tapeops metrics are left out where nothing updates them: in
        a `train_step` (`test_step`) override that does not call the mixin's,
        and afterwards, once such an override has run.
        """
        metrics = super().metrics
        state = self.tapeops_state
        if state is not None and self.compiled and self._tapeops_metrics_updated(state):
            metrics = metrics + state.metrics
        return metrics

    def _tapeops_metrics_updated(self, state):
        if step_watch.in_replaced_step(self):
            return False
        step = "test" if self._tapeops_evaluating else "train"
        return step not in state.replaced_steps

    def get_metrics_result(self) -> dict[str, Any]:
        """Stock metric results, without training-only terms while evaluating.

        A term compiled with `in_validation=False` is not computed by
        `test_step`, so `evaluate()` (and the validation part of `fit()`)
        does not report it: no `val_<name>` entry in History.
        """
        results = super().get_metrics_result()
        options = self.tapeops_options
        if options is not None and self._tapeops_evaluating:
            for term in options.loss_terms:
                if not term.in_validation:
                    results.pop(term.name, None)
            # Transform and multi-gradient metrics (gradient norms, skipped
            # steps, task weights) exist only where an optimizer step runs.
            for metric in self.tapeops_state.training_only_metrics:
                results.pop(metric.name, None)
        return results

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with self._evaluating():
            return super().evaluate(*args, **kwargs)

    def test_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        with self._evaluating():
            return super().test_on_batch(*args, **kwargs)

    def _evaluating(self):
        # A plain attribute set around evaluation (traced test steps read it
        # at trace time; the test function is only traced in evaluation).
        return self._flag_set("_tapeops_evaluating", True)

    @contextlib.contextmanager
    def _flag_set(self, name, value):
        """Sets the plain attribute `name` to `value` inside the block."""
        previous = getattr(self, name)
        object.__setattr__(self, name, value)  # not tracked by Keras
        try:
            yield
        finally:
            object.__setattr__(self, name, previous)
