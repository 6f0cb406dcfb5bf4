"""Draws the documentation's figures into docs/figures/ (`make figures`; issues 23, 30).

Each figure is what its example writes when it really trains: no `--quick`
(the examples' smoke-test mode), the settings the page describes. The
example writes the PNG and a JSON of the numbers it prints (`--json`), and
this script adds how the run was made (`run`: the command, its wall time,
the date). Both files are committed in docs/figures/, so `make docs` only
builds the site (`docs/hooks.py` shows each PNG on its page) and runs no
example; tests/test_figures.py checks that each JSON says what its page
claims (the tables that quote the numbers, the orderings the text states).

To add a figure, append one `Figure` to `FIGURES`: the docs page it belongs
to, the example's command line (`{out}` is replaced by the PNG's path, `{dir}`
by its folder, for an example that names its PNG itself, `{json}` by the
JSON's path), the PNG's name and a caption. The page shows it where it links
`figures/<name>`, or at its end. Then add its claims to tests/test_figures.py.

Usage: python docs/gen_figures.py [--only NAME ...] [--out DIR]
(default DIR: docs/figures; NAME: a PNG's name with or without `.png`.)
Every run retrains: together about 15-25 minutes on a 2-core CPU.
"""

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import resource
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "figures"


@dataclasses.dataclass(frozen=True)
class Figure:
    page: str          # docs page, e.g. "observability.md"
    command: tuple     # example and arguments; "{out}": the PNG, "{dir}": its folder, "{json}"
    name: str          # PNG file name, unique
    caption: str

    @property
    def script(self):
        return REPO / self.command[0]

    @property
    def json_name(self):
        """The numbers' file, beside the PNG: `<name>.json`."""
        return pathlib.Path(self.name).stem + ".json"

    @property
    def has_numbers(self):
        return "{json}" in self.command


FIGURES = [
    Figure(
        page="observability.md",
        command=("examples/gradient_norms.py", "{out}", "{json}"),
        name="gradient_norms.png",
        caption="Per-group gradient norms (before and after ClipByGlobalNorm) and update "
                "ratios at every training step, logged inside fit by "
                "kt.LogGradientNorm and kt.LogUpdateRatio (examples/gradient_norms.py).",
    ),
    Figure(
        page="penalties.md",
        command=("examples/wgan_gp.py", "{out}", "{json}"),
        name="wgan_gp_ring.png",
        caption="kt.WGANGP on a ring of 8 Gaussians: real samples and generated "
                "samples after 8 epochs (examples/wgan_gp.py).",
    ),
    Figure(
        page="multi_task.md",
        command=("examples/multi_task.py", "--out", "{out}", "--json", "{json}"),
        name="multi_task.png",
        caption="Summed losses vs PCGrad, MGDA and uncertainty weighting: toy trajectories "
                "(3000 steps) and per-task validation error over 30 epochs "
                "(examples/multi_task.py).",
    ),
    Figure(
        page="privacy.md",
        command=("examples/private_training.py", "--out", "{out}", "--json", "{json}"),
        name="private_training.png",
        caption="Test accuracy against the privacy budget epsilon, 20 epochs on 1400 digits; "
                "the dashed line is the same network trained without privacy "
                "(examples/private_training.py).",
    ),
    Figure(
        page="adversarial.md",
        command=("examples/adversarial_training.py", "--out", "{dir}", "--json", "{json}"),
        name="adversarial_examples.png",
        caption="Clean test digits and their PGD-20 versions against the standard and the "
                "PGD-7-trained model, 20 epochs each (examples/adversarial_training.py).",
    ),
    Figure(
        page="attribution.md",
        command=("examples/attribution.py", "--out", "{dir}", "--json", "{json}"),
        name="attribution.png",
        caption="Test digits and their saliency, integrated gradients and Grad-CAM maps "
                "for a CNN trained 30 epochs (examples/attribution.py).",
    ),
    Figure(
        page="meta_learning.md",
        command=("examples/maml_sinusoid.py", "--out", "{out}", "--json", "{json}"),
        name="maml_sinusoid.png",
        caption="MAML vs a pretrained network on a held-out sine task: before and after 1 "
                "and 10 SGD steps on K points (examples/maml_sinusoid.py).",
    ),
    Figure(
        page="physics_informed.md",
        command=("examples/pinn_burgers.py", "--out", "{out}", "--json", "{json}"),
        name="pinn_burgers.png",
        caption="A physics-informed network for Burgers' equation after Adam in fit and "
                "L-BFGS: prediction, Cole-Hopf reference and error (examples/pinn_burgers.py).",
    ),
]

