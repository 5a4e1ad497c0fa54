"""Put a "New terms" line in every lesson doc (English and Chinese), linking the glossary
entries whose "first in" column names that lesson. Run it after editing docs/GLOSSARY.md:

    .venv/bin/python tools/glossary_links.py [NN ...]
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r'^\| <a id="([\w-]+)"></a>\*\*(.+?)\*\* \| .*\| \[(\d\d)\]\(', re.M)
MARK_EN = "**New terms in this lesson:**"
MARK_ZH = "**本课新术语：**"


def terms_by_lesson() -> dict[str, list[tuple[str, str]]]:
    found: dict[str, list[tuple[str, str]]] = {}
    for anchor, name, lesson in ROW.findall((ROOT / "docs" / "GLOSSARY.md").read_text()):
        found.setdefault(lesson, []).append((anchor, name))
    return found


def insert(doc: Path, line: str, mark: str) -> None:
    text = doc.read_text()
    # replace an older line (and the blank line after it); touch nothing else
    text = re.sub(rf"^{re.escape(mark)}.*\n\n", "", text, flags=re.M)
    # before the first level-2 heading: right after the introduction
    at = text.index("\n## ") + 1
    doc.write_text(text[:at] + line + "\n\n" + text[at:])


def main(only: list[str]) -> None:
    for lesson, terms in sorted(terms_by_lesson().items()):
        if only and lesson not in only:
            continue
        for doc in (ROOT / "docs").glob(f"{lesson}_*.md"):
            links = ", ".join(f"[{name}](GLOSSARY.md#{a})" for a, name in terms)
            insert(doc, f"{MARK_EN} {links} (every term: [glossary](GLOSSARY.md)).", MARK_EN)
            zh = ROOT / "docs" / "zh" / doc.name
            if zh.exists():
                links = "、".join(f"[{name}](../GLOSSARY.md#{a})" for a, name in terms)
                insert(zh, f"{MARK_ZH}{links}（全部术语见[术语表](../GLOSSARY.md)，目前为英文）。", MARK_ZH)
            print(f"{doc.name}: {len(terms)} terms")


if __name__ == "__main__":
    main(sys.argv[1:])
