"""The protocol of a clipping rule: how one site yields per-example norms and the clipped sum.

A rule (one per layer family: `ghost_dense`, `ghost_embedding`, `ghost_conv`,
`ghost_depthwise`, `ghost_layer_norm`, `ghost_group_norm`, and the
`vectorized` fallback) has two steps:

- `forward(layer, original_call, args, kwargs) -> (outputs, record)`: runs
  the layer in the forward pass and records what it needs (its inputs, and
  `record["z"]`: the tensors whose gradient the backward pass computes, e.g.
  a Dense layer's pre-activation output);
- `clip(site, records, grads_z, context) -> {id(variable): Part}`: from the
  records and the gradients of the (loss-scaled) objective with respect to
  each `z`, every variable's per-example squared norms (true units, float32)
  and a function giving the clipped sum `sum_i c_i g_i` (loss-scaled units).

The per-example squared norm of the whole gradient is the sum of the parts'
norms, over every variable of every site: norms add over variables.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Sequence
from typing import TypeVar

import keras
import tensorflow as tf

from keras_tapeops.layer_records.forwards import output_forward
from keras_tapeops.layer_records.sites import Site
from keras_tapeops.typing_aliases import Gradient


class Part:
    """One variable's per-example squared norms and its clip-weighted sum.

    Args:
        squared_norms: `[B]` float32, `||d loss_i / d variable||^2`.
        weighted: callable `c ([B] float32) -> gradient` giving
            `scale * sum_i c_i * d loss_i / d variable` (a tensor shaped like
            the variable, or `tf.IndexedSlices`), float32.
        method: how the norms were computed ("ghost", "per-example", ...).
        rows: optional `[B, ...]` per-example gradients that `weighted`
            reads, example by example (`weighted(c) == from_rows(rows, c)`).
        from_rows: with `rows`, callable `(rows, c) -> gradient`.
        row_local: False when a row may depend on other examples' records
            (a Jacobian over the whole batch): the engine then runs the rule
            again on zeroed records instead of cleaning the rows.

    A part with rows is row-local: a non-finite example's entries stay in its
    own row, so when some example is not finite the engine zeroes the rows'
    non-finite entries (`sanitized`) instead of running the rule again on
    zeroed records, and the layer's records need not be kept for that.
    """

    def __init__(
        self,
        squared_norms: tf.Tensor,
        weighted: Callable[[tf.Tensor], Gradient],
        method: str,
        *,
        rows: tf.Tensor | None = None,
        from_rows: Callable[[tf.Tensor, tf.Tensor], Gradient] | None = None,
        row_local: bool = True,
    ) -> None:
        self.squared_norms = squared_norms
        self.weighted = weighted
        self.method = method
        self.rows = rows
        self.from_rows = from_rows
        self.row_local = row_local

    @classmethod
    def of_rows(
        cls,
        squared_norms: tf.Tensor,
        rows: tf.Tensor,
        from_rows: Callable[[tf.Tensor, tf.Tensor], Gradient],
        method: str,
        row_local: bool = True,
    ) -> "Part":
        """A `Part` whose clipped sum is `from_rows(rows, c)`.

        Args:
            squared_norms: `[B]` float32 per-example squared norms.
            rows: `[B, ...]` per-example gradients.
            from_rows: callable `(rows, c) -> gradient`.
            method: the name shown in the report.
            row_local: see the class's arguments.

        Returns:
            The `Part`, with `rows` and `from_rows` set.

        Example:
        ```python
        part = kt.privacy.Part.of_rows(
            tf.ones([4]), tf.ones([4, 3]), lambda rows, c: tf.linalg.matvec(rows, c, True), "rows"
        )
        ```
        """
        return cls(
            squared_norms,
            lambda c: from_rows(rows, c),
            method,
            rows=rows,
            from_rows=from_rows,
            row_local=row_local,
        )

    @property
    def cleanable(self) -> bool:
        """Whether `sanitized` can clean this part's rows (it has row-local rows)."""
        return self.rows is not None and self.from_rows is not None and self.row_local

    def sanitized(self) -> "Part | None":
        """This part with non-finite rows' entries and norms zeroed; None without rows.

        Returns:
            A row-local `Part` whose clipped sum gives a non-finite example
            (weight 0) exactly nothing, or None when this part has no rows
            or they are not row-local.

        Example:
        ```python
        clean = kt.privacy.per_example_part(tf.ones([4, 3]), 1.0, [3]).sanitized()
        ```
        """
        from_rows = self.from_rows
        if from_rows is None or not self.cleanable:
            return None
        return Part.of_rows(
            finite_or_zero(self.squared_norms), finite_or_zero(self.rows), from_rows, self.method
        )


