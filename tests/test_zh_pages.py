"""TEACHING.md and PERFORMANCE.md have Chinese versions in docs/zh/ that stay in step with
the English: the same headings (by level), the same commands, the same tables (row by row
for the teacher's guide, cell by cell for the generated performance page, whose tables are
the ones the terminal prints) and the same pictures. A change to one language that is not
made in the other fails here, as tests/test_translations.py does for the lesson docs."""
import re
from pathlib import Path

import pytest

from conftest import ROOT

PAGES = ["TEACHING.md", "PERFORMANCE.md"]
FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")


def parts(path: Path) -> dict:
    text = path.read_text()
    body = FENCE.sub("", text)  # a table or heading inside a code block is not one
    tables, current = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return {"text": text,
            "headings": [len(h) for h in re.findall(r"^(#+) ", body, re.M)],
            "code": FENCE.findall(text),
            "tables": tables,
            "links": LINK.findall(body)}


def resolved(path: Path, links: list[str]) -> set[Path]:
    """Local link targets, as files; every one must exist."""
    out = set()
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target = (path.parent / link).resolve()
        assert target.exists(), f"{path.relative_to(ROOT)} links {link}, which does not exist"
        out.add(target)
    return out


@pytest.mark.parametrize("name", PAGES)
def test_chinese_page_is_in_step_with_the_english(name):
    en_path, zh_path = ROOT / "docs" / name, ROOT / "docs" / "zh" / name
    assert zh_path.exists(), f"docs/zh/{name} is missing"
    en, zh = parts(en_path), parts(zh_path)
    assert re.search(r"[\u4e00-\u9fff]", zh["text"]), f"docs/zh/{name} holds no Chinese text"
    assert f"../{name}" in zh["text"], "the Chinese page links its English original"
    assert zh["headings"] == en["headings"], "the headings differ"
    assert zh["code"] == en["code"], "the commands differ: copy code blocks unchanged"
    assert [len(t) for t in zh["tables"]] == [len(t) for t in en["tables"]], "the tables differ"
    if name == "PERFORMANCE.md":  # generated: the same tables, cell for cell
        assert zh["tables"] == en["tables"]
    else:  # the same lessons in the same rows: the first column is not translated
        first = lambda d: [[row.split("|")[1].strip() for row in table[2:]] for table in d["tables"]]
        assert first(zh) == first(en), "the tables' rows differ"
    # the same pictures, and every local link of both pages leads somewhere
    images = lambda p, d: {x for x in resolved(p, d["links"]) if x.suffix == ".png"}
    assert images(zh_path, zh) == images(en_path, en), "the pictures differ"


def test_english_pages_point_to_the_chinese_ones():
    assert "zh/TEACHING.md" in (ROOT / "docs" / "TEACHING.md").read_text()
