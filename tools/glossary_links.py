"""Put a "New terms" line in every lesson doc (English and Chinese), linking the glossary
entries whose "first in" column names that lesson. English docs link docs/GLOSSARY.md, Chinese
docs link docs/zh/GLOSSARY.md under the Chinese name of each term. Run it after adding a row to
docs/GLOSSARY.md and its translation (same anchor) to docs/zh/GLOSSARY.md:

    .venv/bin/python tools/glossary_links.py [--en | --zh] [NN ...]

A term that has no Chinese row yet is linked from the Chinese doc to the English glossary;
tests/test_translations_extra.py names every such term until its row is translated.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r'^\| <a id="([\w-]+)"></a>\*\*(.+?)\*\* \| .*\| \[(\d\d)\]\(', re.M)
MARK_EN = "**New terms in this lesson:**"
MARK_ZH = "**本课新术语：**"


def terms_by_lesson(glossary: Path = ROOT / "docs" / "GLOSSARY.md") -> dict[str, list[tuple[str, str]]]:
    found: dict[str, list[tuple[str, str]]] = {}
    for anchor, name, lesson in ROW.findall(glossary.read_text()):
        found.setdefault(lesson, []).append((anchor, name))
    return found


def zh_names() -> dict[str, str]:
    """Anchor -> Chinese name, from docs/zh/GLOSSARY.md (empty if it does not exist)."""
    zh = ROOT / "docs" / "zh" / "GLOSSARY.md"
    return {anchor: name for anchor, name, _ in ROW.findall(zh.read_text())} if zh.exists() else {}


def en_line(terms: list[tuple[str, str]]) -> str:
    links = ", ".join(f"[{name}](GLOSSARY.md#{a})" for a, name in terms)
    return f"{MARK_EN} {links} (every term: [glossary](GLOSSARY.md))."


def zh_line(terms: list[tuple[str, str]], names: dict[str, str]) -> str:
    # the Chinese glossary sits beside the Chinese docs; an untranslated term falls back to English
    links = "、".join(f"[{names[a]}](GLOSSARY.md#{a})" if a in names else f"[{name}](../GLOSSARY.md#{a})"
                     for a, name in terms)
    return f"{MARK_ZH}{links}（全部术语见[术语表](GLOSSARY.md)）。"


def insert(doc: Path, line: str, mark: str) -> bool:
    old = doc.read_text()
    # replace an older line (and the blank line after it); touch nothing else
    text = re.sub(rf"^{re.escape(mark)}.*\n\n", "", old, flags=re.M)
    # before the first level-2 heading: right after the introduction
    at = text.index("\n## ") + 1
    text = text[:at] + line + "\n\n" + text[at:]
    if text != old:
        doc.write_text(text)
    return text != old


def main(args: list[str]) -> None:
    langs = {a[2:] for a in args if a in ("--en", "--zh")} or {"en", "zh"}
    only = [a for a in args if not a.startswith("--")]
    names = zh_names()
    for lesson, terms in sorted(terms_by_lesson().items()):
        if only and lesson not in only:
            continue
        for doc in (ROOT / "docs").glob(f"{lesson}_*.md"):
            changed = []
            if "en" in langs and insert(doc, en_line(terms), MARK_EN):
                changed.append(f"docs/{doc.name}")
            zh = ROOT / "docs" / "zh" / doc.name
            if "zh" in langs and zh.exists() and insert(zh, zh_line(terms, names), MARK_ZH):
                changed.append(f"docs/zh/{doc.name}")
            missing = [a for a, _ in terms if a not in names]
            print(f"{doc.name}: {len(terms)} terms; rewrote: {', '.join(changed) or 'nothing'}"
                  + (f"; no Chinese row yet: {', '.join(missing)}" if missing else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
