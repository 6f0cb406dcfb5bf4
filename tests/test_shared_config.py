"""Configuration is not state: one transform or term object serves several models.

Before the redesign (commit 75356bb) a transform or term resolved its
selection or layer on itself, the first time it saw a model. Compiling the
same `kt.ClipByNorm(where="head")` into model A and then model B left it bound
to the last model: fitting A then clipped the wrong tensors, or failed with
"ClipByNorm was built on 4 variables but received 6 gradients"; an
`ActivationPenalty("hidden")` likewise kept one model's layer. Now `bind()`
returns per-model state kept in `model.tapeops_state`, and the configuration
objects never change.

Oracles: a hand-written `tf.GradientTape` step per model, run in
`tf.function`, from the same initial weights on the same batches.
"""

import copy

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops import paths
from oracle_utils import graph_step

CLIP = 0.05
L2 = 0.3
LR = 0.1
BATCH = 8


# ---------------------------------------------------------------- the models
def model_a_layers():
    """Sequential chain with 6 trainable variables: hidden -> mid -> head."""
    return [
        keras.layers.Dense(5, activation="tanh", name="hidden"),
        keras.layers.Dense(3, activation="tanh", name="mid"),
        keras.layers.Dense(2, name="head"),
    ]


def make_a(upgrade=True):
    model = keras.Sequential([keras.Input((4,)), *model_a_layers()], name="model_a")
    return kt.upgrade(model) if upgrade else model


def make_b(upgrade=True):
    """Functional chain with 4 trainable variables: hidden -> head."""
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(inputs)
    outputs = keras.layers.Dense(1, name="head")(hidden)
    model = keras.Model(inputs, outputs, name="model_b")
    return kt.upgrade(model) if upgrade else model


CHAINS = {"a": ("hidden", "mid", "head"), "b": ("hidden", "head")}


def data(kind, n=24, seed=0):
    rng = np.random.default_rng(seed)
    d_in, d_out = (4, 2) if kind == "a" else (3, 1)
    x = rng.normal(size=(n, d_in)).astype("float32")
    y = rng.normal(size=(n, d_out)).astype("float32") * 3.0
    return x, y


def oracle(kind, weights, x, y, batch_sizes, clip_layer="head", l2=L2):
    """Hand loop: mse + L2 * mean(hidden^2); `clip_layer` tensors clipped to CLIP; SGD.

    One epoch (in order, unshuffled) per entry of `batch_sizes`.
    """
    model = make_a(upgrade=False) if kind == "a" else make_b(upgrade=False)
    model.set_weights(weights)
    layers = [model.get_layer(name) for name in CHAINS[kind]]
    variables = model.trainable_variables
    clipped_ids = (
        {id(v) for v in model.get_layer(clip_layer).trainable_variables}
        if clip_layer else set()
    )
    clipped = [id(v) in clipped_ids for v in variables]

    @graph_step
    def step(xb, yb):
        with tf.GradientTape() as tape:
            h = out = layers[0](xb, training=True)
            for layer in layers[1:]:
                out = layer(out, training=True)
            loss = tf.reduce_mean(tf.square(out - yb)) + l2 * tf.reduce_mean(tf.square(h))
        grads = tape.gradient(loss, variables)
        for g, v, on in zip(grads, variables, clipped):
            v.assign_sub(LR * (tf.clip_by_norm(g, CLIP) if on else g))

    for size in batch_sizes:
        for start in range(0, len(x), size):
            step(tf.constant(x[start:start + size]), tf.constant(y[start:start + size]))
    return model.get_weights()


def max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def shared_objects():
    return kt.ClipByNorm(CLIP, where="head"), kt.ActivationPenalty("hidden", l2=L2)


def snapshot(obj):
    """A deep copy of the object's attributes and its config, to compare later."""
    return copy.deepcopy(dict(vars(obj))), obj.get_config()


