"""`compile(adversarial_training=attack)`: adversarial-only training (Madry et al.), issue 29 item 5.

Oracle: a hand-written loop, as in Madry et al. and the usual PGD training
scripts: for each batch, PGD-k by hand (sign steps on the summed loss, the
model in inference mode, projection onto the epsilon ball, clipping), then
one SGD step on the loss of the attacked batch only. Wrapped in
`tf.function`, from the same initial weights and batches.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

EPS, STEP, K, CLIP = 0.3, 0.1, 3, (-2.5, 2.5)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def attack():
    return kt.attacks.PGD(EPS, STEP, steps=K, random_start=False, clip=CLIP)


def net():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def data(n=32):
    rng = np.random.default_rng(0)
    x = np.clip(rng.normal(size=(n, 4)), *CLIP).astype("float32")
    return x, np.argmax(x[:, :3], axis=1).astype("int32")


def compiled(**options):
    model = kt.upgrade(net())
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss=LOSS, metrics=["accuracy"],
                  **options)
    return model


def fit(model, epochs=2):
    x, y = data()
    return model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0).history


def madry_loop(epochs=2):
    model = net()
    optimizer = keras.optimizers.SGD(0.2)
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        x_adv = x
        for _ in range(K):
            with tf.GradientTape() as tape:
                tape.watch(x_adv)
                objective = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(
                    y, model(x_adv, training=False), from_logits=True))
            x_adv = x_adv + STEP * tf.sign(tape.gradient(objective, x_adv))
            x_adv = tf.clip_by_value(x + tf.clip_by_value(x_adv - x, -EPS, EPS), *CLIP)
        x_adv = tf.stop_gradient(x_adv)
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x_adv, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x, y = data()
    losses = []
    for _ in range(epochs):
        epoch = [float(step(tf.constant(x[i:i + 8]), tf.constant(y[i:i + 8])))
                 for i in range(0, len(x), 8)]
        losses.append(np.mean(epoch))
    return model, losses


def test_adversarial_only_training_equals_the_hand_written_madry_loop():
    oracle, losses = madry_loop()
    model = compiled(adversarial_training=attack())
    history = fit(model)
    for a, b in zip(oracle.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    np.testing.assert_allclose(history["loss"], losses, rtol=1e-5)


def test_the_oracle_check_can_fail():
    oracle, _ = madry_loop()
    clean = compiled()
    fit(clean)
    assert max(float(np.max(np.abs(a - b)))
               for a, b in zip(oracle.get_weights(), clean.get_weights())) > 1e-3


def test_evaluation_stays_clean():
    model = compiled(adversarial_training=attack())
    fit(model, epochs=1)
    stock = net()
    stock.set_weights(model.get_weights())
    stock.compile(loss=LOSS, metrics=["accuracy"])
    x, y = data()
    assert (model.evaluate(x, y, verbose=0, return_dict=True)
            == stock.evaluate(x, y, verbose=0, return_dict=True))


def test_save_load_and_continue_equals_uninterrupted(tmp_path):
    uninterrupted = compiled(adversarial_training=attack())
    fit(uninterrupted)
    model = compiled(adversarial_training=attack())
    fit(model, epochs=1)
    model.save(tmp_path / "m.keras")
    reloaded = keras.models.load_model(tmp_path / "m.keras")
    assert repr(reloaded.tapeops_options.adversarial_training) == repr(attack())
    fit(reloaded, epochs=1)
    for a, b in zip(uninterrupted.get_weights(), reloaded.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


def test_mirrored_equals_one_device(mirrored):
    one = compiled(adversarial_training=attack())
    fit(one)
    with mirrored.scope():
        two = compiled(adversarial_training=attack())
    fit(two)
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


@pytest.mark.unit
def test_anything_but_an_attack_is_refused_by_name():
    model = kt.upgrade(net())
    with pytest.raises(TypeError, match=r"`adversarial_training` must be a kt.attacks attack "
                       r".*Received: adversarial_training='pgd'"):
        model.compile(optimizer="sgd", loss=LOSS, adversarial_training="pgd")
