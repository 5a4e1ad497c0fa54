"""Build the reading site: every lesson's doc beside its code, step by step (`make read`).

    make read                              # builds runs/read/ and prints its address
    .venv/bin/python tools/read_site.py    # the same

One page per lesson and language (docs/NN_*.md in English, docs/zh/NN_*.md in Chinese):
each `## Step N` section of the doc sits in one row with the code from `# Step N` to the
next step, so the two stay aligned as you scroll. The rest of the doc (what you will learn,
how to run it, mistakes, exercises) sits above and below. The index is the course, read
from docs/TEACHING.md's table; glossary links land on a glossary page; a lesson whose
docstring names a parent (`Parent: lesson NN`) links to the diff `make diff TO=NN` prints.
Only what the venv already has (markdown-it-py and Pygments come with rich; nh3, pinned in
requirements.txt, sanitizes); no network. The docs' raw HTML goes through an allow-list
(safe_html): their `<a id=...>` anchors stay; a <script>, an onerror, a javascript: link do not.
"""
from __future__ import annotations

import difflib
import html
import os
import posixpath
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(__file__).resolve().parent / "read_site"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import nh3  # noqa: E402
from markdown_it import MarkdownIt  # noqa: E402
from pygments import highlight  # noqa: E402
from pygments.formatters import HtmlFormatter  # noqa: E402
from pygments.lexers import get_lexer_by_name  # noqa: E402
from pygments.util import ClassNotFound  # noqa: E402

from lesson_diff import parent_of  # noqa: E402

CODE_STEP = re.compile(r"^(\s*)# Step (\d+): (.+?)\s*$")
DOC_STEP = re.compile(r"^## (?:Step|步骤|第)\s*(\d+)\s*[:：]?\s*(.*?)\s*$")
H2 = re.compile(r"^## ")
FENCE = re.compile(r"^\s*(```|~~~)")
LANGS = ("en", "zh")
# What the rendered Markdown may hold: the tags and attributes markdown-it, Pygments and this
# file write, and the docs' <a id=...> anchors. Anything else (script, style, iframe, form,
# on* handlers, javascript: and data: URLs) is dropped by nh3 (ammonia's allow-list).
SAFE_TAGS = {"a", "p", "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "li", "em", "strong", "code",
             "pre", "blockquote", "hr", "br", "img", "table", "thead", "tbody", "tr", "th", "td",
             "span", "div", "figure", "figcaption", "del", "s", "sup", "sub", "kbd", "details", "summary"}
SAFE_ATTRIBUTES = {"*": {"id", "class", "title"}, "a": {"href"}, "img": {"src", "alt"},
                   "th": {"style"}, "td": {"style"}, "ol": {"start"}}


# Chinese (and Japanese) text has no spaces between words: where the Markdown source breaks a
# line between two such characters, the browser must not show the break as a space. Fullwidth
# punctuation (，。：（）) carries its own space on either side.
CJK = re.compile(r"[\u2e80-\u2fff\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]")
CJK_PUNCT = re.compile(r"[\u3000-\u303f\uff01-\uff0f\uff1a-\uff20\uff3b-\uff40\uff5b-\uff65]")


def joins_without_space(before: str, after: str) -> bool:
    """A line break between these two characters is no space: both are CJK, or one is
    fullwidth punctuation. Between CJK and Latin text it stays one space (as the docs write
    `使用 torch`)."""
    if not before or not after:
        return False
    return bool((CJK.match(before) and CJK.match(after)) or CJK_PUNCT.match(before) or CJK_PUNCT.match(after))


def _edge_char(tokens, idx: int, step: int) -> str:
    """The nearest character of text beside the inline token at idx (step -1: before it)."""
    i = idx + step
    while 0 <= i < len(tokens):
        content = tokens[i].content if tokens[i].type in ("text", "code_inline") else ""
        if content:
            return content[-1] if step < 0 else content[0]
        if tokens[i].type in ("softbreak", "hardbreak"):
            return ""
        i += step
    return ""


def softbreak(_renderer, tokens, idx, options, env) -> str:
    """markdown-it's softbreak ("\n", shown as a space) unless the break sits inside CJK text."""
    return "" if joins_without_space(_edge_char(tokens, idx, -1), _edge_char(tokens, idx, 1)) else "\n"


