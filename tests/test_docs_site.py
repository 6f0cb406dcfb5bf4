"""The documentation site builds in strict mode; its API reference names every public symbol (issue 23).

The build runs `python -m mkdocs build --strict` as `make docs` does, into a
temporary directory (about 20 s), with the figures committed in docs/figures/
(`make figures`; their numbers are checked by tests/test_figures.py); the
figure runner itself is tested on a small script.
"""

import html as html_module
import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest_docs import REPO
from conftest_docs import load_docs_module

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings_handlers.python")

gen_api = load_docs_module("gen_api")
gen_figures = load_docs_module("gen_figures")


def build(site, config=REPO / "mkdocs.yml"):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )


def test_site_builds_in_strict_mode_with_every_page_and_symbol(tmp_path):
    # One build (about 7 s), checked by the functions below.
    result = build(tmp_path / "site")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    site = tmp_path / "site"
    check_every_docs_page_is_built_and_in_the_navigation(site)
    check_navigation_is_in_reading_order(site)
    check_readme_is_the_home_page(site)
    check_api_reference_names_every_public_symbol(site)
    check_fence_options_are_not_rendered(site)
    check_figures_are_shown(site)


def check_every_docs_page_is_built_and_in_the_navigation(site):
    home = (site / "index.html").read_text("utf-8")
    pages = sorted((REPO / "docs").glob("*.md"))
    assert len(pages) >= 10
    for page in pages:
        html_name = page.stem + ".html"
        assert (site / html_name).exists(), html_name
        assert f'href="{html_name}"' in home, f"{html_name} is not in the navigation"
    assert 'href="api/index.html"' in home


def check_navigation_is_in_reading_order(site):
    # Home, Getting started, Concepts, the capabilities (any unlisted page after
    # them), Recipes, Extending, Faults, the API reference, the Changelog last;
    # previous/next links follow the same order.
    hooks = load_docs_module("hooks")
    home = (site / "index.html").read_text("utf-8")
    links = []
    for href in re.findall(r'<a href="([^"#]+)" class="md-nav__link', home):
        if href not in links:
            links.append(href)
    names = [link.replace(".html", ".md") for link in links]
    assert names[:3] == ["index.md", "getting_started.md", "concepts.md"], names
    assert names[-1] == "changelog.md", names
    assert names == sorted(names, key=hooks.nav_rank), names
    for page in (REPO / "docs").glob("*.md"):
        assert page.name in names, page.name
    concepts = (site / "concepts.html").read_text("utf-8")
    assert '<link rel="prev" href="getting_started.html"' in concepts
    assert '<link rel="next" href="upgrade.html"' in concepts


def check_readme_is_the_home_page(site):
    home = (site / "index.html").read_text("utf-8")
    assert "Quick start: upgrade an existing model" in home
    # README's links into docs/ point at the site's pages.
    assert 'href="transforms.html"' in home
    assert 'href="docs/' not in home


def check_api_reference_names_every_public_symbol(site):
    import keras_tapeops as kt

    symbols = dict(gen_api.public_symbols())
    expected = {f"keras_tapeops.{n}" for n in kt.__all__ if not isinstance(getattr(kt, n), type(kt))}
    expected |= {f"keras_tapeops.callbacks.{n}" for n in kt.callbacks.__all__}
    assert expected <= set(symbols)
    index = (site / "api" / "index.html").read_text("utf-8")
    for dotted in symbols:
        module = dotted.rsplit(".", 1)[0]
        page = site / gen_api.page_name(module).replace(".md", ".html")
        assert f'id="{dotted}"' in page.read_text("utf-8"), f"{dotted} has no entry in {page.name}"
        assert f'#{dotted}"' in index, f"{dotted} is not in the API index"
    # Docstrings are rendered: the Args section of one class, its example.
    clip = text_of((site / "api" / "kt.html").read_text("utf-8"))
    assert "clip_norm" in clip and 'gradient_transforms=[kt.ClipByNorm(1.0, where="head*")]' in clip


def text_of(html):
    return html_module.unescape(re.sub(r"<[^>]+>", "", html))


def check_fence_options_are_not_rendered(site):
    # `python continuation` / `python notest` fences render as highlighted code.
    for name in ("second_order", "distributed"):
        markdown = (REPO / "docs" / f"{name}.md").read_text("utf-8")
        html = (site / f"{name}.html").read_text("utf-8")
        fences = len(re.findall(r"^```(python|bash|text)?", markdown, re.M)) // 2
        assert html.count('<div class="highlight">') >= fences
        prose = re.sub(r"^```.*$", "", markdown, flags=re.M)
        for option in ("continuation", "notest"):
            assert (option in text_of(html)) == (option in prose), option


def check_figures_are_shown(site):
    # Each committed figure is copied into the site and shown on its page.
    for figure in gen_figures.FIGURES:
        assert (site / "figures" / figure.name).read_bytes().startswith(b"\x89PNG"), figure.name
        html = (site / figure.page.replace(".md", ".html")).read_text("utf-8")
        assert f'src="figures/{figure.name}"' in html, figure.name


