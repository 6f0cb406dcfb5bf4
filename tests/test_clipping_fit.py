"""End-to-end `fit()` tests of the clipping transforms against independent oracles.

Oracles: a hand-written `tf.GradientTape` loop clipping each variable with
`tf.clip_by_norm` / `tf.clip_by_value` (rules applied in list order, each
rule's clips counted; each step a `tf.function`, like fit's, see
`oracle_utils`), and a NumPy two-layer linear network with group
global-norm clipping. Same initial weights, same batches (shuffle=False),
plain SGD.
"""

import collections
import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

from oracle_utils import graph_step

LR = 0.05
BATCH = 16
EPOCHS = 2
N = 64
STEPS = EPOCHS * N // BATCH
HEAD_CLIP = 1.0
BACKBONE_CLIP = 5.0
# Group global-norm thresholds: each group is clipped on some steps, not all.
GROUP_HEAD_CLIP = 4.0
GROUP_BACKBONE_CLIP = 10.0


def make_data(n=N, seed=0):
    """Inputs and targets; the second batch has 3x larger targets.

    Its gradients are the only ones large enough for the loose backbone rule
    (5.0) to fire, so both per-layer rules clip on some steps and not on others
    (the oracle fixture asserts it).
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (3.0 * rng.normal(size=(n, 2))).astype("float32")
    y[BATCH:2 * BATCH] *= 3.0
    return x, y


def make_net(activation="tanh"):
    """backbone_1 -> backbone_2 -> head, functional and upgraded."""
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation=activation, name="backbone_1")(inputs)
    h = keras.layers.Dense(8, activation=activation, name="backbone_2")(h)
    outputs = keras.layers.Dense(2, name="head")(h)
    return kt.upgrade(keras.Model(inputs, outputs, name="net"))


def is_head(variable):
    return "head" in variable.path


def is_backbone(variable):
    return "backbone" in variable.path


def is_bias(variable):
    return variable.path.endswith("/bias")


Rule = collections.namedtuple("Rule", "name selects bound kind")


def norm_rule(name, selects, bound):
    return Rule(name, selects, bound, "norm")


def value_rule(name, selects, bound):
    return Rule(name, selects, bound, "value")


def apply_rule(rule, grad):
    """`(clipped gradient, whether the rule changed it)`, written with plain TF ops."""
    if rule.kind == "norm":
        return tf.clip_by_norm(grad, rule.bound), tf.norm(grad) > rule.bound
    fired = tf.reduce_max(tf.abs(grad)) > rule.bound
    return tf.clip_by_value(grad, -rule.bound, rule.bound), fired


PER_LAYER = [
    norm_rule("head", is_head, HEAD_CLIP),
    norm_rule("backbone", is_backbone, BACKBONE_CLIP),
]


class HandLossScale:
    """`LossScaleOptimizer`'s dynamic rule, by hand, for the tape-loop oracles.

    The loss is multiplied by `scale` before the gradient; the gradients are
    divided by it again. A non-finite step is skipped and halves the scale;
    `growth_steps` finite steps in a row double it. `scales` records the
    scale after every step. `None` (float32 oracles) scales nothing.
    """

    def __init__(self, initial=2.0**15, growth_steps=2000):
        self.scale, self.growth_steps, self.counter = initial, growth_steps, 0
        self.scales, self.skipped = [], 0

    def record(self, finite):
        """Updates the scale after a step whose unscaled gradients were `finite`."""
        if finite:
            self.counter += 1
            if self.counter == self.growth_steps:
                self.scale, self.counter = self.scale * 2, 0
        else:
            self.scale, self.counter = self.scale / 2, 0
            self.skipped += 1
        self.scales.append(self.scale)

    def unscale(self, grads):
        """Unscaled gradients, or None for a skipped (non-finite) step."""
        grads = [g / self.scale for g in grads]
        finite = all(
            np.all(np.isfinite(tf.convert_to_tensor(g).numpy())) for g in grads
        )
        self.record(finite)
        return grads if finite else None


def loss_scale_tensor(loss_scale):
    """The current scale as a step argument (1.0, an exact no-op, for float32)."""
    return tf.constant(1.0 if loss_scale is None else loss_scale.scale, "float32")


def unscaled_gradients(tape, scaled_loss, variables, scale):
    """Inside a graph step: the gradients of `scaled_loss` (the loss times
    `scale`, taken inside the tape) divided by `scale`, and whether they are
    all finite."""
    grads = [g / scale for g in tape.gradient(scaled_loss, variables)]
    return grads, all_finite(grads)


def all_finite(grads):
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])


def sgd_if(finite, variables, grads):
    """Inside a graph step: SGD on `variables` unless the step is skipped."""

    def apply():
        for v, g in zip(variables, grads):
            v.assign_sub(LR * g)
        return tf.constant(True)

    tf.cond(finite, apply, lambda: tf.constant(False))


def tape_oracle(weights, x, y, rules, activation="tanh", loss_scale=None, replicas=1,
                clip_per_replica=False):
    """Hand-written loop: per-variable rules in list order, then SGD.

    Returns the final weights and, per rule name, on how many of the steps
    the rule clipped at least one variable. Pass a `HandLossScale` under
    mixed precision. Each step runs as a `tf.function`, like fit's (see
    `oracle_utils`: under mixed_float16 an eager step differs).

    `replicas > 1` computes the batch's gradient the way MirroredStrategy's
    replicas do: each equal share of the batch in its own forward/backward
    pass with its loss divided by `replicas`, the shares' gradients summed in
    float32, then clipped once (or, with `clip_per_replica`, the wrong way:
    each share clipped before the sum). In float32 the split changes nothing
    beyond rounding; under mixed_float16 each share's gradient is rounded to
    float16 on its own, which is why two replicas are not bit-equal to one
    device there.
    """
    model = make_net(activation)
    model.set_weights(weights)
    variables = model.trainable_variables

    def clip(grads, fired):
        clipped = []
        for v, g in zip(variables, grads):
            for rule in rules:
                if rule.selects(v):
                    g, fired_here = apply_rule(rule, g)
                    fired[rule.name] = fired[rule.name] | fired_here
            clipped.append(g)
        return clipped

    def share_gradients(xb, yb, scale):
        """The unscaled gradient of each replica's share of the batch."""
        if replicas == 1:
            shares = [(xb, yb)]
        else:
            shares = zip(tf.split(xb, replicas), tf.split(yb, replicas))
        out = []
        for xr, yr in shares:
            with tf.GradientTape() as tape:
                pred = tf.cast(model(xr, training=True), "float32")
                loss = tf.reduce_mean(tf.square(pred - yr))
                if replicas > 1:
                    loss = loss / replicas
                loss = loss * scale
            out.append([g / scale for g in tape.gradient(loss, variables)])
        return out

    @graph_step
    def step(xb, yb, scale):
        fired = {rule.name: tf.constant(False) for rule in rules}
        shares = share_gradients(xb, yb, scale)
        # Checked before clipping: a value clip makes an inf gradient finite.
        finite = all_finite([g for share in shares for g in share])
        if clip_per_replica:
            shares = [clip(share, fired) for share in shares]
        grads = [tf.add_n(list(gs)) if replicas > 1 else gs[0] for gs in zip(*shares)]
        if not clip_per_replica:
            grads = clip(grads, fired)
        sgd_if(finite, variables, grads)
        return finite, fired

    clips = collections.Counter({rule.name: 0 for rule in rules})
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            finite, fired = step(
                tf.constant(x[start:start + BATCH]), tf.constant(y[start:start + BATCH]),
                loss_scale_tensor(loss_scale),
            )
            if loss_scale is not None:
                loss_scale.record(bool(finite))
            if bool(finite):
                clips.update(name for name, f in fired.items() if bool(f))
    return model.get_weights(), clips


