"""The lesson shape (../shared/STYLE.md): a lesson file is one idea, grown from its parent.

* At most 200 code lines per lesson file (comments, docstrings and blank lines not counted),
  for every lesson.
* A lesson that names a parent (`Parent: lesson NN (...)` in its docstring) adds at most
  ADDED_AT_MOST lines to it, as `diff` counts them, so `make diff TO=NN` shows the idea in about
  one screen. What it drops (the parent's own demonstrations) costs nothing.
* Layers point down: common/ imports nothing of ours but itself; apparatus/ imports common/
  and itself; a module that serves one lesson lives in that lesson's folder (lessons/NN_topic/).
"""
import functools
import io
import re
import sys
import tokenize
from pathlib import Path

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


ADDED_AT_MOST = 135  # lines a lesson adds to its parent: about one screen of `make diff`


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
    is still an edge: it can close a cycle). Parsed once per file and content."""
    return set(_imports_of(str(path), Path(path).read_text()))


@functools.lru_cache(maxsize=None)
def _imports_of(_path: str, text: str) -> frozenset[str]:
    import ast
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return frozenset(found)


PACKAGES = ("common", "apparatus")


def package_modules() -> dict[str, "Path"]:
    return {f"{f.parent.name}.{f.stem}" if f.stem != "__init__" else f.parent.name: f
            for pkg in PACKAGES for f in (ROOT / pkg).glob("*.py")}


def ours(name: str) -> str | None:
    """The package of ours a module name belongs to (common, apparatus, ...), or None."""
    top = name.split(".")[0]
    return top if top in PACKAGES or top in ("lessons", "tools", "bench", "tests") else None


def test_common_imports_nothing_of_ours_but_itself():
    """common/ is the bottom layer: a learner reads it without opening another package, and
    no import hides in a function to dodge a cycle, because there is no cycle to dodge."""
    for f in sorted((ROOT / "common").glob("*.py")):
        above = sorted(i for i in imports_of(f) if ours(i) not in (None, "common"))
        assert not above, f"common/{f.name} imports {', '.join(above)}: common/ imports only common/"


def test_apparatus_imports_only_common_and_itself():
    for f in sorted((ROOT / "apparatus").glob("*.py")):
        above = sorted(i for i in imports_of(f) if ours(i) not in (None, "common", "apparatus"))
        assert not above, f"apparatus/{f.name} imports {', '.join(above)}: it may use common/ only"


def users_of(module: str) -> set[str]:
    """Who imports `module` (e.g. "apparatus.sharding"): "lesson NN" for a lesson, its folder,
    its exercise or its check; "shared" for another module of common/ or apparatus/;
    "bench" or "tools" for those. Tests do not count: they test, they do not use."""
    users = set()
    files = [*(ROOT / "lessons").rglob("*.py"), *(ROOT / "exercises").glob("*.py"),
             *(ROOT / "tools").rglob("*.py"), *(ROOT / "bench").glob("*.py"),
             *[f for pkg in PACKAGES for f in (ROOT / pkg).glob("*.py")]]
    for f in files:
        found = imports_of(f)
        if module not in found and not any(i.startswith(module + ".") for i in found):
            continue
        rel = f.relative_to(ROOT)
        number = re.match(r"(?:check_)?(\d\d)_?", rel.parts[-1] if rel.parts[0] != "lessons" else rel.parts[1])
        if rel.parts[0] in PACKAGES:
            users.add("shared" if f"{rel.parts[0]}.{f.stem}" != module else "")
        elif rel.parts[0] in ("lessons", "exercises") or rel.parts[:2] == ("tools", "checks"):
            users.add(f"lesson {number[1]}" if number else str(rel))
        else:
            users.add(rel.parts[0])
    return users - {""}


def test_no_shared_module_serves_one_lesson_only():
    """A module that one lesson uses lives in that lesson's folder (lessons/NN_topic/), where
    the learner is already reading; common/ and apparatus/ hold what several lessons use.
    (bench/ and the tools measuring or checking that one lesson do not make it shared.)"""
    for name in sorted(package_modules()):
        users = users_of(name)
        lessons = sorted(u for u in users if u.startswith("lesson"))
        assert len(lessons) != 1 or "shared" in users, \
            f"{name} serves {lessons[0]} only: move it into that lesson's folder"


def test_users_of_sees_lessons_checks_and_packages():
    assert {"lesson 01", "lesson 05", "lesson 20", "bench"} <= users_of("apparatus.ui")
    assert users_of("common.datasets") == {"shared"}  # only common/recipe.py imports it
    assert "lesson 17" in users_of("apparatus.comm")  # through lessons/17_tensor_parallel/


def test_common_is_readable_and_nothing_imports_in_a_cycle():
    """common/ is read in one sitting (each module at most 450 lines), and no module of
    common/ or apparatus/ reaches itself through imports (cli -> recipe -> datasets -> cli
    once did)."""
    for f in sorted((ROOT / "common").glob("*.py")):
        n = len(f.read_text().splitlines())
        assert n <= 450, f"common/{f.name} has {n} lines; split it, or move what is not shared out"
    modules = package_modules()
    edges = {m: {i for i in imports_of(f) if i in modules and i != m} for m, f in modules.items()}

    def reaches(start, goal, seen):
        for nxt in edges[start]:
            if nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)):
                return True
        return False

    cycles = [m for m in modules if reaches(m, m, set())]
    assert not cycles, f"import cycles through: {', '.join(sorted(cycles))}"
