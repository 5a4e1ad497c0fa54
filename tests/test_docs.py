"""Every lesson has its doc, and the doc's step headings are the code's steps."""
import re

import pytest

from conftest import ROOT

LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def code_steps(path):
    return re.findall(r"^\s*# Step (\d+): (.+?)\s*$", path.read_text(), re.M)


def doc_steps(path):
    return re.findall(r"^## Step (\d+): (.+?)\s*$", path.read_text(), re.M)


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_doc_exists_and_steps_match(lesson):
    doc = ROOT / "docs" / f"{lesson.stem}.md"
    assert doc.exists(), f"{lesson.name} has no docs/{lesson.stem}.md"
    steps = code_steps(lesson)
    assert steps, f"{lesson.name} marks no '# Step N: title'"
    assert [int(n) for n, _ in steps] == list(range(1, len(steps) + 1))
    assert doc_steps(doc) == steps
    # and the code prints the same headings at run time
    for n, title in steps:
        assert f'step({n}, "{title}")' in lesson.read_text(), f"step {n} is not printed as '{title}'"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_docstring_names_its_doc_and_make_target(lesson):
    text = lesson.read_text()
    assert text.startswith('"""Lesson ' + lesson.name[:2] + ":")
    assert f"docs/{lesson.stem}.md" in text
    assert f"make lesson-{lesson.name[:2]}" in text


def test_readme_gives_the_two_commands_and_every_lesson():
    readme = (ROOT / "README.md").read_text()
    assert "make lesson-01" in readme and "make test" in readme
    for lesson in LESSONS:
        assert f"lessons/{lesson.name}" in readme or f"| {lesson.name[:2]} " in readme


def test_every_glossary_term_is_linked_from_the_lesson_that_introduces_it():
    glossary = (ROOT / "docs" / "GLOSSARY.md").read_text()
    rows = re.findall(r'^\| <a id="([\w-]+)"></a>\*\*.+?\*\* \| .*\| \[(\d\d)\]\((\S+?)\)', glossary, re.M)
    assert len(rows) >= 30
    for anchor, lesson, target in rows:
        doc = ROOT / "docs" / target
        assert doc.name.startswith(lesson) and doc.exists(), target
        assert f"GLOSSARY.md#{anchor}" in doc.read_text(), f"{doc.name} does not link the term #{anchor}"


DOC_PAGES = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "zh").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


@pytest.mark.parametrize("doc", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_relative_links_reach_a_file(doc):
    """A link to a repo file from docs/zh/ needs one more ../ than from docs/: checked here."""
    broken = [target for target in LINK.findall(doc.read_text())
              if "://" not in target and not target.startswith("mailto:")
              and not (doc.parent / target).exists()]
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"


def words_to_the_last_step(text: str) -> int:
    """Words from the top of a doc to the end of its last `## Step N` section, code and output
    blocks included (a learner reads those too); what comes after, under "Going further", is
    not counted. The same count as the style guide's check."""
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("## ")]
    steps = [i for i in heads if re.match(r"## Step \d+", lines[i])]
    if not steps:
        return 0
    end = next((i for i in heads if i > steps[-1]), len(lines))
    return len(" ".join(lines[:end]).split())


def test_word_count_stops_at_going_further():
    text = "# T\nintro words\n## Step 1: a\none two\n```bash\ncounted too\n```\n## Going further\nx y z\n"
    assert words_to_the_last_step(text) == 14  # "# T intro words ## Step 1: a one two ```bash counted too ```"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_doc_reads_in_a_class_at_most_3000_words_to_its_last_step(lesson):
    n = words_to_the_last_step((ROOT / "docs" / f"{lesson.stem}.md").read_text())
    assert n <= 3000, (f"docs/{lesson.stem}.md has {n} words to the end of its last step; "
                       f"move deeper material after the steps, under 'Going further'")
