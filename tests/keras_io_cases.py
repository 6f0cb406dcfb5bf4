"""The keras.io ports of issue 29, as saved-and-resumed cases (tests/test_keras_io_resume.py).

Each case is the library's version of one keras.io example, built exactly as
its oracle test builds it (the test that proves it equals keras.io's code):

- `vae`: tests/test_loss_term_layers.py (`kt.LossTerm(layers=[...])` KL term);
- `dcgan`, `conditional_gan`: tests/test_gan_general.py (`kt.GAN` with
  keras.io's label conventions through the documented hooks);
- `custom_step`: tests/test_custom_step.py (the "Customizing what happens in
  fit()" guide's step with a compiled `kt.ClipByNorm`);
- `reptile`: tests/test_meta_inner_loop.py (`kt.MetaLearner` configured as
  keras.io's Reptile; the meta step size decays over the two epochs).

`build()` returns the compiled model from fixed weights, `fit(model, epochs)`
trains it on fixed batches. `carry`/`restore` move state that Keras does not
save (a `SeedGenerator`'s position, as for a stock VAE) next to the file.
Registered subclasses give the oracles' unregistered classes a name to load by.
"""

import dataclasses
from typing import Callable, Optional

import keras

import keras_tapeops as kt
import test_custom_step as guide
import test_gan_general as gans
import test_loss_term_layers as vae_test
import test_meta_inner_loop as reptile_test

PACKAGE = "keras_io_cases"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    build: Callable
    fit: Callable
    carry: Optional[Callable] = None    # model -> {name: array}, saved beside the file
    restore: Optional[Callable] = None  # (model, {name: array}) -> None, after loading


# ------------------------------------------------------------------ VAE
def _sampling(model):
    return next(layer for layer in model.get_layer("encoder").layers
                if isinstance(layer, vae_test.Sampling))


def _fit_vae(model, epochs):
    model.fit(vae_test.DATA, vae_test.DATA, batch_size=8, epochs=epochs, shuffle=False, verbose=0)


VAE = Case(
    "vae", vae_test.kt_vae, _fit_vae,
    carry=lambda model: {"seed": _sampling(model).seed_generator.state.numpy()},
    restore=lambda model, saved: _sampling(model).seed_generator.state.assign(saved["seed"]),
)


# ----------------------------------------------------- DCGAN, conditional GAN
@keras.saving.register_keras_serializable(package=PACKAGE)
class KerasIOGAN(gans.KerasIOConventions):
    """keras.io's conventions (gan_oracle.KerasIOConventions), saved with their label noise."""

    def get_config(self):
        return {**super().get_config(), "label_noise": self.label_noise}


def _dcgan():
    keras.utils.set_random_seed(0)
    gan = KerasIOGAN(gans.dcgan_generator(), gans.dcgan_discriminator(), latent_dim=gans.LATENT,
                     label_noise=0.05)
    gan.compile(generator_optimizer=gans.adam(), discriminator_optimizer=gans.adam())
    return gan


def _conditional_gan():
    keras.utils.set_random_seed(0)
    generator, discriminator = gans.conditional_networks()[:2]
    gan = KerasIOGAN(generator, discriminator, latent_dim=gans.LATENT, conditional=True,
                     label_noise=0.0)
    gan.compile(generator_optimizer=gans.adam(), discriminator_optimizer=gans.adam())
    return gan


DCGAN = Case("dcgan", _dcgan, lambda gan, epochs: gan.fit(
    gans.images(16), batch_size=gans.BATCH, epochs=epochs, shuffle=False, verbose=0))
CONDITIONAL_GAN = Case("conditional_gan", _conditional_gan, lambda gan, epochs: gan.fit(
    gans.images(16), gans.one_hot(16), batch_size=gans.BATCH, epochs=epochs, shuffle=False,
    verbose=0))


# ------------------------------------------- the customizing-fit guide's step
@keras.saving.register_keras_serializable(package=PACKAGE)
class GuideStep(guide.WithOptions):
    """The guide's `train_step` applying its gradients with the compiled options."""


CUSTOM_STEP = Case(
    "custom_step",
    lambda: guide.build(GuideStep, gradient_transforms=[kt.ClipByNorm(guide.CLIP,
                                                                      where="dense_2")]),
    lambda model, epochs: model.fit(*guide.data(32), batch_size=16, epochs=epochs,
                                    shuffle=False, verbose=0),
)


# ------------------------------------------------------------------ Reptile
TASKS = reptile_test.few_shot_tasks(3, shots=3)


def _reptile():
    # 9 support examples in mini-batches of 4, 4, 1; the step size decays over 2 epochs.
    return reptile_test.reptile_recipe(reptile_test.keras_io_model(), inner_steps=3,
                                       inner_batch_size=4, meta_iters=2 * len(TASKS))


def _fit_reptile(meta, epochs):
    import numpy as np

    support_x, support_y, query_x, query_y = (np.stack([t[i] for t in TASKS]) for i in range(4))
    meta.fit((support_x, support_y, query_x), query_y, batch_size=1, epochs=epochs,
             shuffle=False, verbose=0)


REPTILE = Case("reptile", _reptile, _fit_reptile)

CASES = (VAE, DCGAN, CONDITIONAL_GAN, CUSTOM_STEP, REPTILE)
