"""The package's shape (../shared/STYLE.md): structure, never line counts.

* Layers point down: common/ imports nothing of ours but itself; apparatus/ imports common/
  and itself; no module of theirs reaches itself through imports.
* A module that serves one lesson lives in that lesson's folder (lessons/NN_topic/), and the
  modules of all those folders have names of their own (tests, tools and bench put every
  folder on sys.path: two `pictures.py` would shadow each other).
* Names a learner can read: no one-letter module alias (`F` for torch.nn.functional and `T`
  for common.transformer are the two conventions), no conditional expression used as a
  statement (`a() if x else None`).
* One way to do each thing: a lesson puts the repository and its own folder on sys.path with
  the same lines; a module in a lesson's folder does not touch sys.path unless a learner runs
  it by itself; only common.lesson_module loads a lesson file by its path.
* A lesson that names a parent grows from it, and `make diff TO=NN` shows the difference.

What this file does not count: lines. A count in a test gets met by splitting files, which
hurts the reader (STYLE, Tests); make diff folds what a lesson leaves out of its parent.
"""
import ast
import functools
import re
from collections import Counter
from pathlib import Path

import pytest

from conftest import ROOT, run
from tools.lesson_diff import lesson_file, parent_of

LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
FOLDERS = sorted(d for d in (ROOT / "lessons").glob("[0-9][0-9]_*/") if d.is_dir())
PACKAGES = ("common", "apparatus")
# what a learner reads and what maintains it: lessons and their folders, the shared packages,
# the exercises, the tools and the benchmarks (tests are checked where they say so)
SOURCES = sorted([*(ROOT / "lessons").rglob("*.py"), *(ROOT / "common").glob("*.py"),
                  *(ROOT / "apparatus").glob("*.py"), *(ROOT / "exercises").glob("*.py"),
                  *(ROOT / "tools").rglob("*.py"), *(ROOT / "bench").glob("*.py")])


@functools.lru_cache(maxsize=None)
def _tree(path: str, text: str) -> ast.AST:
    return ast.parse(text)


def tree(path: Path) -> ast.AST:
    """A file parsed once per content (several tests walk the same files)."""
    return _tree(str(path), Path(path).read_text())


def imports_of(path) -> set[str]:
    """The repository modules a file imports, at the top or inside a function (a late import
    is still an edge: it can close a cycle)."""
    found = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def package_modules() -> dict[str, Path]:
    return {f"{f.parent.name}.{f.stem}" if f.stem != "__init__" else f.parent.name: f
            for pkg in PACKAGES for f in (ROOT / pkg).glob("*.py")}


def ours(name: str) -> str | None:
    """The package of ours a module name belongs to (common, apparatus, ...), or None."""
    top = name.split(".")[0]
    return top if top in PACKAGES or top in ("lessons", "tools", "bench", "tests") else None


# --- layers ------------------------------------------------------------------------------

def test_common_imports_nothing_of_ours_but_itself():
    """common/ is the bottom layer: a learner reads it without opening another package."""
    for f in sorted((ROOT / "common").glob("*.py")):
        above = sorted(i for i in imports_of(f) if ours(i) not in (None, "common"))
        assert not above, f"common/{f.name} imports {', '.join(above)}: common/ imports only common/"


def test_apparatus_imports_only_common_and_itself():
    for f in sorted((ROOT / "apparatus").glob("*.py")):
        above = sorted(i for i in imports_of(f) if ours(i) not in (None, "common", "apparatus"))
        assert not above, f"apparatus/{f.name} imports {', '.join(above)}: it may use common/ only"


def test_nothing_in_common_or_apparatus_imports_in_a_cycle():
    """No module of common/ or apparatus/ reaches itself through imports (cli -> recipe ->
    datasets -> cli once did)."""
    modules = package_modules()
    edges = {m: {i for i in imports_of(f) if i in modules and i != m} for m, f in modules.items()}

    def reaches(start, goal, seen):
        for nxt in edges[start]:
            if nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)):
                return True
        return False

    cycles = [m for m in modules if reaches(m, m, set())]
    assert not cycles, f"import cycles through: {', '.join(sorted(cycles))}"


def users_of(module: str) -> set[str]:
    """Who imports `module` (e.g. "apparatus.sharding"): "lesson NN" for a lesson, its folder,
    its exercise or its check; "shared" for another module of common/ or apparatus/;
    "bench" or "tools" for those. Tests do not count: they test, they do not use."""
    users = set()
    for f in SOURCES:
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


def test_every_shared_module_serves_a_lesson():
    """apparatus/ holds what lessons use to show and prove; what only tools, bench or tests
    use belongs with them (apparatus/ranks.py once served no lesson)."""
    for name, path in sorted(package_modules().items()):
        if path.parent.name != "apparatus" or path.stem == "__init__":
            continue
        users = users_of(name)
        assert any(u.startswith("lesson") for u in users) or "shared" in users, \
            f"{name} serves no lesson ({', '.join(sorted(users)) or 'nobody'}): move it where its users are"


def test_users_of_sees_lessons_checks_and_packages():
    assert {"lesson 01", "lesson 05", "lesson 20", "bench"} <= users_of("apparatus.ui")
    assert users_of("common.datasets") == {"shared"}  # only common/recipe.py imports it
    assert "lesson 17" in users_of("apparatus.comm")  # through lessons/17_tensor_parallel/


# --- names a learner can read ----------------------------------------------------------------

def test_lesson_folders_hold_modules_with_names_of_their_own():
    """Every lesson folder is on sys.path in the tests, tools and bench: a module name used in
    two folders would be whichever comes first. Generic names say nothing either."""
    names = Counter(f.stem for d in FOLDERS for f in d.glob("*.py"))
    shared = sorted(n for n, count in names.items() if count > 1)
    assert not shared, f"module names in more than one lesson folder: {shared}"
    generic = sorted(n for n in names if n in {"pictures", "report", "utils", "helpers", "misc", "common"})
    assert not generic, f"lesson-folder modules named for nothing they hold: {generic}"


