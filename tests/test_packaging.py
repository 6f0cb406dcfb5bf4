"""The package as users get it: the sdist and the wheel build, pass `twine check`,
carry LICENSE and py.typed, and the installed wheel runs the quickstart with only
its declared dependencies; the package passes `make lint`'s ruff check and format check.

The slow test installs the wheel into a fresh venv (no system site-packages, no
keras_tapeops on its path) without downloading anything: the declared
dependencies (tensorflow, keras, numpy) and everything they require, and
nothing else, are linked from this interpreter's environment into one folder
that the new venv sees through a `.pth` file. pip then installs the wheel
offline (`--no-index`), finding the dependencies satisfied there, so a module
the package imports that no declared dependency provides fails the quickstart.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What a fresh checkout holds; copied so the build writes nothing into the tree.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
    ".ruff_cache", ".mypy_cache", "*.keras", "logs", "out",
)


def _has(module):
    return importlib.util.find_spec(module) is not None


def _run(args, **kwargs):
    out = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, f"{args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


# ------------------------------------------------------------------ unit tier


@pytest.mark.unit
def test_ruff_check_passes_on_the_package():
    if not _has("ruff"):
        pytest.skip("ruff is not installed (it comes with the `test` extra)")
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "keras_tapeops"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]


@pytest.mark.unit
def test_ruff_format_check_passes_on_the_package():
    """`make lint` enforces the formatter too (issue 30: lint and format)."""
    if not _has("ruff"):
        pytest.skip("ruff is not installed (it comes with the `test` extra)")
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "keras_tapeops"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]


@pytest.mark.unit
def test_metadata_declares_license_typing_and_urls():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    assert (ROOT / "keras_tapeops" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["keras_tapeops"]
    assert {"Homepage", "Documentation", "Changelog"} <= set(project["urls"])
    classifiers = project["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    # PEP 639: setuptools refuses a License classifier next to the SPDX expression.
    assert not [c for c in classifiers if c.startswith("License ::")]
    if _has("trove_classifiers"):
        from trove_classifiers import classifiers as known

        assert set(classifiers) <= known, set(classifiers) - known
    # `make test` runs `make lint`, whose tools the test extra installs.
    test_extra = " ".join(project["optional-dependencies"]["test"])
    for tool in ("ruff", "mypy", "build", "twine"):
        assert re.search(rf"\b{tool}\b", test_extra), tool
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: .*\blint\b", makefile, re.M)


# Every public signature's annotations: tests/test_public_annotations.py.


# ------------------------------------------------------------------ slow tier


def _dependency_closure(requirements):
    """The installed distributions `requirements` need, recursively (no extras)."""
    from packaging.requirements import Requirement

    seen, todo = {}, [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in seen:
            continue
        dist = metadata.distribution(req.name)  # PackageNotFoundError: not installed here
        assert req.specifier.contains(dist.version, prereleases=True), (req, dist.version)
        seen[key] = dist
        todo.extend(Requirement(r) for r in dist.requires or [])
    return seen


def _link_dependencies(dists, folder):
    """Links each distribution's top-level files (modules, packages, dist-info) into `folder`."""
    folder.mkdir()
    for dist in dists.values():
        site = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or ()} - {".."}
        if not tops:  # no RECORD
            tops = set((dist.read_text("top_level.txt") or "").split())
            tops.add(Path(dist._path).name)  # the .dist-info folder itself
        for top in tops:
            source, target = site / top, folder / top
            if source.exists() and not target.exists() and not top.endswith(".pth"):
                target.symlink_to(source)


@pytest.mark.slow
def test_sdist_and_wheel_build_check_and_the_installed_wheel_runs_the_quickstart(tmp_path):
    for module in ("build", "twine", "packaging"):
        if not _has(module):
            pytest.skip(f"{module} is not installed (it comes with the `test` extra)")
    started = time.monotonic()
    source, dist = tmp_path / "source", tmp_path / "dist"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)

    # 1. Build. Offline with the installed setuptools when it is recent enough
    # (the test extra pins it); else in build's isolated env (downloads it).
    build = [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist)]
    setuptools_major = int(metadata.version("setuptools").split(".")[0]) if _has("setuptools") else 0
    if setuptools_major >= 77:
        build.append("--no-isolation")
    _run(build + [str(source)], timeout=300)
    (wheel,) = dist.glob("keras_tapeops-*.whl")
    (sdist,) = dist.glob("keras_tapeops-*.tar.gz")

    # 2. twine check (README rendering, metadata).
    _run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)], timeout=120)

    # 3. Contents.
    names = zipfile.ZipFile(wheel).namelist()
    assert "keras_tapeops/py.typed" in names
    assert [n for n in names if re.fullmatch(r"keras_tapeops-[^/]+\.dist-info/licenses/LICENSE", n)]
    assert not [n for n in names if n.startswith(("tests/", "examples/", "docs/"))]
    wheel_metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))
    ).decode()
    assert "License-Expression: Apache-2.0" in wheel_metadata
    assert "Classifier: Typing :: Typed" in wheel_metadata
    members = {m.split("/", 1)[-1] for m in tarfile.open(sdist).getnames()}
    assert {"LICENSE", "keras_tapeops/py.typed", "pyproject.toml", "tests/conftest.py",
            "examples/quickstart.py"} <= members

    # 4. A fresh venv that sees the declared dependencies and nothing else of ours.
    deps = _dependency_closure(PYPROJECT["project"]["dependencies"])
    assert "keras-tapeops" not in deps
    _link_dependencies(deps, tmp_path / "deps")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site_packages = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site_packages / "_declared_dependencies.pth").write_text(str(tmp_path / "deps") + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    # This interpreter's pip installs into the new venv (`--python`), offline:
    # the dependencies must already be satisfied there.
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
          "--no-cache-dir", "--disable-pip-version-check", str(wheel)],
         env=env, timeout=300)

    # 5. The installed wheel is what imports, from outside the repository.
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    where = _run([str(python), "-c", "import keras_tapeops as kt; print(kt.__file__); print(kt.__version__)"],
                 cwd=run_dir, env=env, timeout=300).split()
    assert Path(where[0]).is_relative_to(site_packages), where
    assert where[1] == PYPROJECT["project"]["version"]
    for undeclared in ("keras_hub", "matplotlib", "pytest"):  # here, not declared
        if _has(undeclared):
            hidden = subprocess.run([str(python), "-c", f"import {undeclared}"], cwd=run_dir,
                                    env=env, capture_output=True, timeout=120)
            assert hidden.returncode != 0, f"the venv sees {undeclared}"
    shutil.copy(ROOT / "examples" / "quickstart.py", run_dir)
    out = _run([str(python), "quickstart.py"], cwd=run_dir, env=env, timeout=300)
    assert "same final weights as stock: True; same val_loss: True" in out
    assert "loss_terms=['sparsity']" in out
    print(f"packaging test: {time.monotonic() - started:.0f} s")
