"""The Chinese glossary and exercises page stay in step with the English ones.

docs/zh/GLOSSARY.md has a row for every row of docs/GLOSSARY.md, under the same anchor and
with the same "first in" lesson; every Chinese lesson doc links the Chinese glossary (in its
own folder) for each term its lesson introduces, as tools/glossary_links.py writes it; and
exercises/README.zh.md lists every checked exercise. Text only: no lesson runs here.
"""
import re

import pytest

from conftest import ROOT

ROW = re.compile(r'^\| <a id="([\w-]+)"></a>\*\*(.+?)\*\* \| (.*) \| \[(\d\d)\]\((\S+?)\) \|\s*$', re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.S | re.M)
HAN = re.compile(r"[\u4e00-\u9fff]")
EN_GLOSSARY = ROOT / "docs" / "GLOSSARY.md"
ZH_GLOSSARY = ROOT / "docs" / "zh" / "GLOSSARY.md"
ZH_EXERCISES = ROOT / "exercises" / "README.zh.md"
HOW = ("add its row to docs/zh/GLOSSARY.md (same anchor, the Chinese term with the English one in "
       "parentheses, the same lesson link), then run .venv/bin/python tools/glossary_links.py --zh")


def rows(path):
    """anchor -> (name, meaning, lesson, target) for every row of a glossary table."""
    found = {}
    for anchor, name, meaning, lesson, target in ROW.findall(path.read_text()):
        assert anchor not in found, f"{path.relative_to(ROOT)}: anchor #{anchor} appears twice"
        found[anchor] = (name, meaning, lesson, target)
    return found


@pytest.fixture(scope="module")
def en():
    found = rows(EN_GLOSSARY)
    assert len(found) >= 30, "docs/GLOSSARY.md: rows no longer parse; update ROW here"
    return found


@pytest.fixture(scope="module")
def zh():
    assert ZH_GLOSSARY.exists(), "docs/zh/GLOSSARY.md is missing"
    return rows(ZH_GLOSSARY)


def test_zh_glossary_has_exactly_the_english_terms(en, zh):
    missing = [f"#{a} ({en[a][0]}, lesson {en[a][2]})" for a in en if a not in zh]
    assert not missing, f"docs/zh/GLOSSARY.md lacks these terms of docs/GLOSSARY.md: " \
                        f"{', '.join(missing)}. For each, {HOW}"
    extra = [f"#{a} ({zh[a][0]})" for a in zh if a not in en]
    assert not extra, f"docs/zh/GLOSSARY.md has rows that docs/GLOSSARY.md lacks: {', '.join(extra)}: " \
                      "rename the anchor to the English one, or remove the row"


def test_zh_glossary_rows_are_translated_and_link_the_same_lessons(en, zh):
    for anchor in en.keys() & zh.keys():
        name, meaning, lesson, target = zh[anchor]
        assert (lesson, target) == en[anchor][2:], \
            f"docs/zh/GLOSSARY.md #{anchor}: first in [{lesson}]({target}); the English row says " \
            f"[{en[anchor][2]}]({en[anchor][3]})"
        assert HAN.search(meaning), f"docs/zh/GLOSSARY.md #{anchor}: the meaning is not translated"
        # a Chinese name keeps the English term(s) beside it, as the zh docs do: 进程 / 秩（process / rank）
        english = re.split(r"\s*/\s*", re.sub(r"\s*\([^)]*\)", "", en[anchor][0]))  # "a / b (note)" -> a, b
        lost = [term for term in english if term not in name]
        assert not lost, f"docs/zh/GLOSSARY.md #{anchor}: the name {name} lacks {' and '.join(lost)}; " \
                         f"write 中文（{en[anchor][0]}）, as the English row names it"


def test_every_zh_doc_links_the_zh_glossary_for_the_terms_it_introduces(en):
    problems = []
    for anchor, (name, _, lesson, target) in en.items():
        doc = ROOT / "docs" / "zh" / target
        if not doc.exists():
            problems.append(f"docs/zh/{target} is missing (it introduces #{anchor})")
        elif f"](GLOSSARY.md#{anchor})" not in doc.read_text():
            problems.append(f"docs/zh/{target} does not link GLOSSARY.md#{anchor} ({name})")
    for doc in sorted((ROOT / "docs" / "zh").glob("[0-9][0-9]_*.md")):
        if "../GLOSSARY.md" in doc.read_text():
            problems.append(f"docs/zh/{doc.name} links the English glossary ../GLOSSARY.md")
    assert not problems, "\n".join(problems) + \
        "\nChinese docs link the Chinese glossary beside them: run .venv/bin/python " \
        "tools/glossary_links.py --zh (it links a term without a Chinese row to ../GLOSSARY.md)"


def test_chinese_exercises_page_lists_every_exercise():
    en_text, zh_text = (ROOT / "exercises" / "README.md").read_text(), ZH_EXERCISES.read_text()
    assert HAN.search(zh_text), "exercises/README.zh.md holds no Chinese text"
    assert FENCE.findall(zh_text) == FENCE.findall(en_text), \
        "exercises/README.zh.md: code blocks differ from exercises/README.md; copy them unchanged"
    starters = sorted(p.name for p in (ROOT / "exercises").glob("[0-9][0-9]_*.py"))
    assert starters, "no exercises/NN_*.py found"
    for name in starters:
        assert f"`exercises/{name}`" in zh_text and f"`make check-{name[:2]}`" in zh_text, \
            f"exercises/README.zh.md does not list exercises/{name}: add a row (make check-{name[:2]})"
        row = next(line for line in zh_text.splitlines() if f"`exercises/{name}`" in line)
        for doc in (ROOT / "docs" / "zh").glob(f"{name[:2]}_*.md"):
            assert f"](../docs/zh/{doc.name})" in row, \
                f"exercises/README.zh.md: the row of exercises/{name} should link ../docs/zh/{doc.name}"
    named = set(re.findall(r"exercises/(\d\d_\w+\.py)", en_text + zh_text))
    assert named <= set(starters), f"the exercises pages name files that do not exist: {named - set(starters)}"


@pytest.mark.parametrize("page", [ZH_GLOSSARY, ZH_EXERCISES, ROOT / "README.zh.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"


def test_chinese_readme_links_the_chinese_glossary_and_exercises():
    readme = (ROOT / "README.zh.md").read_text()
    assert "](docs/zh/GLOSSARY.md)" in readme, "README.zh.md does not link docs/zh/GLOSSARY.md"
    assert "](exercises/README.zh.md)" in readme, "README.zh.md does not link exercises/README.zh.md"
