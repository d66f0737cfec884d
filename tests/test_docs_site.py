"""The docs site's nav and links, checked without mkdocs: a new page cannot be forgotten.

CI builds the site with `mkdocs build --strict` (.ci/run), which also checks anchors; these tests
give the same answer for pages and links in a second, with no mkdocs installed.
"""
import glob
import os
import re

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")


def nav_pages(node):
    """Every page path a mkdocs nav names, in order (a nav is lists of {title: page or list})."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in nav_pages(value)]
    raise AssertionError(f"unexpected nav entry {node!r}")


def load_mkdocs():
    with open(os.path.join(REPO, "mkdocs.yml")) as f:
        return yaml.safe_load(f)


def docs_pages():
    return sorted(os.path.relpath(p, DOCS) for p in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))


def test_nav_lists_every_docs_page_and_only_existing_ones():
    config = load_mkdocs()
    assert config["docs_dir"] == "docs"
    nav = nav_pages(config["nav"])
    duplicates = sorted({p for p in nav if nav.count(p) > 1})
    assert not duplicates, f"pages listed twice in mkdocs.yml's nav: {duplicates}"
    missing_from_nav = sorted(set(docs_pages()) - set(nav))
    assert not missing_from_nav, f"docs pages not in mkdocs.yml's nav (add them): {missing_from_nav}"
    not_there = sorted(p for p in nav if not os.path.isfile(os.path.join(DOCS, p)))
    assert not not_there, f"mkdocs.yml's nav names pages that do not exist in docs/: {not_there}"
    assert nav[0] == "index.md", "the site opens on getting started (docs/index.md)"


def test_strict_build_refuses_every_doubtful_link():
    # mkdocs 1.6 only logs unrecognized links and missing anchors (level info) unless told to
    # warn; --strict fails on warnings alone.
    validation = load_mkdocs()["validation"]
    kinds = ("omitted_files", "not_found", "absolute_links", "unrecognized_links", "anchors")
    assert {k: validation.get(k) for k in kinds} == {k: "warn" for k in kinds}


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_docs_links_stay_inside_docs_and_name_existing_pages():
    bad = []
    for page in docs_pages():
        text = open(os.path.join(DOCS, page)).read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address, or an anchor on the same page (mkdocs checks those)
            path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
            if path.startswith("..") or not os.path.exists(os.path.join(DOCS, path)):
                bad.append(f"{page}: {target}")
    assert not bad, ("links that leave docs/ or name no file there (name a repository file in "
                     f"backticks instead): {bad}")


def test_ci_builds_the_site_strictly_with_the_dev_extras_mkdocs():
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    build = [line for line in ci.splitlines() if "mkdocs build" in line and not line.startswith("#")]
    assert len(build) == 1 and "--strict" in build[0], build
    # -q would silence the very warnings --strict counts: a broken link would pass.
    assert " -q" not in build[0] and "--quiet" not in build[0], build[0]
    setup = open(os.path.join(REPO, "setup.py")).read()
    # .ci/run installs what `grep -o 'mkdocs-material==[0-9.]*' setup.py` finds: one pin, exactly.
    assert len(re.findall(r"mkdocs-material==[0-9.]+", setup)) == 1, "setup.py's dev extra pins mkdocs-material once"
    assert "grep -o 'mkdocs-material==[0-9.]*' setup.py" in ci