# Figures not drawn yet by a full run (none now): their pages show no figure. To add one,
# put it here, run `make figures FIGURES=<name>`, move it into FIGURES, quote its JSON on
# the page (with a check in tests/test_figures.py) and commit the PNG and the JSON.
NOT_YET_DRAWN = [
]


def select(names, figures=None):
    """The figures named (`"maml_sinusoid"` or `"maml_sinusoid.png"`, also one not yet
    drawn); all of FIGURES for no names."""
    if not names:
        return list(FIGURES if figures is None else figures)
    figures = FIGURES + NOT_YET_DRAWN if figures is None else figures
    wanted = {n if n.endswith(".png") else n + ".png" for n in names}
    unknown = wanted - {f.name for f in figures}
    if unknown:
        raise SystemExit(f"no figure named {sorted(unknown)}; figures: "
                         f"{[f.name for f in figures]}")
    return [f for f in figures if f.name in wanted]


def generate(figures=FIGURES, out=DEFAULT_OUT, python=sys.executable, log=print):
    """Runs each figure's example, which writes its PNG (and JSON) into `out`.

    The JSON gets a `run` entry: the command (paths relative to the
    repository), the wall and CPU time in seconds, the date and the machine. Returns
    the paths of the PNGs. Raises RuntimeError naming the example if one
    fails or writes no PNG, or no JSON when its command has `{json}`.
    """
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for figure in figures:
        target, numbers = out / figure.name, out / figure.json_name
        for stale in (target, numbers):
            stale.unlink(missing_ok=True)  # a failed run must not leave the old files
        command = [python] + [str(a).replace("{out}", str(target)).replace("{dir}", str(out))
                              .replace("{json}", str(numbers)) for a in figure.command]
        command[1] = str(REPO / command[1])
        start, cpu_start = time.perf_counter(), _children_cpu()
        env = dict(os.environ, MPLBACKEND="Agg", TF_CPP_MIN_LOG_LEVEL="3")
        result = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True)
        seconds, cpu = time.perf_counter() - start, _children_cpu() - cpu_start
        missing = [p for p in (target, numbers if figure.has_numbers else None)
                   if p is not None and not p.exists()]
        if result.returncode != 0 or missing:
            raise RuntimeError(
                f"{figure.command[0]} did not write {', '.join(map(str, missing)) or target} "
                f"(exit {result.returncode}):\n" + result.stdout[-2000:] + result.stderr[-2000:]
            )
        if figure.has_numbers:
            data = json.loads(numbers.read_text("utf-8"))
            shown = [str(a).replace("{out}", _shown(target)).replace("{dir}", _shown(out))
                     .replace("{json}", _shown(numbers)) for a in figure.command]
            data["run"] = dict(
                command=" ".join(["python"] + shown),
                wall_seconds=round(seconds, 1),
                cpu_seconds=round(cpu, 1),  # wall time depends on what else runs; CPU less
                date=datetime.date.today().isoformat(),
                machine=f"{platform.machine()}, {os.cpu_count()} CPU cores",
            )
            numbers.write_text(json.dumps(data, indent=2) + "\n", "utf-8")
        log(f"{figure.name}: {figure.command[0]} ({seconds:.0f} s, CPU {cpu:.0f} s)")
        paths.append(target)
    return paths


def _children_cpu():
    """CPU seconds (user + system) of the finished child processes."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _shown(path):
    """`path` relative to the repository when it is inside it."""
    try:
        return str(pathlib.Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--only", nargs="+", default=(), metavar="NAME",
                        help="only these figures (PNG names, with or without .png)")
    args = parser.parse_args(argv)
    generate(select(args.only), out=args.out)


if __name__ == "__main__":
    main()
