"""GANs trained with `fit()`: `GAN`, its losses and penalties, and `WGANGP`.

`from keras_tapeops.gan import WGANGP` keeps working (this package replaced
the module `keras_tapeops/gan.py`; saved files name classes by their
registered names, `"keras_tapeops>WGANGP"`, not by module).
"""

from keras_tapeops.gan import losses  # noqa: F401
from keras_tapeops.gan.model import GAN
from keras_tapeops.gan.penalties import DiscriminatorPenalty
from keras_tapeops.gan.penalties import R1Penalty
from keras_tapeops.gan.penalties import WGANGradientPenalty
from keras_tapeops.gan.wgangp import WGANGP

__all__ = ["GAN", "DiscriminatorPenalty", "R1Penalty", "WGANGradientPenalty", "WGANGP", "losses"]
