"""Input-gradient benchmarks (issue 21): adversarial training steps and Integrated Gradients.

One process, interleaved rounds, median ratios (see `common.py`):

1. FGSM-RS training (`kt.AdversarialLoss(kt.attacks.FGSM(eps))`) vs stock
   `fit`, per epoch. The term keeps the clean loss, so one step is the
   attack's forward/backward plus the clean and the adversarial
   forward/backward. For scale, two hand-written `tf.function` loops: the
   same math (clean + adversarial), and Wong et al.'s pure FGSM-RS step
   (attack + one training pass on `x_adv`: the two-pass floor).
2. PGD-7 training (`kt.AdversarialLoss(kt.attacks.PGD(eps, steps=7))`) vs
   `k + 1 = 8` stock epochs (target <= 1.05x), and vs the hand-written loop;
   adversarial-only PGD-7 (`compile(adversarial_training=...)`, no clean
   pass) vs the same `k + 1` budget (target <= 1.0x).
3. `kt.attribution.integrated_gradients(steps=50)` vs the keras.io
   "Integrated Gradients" example's implementation, re-implemented here as
   written there: a Python loop over the `steps + 1` interpolated images,
   each through an eager `get_gradients` (a `tape.watch` on one image),
   then the trapezoid; one call per image of the batch (target >= 1x its
   speed).

Run: python bench/adversarial.py   (a few minutes on 2 CPU cores)
"""

import common  # noqa: F401  (sets TF log level before TensorFlow loads)
import keras
import numpy as np
import tensorflow as tf

import keras_tapeops as kt

ROUNDS = 7
IG_ROUNDS, IG_IMAGES = 5, 4
N, BATCH, SIZE, CLASSES = 2048, 128, 16, 10
EPS = 8 / 255