def compile_shared(model, clip, penalty, run_eagerly=False):
    """Compiles `model` with the shared objects (`penalty` may be None)."""
    model.compile(keras.optimizers.SGD(LR), "mse", run_eagerly=run_eagerly,
                  gradient_transforms=[clip],
                  loss_terms=[penalty] if penalty is not None else None)


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("with_term", [True, False], ids=["clip_and_term", "clip_only"])
@pytest.mark.parametrize("run_eagerly", [False, True], ids=["graph", "eager"])
def test_one_transform_and_term_serve_two_models(run_eagerly, with_term):
    """Compile A, then B; fit A, fit B, then fit A again with another batch size
    (its step is traced again, or run eagerly, after B was set up). Each model
    equals its own oracle (clipping its own `head`, penalizing its own
    `hidden`). Old: the transform and the term kept the selection and layer of
    the model that used them last, so A's later steps clipped with B's mask
    (4 entries for 6 gradients) and recorded B's `hidden`.
    """
    clip, penalty = shared_objects()
    before = [snapshot(clip), snapshot(penalty)]
    l2 = L2 if with_term else 0.0
    if not with_term:
        penalty = None  # the clip alone (old: wrong mask, not a term error)
    model_a, model_b = make_a(), make_b()
    assert len(model_a.trainable_variables) == 6
    assert len(model_b.trainable_variables) == 4
    w_a, w_b = model_a.get_weights(), model_b.get_weights()
    (xa, ya), (xb, yb) = data("a"), data("b", seed=1)

    compile_shared(model_a, clip, penalty, run_eagerly)
    compile_shared(model_b, clip, penalty, run_eagerly)
    fit = dict(epochs=1, shuffle=False, verbose=0)
    model_a.fit(xa, ya, batch_size=BATCH, **fit)
    model_b.fit(xb, yb, batch_size=BATCH, **fit)
    model_a.fit(xa, ya, batch_size=6, **fit)

    expected_a = oracle("a", w_a, xa, ya, [BATCH, 6], l2=l2)
    expected_b = oracle("b", w_b, xb, yb, [BATCH], l2=l2)
    assert max_diff(model_a.get_weights(), expected_a) < 1e-6
    assert max_diff(model_b.get_weights(), expected_b) < 1e-6

    # The oracle tells right from wrong: without the clip, or clipping A's
    # `mid` (B's head mask [F, F, T, T] laid on A's variables), A ends elsewhere.
    for wrong in (None, "mid"):
        assert max_diff(oracle("a", w_a, xa, ya, [BATCH, 6], clip_layer=wrong, l2=l2),
                        expected_a) > 1e-3

    # Configuration unchanged: same attributes (none added), same config.
    penalty = shared_objects()[1] if penalty is None else penalty
    assert [snapshot(clip), snapshot(penalty)] == before


def test_each_model_keeps_its_own_state():
    """The per-model states: each selection has its own model's length and
    marks its own `head`; each penalty state is its own `hidden` layer. One
    state cannot serve the other model: the length check refuses it (the old
    failure, now only reachable by passing the wrong state by hand).
    """
    clip, penalty = shared_objects()
    model_a, model_b = make_a(), make_b()
    compile_shared(model_a, clip, penalty)
    compile_shared(model_b, clip, penalty)
    state_a, state_b = model_a.tapeops_state, model_b.tapeops_state
    assert state_a is not state_b

    (t_a, sel_a), = state_a.transforms
    (t_b, sel_b), = state_b.transforms
    assert t_a is clip and t_b is clip
    assert sel_a.selected == [False, False, False, False, True, True]
    assert sel_b.selected == [False, False, True, True]
    for model, state in ((model_a, sel_a), (model_b, sel_b)):
        tree = paths.LayerTree(model)
        chosen = sorted(
            p for v, on in zip(model.trainable_variables, state.selected) if on
            for p in tree.variable_paths(v)
        )
        assert chosen == ["head/bias", "head/kernel"]

    (p_a, layer_a), = state_a.terms
    (p_b, layer_b), = state_b.terms
    assert p_a is penalty and p_b is penalty
    assert layer_a is model_a.get_layer("hidden")
    assert layer_b is model_b.get_layer("hidden")
    assert layer_a is not layer_b

    grads_a = [tf.zeros_like(v) for v in model_a.trainable_variables]
    with pytest.raises(ValueError, match="bound to 4 variables but received 6 gradients"):
        clip(grads_a, model_a.trainable_variables, sel_b)
    # With its own state the same object clips A's head (norm <= CLIP).
    big = [tf.ones_like(v) * 10.0 for v in model_a.trainable_variables]
    out = clip(big, model_a.trainable_variables, sel_a)
    norms = [float(tf.norm(g)) for g in out]
    assert all(n <= CLIP + 1e-6 for n in norms[4:])
    assert all(n > 1.0 for n in norms[:4])


