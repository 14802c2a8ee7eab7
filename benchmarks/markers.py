"""The markers around the generated part of BENCHMARKS.md, and merging a new generated part into the file
(everything outside the markers is written by hand and kept)."""

from __future__ import annotations

import re
from pathlib import Path

GENERATED_BEGIN = (
    "<!-- generated:begin: `python -m benchmarks` rewrites everything from here to generated:end; "
    "write by hand only outside these markers -->"
)
GENERATED_END = "<!-- generated:end -->"
_BEGIN_RE = re.compile(r"^<!-- generated:begin\b.*$", re.MULTILINE)
_END_RE = re.compile(r"^<!-- generated:end -->[ \t]*$", re.MULTILINE)
GENERATED_SECTIONS = ("What runs", "Machine", "Method", "Results", "Details")
"""`## ` sections the generator writes; in a report from before the markers, any other section is hand-written
and kept."""


def _markers(text: str, where: str) -> tuple[re.Match, re.Match] | None:
    """The generated:begin and generated:end lines of `text`; None when it has neither."""
    begins, ends = list(_BEGIN_RE.finditer(text)), list(_END_RE.finditer(text))
    if not begins and not ends:
        return None
    if len(begins) != 1 or len(ends) != 1 or ends[0].start() < begins[0].end():
        order = " in the wrong order" if len(begins) == len(ends) == 1 else ""
        raise ValueError(
            f"{where}: expected one '<!-- generated:begin ...' line followed by one '{GENERATED_END}' "
            f"line, found {len(begins)} and {len(ends)}{order}; fix the markers by hand (the generator "
            "rewrites only what is between them)"
        )
    return begins[0], ends[0]


def check_markdown(path: Path) -> None:
    """Raise ValueError now if regenerating `path` later would fail (run before any job: the report is
    written hours later)."""
    if path.is_file():
        _markers(path.read_text(), str(path))


def merge_markdown(previous: str | None, generated: str, *, where: str = "BENCHMARKS.md") -> str:
    """The report with `generated` (from `benchmarks_md`) in place of the previous generated part.

    Text outside the markers is kept as it is. A report written before the markers existed keeps its title
    and every `## ` section the generator does not write (`GENERATED_SECTIONS`), after the generated part."""
    if not previous or not previous.strip():
        return "# Benchmarks\n\n" + generated
    marks = _markers(previous, where)
    if marks is not None:
        begin, end = marks
        return previous[: begin.start()] + generated.rstrip("\n") + previous[end.end() :]
    head, *sections = re.split(r"^(?=## )", previous, flags=re.MULTILINE)
    title = next((line for line in head.splitlines() if line.startswith("# ")), "# Benchmarks")
    kept = [
        sec.rstrip("\n")
        for sec in sections
        if re.split(r"[:\n]", sec[3:], maxsplit=1)[0].strip() not in GENERATED_SECTIONS
    ]
    return f"{title}\n\n{generated}" + "".join(f"\n{sec}\n" for sec in kept)
