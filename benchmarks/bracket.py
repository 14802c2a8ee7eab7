"""The bracket every mode's step time is read against (pure: aggregated modes in, numbers out).

floor (no communication; benchmarks/bracket_modes.py) is the least a step can cost; floor + comm_only
(all of the step's all-reduces, nothing else) is what it costs when no communication overlaps
anything. Per mode:

  over floor    = mode_ms - floor_ms (and as % of floor_ms): everything the mode adds to the plain
                  compiled step: exposed communication, DDP's and the compile path's own overhead;
  comm hidden   = 1 - (mode_ms - floor_ms) / comm_only_ms: the share of the communication the mode
                  hid, if all of its overhead were communication. 100 %: as fast as the floor; 0 %:
                  as slow as floor + comm_only.

comm hidden is clamped to 0-100 % and the raw value kept: below 0 the mode is slower than floor +
comm_only (it adds more than its communication: overhead that is not communication, or all-reduces
that contend with compute for the cores), above 100 % it is faster than the floor (noise, or a
mode whose compiled compute beats the floor's). The clamped side is named in the table.
"""

from __future__ import annotations

from typing import Any

from benchmarks.config import BRACKET_MODES


def _ok_ms(modes: dict[str, dict[str, Any]], mode: str) -> float | None:
    a = modes.get(mode)
    return a["step_ms"] if a and a.get("status") == "ok" and a.get("step_ms") else None


def _why_missing(modes: dict[str, dict[str, Any]], mode: str) -> str:
    a = modes.get(mode)
    if a is None:
        return f"{mode} not run (add it to --modes)"
    return f"{mode} {a.get('status')}: {a.get('error', 'no step time')}"


def hidden_share(mode_ms: float, floor_ms: float, comm_only_ms: float) -> tuple[float, float, str | None]:
    """(clamped share 0..1, raw share, 'below' | 'above' | None): comm hidden, see the module doc."""
    raw = 1.0 - (mode_ms - floor_ms) / comm_only_ms
    if raw < 0.0:
        return 0.0, raw, "below"
    if raw > 1.0:
        return 1.0, raw, "above"
    return raw, raw, None


def bracket(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The bracket of one workload and every other finished mode's place in it."""
    floor_ms, comm_ms = _ok_ms(modes, "floor"), _ok_ms(modes, "comm_only")
    out: dict[str, Any] = {
        "floor_ms": floor_ms,
        "comm_only_ms": comm_ms,
        "upper_ms": floor_ms + comm_ms if floor_ms is not None and comm_ms is not None else None,
        "missing": [_why_missing(modes, m) for m in BRACKET_MODES if _ok_ms(modes, m) is None],
        "modes": {},
    }
    if floor_ms is None:
        return out
    for mode in modes:
        mode_ms = _ok_ms(modes, mode)
        if mode in BRACKET_MODES or mode_ms is None:
            continue
        row: dict[str, Any] = {
            "over_floor_ms": mode_ms - floor_ms,
            "over_floor_pct": 100.0 * (mode_ms - floor_ms) / floor_ms,
        }
        if comm_ms is not None:
            row["comm_hidden"], row["comm_hidden_raw"], row["clamped"] = hidden_share(mode_ms, floor_ms, comm_ms)
        out["modes"][mode] = row
    return out


def bracket_line(b: dict[str, Any] | None) -> str:
    """The line above a workload's table."""
    if not b:
        return "Bracket: not in these results (no floor or comm_only); no over-floor or comm-hidden figures."
    if b.get("floor_ms") is None and b.get("comm_only_ms") is None:
        return f"Bracket: not measured ({'; '.join(b['missing'])}); no over-floor or comm-hidden figures."
    floor, comm = b.get("floor_ms"), b.get("comm_only_ms")
    if floor is None or comm is None:
        have = f"floor {floor:.1f} ms" if floor is not None else f"comm_only {comm:.1f} ms"
        return f"Bracket: {have} only ({'; '.join(b['missing'])}); comm hidden needs both."
    return (
        f"**Bracket: floor {floor:.1f} ms** (compiled model + optimizer, no communication) **to floor + comm_only "
        f"{b['upper_ms']:.1f} ms** ({floor:.1f} + {comm:.1f}: every all-reduce exposed). Over floor = mode - "
        "floor; comm hidden = 1 - (mode - floor) / comm_only, clamped to 0-100 % (see Method)."
    )


def over_floor_cell(b: dict[str, Any] | None, mode: str) -> str:
    if mode in BRACKET_MODES:
        return "bracket"
    row = ((b or {}).get("modes") or {}).get(mode)
    if not row:
        return "-"
    return f"{row['over_floor_ms']:+.1f} ({row['over_floor_pct']:+.0f}%)"


def comm_hidden_cell(b: dict[str, Any] | None, mode: str) -> str:
    if mode in BRACKET_MODES:
        return "bracket"
    row = ((b or {}).get("modes") or {}).get(mode)
    if not row or "comm_hidden" not in row:
        return "-"
    text = f"{100 * row['comm_hidden']:.0f}"
    if row["clamped"] == "below":
        return f"{text} (raw {100 * row['comm_hidden_raw']:.0f}: slower than floor + comm_only)"
    if row["clamped"] == "above":
        return f"{text} (raw {100 * row['comm_hidden_raw']:.0f}: faster than floor)"
    return text
