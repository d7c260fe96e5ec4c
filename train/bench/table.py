"""The Markdown table every benchmark prints (readable as plain text too): columns padded to their
widest cell."""
from __future__ import annotations


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max([len(h), *(len(row[i]) for row in body)]) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"   # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in body)])