class Context:
    """What every rule's `clip` may use besides its records.

    Attributes:
        tape: the persistent tape of the forward pass.
        scale: the loss scale the objective was multiplied by (float32).
        jit: True when the step is compiled with XLA (static shapes only).
        sanitize: True when a non-finite example is zeroed (see
            `engine.DPSGDState._parts`): per-example rows a rule
            materializes must have their non-finite entries replaced by zeros.
    """

    def __init__(
        self, tape: tf.GradientTape, scale: tf.Tensor | float, jit: bool, sanitize: bool = False
    ) -> None:
        self.tape = tape
        self.scale = tf.cast(scale, tf.float32)
        self.jit = jit
        self.sanitize = sanitize


def finite_or_zero(tensor):
    """`tensor` with its non-finite entries replaced by zeros (integer tensors as they are)."""
    if isinstance(tensor, tf.RaggedTensor):
        return tensor.with_flat_values(finite_or_zero(tensor.flat_values))
    if not tensor.dtype.is_floating:
        return tensor
    return tf.where(tf.math.is_finite(tensor), tensor, tf.zeros_like(tensor))


class ClippingRule:
    """Base of a DP-SGD clipping rule: per-example norms for one layer family.

    Subclass it for a layer DP-SGD would otherwise clip through the
    vectorized fallback (one gradient per example), and register it with
    `kt.privacy.register_clipping_rule`. Methods are static: a rule holds no
    state; what one step needs travels in its records.

    Attributes:
        family: the name `engine.report()` shows for the rule's layers.

    Example:
    ```python
    class Scale(keras.layers.Layer):              # y = x * w
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

        def call(self, x):
            return x * self.w

    @kt.privacy.register_clipping_rule
    class ScaleRule(kt.privacy.ClippingRule):
        family = "Scale"

        @staticmethod
        def applies(layer):
            return isinstance(layer, Scale)       # y = x * w, w of shape [D]

        @staticmethod
        def clip(site, records, grads, context):
            w = site.layer.w
            rows = tf.add_n([r["a"] * g[0] for r, g in zip(records, grads)])
            return {id(w): kt.privacy.per_example_part(rows, context.scale, w.shape)}
    ```
    """

    family = "custom"

    @staticmethod
    def applies(layer: keras.layers.Layer) -> bool:
        """Returns True if this rule clips `layer`'s own variables."""
        raise NotImplementedError("A ClippingRule must implement applies(layer).")

    @staticmethod
    def forward(
        layer: keras.layers.Layer,
        original_call: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Any]]:
        """Runs the layer; returns `(outputs, record)`.

        The default records the first input as `record["a"]` and the output as
        `record["z"] = [outputs]`: `clip` then receives, per call of the
        layer, the gradient of the objective with respect to the output.
        """
        return output_forward(layer, original_call, args, kwargs)

    @staticmethod
    def clip(
        site: Site,
        records: Sequence[dict[str, Any]],
        grads: Sequence[Sequence[tf.Tensor]],
        context: Context,
    ) -> dict[int, Part]:
        """Returns `{id(variable): Part}` for the site's variables.

        Args:
            site: the layer's site (`site.layer`, `site.variables`).
            records: one record per call of the layer in the forward pass.
            grads: per record, the list of gradients of the loss-scaled
                objective with respect to `record["z"]`.
            context: a `Context` (`scale`, `jit`, `sanitize`, `tape`).
        """
        raise NotImplementedError("A ClippingRule must implement clip(...).")


# A rule class: a ClippingRule subclass, or any class with its static methods.
_Rule = TypeVar("_Rule", bound=type)

_REGISTERED_RULES: list = []


def register_clipping_rule(rule: _Rule) -> _Rule:
    """Registers a clipping rule: DP-SGD (`method="auto"`) tries it before the built-in ones.

    Rules registered later are tried first. Usable as a class decorator.

    Args:
        rule: a `ClippingRule` subclass (or any class with static `applies`,
            `forward` and `clip` and a `family` name).

    Returns:
        `rule`, unchanged.

    Raises:
        TypeError: `rule` lacks one of them.

    Example:
    ```python
    class Doubled(keras.layers.Dense):            # a layer of your own
        pass

    class DoubledRule(kt.privacy.ClippingRule):
        family = "Doubled"

        @staticmethod
        def applies(layer):
            return isinstance(layer, Doubled)

        @staticmethod
        def clip(site, records, grads, context):
            raise NotImplementedError  # see kt.privacy.ClippingRule

    kt.privacy.register_clipping_rule(DoubledRule)   # tried before the built-in rules
    ```
    """
    missing = [
        name for name in ("applies", "forward", "clip") if not callable(getattr(rule, name, None))
    ]
    if missing or not isinstance(getattr(rule, "family", None), str):
        raise TypeError(
            "register_clipping_rule() takes a kt.privacy.ClippingRule subclass "
            "(static applies/forward/clip and a `family` string); missing: "
            f"{missing or ['family']}. Received: rule={rule!r}"
        )
    if rule not in _REGISTERED_RULES:
        _REGISTERED_RULES.insert(0, rule)
    return rule


def registered_rules():
    """The registered rules, most recent first."""
    return tuple(_REGISTERED_RULES)
