"""The model, data and options both sides of the JAX tests use (backend-neutral).

Imported by tests/jax_cases.py (KERAS_BACKEND=jax, its own process) and by
tests/test_jax_backend.py (TensorFlow): same layers, same initial weights
(passed as arrays), same batches.
"""

from __future__ import annotations

import functools

import keras
import numpy as np

EPOCHS, BATCH, LR = 2, 16, 0.1


def data():
    """64 examples of 8 features, a 1-d regression target (float32)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.5).astype("float32")
    return x, y


def update_ratios(kt):
    """SkipNonFinite, then two LogUpdateRatio groups around the clip groups."""
    return [
        kt.SkipNonFinite(),
        kt.LogUpdateRatio(where="body*"),
        *transforms(kt),
        kt.LogUpdateRatio(where="head", name="head_update_ratio"),
    ]


def nan_data():
    """`data()` with a nan target in the second batch (samples 16-31)."""
    x, y = data()
    y = y.copy()
    y[20, 0] = np.nan
    return x, y


def two_nan_batches_data():
    """`data()` with nan targets in batches 1 and 2 (two non-finite steps in a row)."""
    x, y = data()
    y = y.copy()
    y[BATCH + 3, 0] = y[2 * BATCH + 5, 0] = np.nan
    return x, y


def compile_mixed_stop(kt, model):
    """`model` compiled to stop after 2 non-finite steps: loss scale 1 (overflows count),
    one execution of 4 steps (an epoch); call under the mixed_float16 policy."""
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=1.0),
        loss="mse",
        steps_per_execution=4,
        gradient_transforms=[kt.SkipNonFinite(max_consecutive=2)],
    )
    return model


def make_mlp(init=None, upgrade=True):
    """body1 -> body2 -> head; upgraded with kt.upgrade unless `upgrade=False`."""
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", name="body1"),
            keras.layers.Dense(16, activation="tanh", name="body2"),
            keras.layers.Dense(1, name="head"),
        ]
    )
    if init is not None:
        model.set_weights(init)
    if upgrade:
        import keras_tapeops as kt

        model = kt.upgrade(model)
    return model


def initial_weights():
    """Seeded initial weights (NumPy), the same on both backends."""
    rng = np.random.default_rng(1)
    shapes = [(8, 16), (16,), (16, 16), (16,), (16, 1), (1,)]
    return [(rng.normal(size=s) * 0.5).astype("float32") for s in shapes]


def transforms(kt):
    """Three clip groups: one per tensor, one global group, one by value."""
    return [
        kt.ClipByNorm(0.05, where="head"),
        kt.ClipByGlobalNorm(0.5, where="body*"),
        kt.ClipByValue(0.01, where="body2"),
    ]


def sample_weights():
    """Per-example weights in [0.2, 1.8) (the reduction cases)."""
    return np.random.default_rng(2).uniform(0.2, 1.8, size=(64,)).astype("float32")


def make_regularized(init, upgrade=True, activity=True):
    """The MLP with an L2 kernel regularizer (body1) and an activity regularizer (body2).

    `activity=False` leaves the activity regularizer out (DP-SGD refuses it).
    """
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(
                16, activation="tanh", name="body1", kernel_regularizer=keras.regularizers.L2(0.01)
            ),
            keras.layers.Dense(
                16,
                activation="tanh",
                name="body2",
                activity_regularizer=keras.regularizers.L1(0.01) if activity else None,
            ),
            keras.layers.Dense(1, name="head"),
        ]
    )
    model.set_weights(init)
    if upgrade:
        import keras_tapeops as kt

        model = kt.upgrade(model)
    return model


def make_batch_norm(init):
    """body1 -> BatchNormalization -> body2 -> head, upgraded (BN starts at its defaults)."""
    import keras_tapeops as kt

    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", name="body1"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Dense(16, activation="tanh", name="body2"),
            keras.layers.Dense(1, name="head"),
        ]
    )
    for name, start in [("body1", 0), ("body2", 2), ("head", 4)]:
        model.get_layer(name).set_weights(init[start : start + 2])
    return kt.upgrade(model)


def grouped_optimizers(kt, model):
    """SGD on the head, Adam on the body (kt.optimizer_groups)."""
    return kt.optimizer_groups(
        model,
        [("head", keras.optimizers.SGD(0.05)), ("body*", keras.optimizers.Adam(0.01))],
    )


def decayed_optimizer(kt, model):
    """Adam at 0.01 on the head, halved per block below it (kt.layerwise_lr_decay)."""
    return kt.layerwise_lr_decay(
        model, keras.optimizers.Adam(0.01), decay=0.5, layers=["body1", "body2", "head"]
    )


@keras.saving.register_keras_serializable(package="jax_models")
def body2_square(model, x, y, y_pred, body2):
    """A LossTerm reading a layer's output (and the model's head kernel, at weight 0)."""
    return keras.ops.mean(keras.ops.cast(body2, "float32") ** 2) + 0.0 * keras.ops.sum(
        model.get_layer("head").kernel
    )


@keras.saving.register_keras_serializable(package="jax_models")
def mean_output(model, x, y, y_pred):
    """A LossTerm of the predictions only."""
    return keras.ops.mean(y_pred)


def loss_terms(kt):
    """An activation penalty, a LossTerm with `layers=`, a training-only LossTerm."""
    return [
        kt.ActivationPenalty("body1", l2=0.1),
        kt.LossTerm(body2_square, weight=0.5, layers=["body2"], name="body2_square"),
        kt.LossTerm(mean_output, weight=0.2, in_validation=False),
    ]


def with_extra_term(kt, init):
    """A subclass whose `compute_terms` override adds an unnamed term."""

    class WithExtraTerm(kt.TapeOpsSequential):
        def compute_terms(self, terms, context):
            values = super().compute_terms(terms, context)
            return values + [0.1 * keras.ops.mean(context.y_pred**2)]

    model = WithExtraTerm(make_mlp(init, upgrade=False).layers)
    model.build((None, 8))
    model.set_weights(init)
    return model


def logged_transforms(kt):
    """The clip groups between two LogGradientNorm (one with its epoch max)."""
    return (
        [kt.LogGradientNorm(name="raw_norm", log_max=True)]
        + transforms(kt)
        + [kt.LogGradientNorm(where="body*", name="clipped_body_norm")]
    )


def sam_cases(kt):
    """SAM configurations both backends train (name -> compile kwargs)."""
    return {
        "sam": {"sharpness_aware": kt.SAM(rho=0.1)},
        "asam_where_clip": {
            "sharpness_aware": kt.SAM(rho=0.5, adaptive=True, where="body*"),
            "gradient_transforms": transforms(kt),
        },
        "sam_micro": {"sharpness_aware": kt.SAM(rho=0.1), "micro_batches": 3},
        "sam_terms": {"sharpness_aware": kt.SAM(rho=0.1), "loss_terms": loss_terms(kt)},
    }


def penalty_terms(kt):
    """A GradientPenalty (validated too), two other terms, and an own input-gradient term."""

    class InputGradientSquare(kt.Term):
        needs_input_gradients = True

        def call(self, context):
            return keras.ops.mean(context.input_gradients() ** 2)  # default: all outputs

    return [
        kt.GradientPenalty(weight=0.5, target=1.0, in_validation=True),
        InputGradientSquare(weight=2.0),
    ] + loss_terms(kt)[:2]


@keras.saving.register_keras_serializable(package="jax_models")
def squared_batch_mean(model, x, y, y_pred):
    """A LossTerm that is not a mean over samples: the square of the batch's mean."""
    return keras.ops.square(keras.ops.mean(y_pred))