def split_indent(line: str) -> tuple[str, str]:
    """A highlighted line of code: (its leading spaces, the rest with its tags). The rest is
    what wraps; the spaces stay in front of every piece of it."""
    kept, spaces, i = [], 0, 0
    while i < len(line):
        if line[i] == "<":
            end = line.index(">", i) + 1
            kept.append(line[i:end])
            i = end
        elif line[i] == " ":
            spaces, i = spaces + 1, i + 1
        else:
            break
    return " " * spaces, "".join(kept) + line[i:]


def code_line(line: str, number: int | None = None) -> str:
    """One line of highlighted code as the site shows it: a long line wraps under its own first
    character (a little further in), never back at column 0, where it would look dedented."""
    ws, rest = split_indent(line)
    anchor = (f' id="L{number}"', f'<a class="ln" href="#L{number}">{number}</a>') if number else ("", "")
    return (f'<span class="line"{anchor[0]}>{anchor[1]}<span class="ws">{ws}</span>'
            f'<span class="rest">{rest or " "}</span></span>')


def inline(md: MarkdownIt, text: str) -> str:
    """One line of Markdown (a title, a table cell), rendered, through the allow-list."""
    return safe_html(md.renderInline(text))


def safe_html(fragment: str) -> str:
    """Rendered Markdown through the allow-list; table cells keep their text-align only."""
    return nh3.clean(fragment, tags=SAFE_TAGS, attributes=SAFE_ATTRIBUTES, link_rel=None,
                     url_schemes={"http", "https", "mailto"}, filter_style_properties={"text-align"})
WORDS = {
    "en": dict(course="The course", glossary="Glossary", teaching="Teaching guide",
               performance="Performance", other="中文", prev="Previous", next="Next",
               diff="What is new since lesson {p} (diff)", source="Source", lines="lines",
               before="Before Step 1", after="After the last step",
               after_note="The rest of the file: helpers the steps call, and the entry point.",
               untranslated="This page has no Chinese translation yet; it is shown in English.",
               lesson="Lesson {n}", added="{a} lines added, {r} removed",
               diff_title="Lesson {n} against its parent, lesson {p}",
               diff_cmd="The same diff in a terminal:", none="(not in the teaching guide yet)", more="More",
               index_intro="Read each lesson's doc beside its code, step by step.", step_code="code of Step {n}"),
    "zh": dict(course="课程", glossary="术语表", teaching="教学指南", performance="性能",
               other="English", prev="上一课", next="下一课",
               diff="相对第 {p} 课新增了什么（diff）", source="源码", lines="行",
               before="步骤 1 之前",
               after="最后一步之后", after_note="文件的其余部分：各步骤调用的辅助函数，以及程序入口。",
               untranslated="本页还没有中文翻译，下面显示英文原文。",
               lesson="第 {n} 课", added="新增 {a} 行，删除 {r} 行",
               diff_title="第 {n} 课与它的前一课（第 {p} 课）的差异",
               diff_cmd="在终端里看同样的 diff：", none="（教学指南中还没有这一课）", more="更多",
               index_intro="逐步阅读每一课：文档在左，代码在右。", step_code="步骤 {n} 的代码"),
}


class SiteError(Exception):
    """The site cannot be built; the message names the lesson and the step."""


# ----------------------------------------------------------------------------- reading

@dataclass
class Lesson:
    number: str
    path: Path
    docs: dict[str, Path]              # language -> doc (zh falls back to en)
    translated: dict[str, bool]
    steps: list[tuple[int, str]]        # from the code
    prologue: tuple[int, int] = (0, 0)  # 0-based [start, end) line ranges
    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)
    epilogue: tuple[int, int] = (0, 0)
    parent: str | None = None

    @property
    def page(self) -> str:
        return self.path.stem + ".html"

    @property
    def diff_page(self) -> str:
        return self.path.stem + ".diff.html"


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def block_end(lines: list[str], start: int, indent: int, stop: int) -> int:
    """The end of the block a step marker at `start` sits in: the first code line (not blank,
    not a comment) indented less than the marker, before `stop`; comments and blank lines
    just above that line belong to what follows."""
    end = stop
    for i in range(start + 1, stop):
        s = lines[i].strip()
        if s and not s.startswith("#") and indent_of(lines[i]) < indent:
            end = i
            break
    if indent == 0:  # a step at module level runs to the entry point
        for i in range(start + 1, end):
            if lines[i].startswith("if __name__"):
                end = i
                break
    while end > start + 1 and (not lines[end - 1].strip()
                               or (lines[end - 1].lstrip().startswith("#")
                                   and indent_of(lines[end - 1]) < indent)):
        end -= 1
    return end