def assert_every_rule_clips_sometimes(clips, steps=STEPS):
    """Each rule clipped on at least one step and left at least one alone."""
    for name, count in clips.items():
        assert 0 < count < steps, (
            f"rule {name!r} clipped on {count} of {steps} steps: the scenario "
            "does not exercise it"
        )


def fit_weights(model, x, y, **compile_kwargs):
    compile_kwargs.setdefault("optimizer", keras.optimizers.SGD(LR))
    model.compile(loss="mse", **compile_kwargs)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


def assert_weights_close(actual, expected, atol=1e-5):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, atol=atol, rtol=atol)


def weights_close(actual, expected, atol=1e-5):
    return all(np.allclose(a, e, atol=atol, rtol=atol) for a, e in zip(actual, expected))


@pytest.fixture(scope="module")
def oracle():
    """Initial weights and the tape-loop result with head 1.0 / backbone 5.0."""
    keras.utils.set_random_seed(7)
    x, y = make_data()
    weights = make_net().get_weights()
    expected, clips = tape_oracle(weights, x, y, PER_LAYER)
    assert_every_rule_clips_sometimes(clips)
    keras.backend.clear_session()
    return {"x": x, "y": y, "weights": weights, "expected": expected, "clips": clips}


def two_rules(head_where, backbone_where):
    return [
        kt.ClipByNorm(HEAD_CLIP, where=head_where),
        kt.ClipByNorm(BACKBONE_CLIP, where=backbone_where),
    ]


