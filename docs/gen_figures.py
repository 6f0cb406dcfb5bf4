"""Runs the examples that draw figures, for the documentation site (issue 23).

`make docs` runs this before `mkdocs build`; `docs/hooks.py` then puts each
PNG on its page. Nothing here is drawn by hand and no PNG is committed: every
figure is what its example writes.

To add a figure, append one `Figure` to `FIGURES`: the docs page it belongs
to, the example's command line (`{out}` is replaced by the PNG's path, `{dir}`
by its folder, for an example that names its PNG itself), the PNG's name and
a caption. The page shows it at its end, or where the page already links
`figures/<name>`.

Examples with a `--quick` mode run in it, which keeps `make docs` short. Some
quick figures show little (a barely trained model): `python
docs/gen_figures.py --full` runs every example without `--quick` (minutes),
and a later `make docs` keeps those PNGs.

Usage: python docs/gen_figures.py [--out DIR] [--force] [--full]
(default DIR: build/docs-figures; a PNG newer than its example is kept.)
"""

import argparse
import dataclasses
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "build" / "docs-figures"


@dataclasses.dataclass(frozen=True)
class Figure:
    page: str          # docs page, e.g. "observability.md"
    command: tuple     # example and arguments; "{out}": the PNG path, "{dir}": its folder
    name: str          # PNG file name, unique
    caption: str

    @property
    def script(self):
        return REPO / self.command[0]


FIGURES = [
    Figure(
        page="observability.md",
        command=("examples/gradient_norms.py", "{out}"),
        name="gradient_norms.png",
        caption="Per-group gradient norms (before and after ClipByGlobalNorm) and update "
                "ratios at every training step, logged inside fit by "
                "kt.LogGradientNorm and kt.LogUpdateRatio (examples/gradient_norms.py).",
    ),
    Figure(
        page="penalties.md",
        command=("examples/wgan_gp.py", "{out}"),
        name="wgan_gp_ring.png",
        caption="kt.WGANGP on a ring of 8 Gaussians: real samples and generated "
                "samples after training (examples/wgan_gp.py).",
    ),
    Figure(
        page="multi_task.md",
        command=("examples/multi_task.py", "--quick", "--out", "{out}"),
        name="multi_task.png",
        caption="Summed losses vs PCGrad, MGDA and uncertainty weighting "
                "(examples/multi_task.py --quick).",
    ),
    Figure(
        page="privacy.md",
        command=("examples/private_training.py", "--quick", "--out", "{out}"),
        name="private_training.png",
        caption="Accuracy against the privacy budget epsilon "
                "(examples/private_training.py --quick).",
    ),
    Figure(
        page="adversarial.md",
        command=("examples/adversarial_training.py", "--quick", "--out", "{dir}"),
        name="adversarial_examples.png",
        caption="Clean digits and their PGD versions (examples/adversarial_training.py --quick).",
    ),
    Figure(
        page="attribution.md",
        command=("examples/attribution.py", "--quick", "--out", "{dir}"),
        name="attribution.png",
        caption="Inputs and their saliency, integrated gradients and Grad-CAM maps "
                "(examples/attribution.py --quick).",
    ),
    Figure(
        page="meta_learning.md",
        command=("examples/maml_sinusoid.py", "--quick", "--out", "{out}"),
        name="maml_sinusoid.png",
        caption="MAML on sine regression: predictions after adaptation "
                "(examples/maml_sinusoid.py --quick).",
    ),
    Figure(
        page="physics_informed.md",
        command=("examples/pinn_burgers.py", "--quick", "--out", "{out}"),
        name="pinn_burgers.png",
        caption="A physics-informed network for Burgers' equation: prediction, "
                "reference and error (examples/pinn_burgers.py --quick).",
    ),
]


def generate(figures=FIGURES, out=DEFAULT_OUT, force=False, python=sys.executable, log=print,
             full=False):
    """Runs each figure's example unless its PNG is newer than the script.

    `full=True` drops the examples' `--quick` flag (and runs every one).

    Returns the paths of the PNGs. Raises RuntimeError naming the example if
    one fails or writes no PNG.
    """
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for figure in figures:
        target = out / figure.name
        if (not (force or full) and target.exists()
                and target.stat().st_mtime >= figure.script.stat().st_mtime):
            log(f"{figure.name}: up to date")
            paths.append(target)
            continue
        command = [python] + [str(a).replace("{out}", str(target)).replace("{dir}", str(out))
                              for a in figure.command if not (full and a == "--quick")]
        command[1] = str(REPO / command[1])
        start = time.perf_counter()
        env = dict(os.environ, MPLBACKEND="Agg", TF_CPP_MIN_LOG_LEVEL="3")
        result = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True)
        if result.returncode != 0 or not target.exists():
            raise RuntimeError(
                f"{figure.command[0]} did not write {target} (exit {result.returncode}):\n"
                + result.stdout[-2000:] + result.stderr[-2000:]
            )
        log(f"{figure.name}: {figure.command[0]} ({time.perf_counter() - start:.0f} s)")
        paths.append(target)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--force", action="store_true", help="run every example again")
    parser.add_argument("--full", action="store_true", help="without the examples' --quick")
    args = parser.parse_args(argv)
    generate(out=args.out, force=args.force, full=args.full)


if __name__ == "__main__":
    main()
