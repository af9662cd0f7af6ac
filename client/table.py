"""Plain-text tables for the terminal (compare, health)."""

from __future__ import annotations


def format_table(headers: list[str], rows: list[list], right: set[int] = frozenset()) -> str:
    """Columns padded to their widest cell; columns in `right` are right-aligned (numbers)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
