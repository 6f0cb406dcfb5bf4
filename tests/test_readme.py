"""The README is the short front page; the rest lives in docs/ (issue 30).

It starts with the commands that work on a fresh machine (`make demo`,
`make test`), stays under 15 KB, links every capability page from its table,
names the install extras pyproject declares, the oldest supported pair and
the license, and carries no development history. The site's navigation
order (docs/hooks.py) is checked here without building the site.
"""

import re
import tomllib

import pytest

from conftest_docs import REPO

pytestmark = pytest.mark.unit

README = (REPO / "README.md").read_text("utf-8")
DOCS = REPO / "docs"

# Development history does not belong in user-facing text.
HISTORY = [
    r"\bissue\s+\d+", r"\bissue \d+'s\b", r"\b(first|second|third|fourth|fifth|this|next|previous|last) round\b",
    r"\bround \d+", r"target missed",
    r"development machine", r"shared machine", r"\blent\b", r"earlier runs?\b",
    r"\bredesign\b", r"no GPU was available",
]


def capability_table(text):
    """(label, target) of every link in the README's "## Capabilities" table."""
    section = text.split("## Capabilities", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert len(rows) > 2, "the Capabilities section has no table"
    return [link for row in rows[2:] for link in re.findall(r"\[([^\]]+)\]\(([^)]+)\)", row)]


def test_readme_is_at_most_15_kb():
    size = len(README.encode("utf-8"))
    assert size <= 15_000, f"README.md is {size} bytes; move detail into docs/"


def test_readme_starts_with_the_make_commands():
    lines = README.splitlines()
    assert lines[0].startswith("# ")
    body = [line for line in lines[1:] if line.strip()]
    assert body[0].startswith("```"), "the first thing after the title is the commands block"
    block = []
    for line in body[1:]:
        if line.startswith("```"):
            break
        block.append(line.split("#")[0].strip())
    assert block[:2] == ["make demo", "make test"], block


def test_capability_table_links_existing_docs_pages():
    links = capability_table(README)
    assert len(links) >= 15
    for label, target in links:
        assert target.startswith("docs/") and target.endswith(".md"), target
        assert (REPO / target).is_file(), f"{label} -> {target} does not exist"


def test_every_capability_page_is_in_the_table():
    hooks = load_hooks()
    linked = {pathlib_name(target) for _, target in capability_table(README)}
    not_capabilities = set(hooks.BEFORE) | set(hooks.AFTER)
    for page in sorted(DOCS.glob("*.md")):
        if page.name not in not_capabilities:
            assert page.name in linked, f"docs/{page.name} has no row in the README's table"
    # The site lists the capabilities in the table's order (a page that
    # docs/hooks.py does not list yet comes after them there).
    table = [pathlib_name(target) for _, target in capability_table(README)]
    assert [name for name in hooks.CAPABILITIES if (DOCS / name).exists()] == [
        name for name in table if name in hooks.CAPABILITIES
    ]


def pathlib_name(target):
    return target.rsplit("/", 1)[-1]


def test_readme_has_no_development_history():
    for name, text in (("README.md", README),
                       ("docs/getting_started.md", (DOCS / "getting_started.md").read_text("utf-8")),
                       ("docs/concepts.md", (DOCS / "concepts.md").read_text("utf-8"))):
        for pattern in HISTORY:
            match = re.search(pattern, text, re.I)
            assert match is None, f"{name}: {match.group(0)!r} is development history"


def test_history_check_catches_a_phrase():
    # Companion: the patterns find what they are meant to.
    for text in ("as issue 17 showed", "1.05x target missed", "the second round",
                 "on the shared machine"):
        assert any(re.search(p, text, re.I) for p in HISTORY), text
    for text in ("no host round trip", "medians of interleaved rounds"):
        assert not any(re.search(p, text, re.I) for p in HISTORY), text


def test_readme_install_names_every_declared_extra():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))
    assert "pip install keras-tapeops" in README
    for extra in pyproject["project"]["optional-dependencies"]:
        assert f'keras-tapeops[{extra}]' in README, f"the {extra!r} extra is not in the README"


def test_readme_names_the_oldest_pair_docs_and_license():
    assert "make test-oldest" in README
    assert "tensorflow==2.18.0" in README and "keras==3.10.0" in README
    assert "TensorFlow >= 2.18 and Keras >= 3.10" in README
    assert "make docs" in README and "docs/getting_started.md" in README
    assert "Apache-2.0" in README
    assert "class Net(kt.TapeOpsMixin, keras.Model)" in README
    assert "kt.upgrade(" in README


# ------------------------------------------------------------- navigation order
def load_hooks():
    pytest.importorskip("mkdocs")
    from conftest_docs import load_docs_module

    return load_docs_module("hooks")


def test_navigation_is_in_reading_order():
    hooks = load_hooks()
    pages = ["changelog.md", "api/index.md", "extending.md", "recipes.md", "zz_new.md",
             "distributed.md", "gan.md", "transforms.md", "upgrade.md", "concepts.md",
             "getting_started.md", "index.md", "faults.md", "aa_new.md", "from_keras_io.md",
             "versioning.md"]
    ordered = sorted(pages, key=hooks.nav_rank)
    assert ordered == [
        "index.md", "getting_started.md", "concepts.md",
        "upgrade.md", "transforms.md", "gan.md", "distributed.md",  # the capabilities
        "aa_new.md", "zz_new.md",  # unlisted pages: after the capabilities, by name
        "recipes.md", "from_keras_io.md", "extending.md", "faults.md", "api/index.md",
        "versioning.md", "changelog.md",
    ]


def test_every_docs_page_has_a_place_in_the_navigation():
    hooks = load_hooks()
    listed = set(hooks.BEFORE) | set(hooks.CAPABILITIES) | set(hooks.AFTER)
    for page in DOCS.glob("*.md"):
        rank = hooks.nav_rank(page.name)
        assert (page.name in listed) == (rank[0] != 2), page.name
    # Concepts come before every capability, the changelog last.
    ranks = sorted(hooks.nav_rank(p.name) for p in DOCS.glob("*.md"))
    assert ranks[0] < hooks.nav_rank("upgrade.md") < hooks.nav_rank("changelog.md")
    assert max(ranks + [hooks.nav_rank("api/kt.md")]) < hooks.nav_rank("changelog.md")