def net_with(weights, activation="tanh"):
    model = make_net(activation)
    model.set_weights(weights)
    return model


def fresh_net(oracle):
    return net_with(oracle["weights"])


def test_both_rules_clip_on_some_steps_but_not_all(oracle):
    """Every per-layer comparison below depends on both rules, not just the head's."""
    assert set(oracle["clips"]) == {"head", "backbone"}
    assert_every_rule_clips_sometimes(oracle["clips"])


def test_rule_count_check_can_fail(oracle):
    """With targets of one scale the backbone rule never fires and the check says so."""
    x, y = make_data()
    y[BATCH:2 * BATCH] /= 3.0
    _, clips = tape_oracle(oracle["weights"], x, y, PER_LAYER)
    assert clips["backbone"] == 0
    with pytest.raises(AssertionError, match="'backbone' clipped on 0 of"):
        assert_every_rule_clips_sometimes(clips)


def test_per_layer_norm_matches_tape_loop_with_globs(oracle):
    got = fit_weights(
        fresh_net(oracle), oracle["x"], oracle["y"],
        gradient_transforms=two_rules("head*", "backbone*"),
    )
    assert_weights_close(got, oracle["expected"])


def test_per_layer_norm_matches_with_list_layer_and_callable(oracle):
    model = fresh_net(oracle)
    got = fit_weights(
        model, oracle["x"], oracle["y"],
        gradient_transforms=[
            kt.ClipByNorm(HEAD_CLIP, where=model.get_layer("head")),
            kt.ClipByNorm(BACKBONE_CLIP, where=["backbone_1", "backbone_2"]),
        ],
    )
    assert_weights_close(got, oracle["expected"])

    got = fit_weights(
        fresh_net(oracle), oracle["x"], oracle["y"],
        gradient_transforms=two_rules(is_head, lambda v: not is_head(v)),
    )
    assert_weights_close(got, oracle["expected"])


def test_comparison_can_fail(oracle):
    """Without the transforms, or with the rules swapped, the weights differ."""
    unclipped = fit_weights(fresh_net(oracle), oracle["x"], oracle["y"])
    assert not weights_close(unclipped, oracle["expected"])
    swapped = fit_weights(
        fresh_net(oracle), oracle["x"], oracle["y"],
        gradient_transforms=two_rules("backbone*", "head*"),
    )
    assert not weights_close(swapped, oracle["expected"])


@pytest.mark.parametrize("kept", ["head", "backbone"])
def test_dropping_either_rule_fails_the_comparison(oracle, kept):
    """Each rule changes the result: a step that ignored one would be caught."""
    rule = dict(head=("head*", HEAD_CLIP), backbone=("backbone*", BACKBONE_CLIP))[kept]
    got = fit_weights(
        fresh_net(oracle), oracle["x"], oracle["y"],
        gradient_transforms=[kt.ClipByNorm(rule[1], where=rule[0])],
    )
    assert not weights_close(got, oracle["expected"])


# ------------------------------------------------------ overlapping groups
BIAS_CLIP = 0.5
OVERLAP = [
    norm_rule("head_norm", is_head, HEAD_CLIP),
    value_rule("bias_value", is_bias, BIAS_CLIP),
]


