"""Every English lesson doc has a Chinese translation with the same steps and the same code.

The translation's step headings are in Chinese, so we compare their numbers; code and
output blocks are not translated, so they must be identical (tools/doc_output.py
regenerates both languages' output blocks from the same run).
"""
import re

import pytest

from conftest import ROOT

EN = sorted((ROOT / "docs").glob("[0-9][0-9]_*.md"))
FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.S | re.M)


def steps(text):
    return [int(n) for n in re.findall(r"^## (?:Step|步骤|第)\s*(\d+)", text, re.M)]


@pytest.mark.parametrize("doc", EN, ids=lambda p: p.stem)
def test_chinese_doc_has_same_steps_and_code(doc):
    zh = ROOT / "docs" / "zh" / doc.name
    assert zh.exists(), f"docs/zh/{doc.name} is missing"
    en_text, zh_text = doc.read_text(), zh.read_text()
    assert steps(zh_text) == steps(en_text), "the Chinese doc's steps differ"
    assert re.search(r"[\u4e00-\u9fff]", zh_text), "docs/zh/ holds no Chinese text"
    assert FENCE.findall(zh_text) == FENCE.findall(en_text), \
        "code or output blocks differ: copy them unchanged, then run make docs-output"


def test_chinese_readme_exists_and_links_every_translation():
    readme = (ROOT / "README.zh.md").read_text()
    assert "make lesson-01" in readme and "make test" in readme
    for doc in EN:
        assert f"docs/zh/{doc.name}" in readme