def split_code(lesson: Lesson) -> None:
    lines = lesson.path.read_text().splitlines()
    marks = [(i, int(m[2]), m[3], len(m[1])) for i, line in enumerate(lines)
             if (m := CODE_STEP.match(line))]
    lesson.steps = [(n, title) for _, n, title, _ in marks]
    if not marks:  # no steps (check_steps says so): the whole file above the doc
        lesson.prologue, lesson.epilogue = (0, len(lines)), (len(lines), len(lines))
        return
    lesson.prologue = (0, marks[0][0])
    ends = {}
    for k, (i, n, _, indent) in enumerate(marks):
        nxt = marks[k + 1][0] if k + 1 < len(marks) else len(lines)
        ends[n] = block_end(lines, i, indent, nxt)
    # each step runs from where the previous step's block ended (so code between two
    # blocks, e.g. the `def worker(...)` the next step lives in, leads into the next step)
    lo = marks[0][0]
    for _, n, _, _ in marks:
        lesson.ranges[n] = (lo, ends[n])
        lo = ends[n]
    lesson.epilogue = (lo, len(lines))


def doc_sections(text: str) -> tuple[str, list[tuple[int, str, str]], str]:
    """(intro, [(step, title, markdown)], after): split at level-2 headings, outside fences."""
    chunks: list[list[str]] = [[]]
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if not fenced and H2.match(line):
            chunks.append([])
        chunks[-1].append(line)
    intro, steps, pending = "\n".join(chunks[0]), [], []
    for chunk in chunks[1:]:
        m = DOC_STEP.match(chunk[0])
        body = "\n".join(chunk)
        if m:
            if pending:  # a section between two steps stays with the step before it
                n, title, text = steps[-1]
                steps[-1] = (n, title, "\n\n".join([text, *pending]))
                pending = []
            steps.append((int(m[1]), m[2], body))
        elif not steps:
            intro += "\n\n" + body
        else:
            pending.append(body)
    return intro, steps, "\n\n".join(pending)


def find_lessons(root: Path, warnings: list[str] | None = None) -> list[Lesson]:
    """Every lesson with a doc, in order; a lesson still without one is left out (and said)."""
    lessons = []
    for path in sorted((root / "lessons").glob("[0-9][0-9]_*.py")):
        en = root / "docs" / f"{path.stem}.md"
        zh = root / "docs" / "zh" / f"{path.stem}.md"
        if not en.exists():
            if warnings is not None:
                warnings.append(f"lessons/{path.name} has no doc docs/{en.name} yet: left out of the site")
            continue
        lesson = Lesson(path.name[:2], path, {"en": en, "zh": zh if zh.exists() else en},
                        {"en": True, "zh": zh.exists()}, [])
        split_code(lesson)
        lesson.parent = parent_of(path)
        check_steps(root, lesson)
        lessons.append(lesson)
    return lessons


def check_steps(root: Path, lesson: Lesson) -> None:
    code = [n for n, _ in lesson.steps]
    code_title = dict(lesson.steps)
    src = lesson.path.relative_to(root)
    for lang in LANGS:
        if lang == "zh" and not lesson.translated["zh"]:
            continue
        doc = lesson.docs[lang]
        rel = doc.relative_to(root)
        steps = [(n, t) for n, t, _ in doc_sections(doc.read_text())[1]]
        numbers = [n for n, _ in steps]
        for n, title in steps:
            if n not in code:
                raise SiteError(f"lesson {lesson.number}: {rel} has Step {n} ({title}) but {src} "
                                f"has no '# Step {n}:' marker; add the step to the code or remove it from the doc")
        for n in code:
            if n not in numbers:
                raise SiteError(f"lesson {lesson.number}: {src} has Step {n} ({code_title[n]}) but "
                                f"{rel} has no '## Step {n}' section; add it to the doc or remove it from the code")
        if code != sorted(set(code)):
            raise SiteError(f"lesson {lesson.number}: the steps of {src} are not in order "
                            f"({', '.join(map(str, code))}); number them 1, 2, 3, ...")
        if numbers != sorted(set(numbers)):
            raise SiteError(f"lesson {lesson.number}: the steps of {rel} are not in order "
                            f"({', '.join(map(str, numbers))}); number them 1, 2, 3, ... as in {src}")