def test_overlapping_groups_apply_in_list_order(oracle):
    """head/bias is in both groups: norm-clipped first, then value-clipped."""
    expected, clips = tape_oracle(oracle["weights"], oracle["x"], oracle["y"], OVERLAP)
    assert_every_rule_clips_sometimes(clips)
    got = fit_weights(
        fresh_net(oracle), oracle["x"], oracle["y"],
        gradient_transforms=[
            kt.ClipByNorm(HEAD_CLIP, where="head*"),
            kt.ClipByValue(BIAS_CLIP, where="*/bias"),
        ],
    )
    assert_weights_close(got, expected)
    # Companion: the reversed order is a different computation, in both (only
    # head/bias is in both groups, so the difference comes from the overlap).
    reversed_expected, _ = tape_oracle(
        oracle["weights"], oracle["x"], oracle["y"], OVERLAP[::-1]
    )
    assert not weights_close(reversed_expected, expected)
    reversed_got = fit_weights(
        fresh_net(oracle), oracle["x"], oracle["y"],
        gradient_transforms=[
            kt.ClipByValue(BIAS_CLIP, where="*/bias"),
            kt.ClipByNorm(HEAD_CLIP, where="head*"),
        ],
    )
    assert not weights_close(reversed_got, expected)
    assert_weights_close(reversed_got, reversed_expected)


# ------------------------------------------------ group global norm (NumPy)
def numpy_group_oracle(weights, x, y, head_clip, backbone_clip, replicas=1):
    """Two linear layers in NumPy, one global norm per group, SGD.

    `replicas > 1` clips each replica's share of the batch gradient on its
    own and sums afterwards (Keras's per-replica `global_clipnorm`): the
    computation the library must *not* do.

    Returns the final weights and, per group, the number of steps it clipped.
    """
    params = [w.astype("float64") for w in weights]
    clips = {"backbone": 0, "head": 0}
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            xb, yb = x[start:start + BATCH], y[start:start + BATCH]
            total = [np.zeros_like(p) for p in params]
            for xr, yr in zip(np.array_split(xb, replicas), np.array_split(yb, replicas)):
                grads = _linear_grads(params, xr, yr, size=yb.size)
                backbone, head = grads[:4], grads[4:]
                for name, group, bound in (
                    ("backbone", backbone, backbone_clip), ("head", head, head_clip)
                ):
                    norm = np.sqrt(sum(np.sum(g * g) for g in group))
                    clips[name] += int(norm > bound)
                    group[:] = [g * bound / max(norm, bound) for g in group]
                total = [t + g for t, g in zip(total, backbone + head)]
            params = [p - LR * g for p, g in zip(params, total)]
    return params, clips


def _linear_grads(params, xb, yb, size):
    """Gradients of sum((out - y)^2) / size for out = ((x W1 + b1) W2 + b2) W3 + b3."""
    w1, b1, w2, b2, w3, b3 = params
    h1 = xb @ w1 + b1
    h2 = h1 @ w2 + b2
    out = h2 @ w3 + b3
    d_out = 2.0 * (out - yb) / size
    d_h2 = d_out @ w3.T
    d_h1 = d_h2 @ w2.T
    return [xb.T @ d_h1, d_h1.sum(0), h1.T @ d_h2, d_h2.sum(0), h2.T @ d_out, d_out.sum(0)]


def tape_group_oracle(weights, x, y, head_clip, backbone_clip, loss_scale=None):
    """The same group clipping as a tape loop (`tf.clip_by_global_norm`), any policy.

    Each step runs as a `tf.function`, like fit's (see `oracle_utils`).
    """
    model = make_net(activation=None)
    model.set_weights(weights)
    variables = model.trainable_variables

    @graph_step
    def step(xb, yb, scale):
        with tf.GradientTape() as tape:
            pred = tf.cast(model(xb, training=True), "float32")
            loss = tf.reduce_mean(tf.square(pred - yb)) * scale
        grads, finite = unscaled_gradients(tape, loss, variables, scale)
        backbone, _ = tf.clip_by_global_norm(grads[:4], backbone_clip)
        head, _ = tf.clip_by_global_norm(grads[4:], head_clip)
        sgd_if(finite, variables, backbone + head)
        return finite

    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            finite = step(
                tf.constant(x[start:start + BATCH]), tf.constant(y[start:start + BATCH]),
                loss_scale_tensor(loss_scale),
            )
            if loss_scale is not None:
                loss_scale.record(bool(finite))
    return model.get_weights()


def group_rules():
    return [
        kt.ClipByGlobalNorm(GROUP_BACKBONE_CLIP, where="backbone*"),
        kt.ClipByGlobalNorm(GROUP_HEAD_CLIP, where="head*"),
    ]


