"""The cases of the fault matrix (`tests/test_fault_matrix.py`): one per option or model class.

Each case builds a tiny compiled model from fixed seeds, and gives its data.
The models train with plain SGD, so a batch that contributes no gradient
changes no weight (the empty-batch cell compares with the run without it).
`EXPECTED` lists, per case, the cells whose reference is not the default
one (see the test module's docstring) and why; docs/faults.md shows it.
"""

import dataclasses
from typing import Callable

import keras
import numpy as np
import tensorflow as tf
from keras import ops

import keras_tapeops as kt
from keras_tapeops import _compat

PACKAGE = "tapeops_fault_matrix"
FEATURES, CLASSES = 4, 3


@keras.saving.register_keras_serializable(package=PACKAGE)
def mean_square_logits(model, x, y, y_pred):
    return ops.mean(ops.square(y_pred))


def _mlp(name="net"):
    return keras.Sequential(
        [keras.Input((FEATURES,)),
         keras.layers.Dense(6, activation="tanh", name="hidden"),
         keras.layers.Dense(CLASSES, name="head")],
        name=name,
    )


def _two_task_model():
    inputs = keras.Input((FEATURES,))
    trunk = keras.layers.Dense(6, activation="tanh", name="trunk")(inputs)
    a = keras.layers.Dense(CLASSES, name="a")(trunk)
    b = keras.layers.Dense(1, name="b")(trunk)
    return kt.upgrade(keras.Model(inputs, {"a": a, "b": b}, name="tasks"))


def _classification_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (np.argmax(x[:, :CLASSES], axis=1)).astype("int32")
    return x, y


