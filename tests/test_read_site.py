"""`make read`: the reading site (each lesson's doc beside its code), built and then read in a
real headless Chromium.

The site tests need no browser. The browser tests drive Chromium through its DevTools
protocol over a pipe (--remote-debugging-pipe), so they need no driver package: only the
`chromium` binary (Debian: `apt-get install chromium`). Without it they skip with that
reason, except under CI (the CI variable set), where they fail: CI must run them.
"""
from __future__ import annotations

import base64
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from conftest import ROOT

SITE = ROOT / "runs" / "read"
SHOTS = SITE / "screenshots"
# lessons with a doc (make read warns about one without, and test_make_read... fails on it)
LESSONS = [p for p in sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
           if (ROOT / "docs" / f"{p.stem}.md").exists()]
PY = sys.executable


from tools import lesson_diff, read_site  # noqa: E402


@pytest.fixture(scope="module")
def built():
    """`make read`, run once as a learner runs it; every test reads the site it wrote."""
    result = subprocess.run(["make", "--no-print-directory", "read"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result


# ----------------------------------------------------------------------------- the site

def test_make_read_prints_the_address_and_how_to_serve_it(built):
    out = built.stdout
    assert (SITE / "index.html").as_uri() in out
    assert ".venv/bin/python -m http.server --bind 127.0.0.1" in out
    assert "warning" not in built.stderr, built.stderr


def page_ids(path: Path, cache: dict = {}) -> set[str]:
    if path not in cache:
        cache[path] = set(re.findall(r'\b(?:id|name)="([^"]+)"', path.read_text()))
    return cache[path]


class Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.found += [v for k, v in attrs if k in ("href", "src") and v]


def broken_link(page: Path, href: str) -> str | None:
    """None if `href` on `page` resolves to an existing file (and anchor), else why not."""
    parts = urlsplit(href)
    if parts.scheme in ("http", "https", "mailto"):
        return None
    if parts.scheme == "file":
        target = Path(unquote(parts.path))
    else:
        target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
    if not target.exists():
        return f"{href} -> no file {target}"
    if parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in page_ids(target):
        return f"{href} -> no anchor #{parts.fragment} in {target.name}"
    return None


def test_every_link_of_every_page_resolves_and_ids_are_unique(built):
    pages = sorted(SITE.rglob("*.html"))
    assert len(pages) >= 2 * len(LESSONS) + 4
    broken = []
    for page in pages:
        parser = Links()
        parser.feed(page.read_text())
        broken += [f"{page.relative_to(SITE)}: {why}" for href in parser.found
                   if (why := broken_link(page, href))]
        ids = re.findall(r'\bid="([^"]+)"', page.read_text())
        broken += [f"{page.relative_to(SITE)}: id {i!r} twice" for i in sorted(set(ids)) if ids.count(i) > 1]
    assert not broken, "\n".join(broken[:20])


def test_glossary_links_land_on_the_glossary_page_with_the_meaning(built):
    text = (SITE / "05_ddp_spawn.html").read_text()
    term = re.search(r'<a href="glossary\.html#process" title="([^"]+)" class="term">', text)
    assert term and "rank" in term[1], "the glossary link of 'process / rank' is missing or has no title"
    assert 'id="process"' in (SITE / "glossary.html").read_text()


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_each_doc_step_is_one_row_with_its_code(built, lesson):
    code_steps = [int(n) for n in re.findall(r"^\s*# Step (\d+):", lesson.read_text(), re.M)]
    for lang, page in (("en", SITE / f"{lesson.stem}.html"), ("zh", SITE / "zh" / f"{lesson.stem}.html")):
        text = page.read_text()
        rows = re.findall(r'<section class="row step" id="step-(\d+)" data-step="\d+">'
                          r'<div class="doc">(.*?)</div><div class="code">(.*?)</div></section>', text, re.S)
        assert [int(n) for n, _, _ in rows] == code_steps, f"{lang}: the rows are not the code's steps"
        for n, doc, code in rows:
            assert re.search(rf"<h2[^>]*>(Step|步骤|第)\s*{n}\b", doc), f"{lang} row {n}: no doc heading"
            plain = re.sub(r"<[^>]+>", "", code)
            assert re.search(rf"# Step {n}:", plain), f"{lang} row {n}: the code is not Step {n}'s"
            other = [m for m in re.findall(r"# Step (\d+):", plain) if int(m) != int(n)]
            assert not other, f"{lang} row {n} also holds Step {other}"
        assert f'href="{"../" if lang == "zh" else "zh/"}{lesson.stem}.html"' in text, "no language switch"


def test_steps_split_the_whole_file(built):
    """Prologue, steps and epilogue together show every line of a lesson exactly once."""
    for lesson in read_site.find_lessons(ROOT):
        pieces = [lesson.prologue, *[lesson.ranges[n] for n, _ in lesson.steps], lesson.epilogue]
        assert pieces[0][0] == 0 and pieces[-1][1] == len(lesson.path.read_text().splitlines())
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), lesson.path.name


CJK_BREAK = re.compile(r"([\u4e00-\u9fff\u3000-\u303f\uff00-\uffef])\s*\n\s*([\u4e00-\u9fff\u3000-\u303f\uff00-\uffef])")


def test_chinese_line_breaks_show_no_space(built):
    """Where a Chinese doc's Markdown breaks a line inside Chinese text, the page joins the two
    lines (a browser shows a line break as a space, which Chinese text does not have); between
    Chinese and Latin text the break stays (the docs write `使用 torch`). docs/zh/21 breaks
    one sentence as `...收集回原位后` / `与答案比较...`."""
    assert read_site.joins_without_space("后", "与") and read_site.joins_without_space("。", "T")
    assert not read_site.joins_without_space("是", "F") and not read_site.joins_without_space("d", "e")
    assert "收集回原位后\n与答案比较" in (ROOT / "docs" / "zh" / "21_context_parallel.md").read_text()
    page = (SITE / "zh" / "21_context_parallel.html").read_text()
    assert "各部分收集回原位后与答案比较" in page
    found = []
    for path in sorted((SITE / "zh").glob("*.html")):
        for paragraph in re.findall(r"(?s)<(?:p|li|td)\b[^>]*>(.*?)</(?:p|li|td)>", path.read_text()):
            prose = re.sub(r"<[^>]+>", "", re.sub(r"(?s)<pre\b.*?</pre>", "", paragraph))
            found += [f"{path.name}: {m[0]!r}" for m in CJK_BREAK.finditer(prose)]
    assert not found, "\n".join(found[:20])


def test_code_lines_keep_their_indentation_apart_from_the_text(built):
    """Every line of code the site shows (a doc's fenced code, a lesson's code) is its
    indentation and the rest, so that a long line can wrap under itself (the browser test
    below measures it); program output is left as printed."""
    page = (SITE / "05_ddp_spawn.html").read_text()
    lines = re.findall(r'<span class="line"(?: id="L\d+")?>(?:<a class="ln"[^>]*>\d+</a>)?'
                       r'<span class="ws">( *)</span><span class="rest">', page)
    assert len(lines) > 200 and any(len(ws) >= 8 for ws in lines), len(lines)
    assert '<pre class="hl output"><code>' in page and not re.search(
        r'<pre class="hl output"><code>[^<]*<span class="line"', page)


def test_index_is_the_course_from_teaching_md(built):
    text = (SITE / "index.html").read_text()
    teaching = (ROOT / "docs" / "TEACHING.md").read_text()
    for lesson in LESSONS:
        assert f'href="{lesson.stem}.html"' in text
        row = re.search(rf"^\| \[{lesson.name[:2]}\]\([^)]*\) \| [^|]+ \| ([^|]+) \|", teaching, re.M)
        if row:  # the class time comes from the teaching guide's table
            assert row[1].strip() in text, f"lesson {lesson.name[:2]}: {row[1].strip()} not on the index"
    positions = [text.index(f'href="{lesson.stem}.html"') for lesson in LESSONS]
    assert positions == sorted(positions), "the lessons are not in order"


def copy_repo_subset(dest: Path) -> None:
    """The least a build needs: tools, common, lesson 01 and its docs, the glossary, TEACHING."""
    for folder in ("tools", "common"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "lessons").mkdir()
    (dest / "docs" / "zh").mkdir(parents=True)
    shutil.copy(ROOT / "lessons" / "01_single_device.py", dest / "lessons")
    shutil.copy(ROOT / "docs" / "01_single_device.md", dest / "docs")
    shutil.copy(ROOT / "docs" / "zh" / "01_single_device.md", dest / "docs" / "zh")
    for name in ("GLOSSARY.md", "TEACHING.md"):
        shutil.copy(ROOT / "docs" / name, dest / "docs")


def build_with_a_child_lesson(tmp_path: Path):
    """A copy of lesson 01 and a lesson 13 that names it as its parent, built into a site."""
    copy_repo_subset(tmp_path)
    text = (tmp_path / "lessons" / "01_single_device.py").read_text()
    child = text.replace("Doc: docs/01_single_device.md",
                         "Parent: lesson 01 (lessons/01_single_device.py)\n\nDoc: docs/13_child.md", 1)
    child = child.replace("# Step 1:", "NEW_IDEA = 1  # the new idea\n    # Step 1:", 1)
    (tmp_path / "lessons" / "13_child.py").write_text(child)
    for doc in ("docs/01_single_device.md", "docs/zh/01_single_device.md"):
        shutil.copy(tmp_path / doc, tmp_path / doc.replace("01_single_device", "13_child"))
    return read_site.build(tmp_path)


def test_a_child_lesson_links_its_parent_diff(tmp_path):
    site = build_with_a_child_lesson(tmp_path)
    page = (site.out / "13_child.html").read_text()
    assert 'href="13_child.diff.html"' in page and 'rel="prev" href="01_single_device.html"' in page
    diff = (site.out / "13_child.diff.html").read_text()
    assert re.search(r'<span class="line add">.*NEW_IDEA', diff)
    counts = re.search(r"(\d+) lines added, (\d+) removed", diff)
    added = lesson_diff.added_lines(tmp_path / "lessons" / "01_single_device.py", tmp_path / "lessons" / "13_child.py")
    assert "make diff TO=13" in diff and counts and int(counts[1]) == added
    assert int(counts[1]) + int(counts[2]) == 5
    assert 'href="zh/13_child.diff.html"' in diff
    assert (site.out / "zh" / "13_child.diff.html").exists()


@pytest.mark.parametrize("change", ["doc", "code"])
def test_a_step_missing_on_one_side_stops_the_build_with_one_line(tmp_path, change):
    copy_repo_subset(tmp_path)
    out = read_site.build(tmp_path).out  # a good site first: a failed build must leave it alone
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    doc = tmp_path / "docs" / "01_single_device.md"
    lesson = tmp_path / "lessons" / "01_single_device.py"
    if change == "doc":  # the doc gains a step the code lacks
        doc.write_text(doc.read_text().replace("## What to look for", "## Step 7: Celebrate\n\nYes.\n\n"
                                               "## What to look for", 1))
    else:  # the code gains a step the doc lacks
        lesson.write_text(lesson.read_text().replace("\nif __name__", "\n    # Step 7: Celebrate\n"
                                                     "    pass\n\nif __name__", 1))
    result = subprocess.run([PY, "tools/read_site.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: lesson 01:"), result.stderr
    assert "Step 7 (Celebrate)" in lines[0]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before, "the old site was touched"
    assert not list(out.parent.glob(".read.*")), "a half-built site was left behind"


HOSTILE = """
<script>document.title = "ran"</script>

<style>body { display: none }</style>

<iframe src="https://evil.example/"></iframe>

A picture <img src="x.png" onerror="alert('img')"> and a <a href="javascript:alert('a')">link</a>,
a [markdown link](javascript:alert('md')), <svg onload="alert('svg')"></svg>,
<div onclick="alert('div')">a box</div> <object data="evil.swf"></object>
<form action="https://evil.example/"><input name="q"></form>
<a href="JaVaScRiPt:alert('case')">shouting</a> <a href="data:text/html,<script>alert(1)</script>">data</a>

<a id="kept-anchor"></a>A paragraph the docs link to, with an anchor that must stay.
"""


class Hostile(html.parser.HTMLParser):
    """What a page's body holds that could run code, load a page or restyle the site."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self.anchors: list[str] = []
        self.in_head = False

    def handle_starttag(self, tag, attrs):
        self.in_head = self.in_head or tag == "head"
        if tag == "a" and dict(attrs).get("id"):
            self.anchors.append(dict(attrs)["id"])
        if self.in_head:  # the page's own stylesheets and site.js
            return
        if tag in ("script", "style", "iframe", "object", "embed", "form", "input", "svg", "link", "meta"):
            self.found.append(f"<{tag}>")
        for name, value in attrs:
            if name.startswith("on") or name == "style" and tag not in ("th", "td"):
                self.found.append(f"<{tag} {name}>")
            if name in ("href", "src", "action", "data") and re.match(r"\s*(javascript|data|vbscript):", value or "", re.I):
                self.found.append(f"<{tag} {name}={value}>")

    def handle_endtag(self, tag):
        self.in_head = self.in_head and tag != "head"


def test_raw_html_in_the_docs_is_sanitized_keeping_anchors(tmp_path):
    """Issue 35: `make read` copied raw HTML from the docs into the site (markdown-it with
    html enabled): <script>, <img onerror>, <iframe>, <style>, javascript: links, the title
    line's too, on the lesson pages and the index. The site keeps an allow-list (nh3): the
    docs' <a id=...> anchors stay, everything that runs code or loads a page goes."""
    copy_repo_subset(tmp_path)
    for doc in (tmp_path / "docs" / "01_single_device.md", tmp_path / "docs" / "zh" / "01_single_device.md"):
        lines = doc.read_text().split("\n")
        lines[0] += ' <img src="t.png" onerror="alert(\'title\')"><script>alert("title")</script>'
        text = "\n".join(lines)
        cut = text.index("\n## ")  # in the intro, and in the first step's section
        first = next(m.start() for m in re.finditer(r"^## .*", text, re.M) if read_site.DOC_STEP.match(m[0]))
        step = text.index("\n## ", first)
        text = text[:step] + "\n" + HOSTILE + text[step:]
        doc.write_text(text[:cut] + "\n" + HOSTILE + text[cut:])
    (tmp_path / "README.md").write_text("# The course <script>alert('readme')</script>\n\n"
                                        "Intro <img src=x onerror=alert('readme')> here.\n")
    site = read_site.build(tmp_path)
    pages = sorted(site.out.rglob("*.html"))
    assert any(p.name == "01_single_device.html" for p in pages) and site.out / "index.html" in pages
    for page in pages:
        text = page.read_text()
        parser = Hostile()
        parser.feed(text)
        assert parser.found == [], f"{page.relative_to(site.out)}: {parser.found}"
        if page.name == "01_single_device.html":
            assert parser.anchors.count("kept-anchor") == 2, (page, parser.anchors)  # intro and Step 1
            assert "A paragraph the docs link to" in text and "a box" in text  # the text stays


# ----------------------------------------------------------------------------- in Chromium

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--no-default-browser-check", "--hide-scrollbars", "--mute-audio",
         "--remote-debugging-pipe"]
LAPTOP, PHONE = (1366, 800), (390, 844)


def chromium_binary() -> str | None:
    for name in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        if name and (found := shutil.which(name)):
            return found
    return None


class Chromium:
    """Just enough of the DevTools protocol, spoken over the pipe Chromium opens on fds 3
    and 4 (--remote-debugging-pipe): JSON messages, each ended by a NUL byte."""

    def __init__(self, binary: str, profile: Path):
        import queue
        import threading
        import fcntl
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()
        # bash moves Chromium's pipe ends to fds 3 and 4, then becomes Chromium; first lift
        # them above 9, so that neither is 3 or 4 already (closing it would close fd 3 or 4)
        def lift(fd: int) -> int:
            high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
            os.close(fd)
            return high
        to_r, from_w = lift(to_r), lift(from_w)
        script = f'exec "$0" "$@" 3<&{to_r} 4>&{from_w} {to_r}<&- {from_w}>&-'
        self.log = open(profile / "chromium.log", "wb")
        self.proc = subprocess.Popen(["bash", "-c", script, binary, *FLAGS, f"--user-data-dir={profile}"],
                                     pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=self.log)
        os.close(to_r)
        os.close(from_w)
        self._messages: queue.Queue = queue.Queue()
        self._events: list[dict] = []
        self._id = 0
        threading.Thread(target=self._read, daemon=True).start()
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session=True)

    def _read(self):
        buf = bytearray()
        while chunk := os.read(self._from_r, 1 << 20):
            buf += chunk
            while (end := buf.find(b"\0")) >= 0:
                self._messages.put(json.loads(buf[:end]))
                del buf[:end + 1]
        self._messages.put(None)

    def _next(self, deadline: float) -> dict:
        import queue
        try:
            message = self._messages.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("Chromium did not answer in time") from None
        if message is None:
            raise RuntimeError(f"Chromium exited (code {self.proc.poll()}); see {self.log.name}")
        return message

    def send(self, method: str, params: dict | None = None, session: bool = False, timeout: float = 30):
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_w, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._next(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self._events.append(reply)

    def wait_for(self, method: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for event in self._events:
                if event.get("method") == method:
                    self._events.remove(event)
                    return event
            self._events.append(self._next(deadline))

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads since the last call."""
        found = []
        for event in self._events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(params["exceptionDetails"].get("text", "exception"))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(" ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(f'{params["entry"]["text"]} {params["entry"].get("url", "")}')
        self._events.clear()
        return found

    def viewport(self, size: tuple[int, int]) -> None:
        self.send("Emulation.setDeviceMetricsOverride", {"width": size[0], "height": size[1],
                  "deviceScaleFactor": 1, "mobile": size[0] < 600}, session=True)

    def open(self, url: str) -> None:
        self._events.clear()
        self.send("Page.navigate", {"url": url}, session=True)
        self.wait_for("Page.loadEventFired")

    def eval(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, session=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:60]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click in the middle of the element."""
        box = self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
                        f" e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect();"
                        f" return [r.left + r.width / 2, r.top + r.height / 2]; }})()")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1],
                                                   "button": "left", "clickCount": 1}, session=True)

    def screenshot(self, path: Path, clip: dict | None = None) -> None:
        params = {"format": "png"}
        if clip:
            params.update(clip=dict(clip, scale=1), captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", params, session=True)["data"]))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._to_w)
        self.log.close()


@pytest.fixture(scope="module")
def browser(built):
    binary = chromium_binary()
    if not binary:
        why = ("no Chromium found (looked for chromium, chromium-browser, google-chrome; "
               "install it with: sudo apt-get install chromium)")
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the browser tests")
        pytest.skip(why)
    with tempfile.TemporaryDirectory(prefix="read-site-chromium-") as profile:
        chromium = Chromium(binary, Path(profile))
        try:
            yield chromium
        finally:
            chromium.close()


# what one page looks like to the reader, measured in the browser
INSPECT = """(() => {
  const rect = e => e.getBoundingClientRect();
  const rows = [...document.querySelectorAll('section.row.step')].map(row => {
    const doc = row.querySelector(':scope > .doc'), code = row.querySelector(':scope > .code');
    const d = rect(doc), c = rect(code), h = doc.querySelector('h2');
    return {step: row.dataset.step, heading: h ? h.textContent : '', code: code.innerText,
            docTop: d.top, codeTop: c.top, docRight: d.right, docBottom: d.bottom,
            codeLeft: c.left, codeWidth: c.width, codeHeight: c.height};
  });
  const cut = [...document.querySelectorAll('pre')].filter(p => {
    const x = getComputedStyle(p).overflowX;
    return p.scrollWidth > p.clientWidth + 1 && !(x === 'auto' || x === 'scroll');
  }).map(p => p.textContent.slice(0, 60));
  const wide = [...document.querySelectorAll('pre.code')].filter(p => p.scrollWidth > p.clientWidth + 1).length;
  return {url: location.href, rows, cut, wideLessonCode: wide,
          pageOverflow: document.documentElement.scrollWidth - window.innerWidth,
          links: [...document.querySelectorAll('[href], [src]')].map(e => e.href || e.src),
          lang: document.documentElement.lang};
})()"""


def inspect(browser: Chromium, page: Path, phone: bool = False) -> list[str]:
    """Everything wrong with one page, as seen in the browser."""
    browser.open(page.as_uri())
    seen = browser.eval(INSPECT)
    name = str(page.relative_to(SITE)) if SITE in page.parents else page.name
    problems = [f"{name}: console: {e}" for e in browser.errors()]
    problems += [f"{name}: a code block is cut off: {text!r}" for text in seen["cut"]]
    if seen["wideLessonCode"]:
        problems.append(f"{name}: {seen['wideLessonCode']} lesson code blocks are wider than their box")
    if seen["pageOverflow"] > 0:
        problems.append(f"{name}: the page is {seen['pageOverflow']}px wider than the window")
    problems += [f"{name}: {why}" for href in seen["links"] if (why := broken_link(page, href))]
    for row in seen["rows"]:
        n = row["step"]
        if not re.match(rf"(Step|步骤|第)\s*{n}\b", row["heading"]):
            problems.append(f"{name}: row {n} opens with {row['heading']!r}, not its step")
        if f"# Step {n}:" not in row["code"] or row["codeWidth"] < 100 or row["codeHeight"] < 20:
            problems.append(f"{name}: step {n}'s code is missing from its row")
        if not phone and (abs(row["docTop"] - row["codeTop"]) > 2 or row["codeLeft"] < row["docRight"]):
            problems.append(f"{name}: step {n}'s code is not beside its doc")
        if phone and row["codeTop"] < row["docBottom"] - 1:
            problems.append(f"{name}: at phone width step {n}'s code is not under its doc")
    return problems


def test_every_page_in_chromium_at_laptop_width(browser):
    """No console errors, every doc step beside its code, no code cut off, every link resolves."""
    browser.viewport(LAPTOP)
    pages = sorted(SITE.rglob("*.html"))
    problems = [p for page in pages for p in inspect(browser, page)]
    assert not problems, "\n".join(problems[:30])


def test_lesson_pages_at_phone_width_stack_doc_and_code(browser):
    browser.viewport(PHONE)
    pages = [SITE / "index.html", SITE / "zh" / "index.html", SITE / "glossary.html",
             *(SITE / f"{lesson.stem}.html" for lesson in LESSONS), SITE / "zh" / f"{LESSONS[-1].stem}.html"]
    problems = [p for page in pages for p in inspect(browser, page, phone=True)]
    assert not problems, "\n".join(problems[:30])


WRAPS = """(() => {
  const found = {wrapped: 0, indented: 0, dedented: []};
  document.querySelectorAll('pre.hl:not(.output):not(.diff) .line').forEach(line => {
    const rest = line.querySelector(':scope > .rest'), ws = line.querySelector(':scope > .ws');
    const range = document.createRange();
    range.selectNodeContents(rest || line);
    const rects = [...range.getClientRects()].filter(r => r.width > 0);
    const tops = [...new Set(rects.map(r => Math.round(r.top)))].sort((a, b) => a - b);
    if (tops.length < 2) return;
    found.wrapped++;
    if (ws && ws.getBoundingClientRect().width > 0) found.indented++;
    const first = Math.min(...rects.filter(r => Math.round(r.top) === tops[0]).map(r => r.left));
    if (Math.min(...rects.map(r => r.left)) < first - 0.5)
      found.dedented.push(line.textContent.trim().slice(0, 70));
  });
  return found;
})()"""


def test_long_code_lines_wrap_under_their_own_indentation(browser):
    """At phone width many code lines wrap. Each piece of a wrapped line starts at or right of
    the line's first character: none goes back to column 0 (it looked dedented, which in
    Python reads as another block). In the docs' code and in the lessons' code alike."""
    browser.viewport(PHONE)
    total = {"wrapped": 0, "indented": 0}
    for page in (SITE / "05_ddp_spawn.html", SITE / "21_context_parallel.html",
                 SITE / "zh" / "21_context_parallel.html"):
        browser.open(page.as_uri())
        seen = browser.eval(WRAPS)
        assert not seen["dedented"], f"{page.name}: wrapped back to column 0: {seen['dedented'][:5]}"
        total["wrapped"] += seen["wrapped"]
        total["indented"] += seen["indented"]
    assert total["wrapped"] > 20 and total["indented"] > 5, total


def test_a_parent_diff_page_in_chromium(browser, tmp_path):
    site = build_with_a_child_lesson(tmp_path)
    for size, phone in ((LAPTOP, False), (PHONE, True)):
        browser.viewport(size)
        for page in ("13_child.html", "13_child.diff.html", "zh/13_child.diff.html"):
            problems = inspect(browser, site.out / page, phone)
            assert not problems, "\n".join(problems)


def test_language_switch_lands_on_the_same_lesson(browser):
    browser.viewport(LAPTOP)
    for lesson in (LESSONS[0], LESSONS[-1]):
        browser.open((SITE / f"{lesson.stem}.html").as_uri())
        browser.click("a.lang")
        browser.wait_for("Page.loadEventFired")
        assert browser.eval("location.href") == (SITE / "zh" / f"{lesson.stem}.html").as_uri()
        assert browser.eval("document.documentElement.lang") == "zh-CN"
        browser.click("a.lang")
        browser.wait_for("Page.loadEventFired")
        assert browser.eval("location.href") == (SITE / f"{lesson.stem}.html").as_uri()
        assert not browser.errors()


def test_screenshots_at_laptop_and_phone_width(browser):
    """Written for a person to look at: the index, and a lesson at its first steps."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    lesson = next((p for p in LESSONS if p.name.startswith("05_")), LESSONS[0])
    for size, tag in ((LAPTOP, "laptop"), (PHONE, "phone")):
        browser.viewport(size)
        browser.open((SITE / "index.html").as_uri())
        browser.screenshot(SHOTS / f"index-{tag}.png")
        browser.open((SITE / f"{lesson.stem}.html").as_uri())
        # from Step 1's heading; at phone width from just above its code, under its doc
        top = browser.eval("Math.max(...[...document.querySelectorAll('#step-1, #step-1 > .code')].map("
                           f"(e, i) => e.getBoundingClientRect().top + scrollY - i * {size[1] // 2}))")
        browser.screenshot(SHOTS / f"{lesson.stem}-{tag}.png",
                           clip={"x": 0, "y": top - 60, "width": size[0], "height": int(size[1] * 1.6)})
        assert not browser.errors()
    for shot in SHOTS.glob("*.png"):
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000, shot.name
