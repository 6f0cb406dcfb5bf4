"""CHANGELOG.md is in Keep a Changelog form; docs/versioning.md states the policy (issue 30).

https://keepachangelog.com/en/1.1.0/: `## [Unreleased]` first, then one
`## [X.Y.Z] - YYYY-MM-DD` section per release, newest first, each made of
`### Added/Changed/Deprecated/Removed/Fixed/Security` groups (in that order,
each at most once) of bullet entries, and a link definition per section.
"""

import re

import pytest

from conftest_docs import REPO
from conftest_docs import load_docs_module

pytestmark = pytest.mark.unit

GROUPS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
VERSION = re.compile(r"^## \[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d{2}-\d{2})$")


def check_changelog(text):
    """Raises AssertionError naming the first line that breaks the form."""
    lines = text.splitlines()
    assert lines[0] == "# Changelog", lines[0]
    headings = [i for i, line in enumerate(lines) if line.startswith("## ")]
    assert headings and lines[headings[0]] == "## [Unreleased]", "## [Unreleased] comes first"
    releases = []
    for start, end in zip(headings, headings[1:] + [len(lines)]):
        heading = lines[start]
        if start != headings[0]:
            match = VERSION.match(heading)
            assert match, f"not '## [X.Y.Z] - YYYY-MM-DD': {heading!r}"
            releases.append((tuple(int(n) for n in match.groups()[:3]), match.group(4)))
        name = heading[heading.index("[") + 1:heading.index("]")]
        assert re.search(rf"^\[{re.escape(name)}\]: https://", text, re.M), f"no link for {name}"
        seen, group = [], None
        for line in lines[start + 1:end]:
            if line.startswith("### "):
                group = line[4:]
                assert group in GROUPS, f"{heading}: unknown group {line!r}"
                assert group not in seen, f"{heading}: {group} twice"
                seen.append(group)
            elif line.startswith("[") and "]: https://" in line:
                continue  # the link definitions at the end
            elif line.strip():
                assert group is not None, f"{heading}: text outside a group: {line!r}"
                assert line.startswith("- ") or line.startswith("  "), (
                    f"{heading}, {group}: not a bullet entry: {line!r}")
        assert seen == sorted(seen, key=GROUPS.index), f"{heading}: groups out of order {seen}"
    assert releases == sorted(releases, reverse=True), "releases newest first"


def test_changelog_is_in_keep_a_changelog_form():
    check_changelog((REPO / "CHANGELOG.md").read_text("utf-8"))


@pytest.mark.parametrize("edit", [
    lambda t: t.replace("## [Unreleased]\n", "## Unreleased\n"),
    lambda t: t.replace("## [0.1.0] - 2026-11-22", "## [0.1.0]"),
    lambda t: t.replace("### Changed", "### Improved", 1),
    lambda t: t.replace("## [Unreleased]\n\n", "## [Unreleased]\n\nFifth round, in progress.\n\n"),
    lambda t: t.replace("### Fixed", "### Added", 1),
])
def test_a_changelog_out_of_form_is_rejected(edit):
    text = (REPO / "CHANGELOG.md").read_text("utf-8")
    assert edit(text) != text
    with pytest.raises(AssertionError):
        check_changelog(edit(text))


def test_versioning_policy_is_a_page_next_to_the_changelog():
    text = (REPO / "docs" / "versioning.md").read_text("utf-8")
    for phrase in ("Semantic Versioning", "keras_tapeops.__all__", "DeprecationWarning",
                   "**Deprecated**", "at least one minor release", "Saved files"):
        assert phrase in text, phrase
    hooks = load_docs_module("hooks")
    assert hooks.nav_rank("api/index.md") < hooks.nav_rank("versioning.md") < hooks.nav_rank(
        "changelog.md")