def _two_task_data(n, seed=0):
    x, y = _classification_data(n, seed)
    return x, {"a": y, "b": x[:, :1] * 2.0 - x[:, 1:2]}


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the matrix.

    Attributes:
        name: the row's id.
        build: `(**compile_kwargs) -> compiled model` (extra compile arguments,
            e.g. `jit_compile=True`; call it inside a strategy's scope).
        data: `n -> (x, y)` arrays (y may be a dict per task).
        kind: "single", "tasks", "meta" or "gan": which cells apply.
    """

    name: str
    build: Callable[[], keras.Model]
    data: Callable[[int], tuple]
    kind: str = "single"


def _single(name, **options):
    def build(**extra):
        keras.utils.set_random_seed(7)
        model = kt.upgrade(_mlp())
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **options, **extra,
        )
        return model

    return Case(name, build, _classification_data)


def _single_with_optimizer(name, make_optimizer, **options):
    """A row whose optimizer is built from the model (per-group optimizers)."""

    def build(**extra):
        keras.utils.set_random_seed(7)
        model = kt.upgrade(_mlp())
        model.compile(
            optimizer=make_optimizer(model),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **options, **extra,
        )
        return model

    return Case(name, build, _classification_data)


@keras.saving.register_keras_serializable(package=PACKAGE)
def advection(x, u, du, d2u):
    """A made-up residual on the first logit: u_0 + d u_0 / d x_1 + 0.1 d2 u_0 / d x_0^2."""
    return u[:, 0] + du[:, 0, 1] + 0.1 * d2u[:, 0, 0]


COLLOCATION = np.random.default_rng(3).normal(size=(6, FEATURES)).astype("float32")


def _tasks(name, balancing):
    def build(**extra):
        keras.utils.set_random_seed(7)
        model = _two_task_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss={"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  "b": "mse"},
            task_balancing=balancing(), **extra,
        )
        return model

    return Case(name, build, _two_task_data, kind="tasks")


def _meta(name, **learner):
    def build(**extra):
        keras.utils.set_random_seed(7)
        inner = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(6, activation="tanh", name="hidden"),
             keras.layers.Dense(1, name="head")], name="mlp")
        meta = kt.MetaLearner(inner, inner_learning_rate=0.05, inner_steps=1, **learner)
        meta.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", **extra)
        return meta

    def data(n, seed=0):
        rng = np.random.default_rng(seed)
        amplitude = rng.uniform(0.5, 2.0, (n, 1, 1))
        sx = rng.uniform(-3, 3, (n, 4, 1))
        qx = rng.uniform(-3, 3, (n, 4, 1))
        arrays = [a.astype("float32") for a in (sx, amplitude * np.sin(sx), qx,
                                                 amplitude * np.sin(qx))]
        return tuple(arrays[:3]), arrays[3]

    return Case(name, build, data, kind="meta")


@keras.saving.register_keras_serializable(package=PACKAGE)
class SeededWGANGP(kt.WGANGP):
    """WGANGP whose noise and interpolation are functions of the real samples.

    The documented hooks `sample_latent`/`sample_alpha`: so replicas, XLA and
    a reloaded model draw the same numbers (as tests/test_gan.py does).
    """

    def sample_latent(self, real, step):
        k = tf.range(self.latent_dim, dtype="float32")
        return tf.sin(real[:, :1] * (step + 1.3) + 0.7 * k) + tf.cos(real[:, 1:2] * (k + 1.0))

    def sample_alpha(self, real, step):
        return tf.sigmoid(tf.reduce_sum(real, axis=1) * (step + 1.0))


def _wgangp():
    def build(**extra):
        keras.utils.set_random_seed(7)
        generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4, "tanh"),
                                      keras.layers.Dense(2)], name="generator")
        critic = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4, "tanh"),
                                   keras.layers.Dense(1)], name="critic")
        gan = SeededWGANGP(generator, critic, latent_dim=2, critic_steps=2, gp_weight=1.0)
        gan.compile(generator_optimizer=keras.optimizers.SGD(0.05),
                    critic_optimizer=keras.optimizers.SGD(0.05), **extra)
        return gan

    def data(n, seed=0):
        x = np.random.default_rng(seed).normal(size=(n, 2)).astype("float32")
        return x, None

    return Case("wgangp", build, data, kind="gan")


CASES = [
    _single("stock"),
    _single("transforms", gradient_transforms=[
        kt.ClipByNorm(0.5, where="head"), kt.ClipByGlobalNorm(1.0),
        kt.CentralizeGradients(where="hidden")]),
    _single("adaptive_clip", gradient_transforms=[kt.AdaptiveClip(0.05)]),
    _single("skip_non_finite", gradient_transforms=[kt.SkipNonFinite()]),
    _single("loss_terms", loss_terms=[
        kt.ActivationPenalty("hidden", l2=0.01),
        kt.LossTerm(mean_square_logits, weight=0.1)]),
    _single("gradient_penalty", loss_terms=[kt.GradientPenalty(weight=0.1)]),
    _single("adversarial", loss_terms=[
        kt.AdversarialLoss(kt.attacks.FGSM(0.1, random_start=False), weight=0.5)]),
    _single("adversarial_training", adversarial_training=kt.attacks.PGD(
        0.1, 0.05, steps=2, random_start=False)),
    _single("observability", gradient_transforms=[kt.LogGradientNorm(), kt.LogUpdateRatio()]),
    _single("trades", loss_terms=[
        kt.TRADES(kt.attacks.PGD(0.1, 0.05, steps=2, seed=1), beta=1.0)]),
    _single("physics", loss_terms=[
        kt.PDEResidual(advection, kt.physics.FixedPoints(COLLOCATION), weight=0.1)]),
    _single_with_optimizer("optimizer_groups", lambda model: kt.optimizer_groups(
        model, [("head", keras.optimizers.SGD(0.05))], default=keras.optimizers.SGD(0.1))),
    _single_with_optimizer("layerwise_lr_decay", lambda model: kt.layerwise_lr_decay(
        model, keras.optimizers.SGD(0.1), 0.5, ["head", "hidden"])),
    _single("micro_batches", micro_batches=2),
    _single("accumulation", accumulation_steps=2),
    _single("sam", sharpness_aware=kt.SAM(0.05)),
    _single("dp_sgd", differential_privacy=kt.DPSGD(1.0, 0.5, seed=3)),
    _single("top_loss", sample_selection=kt.TopLoss(0.5)),
    _single("selective_backprop", sample_selection=kt.SelectiveBackprop(seed=1)),
    _single("super_loss", sample_selection=kt.SuperLoss()),
    _single("importance_sampling", sample_selection=kt.ImportanceSampling(0.5, seed=1)),
    _single("self_paced", sample_selection=kt.SelfPaced(1.5)),
    _tasks("pcgrad", lambda: kt.PCGrad(shared="trunk", seed=1)),
    _tasks("mgda", lambda: kt.MGDA(shared="trunk")),
    _tasks("cagrad", lambda: kt.CAGrad(shared="trunk")),
    _tasks("imtlg", lambda: kt.IMTLG(shared="trunk")),
    _tasks("aligned_mtl", lambda: kt.AlignedMTL(shared="trunk")),
    _tasks("upgrad", lambda: kt.UPGrad(shared="trunk")),
    _tasks("gradnorm", lambda: kt.GradNorm(shared="trunk")),
    _tasks("uncertainty", lambda: kt.UncertaintyWeighting()),
    _tasks("dwa", lambda: kt.DWA()),
    _tasks("famo", lambda: kt.FAMO()),
    _tasks("measure_conflict", lambda: kt.MeasureConflict()),
    _meta("maml"),
    _meta("meta_sgd", learn_inner_learning_rate=True),
    _wgangp(),
]

# kt.optimizer_groups and kt.layerwise_lr_decay build a
# keras.optimizers.MultiOptimizer, which Keras added in 3.15; on the oldest
# supported Keras they refuse with a clear error (tested in
# test_issue17_training_fixes.py), so their rows leave the matrix there.
NEEDS_MULTI_OPTIMIZER = ("optimizer_groups", "layerwise_lr_decay")
if _compat.multi_optimizer_class() is None:
    CASES = [case for case in CASES if case.name not in NEEDS_MULTI_OPTIMIZER]

CONDITIONS = [
    "save_load", "mirrored", "jit", "steps_per_execution", "mixed_overflow",
    "empty_batch", "batch_of_one", "nan_example", "zero_weight",
]

# Per-case cells whose outcome is not the condition's default (see the test
# module): "runs" (finite, trains, not equal by design), "nan" (non-finite
# weights, as stock Keras), "finite" (stays finite where stock would not),
# "n/a" (the condition does not apply), "refused: <message regex>" (a clear
# error before any weight changes), or "xfail: <defect>" (a known defect,
# strict: the cell fails the suite once fixed until the entry is removed).
# Each entry says why; docs/faults.md shows the table.
_DRAWS_DIFFER = ("runs", "random draws under XLA differ from graph mode (documented)")
_PER_REPLICA = ("runs", "selection is per replica (documented in docs/selection.md)")
_UNWEIGHTED_TERM = ("runs", "the term averages over every example, label or not, as "
                            "Keras's activity regularizers do (documented in docs/terms.md)")
EXPECTED = {
    "skip_non_finite": {"nan_example": ("finite", "the step with a NaN gradient is skipped")},
    "loss_terms": {"zero_weight": _UNWEIGHTED_TERM},
    "physics": {"zero_weight": ("runs", "the residual is evaluated at collocation points, "
                                        "not at the batch's examples")},
    "gradient_penalty": {"zero_weight": _UNWEIGHTED_TERM},
    "dp_sgd": {
        "nan_example": ("finite", "a non-finite example contributes zero"),
        "jit": _DRAWS_DIFFER,
        "empty_batch": ("runs", "noise is added at every step, also an empty one, "
                                "as the privacy accounting assumes"),
        "zero_weight": ("refused: DPSGD does not support sample_weight",
                        "a weight would break the per-example bound"),
    },
    "top_loss": {"mirrored": _PER_REPLICA},
    "selective_backprop": {
        "jit": _DRAWS_DIFFER, "mirrored": _PER_REPLICA,
        "nan_example": ("finite", "an example with a non-finite loss is never selected"),
    },
    "super_loss": {"mirrored": _PER_REPLICA},
    "importance_sampling": {"jit": _DRAWS_DIFFER, "mirrored": _PER_REPLICA},
    "pcgrad": {"jit": _DRAWS_DIFFER},
    "trades": {"jit": _DRAWS_DIFFER,
               "empty_batch": ("runs", "the seeded random start is keyed by the step count, "
                                       "which an empty batch advances")},
    "accumulation": {"empty_batch": ("runs", "an empty batch still counts in its window")},
}
for _case in CASES:
    if _case.kind in ("meta", "gan"):
        # Per-example faults have no meaning for a batch of tasks or of
        # unlabelled samples; the task-level faults are in their own tests.
        reason = "per-example faults of a batch of tasks or of unlabelled samples"
        EXPECTED.setdefault(_case.name, {}).update(
            {"nan_example": ("n/a", reason), "zero_weight": ("n/a", reason)})


def expected(case, condition, default):
    """The expected outcome of one cell (without its reason)."""
    return EXPECTED.get(case.name, {}).get(condition, (default, ""))[0]