def test_compiling_another_model_leaves_the_first_untouched():
    """Compiling B (and a failing compile of a third model that lacks `head`)
    does not change A's state or the shared objects."""
    clip, penalty = shared_objects()
    before = [snapshot(clip), snapshot(penalty)]
    model_a, model_b = make_a(), make_b()
    compile_shared(model_a, clip, penalty)
    state_a = model_a.tapeops_state
    selected_a = list(state_a.transforms[0][1].selected)
    compile_shared(model_b, clip, penalty)
    no_head = kt.upgrade(keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name="hidden")], name="no_head"
    ))
    with pytest.raises(ValueError, match="Received: where='head'"):
        compile_shared(no_head, clip, penalty)
    assert model_a.tapeops_state is state_a
    assert state_a.transforms[0][1].selected == selected_a
    assert state_a.terms[0][1] is model_a.get_layer("hidden")
    assert [snapshot(clip), snapshot(penalty)] == before


# ---------------------------------------------------------------------- repr
@keras.saving.register_keras_serializable(package="tapeops_shared_config")
def smooth(model, x, y, y_pred):
    return keras.ops.mean(keras.ops.square(y_pred))


def _head_layer():
    return keras.layers.Dense(2, name="head")


REPR_CASES = [
    (lambda: kt.ClipByNorm(1.0, where="head"), "ClipByNorm(where='head', clip_norm=1.0)"),
    (lambda: kt.ClipByValue(0.5), "ClipByValue(where=None, clip_value=0.5)"),
    (lambda: kt.ClipByGlobalNorm(5.0, where=["backbone*", "head"]),
     "ClipByGlobalNorm(where=['backbone*', 'head'], clip_norm=5.0)"),
    (lambda: kt.ClipByNorm(1.0, where=_head_layer()),
     "ClipByNorm(where=<Dense name='head'>, clip_norm=1.0)"),
    (lambda: kt.ActivationPenalty("hidden", l2=0.01),
     "ActivationPenalty(layer='hidden', l1=0.0, l2=0.01, weight=1.0, "
     "name='activation_penalty_hidden', in_validation=True)"),
    (lambda: kt.LossTerm(smooth, weight=0.1, name="smooth"),
     "LossTerm(fn=smooth, weight=0.1, name='smooth', in_validation=True)"),
    (lambda: kt.GradientPenalty(weight=10.0, target=1.0),
     "GradientPenalty(weight=10.0, name='gradient_penalty', in_validation=False, "
     "target=1.0)"),
    (lambda: kt.SAM(rho=0.05), "SAM(rho=0.05, adaptive=False, where=None)"),
]


@pytest.mark.parametrize("construct, expected", REPR_CASES)
def test_repr_shows_the_arguments(construct, expected):
    """Old: the default `<keras_tapeops...ClipByNorm object at 0x...>`."""
    assert repr(construct()) == expected


REPR_ANY = [
    lambda: kt.SkipNonFinite(max_consecutive=3, where="head"),
    lambda: kt.LogGradientNorm(where="head", log_max=True),
    lambda: kt.ClipByNorm(1.0, where=lambda v: "head" in v.path),
    lambda: kt.LossTerm(smooth, weight=keras.optimizers.schedules.ExponentialDecay(1.0, 10, 0.5)),
    lambda: kt.ActivationPenalty("hidden", l1=0.1, weight=lambda step: 0.5),
]


@pytest.mark.parametrize("construct", REPR_ANY, ids=[
    "skip_non_finite", "log_gradient_norm", "callable_where", "schedule_weight",
    "callable_weight",
])
def test_repr_never_shows_an_address(construct):
    """Every configuration object (whatever its arguments: callables,
    LearningRateSchedules) prints as `ClassName(arg=value, ...)` naming each
    config entry, never as `object at 0x...`."""
    obj = construct()
    text = repr(obj)
    assert text.startswith(type(obj).__name__ + "("), text
    assert "object at 0x" not in text, text
    for key in obj.get_config() if not _has_unsaveable(obj) else vars(obj):
        if not key.startswith("_"):
            assert f"{key}=" in text, (key, text)


def _has_unsaveable(obj):
    try:
        obj.get_config()
    except ValueError:  # a lambda argument: repr still works, config refuses
        return True
    return False


def test_repr_of_compiled_options():
    """The options of a compile() print their transforms and terms in full."""
    clip, penalty = shared_objects()
    model = make_a()
    compile_shared(model, clip, penalty)
    text = repr(model.tapeops_options)
    assert "object at 0x" not in text
    assert text.startswith("TapeOpsOptions(")
    assert f"gradient_transforms=[{clip!r}]" in text
    assert f"loss_terms=[{penalty!r}]" in text
    assert "micro_batches=1" in text and "accumulation_steps=1" in text
    assert repr(clip) == f"ClipByNorm(where='head', clip_norm={CLIP})"