GROUP_VARIANTS = ["single", "mirrored", "mixed_float16", "jit_compile", "steps_per_execution"]


@pytest.mark.parametrize("variant", GROUP_VARIANTS)
def test_group_global_norm_matches_numpy(variant, request):
    x, y = make_data()
    weights = make_net(activation=None).get_weights()
    expected, clips = numpy_group_oracle(
        weights, x, y, GROUP_HEAD_CLIP, GROUP_BACKBONE_CLIP
    )
    assert_every_rule_clips_sometimes(clips)
    compile_kwargs = {
        "jit_compile": {"jit_compile": True},
        "steps_per_execution": {"steps_per_execution": 3},
    }.get(variant, {})
    if variant == "mixed_float16":
        # float16 forward/backward cannot match float64 NumPy to 1e-5 (it is
        # ~2e-2 off): the oracle is the same group clipping as a float16 tape
        # loop, itself checked against NumPy in float32 below.
        keras.config.set_dtype_policy("mixed_float16")
        expected = tape_group_oracle(
            weights, x, y, GROUP_HEAD_CLIP, GROUP_BACKBONE_CLIP, HandLossScale()
        )
    scope = (
        request.getfixturevalue("mirrored").scope()
        if variant == "mirrored" else contextlib.nullcontext()
    )
    with scope:
        model = net_with(weights, activation=None)
        got = fit_weights(model, x, y, gradient_transforms=group_rules(), **compile_kwargs)
    if variant == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_weights_close(got, expected)


def test_group_tape_oracle_matches_numpy_in_float32():
    """The tape-loop group oracle (used for mixed_float16) computes the NumPy thing."""
    x, y = make_data()
    weights = make_net(activation=None).get_weights()
    expected, _ = numpy_group_oracle(weights, x, y, GROUP_HEAD_CLIP, GROUP_BACKBONE_CLIP)
    got = tape_group_oracle(weights, x, y, GROUP_HEAD_CLIP, GROUP_BACKBONE_CLIP)
    assert_weights_close(got, expected)


def test_group_global_norm_comparison_can_fail():
    """Unclipped, per-tensor, per-replica and loss-scaled clipping all differ."""
    x, y = make_data()
    weights = make_net(activation=None).get_weights()
    expected, _ = numpy_group_oracle(weights, x, y, GROUP_HEAD_CLIP, GROUP_BACKBONE_CLIP)
    unclipped, _ = numpy_group_oracle(weights, x, y, 1e9, 1e9)
    assert not weights_close(unclipped, expected)
    per_replica, _ = numpy_group_oracle(
        weights, x, y, GROUP_HEAD_CLIP, GROUP_BACKBONE_CLIP, replicas=2
    )
    assert not weights_close(per_replica, expected)
    per_tensor = fit_weights(
        net_with(weights, activation=None), x, y,
        gradient_transforms=[
            kt.ClipByNorm(GROUP_BACKBONE_CLIP, where="backbone*"),
            kt.ClipByNorm(GROUP_HEAD_CLIP, where="head*"),
        ],
    )
    assert not weights_close(per_tensor, expected)
    keras.config.set_dtype_policy("mixed_float16")
    float16 = tape_group_oracle(
        weights, x, y, GROUP_HEAD_CLIP, GROUP_BACKBONE_CLIP, HandLossScale()
    )
    scaled = tape_group_oracle(
        weights, x, y, GROUP_HEAD_CLIP / 2.0**15, GROUP_BACKBONE_CLIP / 2.0**15,
        HandLossScale(),
    )
    assert not weights_close(scaled, float16)


# ---------------------------------------------------------- tf.distribute
def test_mirrored_two_replicas_equals_single_device(oracle, mirrored):
    with mirrored.scope():
        got = fit_weights(
            fresh_net(oracle), oracle["x"], oracle["y"],
            gradient_transforms=two_rules("head*", "backbone*"),
        )
    assert_weights_close(got, oracle["expected"])


def test_one_all_reduce_per_optimizer_step(oracle, mirrored, monkeypatch):
    calls = []
    original = tf.distribute.ReplicaContext.all_reduce

    def counting(self, reduce_op, value, options=None):
        calls.append(len(tf.nest.flatten(value)))
        return original(self, reduce_op, value, options)

    monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", counting)
    x, y = oracle["x"][:BATCH], oracle["y"][:BATCH]
    with mirrored.scope():
        model = make_net()
        model.compile(
            optimizer=keras.optimizers.SGD(LR), loss="mse",
            gradient_transforms=two_rules("head*", "backbone*"),
        )
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    # The step is traced once; each replica's trace calls all_reduce once,
    # on all six gradients together (the optimizer's own call is disabled).
    n_replicas = mirrored.num_replicas_in_sync
    assert calls == [6] * n_replicas