def make_model():
    return keras.Sequential([
        keras.Input((SIZE, SIZE, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(CLASSES),
    ])


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compiled(terms=None, initial=None):
    model = kt.upgrade(make_model()) if terms else make_model()
    if initial is not None:
        model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss_fn(),
                  **({"loss_terms": terms} if terms else {}))
    return model


def hand_loop(attack_steps, step_size, keep_clean):
    """A hand-written tf.function adversarial training epoch (the seed style)."""
    model = make_model()
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    ce, ce_sum = loss_fn(), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum")

    @tf.function
    def step(x, y):
        adv = tf.clip_by_value(x + tf.random.uniform(tf.shape(x), -EPS, EPS), 0.0, 1.0)
        for _ in range(attack_steps):
            with tf.GradientTape() as tape:
                tape.watch(adv)
                value = ce_sum(y, model(adv, training=False))
            adv = adv + step_size * tf.sign(tape.gradient(value, adv))
            adv = tf.clip_by_value(x + tf.clip_by_value(adv - x, -EPS, EPS), 0.0, 1.0)
        adv = tf.stop_gradient(adv)
        with tf.GradientTape() as tape:
            loss = ce(y, model(adv, training=True))
            if keep_clean:
                loss += ce(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def epoch_of(step, x, y):
    batches = [(tf.constant(x[i:i + BATCH]), tf.constant(y[i:i + BATCH]))
               for i in range(0, len(x), BATCH)]

    def run():
        for xb, yb in batches:
            step(xb, yb)
        float(step(*batches[0]))  # wait for the last step

    return run


def fit_epoch(model, x, y, epochs=1):
    return lambda: model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)


def training_benchmarks(x, y):
    initial = make_model().get_weights()
    stock = compiled()
    fgsm = compiled([kt.AdversarialLoss(kt.attacks.FGSM(EPS, clip=(0.0, 1.0)))], initial)
    pgd = compiled([kt.AdversarialLoss(
        kt.attacks.PGD(EPS, step_size=2 / 255, steps=7, clip=(0.0, 1.0)))], initial)
    # Adversarial-only training (Madry et al.): the attack plus one pass on x_adv.
    madry = kt.upgrade(make_model())
    madry.set_weights(initial)
    madry.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss_fn(),
                  adversarial_training=kt.attacks.PGD(EPS, step_size=2 / 255, steps=7,
                                                      clip=(0.0, 1.0)))
    hand = {
        "hand FGSM-RS clean+adv": hand_loop(1, 1.25 * EPS, True),
        "hand FGSM-RS adv only (floor)": hand_loop(1, 1.25 * EPS, False),
        "hand PGD-7 clean+adv": hand_loop(7, 2 / 255, True),
    }
    for model in (stock, fgsm, pgd, madry):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # trace once
    candidates = {
        "stock fit": fit_epoch(stock, x, y),
        "8 stock epochs (PGD-7 budget)": fit_epoch(stock, x, y, epochs=8),
        "kt FGSM-RS (AdversarialLoss)": fit_epoch(fgsm, x, y),
        "kt PGD-7 (AdversarialLoss)": fit_epoch(pgd, x, y),
        "kt PGD-7 (adversarial_training)": fit_epoch(madry, x, y),
    }
    for name, step in hand.items():
        candidates[name] = epoch_of(step, x, y)
        candidates[name]()  # trace once
    times = common.interleaved(candidates, ROUNDS)
    steps = -(-len(x) // BATCH)
    print(f"adversarial training: {ROUNDS} interleaved rounds, one epoch = {steps} steps "
          f"of batch {BATCH}, {SIZE}x{SIZE}x3 CNN")
    common.report(times, "stock fit", "stock fit")
    print("PGD-7 vs (k + 1) = 8 stock epochs:")
    common.report({k: times[k] for k in ("8 stock epochs (PGD-7 budget)",
                                          "kt PGD-7 (AdversarialLoss)",
                                          "kt PGD-7 (adversarial_training)",
                                          "hand PGD-7 clean+adv")},
                  "8 stock epochs (PGD-7 budget)", "8 stock epochs")


def keras_io_integrated_gradients(model, img_input, top_pred_idx, baseline=None, num_steps=50):
    """The keras.io example's `get_integrated_gradients`, as written there (one image)."""

    def get_gradients(img_input, top_pred_idx):
        images = tf.cast(img_input, tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(images)
            preds = model(images)
            top_class = preds[:, top_pred_idx]
        return tape.gradient(top_class, images)

    if baseline is None:
        baseline = np.zeros(img_input.shape).astype(np.float32)
    img_input = img_input.astype(np.float32)
    interpolated_image = [
        baseline + (step / num_steps) * (img_input - baseline)
        for step in range(num_steps + 1)
    ]
    interpolated_image = np.array(interpolated_image).astype(np.float32)
    grads = []
    for img in interpolated_image:
        img = tf.expand_dims(img, axis=0)
        grad = get_gradients(img, top_pred_idx=top_pred_idx)
        grads.append(grad[0])
    grads = tf.convert_to_tensor(grads, dtype=tf.float32)
    grads = (grads[:-1] + grads[1:]) / 2.0
    avg_grads = tf.reduce_mean(grads, axis=0)
    return (img_input - baseline) * avg_grads


def attribution_benchmark(x):
    model = make_model()
    batch = x[:IG_IMAGES]
    targets = np.argmax(model.predict(batch, verbose=0), axis=1)

    def ours():
        return kt.attribution.integrated_gradients(model, batch, target=targets, steps=50)

    def keras_io():
        return np.stack([
            keras_io_integrated_gradients(model, image, int(t)).numpy()
            for image, t in zip(batch, targets)
        ])

    difference = np.abs(ours() - keras_io()).max()
    times = common.interleaved({"keras.io loop": keras_io, "kt integrated_gradients": ours},
                               IG_ROUNDS)
    print(f"integrated gradients, steps=50, batch of {len(batch)} {SIZE}x{SIZE}x3 images "
          f"(max |difference| {difference:.1e}):")
    common.report(times, "keras.io loop", "keras.io loop (lower is faster)")


def main():
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(N, SIZE, SIZE, 3)).astype("float32")
    y = rng.integers(0, CLASSES, size=N).astype("int32")
    training_benchmarks(x, y)
    attribution_benchmark(x)


if __name__ == "__main__":
    main()