def micro_batch_terms(kt):
    """The input-gradient terms, layer outputs, and a term that is not a per-sample
    mean: computed per micro-batch, it differs from the whole batch's value."""
    return penalty_terms(kt) + [
        kt.LossTerm(squared_batch_mean, weight=2.0, name="batch_mean_square")
    ]


def make_masked():
    """Token ids -> Embedding(mask_zero=True) -> Dense -> Dense: a masked output."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(10, 4, mask_zero=True)(inputs)
    h = keras.layers.Dense(3, activation="tanh")(h)
    import keras_tapeops as kt

    return kt.upgrade(keras.Model(inputs, keras.layers.Dense(2)(h)))


def masked_data():
    """16 padded sequences (zeros after position 4, and after 2 in every third)."""
    rng = np.random.default_rng(0)
    x = rng.integers(1, 9, size=(16, 6)).astype("int32")
    x[:, 4:] = 0
    x[::3, 2:] = 0
    return x, rng.normal(size=(16, 6, 2)).astype("float32")


#: DP-SGD's clipping bound in the cross-backend cases (the per-example
#: gradients of `data()` are larger: every example is clipped).
DP_CLIP = 0.5


def dp_cases(kt):
    """DP-SGD configurations both backends train with the noise off (name -> kwargs)."""
    return {
        "dp": {"differential_privacy": kt.DPSGD(DP_CLIP, 0.0)},
        "dp_clip_transforms": {
            "differential_privacy": kt.DPSGD(DP_CLIP, 0.0, method="vectorized"),
            "gradient_transforms": transforms(kt),
        },
    }


def dp_mixed_optimizer():
    """SGD under a loss scale low enough that neither backend overflows (see the test)."""
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=256.0)


@functools.lru_cache(maxsize=None)
def step_decay_class(kt):
    """A transform whose training state changes the result: gradients / (1 + steps seen).

    Registered for loading; `StepDecay()` is saved with its `steps` variable.
    """

    @keras.saving.register_keras_serializable(package="tapeops_jax_tests")
    class StepDecay(kt.GradientTransform):
        def bind(self, model, variables, tree=None):
            state = super().bind(model, variables, tree)
            state.add_variable("steps", 0.0)
            return state

        def transform(self, grads, variables, state):
            steps = state.variables["steps"]
            factor = 1.0 / (1.0 + keras.ops.convert_to_tensor(steps))
            steps.assign(steps + 1.0)
            return [
                g if g is None or not on else g * factor for g, on in zip(grads, state.selected)
            ]

    return StepDecay


def group_schedule_callbacks(kt):
    """Halve the body group's rate each epoch, and the head's on a plateau (logged)."""
    return [
        kt.callbacks.GroupLearningRateScheduler({"body": lambda epoch, lr: lr * 0.5}, log=True),
        kt.callbacks.GroupReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0),
    ]


def named_groups(kt, model):
    """SGD named "head" on the head, Adam named "body" on the body (the groups' names)."""
    return kt.optimizer_groups(
        model,
        [
            ("head", keras.optimizers.SGD(0.05, name="head")),
            ("body*", keras.optimizers.Adam(0.01, name="body")),
        ],
    )


def decaying_weight(step):
    """A term weight scheduled on the optimizer's step: 0.5 / (1 + step)."""
    return 0.5 / (1.0 + keras.ops.cast(step, "float32"))


def scheduled_terms(kt):
    """An activation penalty whose weight decays with the step, also in validation."""
    return [kt.ActivationPenalty("body1", l2=0.1, weight=decaying_weight, in_validation=True)]