# ---------------------------------------------------------- mixed precision
def per_layer_scaled_by(factor):
    return [Rule(r.name, r.selects, r.bound * factor, r.kind) for r in PER_LAYER]


def test_mixed_float16_clips_unscaled_gradients(oracle):
    """Thresholds act on unscaled gradients; overflowing steps are skipped as usual.

    The large-target batch overflows float16 at the default scale 2**15, so
    the oracle runs LossScaleOptimizer's rule by hand (skip, halve) too.
    """
    keras.config.set_dtype_policy("mixed_float16")
    x, y = oracle["x"], oracle["y"]
    loss_scale = HandLossScale()
    expected, clips = tape_oracle(oracle["weights"], x, y, PER_LAYER, loss_scale=loss_scale)
    assert_every_rule_clips_sometimes(clips)
    model = fresh_net(oracle)
    got = fit_weights(model, x, y, gradient_transforms=two_rules("head*", "backbone*"))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_weights_close(got, expected)
    assert float(model.optimizer.dynamic_scale.numpy()) == loss_scale.scale
    assert int(model.optimizer.iterations.numpy()) == STEPS - loss_scale.skipped
    # Clipping the loss-scaled gradients instead would be far off.
    far, _ = tape_oracle(
        oracle["weights"], x, y, per_layer_scaled_by(2.0**-15),
        loss_scale=HandLossScale(),
    )
    assert not weights_close(far, expected)


def test_mirrored_and_mixed_float16_together(oracle, mirrored):
    """LossScaleOptimizer's merge_call path under two replicas, with transforms.

    Under mixed_float16 each replica's gradient is rounded to float16 on its
    own, so two replicas are not bit-equal to one device (6e-5 apart here).
    The oracle therefore computes the two half-batch gradients the way the
    replicas do, sums them and clips once: then the comparison holds at the
    float32 tolerance (measured 1.5e-8), and both wrong semantics (clipping
    each replica's gradient, clipping the loss-scaled gradients) are 4e-2 and
    2e-1 away.
    """
    keras.config.set_dtype_policy("mixed_float16")
    x, y = oracle["x"], oracle["y"]
    loss_scale = HandLossScale()
    expected, clips = tape_oracle(
        oracle["weights"], x, y, PER_LAYER, loss_scale=loss_scale, replicas=2
    )
    assert_every_rule_clips_sometimes(clips)
    with mirrored.scope():
        model = fresh_net(oracle)
        got = fit_weights(model, x, y, gradient_transforms=two_rules("head*", "backbone*"))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_weights_close(got, expected)
    assert float(model.optimizer.dynamic_scale.numpy()) == loss_scale.scale
    per_replica, _ = tape_oracle(
        oracle["weights"], x, y, PER_LAYER, loss_scale=HandLossScale(), replicas=2,
        clip_per_replica=True,
    )
    assert not weights_close(per_replica, expected)
    far, _ = tape_oracle(
        oracle["weights"], x, y, per_layer_scaled_by(2.0**-15),
        loss_scale=HandLossScale(), replicas=2,
    )
    assert not weights_close(far, expected)


def test_replica_split_oracle_is_the_single_device_step_in_float32(oracle):
    """The oracle's two-share gradient is the one-device gradient (float32).

    So the mirrored mixed_float16 test above checks single-device semantics,
    up to the float16 rounding of each share; per-replica clipping is not.
    """
    two, _ = tape_oracle(oracle["weights"], oracle["x"], oracle["y"], PER_LAYER, replicas=2)
    assert_weights_close(two, oracle["expected"])
    per_replica, _ = tape_oracle(
        oracle["weights"], oracle["x"], oracle["y"], PER_LAYER, replicas=2,
        clip_per_replica=True,
    )
    assert not weights_close(per_replica, oracle["expected"])


