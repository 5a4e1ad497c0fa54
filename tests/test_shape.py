"""The lesson shape (../shared/STYLE.md): a lesson file is one idea, grown from its parent.

* At most 200 code lines per lesson file (comments, docstrings and blank lines not counted),
  for every lesson.
* A lesson that names a parent (`Parent: lesson NN (...)` in its docstring) adds at most
  ADDED_AT_MOST lines to it, as `diff` counts them, so `make diff TO=NN` shows the idea in about
  one screen. What it drops (the parent's own demonstrations) costs nothing.
* Layers point down: common/ imports nothing of ours but itself; apparatus/ imports common/
  and itself; a module that serves one lesson lives in that lesson's folder (lessons/NN_topic/).
"""
import io
import re
import sys
import tokenize

import pytest

from conftest import ROOT, run

sys.path.insert(0, str(ROOT / "tools"))
from lesson_diff import added_lines, lesson_file, parent_of  # noqa: E402

LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def code_lines(source: str) -> int:
    """Lines holding code: not comments, not docstrings, not blank."""
    code, doc, prev = set(), set(), None
    for t in tokenize.generate_tokens(io.StringIO(source).readline):
        if t.type == tokenize.STRING and (prev is None or prev.type in (
                tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL)):
            doc.update(range(t.start[0], t.end[0] + 1))
        elif t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(t.start[0], t.end[0] + 1))
        if t.type not in (tokenize.COMMENT, tokenize.NL):
            prev = t
    return len(code - doc)


def test_code_lines_counts_only_code():
    src = '"""Doc\nstring."""\n# a comment\n\nx = 1  # trailing\ny = """not a\ndocstring"""\n'
    assert code_lines(src) == 3


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_has_at_most_200_code_lines(lesson):
    n = code_lines(lesson.read_text())
    assert n <= 200, f"{lesson.name} has {n} code lines; move what is not the idea out of it"


ADDED_AT_MOST = 130  # lines a lesson adds to its parent: about one screen of `make diff`


@pytest.mark.parametrize("lesson", [p for p in LESSONS if parent_of(p)], ids=lambda p: p.stem)
def test_lesson_grows_from_its_parent(lesson):
    parent = lesson_file(parent_of(lesson))
    added = added_lines(parent, lesson)
    assert added <= ADDED_AT_MOST, (f"{lesson.name} adds {added} lines to its parent {parent.name}"
                                    f" (at most {ADDED_AT_MOST}): grow it, do not rewrite it")


def test_part2_lessons_name_a_parent_or_open_a_topic():
    for lesson in LESSONS:
        if lesson.name[:2] > "13":
            assert parent_of(lesson), f"{lesson.name} names no 'Parent: lesson NN' in its docstring"


def test_make_diff_defaults_to_the_parent():
    with_parent = [p for p in LESSONS if parent_of(p)]
    if not with_parent:
        pytest.skip("no lesson names a parent yet")
    lesson = with_parent[0]
    first = run(["make", "-s", "diff", f"TO={lesson.name[:2]}"]).stdout.splitlines()[0]
    assert first.startswith(f"{lesson_file(parent_of(lesson)).name} -> {lesson.name}:"), first
    assert re.search(r"\d+ lines added", first)


def imports_of(path) -> set[str]:
    """The repository modules a file imports, at the top or inside a function (a late import
    is still an edge: it can close a cycle)."""
    import ast
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_common_is_small_and_has_no_import_cycle():
    """common/ is read in one sitting: at most 900 lines, and no module of common/ or
    apparatus/ reaches itself through imports (cli -> recipe -> datasets -> cli once did)."""
    files = sorted((ROOT / "common").glob("*.py"))
    total = sum(len(f.read_text().splitlines()) for f in files)
    assert total <= 900, f"common/ has {total} lines; move what is not shared lesson code out"
    modules = {f"{f.parent.name}.{f.stem}" if f.stem != "__init__" else f.parent.name: f
               for pkg in ("common", "apparatus") for f in (ROOT / pkg).glob("*.py")}
    edges = {m: {i for i in imports_of(f) if i in modules and i != m} for m, f in modules.items()}

    def reaches(start, goal, seen):
        for nxt in edges[start]:
            if nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)):
                return True
        return False

    cycles = [m for m in modules if reaches(m, m, set())]
    assert not cycles, f"import cycles through: {', '.join(sorted(cycles))}"
