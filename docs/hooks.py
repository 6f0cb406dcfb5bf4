"""MkDocs hooks of the documentation site (issue 23; `hooks:` in mkdocs.yml).

- The home page is README.md (links into docs/ made site-relative; links to
  other repository files kept as their text); CHANGELOG.md is a page too
  (its links rewritten the same way).
- The API reference (`api/*.md`) is generated from `kt.__all__` by
  `docs/gen_api.py`, so a new export gets its entry without an edit.
- The figures of `docs/gen_figures.py` (PNGs written by the examples, with
  their numbers in a JSON beside each) are committed in docs/figures/ by
  `make figures`; the build runs no example and shows each PNG on its page
  (where the page links `figures/<name>`, else at its end). A missing PNG
  fails the build with the command to run.
- The navigation is in reading order (`nav_rank`): Home, Getting started,
  Concepts, one page per capability (`CAPABILITIES`, then any page not
  listed anywhere, by file name: a new page appears without editing this
  file), Recipes (From keras.io), Extending, Faults, the API reference,
  Versioning, the Changelog last.
- pytest-markdown-docs' fence options (`python notest`, `python continuation`)
  are dropped from the rendered code fences so they highlight as Python.
"""

import importlib.util
import pathlib
import re

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

DOCS = pathlib.Path(__file__).resolve().parent
REPO = DOCS.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_api = _load("gen_api")
gen_figures = _load("gen_figures")

_LINK = re.compile(r"\[([^\]]+)\]\((?!https?:|mailto:|#)([^)\s]+)\)")
_FENCE_OPTIONS = re.compile(r"^(\s*(?:```|~~~)+\s*(?:python|py|python3))[ \t]+[^\n`]*$", re.M)


def site_links(text, prefix):
    """Rewrites the links of a page written for the repository for the site.

    `prefix` is the page's folder seen from the repository root ("" for
    README.md, "../" seen from docs/): links into docs/ become site-relative,
    README.md and CHANGELOG.md become their pages, and links to any other
    repository file (examples/, bench/, ...) are kept as their text.
    """
    pages = {"README.md": "index.md", "CHANGELOG.md": "changelog.md"}

    def link(match):
        label, target = match.groups()
        path, _, anchor = target.partition("#")
        if prefix and not path.startswith(prefix):
            return match.group(0)  # a link inside docs/
        path = path[len(prefix):]
        if path.startswith("docs/"):
            path = path[len("docs/"):]
        elif path in pages:
            path = pages[path]
        else:
            return label  # a repository file outside the site
        return f"[{label}]({path}{'#' + anchor if anchor else ''})"

    return _LINK.sub(link, text)


def readme_as_home(text):
    """README.md rewritten for `index.md` inside the site."""
    return site_links(text, prefix="")


def figures_dir():
    """docs/figures: inside docs_dir, so mkdocs copies the PNGs (and JSONs) itself."""
    return gen_figures.DEFAULT_OUT


def on_files(files, config):
    files.append(File.generated(config, "index.md",
                                content=readme_as_home((REPO / "README.md").read_text("utf-8"))))
    files.append(File.generated(config, "changelog.md",
                                content=site_links((REPO / "CHANGELOG.md").read_text("utf-8"),
                                                   prefix="")))
    for path, content in gen_api.api_pages().items():
        files.append(File.generated(config, path, content=content))
    return files


# Reading order of the navigation. Pages before the capabilities, the
# capabilities in the README's order, pages after them; a docs/*.md page in
# none of these lists is a capability page placed after the listed ones.
BEFORE = ("index.md", "getting_started.md", "concepts.md")
CAPABILITIES = (
    "upgrade.md", "transforms.md", "terms.md", "penalties.md", "gan.md", "accumulation.md",
    "observability.md", "groups.md", "sam.md", "second_order.md", "multi_task.md",
    "privacy.md", "selection.md", "adversarial.md", "attribution.md", "meta_learning.md",
    "physics_informed.md", "distributed.md", "backends.md",
)
AFTER = (
    "recipes.md", "from_keras_io.md", "extending.md", "faults.md", "api/", "versioning.md",
    "changelog.md",
)


def nav_rank(src_uri):
    """Sort key of a navigation entry: its page's file (`api/` for the API section)."""
    if src_uri in BEFORE:
        return (0, BEFORE.index(src_uri), "")
    if src_uri in CAPABILITIES:
        return (1, CAPABILITIES.index(src_uri), "")
    for i, name in enumerate(AFTER):
        if src_uri == name or (name.endswith("/") and src_uri.startswith(name)):
            return (3, i, "")
    return (2, 0, src_uri)  # an unlisted page: a capability, by file name


def _entry_uri(item):
    if item.is_page:
        return item.file.src_uri
    if item.is_section:
        pages = [child for child in item.children if child.is_page]
        if pages:
            return pages[0].file.src_uri
    return ""


def _pages(items):
    for item in items:
        if item.is_page:
            yield item
        elif item.is_section:
            yield from _pages(item.children)


def on_nav(nav, config, files):
    for item in nav.items:
        if item.is_section and item.title.lower() == "api":
            item.title = "API reference"
    nav.items.sort(key=lambda item: nav_rank(_entry_uri(item)))
    # Previous/next links follow the new order.
    nav.pages = list(_pages(nav.items))
    for i, page in enumerate(nav.pages):
        page.previous_page = nav.pages[i - 1] if i > 0 else None
        page.next_page = nav.pages[i + 1] if i + 1 < len(nav.pages) else None
    return nav


def on_page_markdown(markdown, page, config, files):
    markdown = _FENCE_OPTIONS.sub(r"\1", markdown)
    if page.file.src_uri.count("/") == 0 and not page.file.generated_by:
        markdown = site_links(markdown, prefix="../")  # a docs/*.md page
    for figure in gen_figures.FIGURES:
        if page.file.src_uri != figure.page:
            continue
        link = f"figures/{figure.name}"
        if not (figures_dir() / figure.name).exists():
            raise PluginError(
                f"{figure.page} shows {figure.name}, which {figure.command[0]} has not "
                f"written to {figures_dir()}: run `make figures` (or `python "
                f"docs/gen_figures.py --only {figure.name}`) and commit the PNG and its JSON."
            )
        if link not in markdown:
            markdown += f"\n\n## Figure\n\n![{figure.caption}]({link})\n\n*{figure.caption}*\n"
    return markdown
