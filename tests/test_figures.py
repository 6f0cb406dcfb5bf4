"""The documentation's figures say what their pages claim (issue 30).

Each figure of `docs/gen_figures.py` is committed in docs/figures/ by `make
figures` (its example run as the page describes, not `--quick`), with a JSON
of the numbers beside it. For every figure: the PNG and the JSON exist, the
page shows the figure, the numbers the page quotes are the JSON's (rounded as
shown), and the claims the page makes hold for them (the non-private
accuracy at least every private one, the fitted models' errors below the
threshold the page states, ...). The last tests show that the same checks
reject a tampered copy of a JSON.

Reading a JSON and a page takes milliseconds: the unit tier.
"""

import copy
import json
import re

import pytest

from conftest_docs import REPO
from conftest_docs import load_docs_module

pytestmark = pytest.mark.unit

gen_figures = load_docs_module("gen_figures")
FIGURES = {f.name: f for f in gen_figures.FIGURES}
FIGURES_DIR = REPO / "docs" / "figures"


def numbers(name):
    return json.loads((FIGURES_DIR / FIGURES[name].json_name).read_text("utf-8"))


def page(name):
    return (REPO / "docs" / FIGURES[name].page).read_text("utf-8")


def table(text, header):
    """The rows (lists of cell strings) of the Markdown table whose header starts with `header`."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("| " + header)]
    assert len(starts) == 1, f"{len(starts)} tables start with {header!r}"
    rows = []
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("**", "") for cell in line.strip().strip("|").split("|")])
    return rows


def prose(text):
    """The page with line breaks and repeated spaces folded, for phrases that wrap."""
    return re.sub(r"\s+", " ", text)


def fixed(value, digits):
    return f"{value:.{digits}f}"


# ------------------------------------------------------------------ the claims, one function each
def check_private_training(data, text):
    private, public = data["private"], data["non_private"]
    assert not data["quick"] and data["epochs"] == 20 and data["train_images"] == 1400, data
    accuracies = [run["test_accuracy"] for run in private]
    # The claims of the page: the non-private run is the ceiling, accuracy rises with epsilon,
    # and no run spends more than its target.
    assert public["test_accuracy"] >= max(accuracies), (public, accuracies)
    assert accuracies == sorted(accuracies), accuracies
    for run in private:
        assert run["spent_epsilon"] <= run["target_epsilon"], run
    rows = table(text, "target epsilon (delta 1e-5)")
    expected = [[f"{run['target_epsilon']:g}", fixed(run["noise_multiplier"], 2),
                 fixed(run["spent_epsilon"], 2), fixed(run["test_accuracy"], 2)]
                for run in private]
    expected.append(["none (plain SGD)", "-", "-", fixed(public["test_accuracy"], 2)])
    assert rows == expected
    summary = (f"test accuracy {' / '.join(fixed(a, 2) for a in accuracies)} at epsilon "
               f"{' / '.join(fixed(run['spent_epsilon'], 2) for run in private)} (delta 1e-5) "
               f"vs {fixed(public['test_accuracy'], 2)} non-private")
    assert summary in prose(text), summary


def check_maml_sinusoid(data, text):
    assert not data["quick"] and data["meta_steps"] == 6000 and data["test_tasks"] == 500, data
    results = {(r["model"], r["shots"]): r for r in data["query_mse"]}
    rows = table(text, "model | K |")
    assert rows == [[model, str(shots)] + [fixed(results[model, shots][f"steps_{k}"], 2)
                                           for k in (0, 1, 10)]
                    for model, shots in (("MAML", 5), ("pretrained", 5), ("MAML", 10),
                                         ("pretrained", 10))]
    # The fit the page states: MAML's query MSE after 10 steps below its threshold, and
    # MAML after one step better than the pretrained network after ten (the paper's result).
    [threshold] = re.findall(r"after 10 steps is below ([\d.]+) for both K", prose(text))
    for shots in (5, 10):
        maml, pretrained = results["MAML", shots], results["pretrained", shots]
        assert maml["steps_10"] < float(threshold), (maml, threshold)
        assert maml["steps_1"] < pretrained["steps_10"], (maml, pretrained)
    m5, p5, m10, p10 = (results[k] for k in (("MAML", 5), ("pretrained", 5), ("MAML", 10),
                                             ("pretrained", 10)))
    summary = (f"K=10: MAML {fixed(m10['steps_1'], 2)} / {fixed(m10['steps_10'], 2)}, pretrained "
               f"{fixed(p10['steps_1'], 2)} / {fixed(p10['steps_10'], 2)} (K=5: "
               f"{fixed(m5['steps_1'], 2)} / {fixed(m5['steps_10'], 2)} vs "
               f"{fixed(p5['steps_1'], 2)} / {fixed(p5['steps_10'], 2)})")
    assert summary in prose(text), summary


def check_pinn_burgers(data, text):
    assert not data["quick"] and (data["width"], data["depth"]) == (20, 8), data
    assert (data["adam_steps"], data["lbfgs_iterations"]) == (500, 2000), data
    [target] = re.findall(r"relative L2 error below the (\de-\d) target", prose(text))
    assert data["error"] < float(target), (data["error"], target)
    # The table of the run: the error after Adam, at every 250 L-BFGS iterations, at the end.
    rows = table(text, "`python examples/pinn_burgers.py`")
    expected = [["after 500 Adam steps in `fit`", f"{data['adam_error']:.1e}",
                 f"{data['adam_seconds']:.0f} s"]]
    for step in data["lbfgs_progress"]:
        if step["iteration"] < data["lbfgs_done"]:
            expected.append([f"+ {step['iteration']} L-BFGS iterations", f"{step['error']:.1e}",
                             f"{step['seconds']:.0f} s"])
    expected.append([f"+ {data['lbfgs_done']} L-BFGS iterations (the end; "
                     f"{data['evaluations']} evaluations)", f"{data['error']:.1e}",
                     f"{data['seconds']:.0f} s (CPU {data['cpu_seconds']:.0f} s)"])
    assert rows == expected
    summary = f"to a relative L2 error of {data['error']:.1e} against the exact Cole-Hopf"
    assert summary in prose(text), summary


def check_adversarial_examples(data, text):
    assert not data["quick"] and data["epochs"] == 20 and data["train_images"] == 1400, data
    runs = {r["training"]: r for r in data["runs"]}
    # The page's claims: adversarial training keeps the clean accuracy within a point and
    # raises the PGD-20 accuracy well above standard training's.
    standard = runs["standard"]
    for label in ("FGSM-RS", "PGD-7", "TRADES"):
        assert runs[label]["robust_accuracy"] > standard["robust_accuracy"] + 0.2, runs
        assert runs[label]["clean_accuracy"] >= standard["clean_accuracy"] - 0.01, runs
    labels = {"standard": "standard", "FGSM-RS": "FGSM-RS (`AdversarialLoss(FGSM)`)",
              "PGD-7": "PGD-7 (`AdversarialLoss(PGD(steps=7))`)",
              "TRADES": "TRADES (`TRADES(PGD(steps=7), beta=6)`)"}
    short = {"standard": "standard", "FGSM-RS": "FGSM-RS", "PGD-7": "PGD-7",
             "TRADES": "TRADES (beta 6)"}
    for header, names, digits in (("training | clean accuracy", labels, 4),
                                  ("training | clean |", short, 3)):
        assert table(text, header) == [
            [names[label], fixed(run["clean_accuracy"], digits),
             fixed(run["robust_accuracy"], digits)]
            for label, run in runs.items()]


def check_attribution(data, text):
    assert not data["quick"] and data["epochs"] == 30, data
    [accuracy, error] = re.findall(
        r"test accuracy ([\d.]+); the completeness error of Integrated Gradients is "
        r"([\d.]+)% at most", prose(text))[0]
    assert fixed(data["test_accuracy"], 3) == accuracy
    assert fixed(100 * data["ig_completeness_max_relative_error"], 1) == error
    assert data["test_accuracy"] >= 0.8  # a trained model (chance: 0.1), as the page says
    assert data["predicted"] == data["labels"]  # the page: every digit shown is classified right


def check_wgan_gp_ring(data, text):
    before, after = fixed(data["distance_before"], 2), fixed(data["distance_after"], 2)
    assert f"drops from {before} to {after} in {data['epochs']} epochs" in prose(text)
    assert data["distance_after"] < data["distance_before"] / 5, data


def check_gradient_norms(data, text):
    assert data["per_step_reproduces_epoch_means"], data
    assert 0 < data["clipped_steps"] < data["steps"], data
    claim = (f"{data['clipped_steps']} of its {data['steps']} steps are clipped, and the "
             f"training accuracy ends at {fixed(data['final_accuracy'], 3)}")
    assert claim in prose(text), claim


def check_multi_task(data, text):
    assert not data["quick"] and (data["toy_steps"], data["epochs"]) == (3000, 30), data
    [block] = re.findall(r"```text\n(Part 1: .*?)```", text, re.S)
    for run in data["toy"]:
        cells = "".join(f"  {'f=(%6.2f,%6.2f)' % tuple(f):<20}" for f in run["final"])
        assert f"{run['method']:<14}{cells}".rstrip() in block, run
    for run in data["model"]:
        cosine = run["cosine"] if run["cosine"] is not None else float("nan")
        line = (f"{run['method']:<12} {run['val_a']:11.3f} {run['val_b']:11.3f} "
                f"{run['weight_a']:9.3f} {run['weight_b']:9.3f} {cosine:9.3f} "
                f"{run['seconds_per_epoch']:8.3f}")
        assert line in block, line
    model = {run["method"]: run for run in data["model"]}
    # The page's reading: uncertainty weighting is the best on both tasks.
    for task in ("val_a", "val_b"):
        assert model["uncertainty"][task] <= min(run[task] for run in data["model"]), task


CHECKS = {
    "private_training.png": check_private_training,
    "maml_sinusoid.png": check_maml_sinusoid,
    "pinn_burgers.png": check_pinn_burgers,
    "adversarial_examples.png": check_adversarial_examples,
    "attribution.png": check_attribution,
    "wgan_gp_ring.png": check_wgan_gp_ring,
    "gradient_norms.png": check_gradient_norms,
    "multi_task.png": check_multi_task,
}


# ------------------------------------------------------------------ the tests
def test_every_figure_has_a_check_and_writes_numbers():
    assert set(FIGURES) <= set(CHECKS)
    for figure in FIGURES.values():
        assert figure.has_numbers, figure.name
        assert "--quick" not in figure.command, figure.name  # figures come from real training


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_figure_is_committed_and_shown_on_its_page(name):
    png = FIGURES_DIR / name
    assert png.read_bytes().startswith(b"\x89PNG"), png
    assert png.stat().st_size < 300_000, "keep the committed PNGs small (dpi ~80-100)"
    data = numbers(name)
    assert data["run"]["command"].startswith("python " + FIGURES[name].command[0]), data["run"]
    assert "--quick" not in data["run"]["command"]
    assert f"](figures/{name})" in page(name), f"{FIGURES[name].page} does not show {name}"


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_figure_numbers_are_what_the_page_says(name):
    CHECKS[name](numbers(name), page(name))


# ------------------------------------------------------------------ the checks can fail
def tampered(name, edit):
    data = copy.deepcopy(numbers(name))
    edit(data)
    return data


def test_a_private_run_above_the_non_private_one_is_rejected():
    def edit(data):
        data["non_private"]["test_accuracy"] = data["private"][-1]["test_accuracy"] - 0.01

    with pytest.raises(AssertionError):
        check_private_training(tampered("private_training.png", edit),
                               page("private_training.png"))


def test_a_table_that_disagrees_with_the_numbers_is_rejected():
    def edit(data):
        data["private"][1]["test_accuracy"] += 0.05  # still in order, but not what the page says

    with pytest.raises(AssertionError):
        check_private_training(tampered("private_training.png", edit),
                               page("private_training.png"))
    text = page("adversarial_examples.png").replace("| standard | ", "| standard | 0", 1)
    with pytest.raises(AssertionError):
        check_adversarial_examples(numbers("adversarial_examples.png"), text)


def test_an_unfitted_model_is_rejected():
    def unfit_maml(data):
        for row in data["query_mse"]:
            row["steps_10"] = row["steps_0"]  # adaptation does nothing (the --quick figure)

    def unfit_pinn(data):
        data["error"] = 0.44

    with pytest.raises(AssertionError):
        check_maml_sinusoid(tampered("maml_sinusoid.png", unfit_maml), page("maml_sinusoid.png"))
    if "pinn_burgers.png" in FIGURES:
        with pytest.raises(AssertionError):
            check_pinn_burgers(tampered("pinn_burgers.png", unfit_pinn), page("pinn_burgers.png"))


def test_a_quick_run_is_rejected():
    for name in sorted({"private_training.png", "maml_sinusoid.png", "pinn_burgers.png"}
                       & set(FIGURES)):
        with pytest.raises(AssertionError):
            CHECKS[name](tampered(name, lambda data: data.update(quick=True)), page(name))
