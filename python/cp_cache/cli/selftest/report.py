"""The selftest's table, verdict and legend."""

from __future__ import annotations

from .._common import table
from .checks import Row


def _cell(x: float, fmt: str) -> str:
    return "-" if x != x else format(x, fmt)


def report(rows: list[Row]) -> str:
    """The table, one line per case, and the notes of the cases that have one below it."""
    headers = ["case", "check", "error", "bound", "ms/call", "sent", "K/V lower bound", "sent/bound", "result"]
    lines, notes = [], []
    for r in rows:
        error = "-" if r.error != r.error else f"{r.error:.1e}" + (f" ({r.worst})" if r.worst else "")
        ratio = "-" if r.lower != r.lower or r.lower <= 0 else f"{r.sent / r.lower:.2f}"
        if r.note:
            notes.append(f"[{len(notes) + 1}] {r.case}: {r.note}")
        mark = f" [{len(notes)}]" if r.note else ""
        lines.append([r.case, r.check, error, _cell(r.bound, ".1e"), _cell(r.ms, ".1f"), _fmt_bytes(r.sent),
                      _fmt_bytes(r.lower), ratio, r.status + mark])
    return "\n".join([table(headers, lines), *notes])


def _fmt_bytes(n: float) -> str:
    from .._common import fmt_bytes

    return "-" if n != n else fmt_bytes(n)


def verdict(rows: list[Row], world: int, info: dict) -> tuple[bool, str]:
    if not rows:
        return False, "FAIL: no case to run (see --cases)"
    failed = [r.case for r in rows if r.status == "FAIL"]
    checked = [r for r in rows if r.status == "ok"]
    skipped = [r.case for r in rows if r.status == "n/a"]
    where = f"{world} rank{'s' if world > 1 else ''} on {info['device'].split(':')[0]} ({info['ops']} ops, {info['kernel']} step kernel)"
    text = f"{len(checked)} of {len(rows)} cases passed on {where}"
    if skipped:
        text += f"; not run: {', '.join(skipped)}"
    if world == 1:
        text += " (one rank: nothing crossed ranks; launch two or more)"
    if failed:
        return False, f"FAIL: {len(failed)} failed ({', '.join(failed)}); {text}"
    return True, f"PASS: {text}"


LEGEND = """\
fwd+bwd: error = max|CP - float64| / max|float64| of the output (out, lse, dq, dk, dv) nearest its bound;
  bound = 20x the same error of one-device float32 attention on the same inputs + 32 eps
directional (dropout): |autograd slope - central difference| / slope, bound from the differences themselves
ms/call: one forward + backward (median of --repeats, slowest rank); sent: forward bytes, all ranks;
K/V lower bound: K/V rows that some query of a rank may attend to and the rank does not hold, summed
"""
