"""The words every bench page shares: one sentence in two languages, Markdown tables, numbers,
and the honest comparison of two measured summaries. A leaf: bench.doc, bench.report and
bench.sharded_transformer import it, it imports none of them (so they no longer import one
another in a circle).
"""
from __future__ import annotations

API = "https://docs.pytorch.org/docs/stable"
TEACHES = ("**What it teaches**", "**从中学到什么**")


class _Lang:
    current = "en"  # the language bench.doc.render() is writing; L() picks the sentence for it


LANG = _Lang()


def L(en: str, zh: str) -> str:
    """The same sentence in English and Chinese; render() decides which one is written."""
    return zh if LANG.current == "zh" else en


def md_table(title: str, columns: list[str], rows: list[list]) -> str:
    def cell(x) -> str:
        return str(x).replace("|", "\\|")
    lines = [f"*{title}*", "", "| " + " | ".join(map(cell, columns)) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def num(x: float) -> str:
    """A number with 3 significant digits, thousands separated: 12,300 / 45.6 / 0.123."""
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def spread(s: dict) -> str:
    return f"{num(s['min'])} - {num(s['max'])}"


# --- comparisons: the only place where a conclusion is drawn from two measurements ---

def order(a: dict, b: dict) -> int:
    """+1 when summary `a` is above `b` beyond the run-to-run spread, -1 below, 0 neither."""
    if a["min"] > b["max"]:
        return 1
    if a["max"] < b["min"]:
        return -1
    return 0


def compare(a: dict, b: dict, than: str = "") -> str:
    """How summary `a` relates to summary `b`, honestly: within the spread is no difference.
    `than` names b: compare(x, y, "the server's") -> "lower than the server's by 12%"."""
    o = order(a, b)
    if o > 0:
        by = a["median"] / b["median"] - 1
        return L(f"higher{' than ' + than if than else ''} by {by:.0%}",
                 f"{'比' + than if than else ''}高 {by:.0%}")
    if o < 0:
        by = 1 - a["median"] / b["median"]
        return L(f"lower{' than ' + than if than else ''} by {by:.0%}",
                 f"{'比' + than if than else ''}低 {by:.0%}")
    return L(f"no different{' from ' + than if than else ''} beyond the run-to-run spread",
             f"{'与' + than if than else ''}在重复测量的波动范围内没有差别")


def real(a: dict, b: dict) -> str:
    """Whether two summaries differ by more than their run-to-run spread."""
    if order(a, b):
        return L("the spreads do not overlap, so the difference is real",
                 "两者的波动范围不重叠，所以这个差别是真实的")
    return L("but the spreads overlap, so this run cannot tell the two apart",
             "但两者的波动范围重叠，所以这次运行无法区分二者")