def test_mixed_float16_non_finite_step_is_skipped_and_scale_halves():
    keras.config.set_dtype_policy("mixed_float16")
    x, y = make_data(n=16)
    x[3, 0] = np.inf
    model = make_net()
    before = model.get_weights()
    model.compile(
        optimizer=keras.optimizers.SGD(LR), loss="mse",
        # A value clip would turn an inf gradient into a finite one.
        gradient_transforms=[kt.ClipByValue(0.1), kt.ClipByGlobalNorm(1.0)],
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert_weights_close(model.get_weights(), before, atol=0)
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**14
    assert int(model.optimizer.iterations.numpy()) == 0


class ScaleRecorder(keras.callbacks.Callback):
    """The loss scale after every batch."""

    def __init__(self):
        super().__init__()
        self.scales = []

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(float(self.model.optimizer.dynamic_scale.numpy()))


def loss_scale_sequence(model, x, y, growth_steps, **compile_kwargs):
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(LR), initial_scale=16.0,
        dynamic_growth_steps=growth_steps,
    )
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    recorder = ScaleRecorder()
    model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
        callbacks=[recorder],
    )
    return recorder.scales, int(optimizer.iterations.numpy())


def expected_scales(finite, initial, growth_steps):
    """The scale after each step by `HandLossScale`'s rule, given which steps are finite."""
    loss_scale = HandLossScale(initial, growth_steps)
    for ok in finite:
        loss_scale.unscale([tf.constant(1.0 if ok else np.inf)])
    return loss_scale.scales


def test_mixed_float16_loss_scale_grows_like_stock_keras():
    """Finite steps double the scale every `dynamic_growth_steps`, as in stock Keras.

    Eight batches, the sixth non-finite: the scale goes 16 -> 32 -> 64, halves
    to 32, then grows again. The stock model (same optimizer, no transforms)
    and the hand-computed rule give the same sequence.
    """
    keras.config.set_dtype_policy("mixed_float16")
    x, y = make_data(n=8 * BATCH)
    x[5 * BATCH + 2, 0] = np.inf
    finite = [True] * 5 + [False] + [True] * 2
    weights = make_net().get_weights()

    model = net_with(weights)
    ours, our_steps = loss_scale_sequence(
        model, x, y, growth_steps=2,
        gradient_transforms=[
            kt.ClipByNorm(HEAD_CLIP, where="head*"),
            kt.ClipByGlobalNorm(BACKBONE_CLIP, where="backbone*"),
        ],
    )
    stock = keras.Model.from_config(make_net().get_config())
    assert not isinstance(stock, kt.TapeOpsMixin)
    stock.set_weights(weights)
    theirs, their_steps = loss_scale_sequence(stock, x, y, growth_steps=2)

    assert ours == expected_scales(finite, 16.0, 2)
    assert max(ours) == 64.0
    assert ours == theirs
    assert our_steps == their_steps == 7
    # Companion: another growth period gives another sequence.
    assert expected_scales(finite, 16.0, 3) != ours


# ----------------------------------------------------- jit, steps_per_execution
def test_jit_compile_and_steps_per_execution(oracle):
    for options in ({"jit_compile": True}, {"steps_per_execution": 3}):
        got = fit_weights(
            fresh_net(oracle), oracle["x"], oracle["y"],
            gradient_transforms=two_rules("head*", "backbone*"),
            **options,
        )
        assert_weights_close(got, oracle["expected"])


# ------------------------------------------------------------------ saving
def test_save_load_keeps_transforms(oracle, tmp_path):
    model = fresh_net(oracle)
    model.compile(
        optimizer=keras.optimizers.SGD(LR), loss="mse",
        gradient_transforms=[
            kt.ClipByNorm(HEAD_CLIP, where=model.get_layer("head")),
            kt.ClipByNorm(BACKBONE_CLIP, where="backbone*"),
        ],
    )
    path = tmp_path / "clip.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    transforms = loaded.tapeops_options.transforms
    assert [type(t) for t in transforms] == [kt.ClipByNorm, kt.ClipByNorm]
    assert [t.clip_norm for t in transforms] == [HEAD_CLIP, BACKBONE_CLIP]
    loaded.fit(
        oracle["x"], oracle["y"], batch_size=BATCH, epochs=EPOCHS,
        shuffle=False, verbose=0,
    )
    assert_weights_close(loaded.get_weights(), oracle["expected"])


