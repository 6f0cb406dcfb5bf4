"""WGAN-GP on a 2-D ring of 8 Gaussians, trained with `fit()`.

Writes `wgan_gp_ring.png` (real samples in blue, generated in orange) next to
the current directory, or to the path given as the first argument. Uses
matplotlib if installed (`pip install keras-tapeops[examples]`), else a tiny
built-in PNG writer. Runs in well under a minute on a CPU.

Usage:
    python examples/wgan_gp.py [out.png [numbers.json]]

The second argument writes the printed distances to a JSON file; `make
figures` keeps it next to the documentation's copy of the PNG (docs/figures/).
"""

import json
import os
import struct
import sys
import zlib

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402

RADIUS = 2.0


def ring_of_gaussians(n, modes=8, std=0.05, seed=0):
    """`n` points from `modes` Gaussians evenly spaced on a circle."""
    rng = np.random.default_rng(seed)
    angle = 2 * np.pi * rng.integers(0, modes, n) / modes
    centers = RADIUS * np.stack([np.cos(angle), np.sin(angle)], axis=1)
    return (centers + std * rng.normal(size=(n, 2))).astype("float32")


def mlp(inputs, outputs, name):
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(outputs),
        ],
        name=name,
    )


def distance_to_ring(samples):
    return float(np.mean(np.abs(np.linalg.norm(samples, axis=1) - RADIUS)))


def main(out_path="wgan_gp_ring.png", json_path=None):
    keras.utils.set_random_seed(0)
    real = ring_of_gaussians(4096)
    gan = kt.WGANGP(
        generator=mlp(2, 2, "generator"), critic=mlp(2, 1, "critic"),
        latent_dim=2, critic_steps=5, gp_weight=1.0,
    )
    gan.compile(
        generator_optimizer=keras.optimizers.Adam(2e-3, beta_1=0.5, beta_2=0.9),
        critic_optimizer=keras.optimizers.Adam(2e-3, beta_1=0.5, beta_2=0.9),
    )
    noise = np.random.default_rng(1).normal(size=(1024, 2)).astype("float32")
    before = distance_to_ring(gan.predict(noise, verbose=0))
    print(f"mean distance to the ring before: {before:.3f}")
    gan.fit(real, batch_size=64, epochs=8, verbose=2)
    fake = gan.predict(noise, verbose=0)
    after = distance_to_ring(fake)
    print(f"mean distance to the ring after:  {after:.3f}")
    scatter_png(out_path, real[:1024], fake)
    print(f"wrote {out_path}")
    if json_path:
        numbers = dict(epochs=8, batch=64, samples=len(real), radius=RADIUS,
                       distance_before=float(before), distance_after=float(after))
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(numbers, f, indent=2)
        print(f"wrote {json_path}")


# ------------------------------------------------------------------ plotting
def scatter_png(path, real, fake, size=400, extent=3.0):
    """Scatter plot of `real` (blue) and `fake` (orange) points into a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.scatter(*real.T, s=3, c="tab:blue", label="real")
        ax.scatter(*fake.T, s=3, c="tab:orange", label="generated")
        ax.set_xlim(-extent, extent)
        ax.set_ylim(-extent, extent)
        ax.set_aspect("equal")
        ax.legend(loc="upper right")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return
    image = np.full((size, size, 3), 255, np.uint8)
    for points, color in ((real, (31, 119, 180)), (fake, (255, 127, 14))):
        pixels = ((points + extent) / (2 * extent) * (size - 1)).round().astype(int)
        for col, row in pixels:
            row = size - 1 - row
            image[max(row - 1, 0):row + 2, max(col - 1, 0):col + 2] = color
    write_png(path, image)


def write_png(path, image):
    """Writes an RGB uint8 array `(height, width, 3)` as a PNG (no dependencies)."""
    height, width, _ = image.shape
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(height))

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", header))
        f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
        f.write(chunk(b"IEND", b""))


if __name__ == "__main__":
    main(*sys.argv[1:3])
