"""`make read`: the reading site (each lesson's doc beside its code), built and then read in a
real headless Chromium.

The site tests need no browser. The browser tests drive Chromium through its DevTools
protocol over a pipe (--remote-debugging-pipe), so they need no driver package: only the
`chromium` binary (Debian: `apt-get install chromium`). Without it they skip with that
reason, except under CI (the CI variable set), where they fail: CI must run them.
"""
from __future__ import annotations

import base64
import html.parser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from conftest import ROOT

SITE = ROOT / "runs" / "read"
SHOTS = SITE / "screenshots"
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
PY = sys.executable


def load_tool():
    spec = importlib.util.spec_from_file_location("read_site", ROOT / "tools" / "read_site.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["read_site"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


read_site = load_tool()
import lesson_diff  # noqa: E402 (tools/ is on the path now)


@pytest.fixture(scope="module")
def built():
    """`make read`, run once as a learner runs it; every test reads the site it wrote."""
    result = subprocess.run(["make", "--no-print-directory", "read"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result


# ----------------------------------------------------------------------------- the site

def test_make_read_prints_the_address_and_how_to_serve_it(built):
    out = built.stdout
    assert (SITE / "index.html").as_uri() in out
    assert ".venv/bin/python -m http.server --bind 127.0.0.1" in out
    assert "warning" not in built.stderr, built.stderr


def page_ids(path: Path, cache: dict = {}) -> set[str]:
    if path not in cache:
        cache[path] = set(re.findall(r'\b(?:id|name)="([^"]+)"', path.read_text()))
    return cache[path]


class Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.found += [v for k, v in attrs if k in ("href", "src") and v]


def broken_link(page: Path, href: str) -> str | None:
    """None if `href` on `page` resolves to an existing file (and anchor), else why not."""
    parts = urlsplit(href)
    if parts.scheme in ("http", "https", "mailto"):
        return None
    if parts.scheme == "file":
        target = Path(unquote(parts.path))
    else:
        target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
    if not target.exists():
        return f"{href} -> no file {target}"
    if parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in page_ids(target):
        return f"{href} -> no anchor #{parts.fragment} in {target.name}"
    return None


def test_every_link_of_every_page_resolves(built):
    pages = sorted(SITE.rglob("*.html"))
    assert len(pages) >= 2 * len(LESSONS) + 4
    broken = []
    for page in pages:
        parser = Links()
        parser.feed(page.read_text())
        broken += [f"{page.relative_to(SITE)}: {why}" for href in parser.found
                   if (why := broken_link(page, href))]
    assert not broken, "\n".join(broken[:20])


def test_glossary_links_land_on_the_glossary_page_with_the_meaning(built):
    text = (SITE / "05_ddp_spawn.html").read_text()
    term = re.search(r'<a href="glossary\.html#process" title="([^"]+)" class="term">', text)
    assert term and "rank" in term[1], "the glossary link of 'process / rank' is missing or has no title"
    assert 'id="process"' in (SITE / "glossary.html").read_text()


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_each_doc_step_is_one_row_with_its_code(built, lesson):
    code_steps = [int(n) for n in re.findall(r"^\s*# Step (\d+):", lesson.read_text(), re.M)]
    for lang, page in (("en", SITE / f"{lesson.stem}.html"), ("zh", SITE / "zh" / f"{lesson.stem}.html")):
        text = page.read_text()
        rows = re.findall(r'<section class="row step" id="step-(\d+)" data-step="\d+">'
                          r'<div class="doc">(.*?)</div><div class="code">(.*?)</div></section>', text, re.S)
        assert [int(n) for n, _, _ in rows] == code_steps, f"{lang}: the rows are not the code's steps"
        for n, doc, code in rows:
            assert re.search(rf"<h2[^>]*>(Step|步骤|第)\s*{n}\b", doc), f"{lang} row {n}: no doc heading"
            plain = re.sub(r"<[^>]+>", "", code)
            assert re.search(rf"# Step {n}:", plain), f"{lang} row {n}: the code is not Step {n}'s"
            other = [m for m in re.findall(r"# Step (\d+):", plain) if int(m) != int(n)]
            assert not other, f"{lang} row {n} also holds Step {other}"
        assert f'href="{"../" if lang == "zh" else "zh/"}{lesson.stem}.html"' in text, "no language switch"


def test_steps_split_the_whole_file(built):
    """Prologue, steps and epilogue together show every line of a lesson exactly once."""
    for lesson in read_site.find_lessons(ROOT):
        pieces = [lesson.prologue, *[lesson.ranges[n] for n, _ in lesson.steps], lesson.epilogue]
        assert pieces[0][0] == 0 and pieces[-1][1] == len(lesson.path.read_text().splitlines())
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), lesson.path.name


def test_index_is_the_course_from_teaching_md(built):
    text = (SITE / "index.html").read_text()
    teaching = (ROOT / "docs" / "TEACHING.md").read_text()
    for lesson in LESSONS:
        assert f'href="{lesson.stem}.html"' in text
        row = re.search(rf"^\| \[{lesson.name[:2]}\]\([^)]*\) \| [^|]+ \| ([^|]+) \|", teaching, re.M)
        if row:  # the class time comes from the teaching guide's table
            assert row[1].strip() in text, f"lesson {lesson.name[:2]}: {row[1].strip()} not on the index"
    positions = [text.index(f'href="{lesson.stem}.html"') for lesson in LESSONS]
    assert positions == sorted(positions), "the lessons are not in order"


def copy_repo_subset(dest: Path) -> None:
    """The least a build needs: tools, common, lesson 01 and its docs, the glossary, TEACHING."""
    for folder in ("tools", "common"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "lessons").mkdir()
    (dest / "docs" / "zh").mkdir(parents=True)
    shutil.copy(ROOT / "lessons" / "01_single_device.py", dest / "lessons")
    shutil.copy(ROOT / "docs" / "01_single_device.md", dest / "docs")
    shutil.copy(ROOT / "docs" / "zh" / "01_single_device.md", dest / "docs" / "zh")
    for name in ("GLOSSARY.md", "TEACHING.md"):
        shutil.copy(ROOT / "docs" / name, dest / "docs")


def test_a_child_lesson_links_its_parent_diff(tmp_path):
    copy_repo_subset(tmp_path)
    text = (tmp_path / "lessons" / "01_single_device.py").read_text()
    child = text.replace("Doc: docs/01_single_device.md",
                         "Parent: lesson 01 (lessons/01_single_device.py)\n\nDoc: docs/13_child.md", 1)
    child = child.replace("# Step 1:", "NEW_IDEA = 1  # the new idea\n    # Step 1:", 1)
    (tmp_path / "lessons" / "13_child.py").write_text(child)
    for doc in ("docs/01_single_device.md", "docs/zh/01_single_device.md"):
        shutil.copy(tmp_path / doc, tmp_path / doc.replace("01_single_device", "13_child"))
    site = read_site.build(tmp_path)
    page = (site.out / "13_child.html").read_text()
    assert 'href="13_child.diff.html"' in page and 'rel="prev" href="01_single_device.html"' in page
    diff = (site.out / "13_child.diff.html").read_text()
    assert re.search(r'<span class="line add">.*NEW_IDEA', diff)
    counts = re.search(r"(\d+) lines added, (\d+) removed", diff)
    changed = lesson_diff.changed_lines(tmp_path / "lessons" / "01_single_device.py", tmp_path / "lessons" / "13_child.py")
    assert "make diff TO=13" in diff and counts and int(counts[1]) + int(counts[2]) == changed == 5
    assert 'href="zh/13_child.diff.html"' in diff
    assert (site.out / "zh" / "13_child.diff.html").exists()


@pytest.mark.parametrize("change", ["doc", "code"])
def test_a_step_missing_on_one_side_stops_the_build_with_one_line(tmp_path, change):
    copy_repo_subset(tmp_path)
    out = tmp_path / "runs" / "read"
    subprocess.run([PY, "tools/read_site.py"], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    doc = tmp_path / "docs" / "01_single_device.md"
    lesson = tmp_path / "lessons" / "01_single_device.py"
    if change == "doc":  # the doc gains a step the code lacks
        doc.write_text(doc.read_text().replace("## What to look for", "## Step 7: Celebrate\n\nYes.\n\n"
                                               "## What to look for", 1))
    else:  # the code gains a step the doc lacks
        lesson.write_text(lesson.read_text().replace("\nif __name__", "\n    # Step 7: Celebrate\n"
                                                     "    pass\n\nif __name__", 1))
    result = subprocess.run([PY, "tools/read_site.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: lesson 01:"), result.stderr
    assert "Step 7 (Celebrate)" in lines[0]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before, "the old site was touched"
    assert not list(out.parent.glob(".read.*")), "a half-built site was left behind"