def test_selector_matching_nothing_fails_at_compile_before_weights_change(oracle):
    model = make_net()
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"where='haed\*'.*backbone_1.*head"):
        model.compile(
            optimizer="sgd", loss="mse",
            gradient_transforms=[kt.ClipByNorm(1.0, where="haed*")],
        )
    assert model.tapeops_options is None  # no compilation was half-applied
    assert_weights_close(model.get_weights(), before, atol=0)


# ---------------------------------------------------------- sparse gradients
EMB_ROWS = 5
EMB_VALUE_CLIP = 0.01
EMB_GLOBAL_CLIP = 0.05


def embedding_data():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, EMB_ROWS, size=(32, 4)).astype("int32")  # many repeats
    y = rng.normal(size=(32, 1)).astype("float32") * 5
    return tokens, y


def embedding_net():
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(EMB_ROWS, 3, name="emb")(inputs)
    h = keras.layers.Flatten()(h)
    return kt.upgrade(keras.Model(inputs, keras.layers.Dense(1, name="head")(h)))


def embedding_tape_oracle(weights, tokens, y, densify=True):
    """Value clip on the embedding, then one global norm; `densify=False` clips raw slices."""
    model = embedding_net()
    model.set_weights(weights)
    for _ in range(EPOCHS):
        for start in range(0, len(tokens), BATCH):
            with tf.GradientTape() as tape:
                pred = model(tokens[start:start + BATCH])
                loss = tf.reduce_mean(tf.square(pred - y[start:start + BATCH]))
            grads = tape.gradient(loss, model.trainable_variables)
            assert isinstance(grads[0], tf.IndexedSlices)
            if densify:
                grads = [tf.convert_to_tensor(g) for g in grads]
                grads[0] = tf.clip_by_value(grads[0], -EMB_VALUE_CLIP, EMB_VALUE_CLIP)
            else:  # each slice row on its own, repeats not summed
                values = tf.clip_by_value(grads[0].values, -EMB_VALUE_CLIP, EMB_VALUE_CLIP)
                grads[0] = tf.IndexedSlices(values, grads[0].indices, grads[0].dense_shape)
            grads, _ = tf.clip_by_global_norm(grads, EMB_GLOBAL_CLIP)
            for v, g in zip(model.trainable_variables, grads):
                v.assign_sub(LR * tf.convert_to_tensor(g))
    return model.get_weights()


class SeenTypes(kt.GradientTransform):
    """Identity transform that records the gradient types it was traced with."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def transform(self, grads, variables, state):
        self.seen.append(tuple(type(g).__name__ for g in grads))
        return list(grads)

    def get_config(self):
        return {}


@pytest.mark.parametrize("variant", ["single", "mirrored", "jit_compile"])
def test_embedding_sparse_gradients_clip_like_dense(variant, request):
    """IndexedSlices with repeated rows give the dense-gradient result.

    Under MirroredStrategy the replica aggregation concatenates both replicas'
    slices (more repeats); under XLA the row sums need a static row count.
    """
    tokens, y = embedding_data()
    weights = embedding_net().get_weights()
    expected = embedding_tape_oracle(weights, tokens, y)
    spy = SeenTypes()
    scope = (
        request.getfixturevalue("mirrored").scope()
        if variant == "mirrored" else contextlib.nullcontext()
    )
    with scope:
        model = embedding_net()
        model.set_weights(weights)
        got = fit_weights(
            model, tokens, y,
            gradient_transforms=[
                kt.ClipByValue(EMB_VALUE_CLIP, where="emb"),
                kt.ClipByGlobalNorm(EMB_GLOBAL_CLIP),
                spy,
            ],
            jit_compile=variant == "jit_compile",
        )
    assert spy.seen and all(kinds[0] == "IndexedSlices" for kinds in spy.seen)
    assert_weights_close(got, expected)


def test_embedding_comparison_can_fail():
    """Clipping the raw slices (repeats not summed) gives other weights."""
    tokens, y = embedding_data()
    weights = embedding_net().get_weights()
    expected = embedding_tape_oracle(weights, tokens, y)
    naive = embedding_tape_oracle(weights, tokens, y, densify=False)
    assert not weights_close(naive, expected)
    unclipped = fit_weights(embedding_net_with(weights), tokens, y)
    assert not weights_close(unclipped, expected)


def embedding_net_with(weights):
    model = embedding_net()
    model.set_weights(weights)
    return model
