"""Worked solutions for reasoning-gym generators that write none: POPE's and PrefixRL's oracle.

A solution is one step a line, as the methods cut them (methods/prompting.oracle_units: a prefix
of k steps is the first k lines), ending in the boxed answer the real-model prompts ask for. A
writer takes the generator's entry and returns the text, or None where it cannot (the entry is
then left without an oracle, as before).
"""
from __future__ import annotations

import re
from collections.abc import Callable

_TERM = re.compile(r"\s*([+-])\s*(\d+)")


def chain_sum(entry: dict) -> str | None:
    """'914 + 807 - 961' -> '914 + 807 = 1721' / '1721 - 961 = 760' / 'So the answer is
    \\boxed{760}.': a running total, one operation a line."""
    expression = str(entry.get("metadata", {}).get("expression", ""))
    first = re.match(r"\s*(-?\d+)", expression)
    if first is None:
        return None
    total, lines, rest = int(first.group(1)), [], expression[first.end():]
    for sign, digits in _TERM.findall(rest):
        value = int(digits)
        after = total + value if sign == "+" else total - value
        lines.append(f"{total} {sign} {value} = {after}")
        total = after
    if not lines or _TERM.sub("", rest).strip() or str(total) != str(entry["answer"]).strip():
        return None  # an expression this reading does not cover: no oracle rather than a wrong one
    return "\n".join(lines + [f"So the answer is \\boxed{{{total}}}."])


WRITERS: dict[str, Callable[[dict], str | None]] = {"chain_sum": chain_sum}