def teaching_table(path: Path) -> dict[str, list[str]]:
    """The cells of the lesson-order table(s), by lesson: the rows whose first cell links a lesson."""
    rows: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        m = re.match(r"\[(\d\d)\]\(", cells[0]) if cells else None
        if m and m[1] not in rows:  # any table of the guide (Part 1, Part 2, ...); first row wins
            rows[m[1]] = cells
    return rows


def teaching_header(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines[:-2]):
        if line.startswith("|") and re.match(r"^\|[-:| ]+\|$", lines[i + 1].strip()) \
                and re.match(r"\|\s*\[\d\d\]\(", lines[i + 2]):
            return [c.strip() for c in line.strip().strip("|").split("|")]
    return []


# ----------------------------------------------------------------------------- rendering

def slug(text: str) -> str:
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return re.sub(r" ", "-", text)


class Site:
    def __init__(self, root: Path, out: Path):
        self.root, self.out = root.resolve(), out.resolve()
        self.warnings: list[str] = []
        self.lessons = find_lessons(root, self.warnings)
        self.by_number = {l.number: l for l in self.lessons}
        self.glossary = self.read_glossary()
        self.formatter = HtmlFormatter(nowrap=True)
        self.copied: set[Path] = set()
        self.pages: dict[Path, str] = {}   # repo path of a markdown doc -> site path

    # --- the map from repo files to site pages
    def doc_pages(self) -> dict[Path, str]:
        pages = {}
        for lesson in self.lessons:
            pages[lesson.docs["en"]] = lesson.page
            # the Chinese page exists even before its doc does (it shows the English one)
            pages[self.root / "docs" / "zh" / lesson.docs["en"].name] = "zh/" + lesson.page
        for doc in sorted((self.root / "docs").glob("*.md")):
            if not re.match(r"\d\d_", doc.name):
                pages[doc] = doc.stem.lower() + ".html"
                zh = self.root / "docs" / "zh" / doc.name
                if zh.exists():
                    pages[zh] = "zh/" + doc.stem.lower() + ".html"
        pages[self.root / "README.md"] = "index.html"
        pages[self.root / "README.zh.md"] = "zh/index.html"
        pages[self.root / "docs"] = "index.html"
        pages[self.root / "docs" / "zh"] = "zh/index.html"
        return {doc.resolve(): page for doc, page in pages.items()}

    def read_glossary(self) -> dict[Path, dict[str, str]]:
        """Each glossary (English, Chinese): its terms' meanings as plain text, by anchor."""
        found = {}
        for path in (self.root / "docs" / "GLOSSARY.md", self.root / "docs" / "zh" / "GLOSSARY.md"):
            if path.exists():
                rows = re.finditer(r'^\| <a id="([\w-]+)"></a>\*\*(.+?)\*\* \| (.+?) \|', path.read_text(), re.M)
                found[path.resolve()] = {m[1]: re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", m[3]) for m in rows}
        return found

    def link(self, href: str, source: Path, page: str) -> tuple[str, str | None]:
        """Where a link written in `source` (a repo file) points from site page `page`;
        and a title for glossary terms."""
        parts = urlsplit(href)
        if parts.scheme or href.startswith(("#", "//", "mailto:")):
            return href, None
        target = (source.parent / unquote(parts.path)).resolve()
        frag = ("#" + parts.fragment) if parts.fragment else ""
        up = "../" * page.count("/")
        title = None
        if target.name == "GLOSSARY.md" and parts.fragment:
            title = self.glossary.get(target, {}).get(parts.fragment)
        if target in self.pages:
            return posixpath.relpath(self.pages[target], posixpath.dirname(page) or ".") + frag, title
        if not target.exists():
            self.warnings.append(f"{source.relative_to(self.root)}: the link {href!r} points to no file")
            return href, None
        docs = self.root / "docs"
        if target.suffix.lower() in {".png", ".svg", ".jpg", ".jpeg", ".gif"} and docs in target.parents:
            rel = target.relative_to(docs)
            if rel.parts[0] == "zh":
                rel = rel.relative_to("zh")
            self.copied.add(target)
            return up + "files/" + quote(str(rel)) + frag, None
        # anything else is a file of the repository: link it where it lies
        rel = os.path.relpath(target, self.out / page.rsplit("/", 1)[0] if "/" in page else self.out)
        return quote(rel) + ("/" if target.is_dir() else "") + frag, None

    def markdown(self, text: str, source: Path, page: str, used: set[str] | None = None) -> str:
        """Markdown to HTML: links mapped into the site, headings given ids (unique within
        `used`: one set for all the pieces of one page), fenced code highlighted."""
        md = MarkdownIt("commonmark", {"html": True, "highlight": self.highlight_fence}).enable("table")
        md.add_render_rule("softbreak", softbreak)
        tokens = md.parse(text)
        used = set() if used is None else used
        for i, tok in enumerate(tokens):
            if tok.type == "heading_open":
                inline = tokens[i + 1]
                ident = base = slug(inline.content) or "section"
                k = 1
                while ident in used:
                    ident, k = f"{base}-{k}", k + 1
                used.add(ident)
                tok.attrSet("id", ident)
            for child in tok.children or []:
                if child.type == "link_open":
                    href, title = self.link(child.attrGet("href") or "", source, page)
                    child.attrSet("href", href)
                    if title:
                        child.attrSet("title", title)
                        child.attrSet("class", "term")
                elif child.type == "image":
                    child.attrSet("src", self.link(child.attrGet("src") or "", source, page)[0])
        return safe_html(md.renderer.render(tokens, md.options, {}))  # the docs' raw HTML too

    def highlight_fence(self, code: str, lang: str, _attrs) -> str:
        name = {"": "text", "mermaid": "text", "sh": "bash"}.get(lang, lang)
        try:
            lexer = get_lexer_by_name(name)
        except ClassNotFound:
            lexer = get_lexer_by_name("text")
        label = f'<span class="lang">{html.escape(lang)}</span>' if lang == "mermaid" else ""
        if name == "text" and lang != "mermaid":  # program output: scrolls sideways, as printed
            return f'<pre class="hl output"><code>{highlight(code, lexer, self.formatter)}</code></pre>'
        lines = highlight(code, lexer, self.formatter).split("\n")[:len(code.splitlines())]
        return f'<pre class="hl">{label}<code>{"".join(code_line(l) for l in lines)}</code></pre>'

    def code_lines(self, lesson: Lesson) -> list[str]:
        text = lesson.path.read_text()
        out = highlight(text, get_lexer_by_name("python"), self.formatter).split("\n")
        return out[:len(text.splitlines())]

    def code_block(self, lesson: Lesson, lines: list[str], lo: int, hi: int, label: str) -> str:
        while lo < hi and not lesson_src(lesson)[lo].strip():
            lo += 1
        while hi > lo and not lesson_src(lesson)[hi - 1].strip():
            hi -= 1
        if hi <= lo:
            return ""
        rows = "".join(code_line(lines[i], i + 1) for i in range(lo, hi))
        rel = lesson.path.relative_to(self.root)
        return (f'<figure class="codebox"><figcaption>{html.escape(label)} · '
                f'<code>{rel}</code> {lo + 1}-{hi}</figcaption>'
                f'<pre class="hl code"><code>{rows}</code></pre></figure>')

    # --- pages
    def page(self, lang: str, page: str, title: str, body: str, other: str | None,
             nav_extra: str = "") -> str:
        w = WORDS[lang]
        up = "../" * page.count("/")
        here = posixpath.dirname(page) or "."
        home = posixpath.relpath(("zh/" if lang == "zh" else "") + "index.html", here)
        glossary = posixpath.relpath(self.pages.get(self.root / "docs" / "zh" / "GLOSSARY.md" if lang == "zh"
                                                    else self.root / "docs" / "GLOSSARY.md",
                                                    ("zh/" if lang == "zh" else "") + "glossary.html"), here)
        switch = (f'<a class="lang" hreflang="{"en" if lang == "zh" else "zh"}" href="{other}">{w["other"]}</a>'
                  if other else "")
        return f"""<!doctype html>
<html lang="{'zh-CN' if lang == 'zh' else 'en'}">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<link rel="stylesheet" href="{up}style.css">
<link rel="stylesheet" href="{up}pygments.css">
<script src="{up}site.js" defer></script>
</head>
<body>
<header class="top"><nav>
<a class="home" href="{home}">{w["course"]}</a>
<a href="{glossary}">{w["glossary"]}</a>
{nav_extra}
<span class="spacer"></span>
{switch}
</nav></header>
<main>
{body}
</main>
</body>
</html>
"""

    def other_lang(self, page: str, lang: str) -> str:
        """The relative address of the same page in the other language."""
        return page.split("/")[-1] if lang == "zh" else "zh/" + page

    def lesson_page(self, lesson: Lesson, lang: str) -> str:
        w = WORDS[lang]
        page = ("zh/" if lang == "zh" else "") + lesson.page
        source = lesson.docs[lang]
        intro, steps, after = doc_sections(source.read_text())
        lines = self.code_lines(lesson)
        i = self.lessons.index(lesson)
        nav, top = [], []  # links under the doc's intro and at its end; a short form in the top bar
        if i > 0:
            p = self.lessons[i - 1]
            nav.append(f'<a rel="prev" href="{p.page}">← {w["prev"]} {p.number}</a>')
            top.append(f'<a rel="prev" href="{p.page}">← {p.number}</a>')
        if i + 1 < len(self.lessons):
            n = self.lessons[i + 1]
            nav.append(f'<a rel="next" href="{n.page}">{w["next"]} {n.number} →</a>')
            top.append(f'<a rel="next" href="{n.page}">{n.number} →</a>')
        if lesson.parent and lesson.parent in self.by_number:
            nav.append(f'<a class="diff" href="{lesson.diff_page}">{w["diff"].format(p=lesson.parent)}</a>')
        rel = lesson.path.relative_to(self.root)
        src_href = quote(os.path.relpath(lesson.path, (self.out / page).parent))
        nav.append(f'<a class="src" href="{src_href}">{w["source"]}: {rel}</a>')
        navline = '<p class="lessonnav">' + " ".join(nav) + "</p>"
        note = "" if lesson.translated[lang] else f'<p class="note">{w["untranslated"]}</p>'
        ids = {f"step-{n}" for n, _, _ in steps}
        rows = [f'<section class="row intro"><div class="doc">{note}{self.markdown(intro, source, page, ids)}'
                f'{navline}</div><div class="code">'
                f'{self.code_block(lesson, lines, *lesson.prologue, w["before"])}</div></section>']
        for n, title, body in steps:
            code = self.code_block(lesson, lines, *lesson.ranges[n], w["step_code"].format(n=n))
            rows.append(f'<section class="row step" id="step-{n}" data-step="{n}">'
                        f'<div class="doc">{self.markdown(body, source, page, ids)}</div>'
                        f'<div class="code">{code}</div></section>')
        tail = self.code_block(lesson, lines, *lesson.epilogue, w["after"])
        if tail:
            rows.append(f'<section class="row epilogue"><div class="doc"><h2>{w["after"]}</h2>'
                        f'<p>{w["after_note"]}</p></div><div class="code">{tail}</div></section>')
        rows.append(f'<section class="after">{self.markdown(after, source, page, ids)}{navline}</section>')
        title = re.sub(r"^#\s*", "", source.read_text().splitlines()[0])
        title = re.sub(r"[`*]", "", title)
        return self.page(lang, page, title, "\n".join(rows), self.other_lang(page, lang) if lang == "en"
                         else "../" + lesson.page, nav_extra=" ".join(top))

    def diff_page(self, lesson: Lesson, lang: str) -> str:
        w = WORDS[lang]
        page = ("zh/" if lang == "zh" else "") + lesson.diff_page
        parent = self.by_number[lesson.parent]
        old, new = parent.path.read_text().splitlines(), lesson.path.read_text().splitlines()
        diff = list(difflib.unified_diff(old, new, f"lessons/{parent.path.name}", f"lessons/{lesson.path.name}",
                                         n=3, lineterm=""))
        added = sum(1 for l in diff if l.startswith("+") and not l.startswith("+++"))
        removed = sum(1 for l in diff if l.startswith("-") and not l.startswith("---"))
        body_lines = highlight("\n".join(diff), get_lexer_by_name("diff"), self.formatter).split("\n")
        rows = "".join(f'<span class="line {cls}">{l or " "}</span>' for l, cls in
                         zip(body_lines, ["add" if d.startswith("+") and not d.startswith("+++") else
                                          "del" if d.startswith("-") and not d.startswith("---") else ""
                                          for d in diff]))
        body = (f'<h1>{w["diff_title"].format(n=lesson.number, p=parent.number)}</h1>'
                f'<p class="lessonnav"><a href="{parent.page}">← {w["lesson"].format(n=parent.number)}</a> '
                f'<a href="{lesson.page}">{w["lesson"].format(n=lesson.number)} →</a></p>'
                f'<p>{w["added"].format(a=added, r=removed)} ({len(old)} → {len(new)} {w["lines"]}). '
                f'{w["diff_cmd"]} <code>make diff TO={lesson.number}</code></p>'
                f'<pre class="hl code diff"><code>{rows}</code></pre>')
        other = self.other_lang(page, lang) if lang == "en" else "../" + lesson.diff_page
        return self.page(lang, page, w["diff_title"].format(n=lesson.number, p=parent.number), body, other)

    def plain_page(self, doc: Path, lang: str) -> str:
        page = self.pages[doc] if lang == "en" else "zh/" + self.pages[doc]
        zh = self.root / "docs" / "zh" / doc.name
        source = zh if lang == "zh" and zh.exists() else doc
        note = f'<p class="note">{WORDS[lang]["untranslated"]}</p>' if lang == "zh" and source == doc else ""
        title = re.sub(r"^#\s*", "", source.read_text().splitlines()[0])
        body = f'<article class="plain">{note}{self.markdown(source.read_text(), source, page)}</article>'
        other = self.other_lang(page, lang) if lang == "en" else "../" + page.split("/")[-1]
        return self.page(lang, page, title, body, other)

    def index_page(self, lang: str) -> str:
        w = WORDS[lang]
        page = "index.html" if lang == "en" else "zh/index.html"
        readme = self.root / ("README.zh.md" if lang == "zh" else "README.md")
        title, intro = "Distributed PyTorch, Step by Step", ""
        if readme.exists():
            text = readme.read_text()
            title = re.sub(r"^#\s*", "", text.splitlines()[0])
            paras = [p for p in re.split(r"\n\s*\n", text) if p.strip() and not p.startswith(("#", ">"))]
            intro = self.markdown(paras[0], readme, page) if paras else ""
        teaching = self.root / "docs" / "TEACHING.md"
        zh_teaching = self.root / "docs" / "zh" / "TEACHING.md"
        source = zh_teaching if lang == "zh" and zh_teaching.exists() else teaching
        header = teaching_header(source) if source.exists() else []
        rows = teaching_table(source) if source.exists() else {}
        md = MarkdownIt("commonmark")  # renders raw HTML: each piece goes through safe_html
        head = header[1:5] if len(header) >= 5 else ["topic", "class time", "prerequisites", "processes"]
        cells = "".join(f"<th>{inline(md, h)}</th>" for h in [header[0] if header else "lesson", *head[1:]])
        trs = []
        for lesson in self.lessons:
            doc = lesson.docs[lang]
            name = re.sub(r"^#\s*", "", doc.read_text().splitlines()[0])
            name = re.sub(r"^(Lesson \d+|第 ?\d+ ?课)[:：]\s*", "", name)
            link = lesson.page
            row = rows.get(lesson.number)
            if row and len(row) >= 5:
                topic, time, prereq, procs = (inline(md, c) for c in row[1:5])
                prereq = re.sub(r"\b(\d\d)\b", lambda m: (f'<a href="{self.by_number[m[1]].page}">{m[1]}</a>'
                                                            if m[1] in self.by_number else m[1]), prereq)
            else:
                topic, time, prereq, procs = w["none"], "", "", ""
            diff = (f' <a class="diff" href="{lesson.diff_page}">diff</a>'
                    if lesson.parent and lesson.parent in self.by_number else "")
            trs.append(f'<tr><td class="num">{lesson.number}</td><td><a href="{link}">'
                       f'{inline(md, name)}</a>{diff}<div class="topic">{topic}</div></td>'
                       f'<td data-label="{html.escape(head[1])}">{time}</td>'
                       f'<td data-label="{html.escape(head[2])}">{prereq}</td>'
                       f'<td data-label="{html.escape(head[3])}">{procs}</td></tr>')
        more = []
        for doc, label in (("TEACHING.md", "teaching"), ("PERFORMANCE.md", "performance")):
            target = self.root / "docs" / doc
            if target in self.pages:
                more.append(f'<a href="{self.pages[target]}">{w[label]}</a>')
        body = (f'<h1>{html.escape(title)}</h1>{intro}<p>{w["index_intro"]}</p>'
                f'<table class="course"><thead><tr><th>#</th>{cells}</tr></thead>'
                f'<tbody>{"".join(trs)}</tbody></table>'
                f'<p class="more">{w["more"]}: {" · ".join(more)}</p>')
        other = "zh/index.html" if lang == "en" else "../index.html"
        return self.page(lang, page, title, f'<article class="index">{body}</article>', other)

    # --- writing
    def build(self) -> list[str]:
        self.pages = self.doc_pages()
        files: dict[str, str] = {}
        for lang in LANGS:
            files[("zh/" if lang == "zh" else "") + "index.html"] = self.index_page(lang)
            for lesson in self.lessons:
                files[("zh/" if lang == "zh" else "") + lesson.page] = self.lesson_page(lesson, lang)
                if lesson.parent and lesson.parent in self.by_number:
                    files[("zh/" if lang == "zh" else "") + lesson.diff_page] = self.diff_page(lesson, lang)
            for doc, page in list(self.pages.items()):
                if doc.parent == self.root / "docs" and doc.suffix == ".md" and not re.match(r"\d\d_", doc.name):
                    files[("zh/" if lang == "zh" else "") + page] = self.plain_page(doc, lang)
        files["style.css"] = (ASSETS / "style.css").read_text()
        files["site.js"] = (ASSETS / "site.js").read_text()
        files["pygments.css"] = HtmlFormatter(style="default").get_style_defs(".hl")
        tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for name, text in files.items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_text(text)
            docs = self.root / "docs"
            for image in self.copied:
                rel = image.relative_to(docs)
                if rel.parts[0] == "zh":
                    rel = rel.relative_to("zh")
                (tmp / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(image, tmp / "files" / rel)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
            raise
        # swap the new site in; keep screenshots a test wrote there
        old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
        if (self.out / "screenshots").is_dir():
            shutil.move(str(self.out / "screenshots"), str(tmp / "screenshots"))
        if self.out.exists():
            self.out.rename(old)
        tmp.rename(self.out)
        shutil.rmtree(old, ignore_errors=True)
        return sorted(files)


_SOURCES: dict[Path, list[str]] = {}


def lesson_src(lesson: Lesson) -> list[str]:
    if lesson.path not in _SOURCES:
        _SOURCES[lesson.path] = lesson.path.read_text().splitlines()
    return _SOURCES[lesson.path]


def build(root: Path = ROOT, out: Path | None = None) -> Site:
    """Build the site of the repository at `root` into `out` (default root/runs/read)."""
    _SOURCES.clear()
    site = Site(root, out or root / "runs" / "read")
    site.out.parent.mkdir(parents=True, exist_ok=True)
    site.build()
    return site


def main(argv: list[str]) -> None:
    from common.cli import fail
    if argv:
        fail(f"make read takes no arguments (got {' '.join(argv)}); run: make read")
    try:
        site = build()
    except SiteError as exc:
        fail(str(exc), code=1)
    for warning in dict.fromkeys(site.warnings):  # each once
        print(f"warning: {warning}", file=sys.stderr)
    index = site.out / "index.html"
    rel = site.out.relative_to(ROOT)
    print(f"Built {rel}/: {len(site.lessons)} lessons, in English and Chinese, each step's doc beside its code.")
    print(f"Open {index.as_uri()}")
    print(f"or serve it: .venv/bin/python -m http.server --bind 127.0.0.1 8000   "
          f"then open http://127.0.0.1:8000/{rel}/")


if __name__ == "__main__":
    main(sys.argv[1:])