def test_strict_build_fails_on_a_broken_link(tmp_path):
    # Companion: the same configuration over a copy of the pages, one of them
    # with a link to a page that does not exist.
    docs = tmp_path / "docs"
    docs.mkdir()
    for page in (REPO / "docs").glob("*.md"):
        (docs / page.name).write_text(page.read_text("utf-8"), "utf-8")
    (docs / "sam.md").write_text("# SAM\n\nSee [the guide](no_such_page.md).\n", "utf-8")
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text("utf-8"))
    config["docs_dir"] = str(docs)
    config["hooks"] = [str(REPO / "docs" / "hooks.py")]
    config["plugins"] = ["search"]  # the API pages' `:::` lines stay text: a faster build
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config), "utf-8")
    (docs / "figures").symlink_to(REPO / "docs" / "figures")
    result = build(tmp_path / "site", config=tmp_path / "mkdocs.yml")
    assert result.returncode != 0
    assert "no_such_page.md" in result.stdout + result.stderr


def test_figures_name_existing_pages_and_examples():
    names = [f.name for f in gen_figures.FIGURES]
    assert len(names) == len(set(names))
    for figure in gen_figures.FIGURES:
        assert (REPO / "docs" / figure.page).exists(), figure.page
        assert figure.script.exists(), figure.command[0]
        assert "{out}" in figure.command or "{dir}" in figure.command
        assert "{json}" in figure.command and "--quick" not in figure.command


PNG_WRITER = """
import struct, sys, zlib
def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
raw = b"".join(b"\\x00" + bytes([200, 30, 30]) * 4 for _ in range(4))
with open(sys.argv[1], "wb") as f:
    f.write(b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
"""
NUMBERS_WRITER = """
import json
json.dump({"error": 0.25}, open(sys.argv[3], "w"))
"""


def test_figure_runner_runs_the_example_and_adds_the_run_to_its_numbers(tmp_path):
    script = tmp_path / "draw.py"
    script.write_text(PNG_WRITER + NUMBERS_WRITER, "utf-8")
    figure = gen_figures.Figure("sam.md", (str(script), "{out}", "--json", "{json}"),
                                "draw.png", "A test figure.")
    out = tmp_path / "figures"
    logs = []
    [png] = gen_figures.generate([figure], out=out, log=logs.append)
    assert png == out / "draw.png" and png.read_bytes().startswith(b"\x89PNG")
    assert logs[-1].startswith("draw.png: ")
    numbers = json.loads((out / "draw.json").read_text("utf-8"))
    assert numbers["error"] == 0.25
    assert numbers["run"]["command"] == f"python {script} {out}/draw.png --json {out}/draw.json"
    assert numbers["run"]["wall_seconds"] >= 0 and numbers["run"]["cpu_seconds"] >= 0


def test_figure_runner_names_an_example_that_writes_no_png(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text("print('no figure')\n", "utf-8")
    figure = gen_figures.Figure("sam.md", (str(script), "{out}"), "none.png", "Missing.")
    with pytest.raises(RuntimeError, match="silent.py did not write"):
        gen_figures.generate([figure], out=tmp_path / "figures", log=lambda _: None)


def test_figure_runner_names_an_example_that_writes_no_numbers(tmp_path):
    script = tmp_path / "draw.py"
    script.write_text(PNG_WRITER, "utf-8")
    out = tmp_path / "figures"
    out.mkdir()
    (out / "draw.json").write_text('{"error": 0.1}', "utf-8")  # an old run's: removed first
    figure = gen_figures.Figure("sam.md", (str(script), "{out}", "{json}"), "draw.png", "D.")
    with pytest.raises(RuntimeError, match="draw.py did not write .*draw.json"):
        gen_figures.generate([figure], out=out, log=lambda _: None)
    assert not (out / "draw.json").exists()


def test_figure_runner_selects_figures_by_name():
    assert gen_figures.select([]) == gen_figures.FIGURES
    assert [f.name for f in gen_figures.select(["maml_sinusoid", "pinn_burgers.png"])] == [
        "maml_sinusoid.png", "pinn_burgers.png"]
    with pytest.raises(SystemExit, match="no figure named"):
        gen_figures.select(["nope"])


def test_version_in_one_place():
    import keras_tapeops as kt

    pyproject = (REPO / "pyproject.toml").read_text("utf-8")
    [declared] = re.findall(r'^version = "([^"]+)"$', pyproject, re.M)
    assert kt.__version__ == declared
    changelog = (REPO / "CHANGELOG.md").read_text("utf-8")
    assert f"## [{declared}]" in changelog or "## [Unreleased]" in changelog


def test_figure_runner_passes_the_folder_to_an_example_that_names_its_png(tmp_path):
    script = tmp_path / "draw_in.py"
    script.write_text(PNG_WRITER.replace("sys.argv[1]", "sys.argv[2] + '/fixed.png'"), "utf-8")
    figure = gen_figures.Figure("sam.md", (str(script), "--out", "{dir}"), "fixed.png", "Fixed.")
    [png] = gen_figures.generate([figure], out=tmp_path / "figures", log=lambda _: None)
    assert png.read_bytes().startswith(b"\x89PNG")