CONVENTIONS = {"F": "torch.nn.functional", "T": "common.transformer"}


def _one_letter_aliases(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.asname and len(a.asname) == 1:
                    full = f"{node.module}.{a.name}" if isinstance(node, ast.ImportFrom) else a.name
                    if CONVENTIONS.get(a.asname) != full:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {full} as {a.asname}")
    return found


def test_no_one_letter_module_aliases():
    found = [hit for f in SOURCES for hit in _one_letter_aliases(f)]
    assert not found, "one-letter module aliases a learner must decode:\n" + "\n".join(found)


def test_the_alias_check_sees_an_alias_and_lets_the_conventions_be(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import ring_attention as R\nimport torch.nn.functional as F\n"
                 "from common import transformer as T\nfrom torch.nn import functional as G\n")
    hits = [h.split(" ", 1)[1] for h in _one_letter_aliases(f, tmp_path)]
    assert hits == ["ring_attention as R", "torch.nn.functional as G"]


def _expression_statements(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(tree(path))
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.IfExp)]


def test_no_conditional_expression_used_as_a_statement():
    """`a() if x else None` on a line of its own hides an if statement in an expression."""
    found = [hit for f in SOURCES for hit in _expression_statements(f)]
    assert not found, "conditional expressions used as statements (write an if):\n" + "\n".join(found)


# --- one way to do each thing ----------------------------------------------------------------

LESSON_PATH_LINES = (
    'sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import common` works',
    'sys.path.insert(0, str(Path(__file__).resolve().with_suffix("")))  # this lesson\'s own folder, {folder}/',
)


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_reaches_the_package_and_its_folder_the_one_way(lesson):
    edits = [line.strip() for line in lesson.read_text().splitlines() if "sys.path" in line and not line.lstrip().startswith("#")]
    wanted = [LESSON_PATH_LINES[0]]
    if lesson.with_suffix("").is_dir():
        wanted.append(LESSON_PATH_LINES[1].format(folder=lesson.stem))
    # after them, a lesson that uses another lesson's folder (23: lesson 19's planner) says so
    borrowed = re.compile(r'sys\.path\.insert\(1, str\(Path\(__file__\)\.resolve\(\)\.parent / "(\d\d)_\w+"\)\)  # lesson \1\'s ')
    assert edits[:len(wanted)] == wanted and all(borrowed.match(e) for e in edits[len(wanted):]), \
        f"{lesson.name}: {edits}"


def _runs_by_itself(path: Path) -> bool:
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree(path).body)


def test_a_folder_module_leaves_sys_path_alone_unless_a_learner_runs_it():
    """A module a lesson imports finds everything on the path the lesson set; a script a
    learner runs by itself (a picture, a pitfall, the planner) sets the path itself."""
    offenders = [str(f.relative_to(ROOT)) for d in FOLDERS for f in d.glob("*.py")
                 if "sys.path" in f.read_text() and not _runs_by_itself(f)]
    assert not offenders, f"lesson-folder modules that edit sys.path: {offenders}"


def _lesson_loads(path: Path) -> list[str]:
    """Calls that load a file by its path (importlib's spec_from_file_location, runpy.run_path)
    with a lesson in their arguments."""
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "spec_from_file_location", "run_path"):
            text = " ".join(ast.unparse(a) for a in node.args)
            if "lessons" in text or "lesson_path" in text:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_only_common_loads_a_lesson_file_by_its_path():
    """Lesson files start with digits, so `import` cannot name them: common.lesson_module is
    the one place that loads one by its path (tools, bench, exercises and tests call it).
    (A learner's answer or a starter file is not a lesson: a check may load those.)"""
    found = [hit for f in [*SOURCES, *(ROOT / "tests").rglob("*.py")] for hit in _lesson_loads(f)
             if not hit.startswith(("common/__init__.py", "tests/test_shape.py"))]
    assert not found, f"lesson files loaded by path outside common.lesson_module: {found}"


def test_tests_use_public_apis_only():
    """The harness replaces no private method of subprocess or multiprocessing (STYLE, Tests)."""
    private = re.compile(r"(subprocess\.Popen\._\w+|multiprocessing\.\w+\._\w+|util\.spawnv_passfds|"
                         r"forkserver\._forkserver)\s*=")
    found = [f"{f.name}: {m[0]}" for f in (ROOT / "tests").rglob("*.py") for m in private.finditer(f.read_text())]
    assert not found, found


# --- lessons grow from their parents -------------------------------------------------------

def test_part2_lessons_name_a_parent_or_open_a_topic():
    for lesson in LESSONS:
        if lesson.name[:2] > "13":
            assert parent_of(lesson), f"{lesson.name} names no 'Parent: lesson NN' in its docstring"


def test_make_diff_defaults_to_the_parent_and_folds_what_it_leaves_out():
    lesson = next(p for p in LESSONS if p.name.startswith("15_"))
    out = run(["make", "-s", "diff", f"TO={lesson.name[:2]}"]).stdout
    first = out.splitlines()[0]
    assert first.startswith(f"{lesson_file(parent_of(lesson)).name} -> {lesson.name}:"), first
    assert re.search(r"\d+ lines added", first)
    assert "more lines of lesson 13 that lesson 15 leaves out" in out  # lesson 13's Steps 6-9
    everything = run(["make", "-s", "diff", "TO=15", "ARGS=--all"]).stdout
    assert "leaves out" not in everything and "bf16 autocast" in everything
    assert len(out.splitlines()) < len(everything.splitlines())
