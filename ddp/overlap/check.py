"""`check_alignment` (pure): do DDP's observed buckets end where our planned pieces end?"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketAlignment:
    """Whether one observed bucket ends exactly on a planned piece boundary."""

    index: int
    """Position of the bucket in the observed (DDP) order."""
    params: tuple[str, ...]
    """The bucket's parameters."""
    aligned: bool
    """True when the params of buckets 0..index are exactly the params of planned pieces 0..k for some k."""
    piece: int | None
    """When aligned: the planned piece the boundary falls after; otherwise the first planned piece cut by it."""
    split_before: tuple[str, ...] = ()
    """When misaligned: params of the cut piece(s) that fall in this bucket or an earlier one."""
    split_after: tuple[str, ...] = ()
    """When misaligned: params of the cut piece(s) that fall in a later bucket."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlignmentResult:
    """Outcome of `check_alignment`."""

    buckets: tuple[BucketAlignment, ...]
    """One entry per observed bucket."""
    only_planned: tuple[str, ...] = ()
    """Params in the plan that no observed bucket carries (e.g. unused or ignored by DDP)."""
    only_observed: tuple[str, ...] = ()
    """Params DDP all-reduced that the plan does not know."""
    unused_piece_boundaries: tuple[int, ...] = ()
    """Planned pieces whose end is not a bucket boundary (a graph split that buys no overlap)."""

    @property
    def ok(self) -> bool:
        return all(b.aligned for b in self.buckets) and not self.only_planned and not self.only_observed

    @property
    def mismatched(self) -> list[BucketAlignment]:
        return [b for b in self.buckets if not b.aligned]

    def mismatched_params(self) -> list[str]:
        """Every parameter name involved in any mismatch, in first-seen order."""
        seen: dict[str, None] = {}
        for b in self.mismatched:
            seen.update(dict.fromkeys(b.split_before + b.split_after))
        seen.update(dict.fromkeys(self.only_planned + self.only_observed))
        return list(seen)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "buckets": [dataclasses.asdict(b) for b in self.buckets],
            "only_planned": list(self.only_planned),
            "only_observed": list(self.only_observed),
            "unused_piece_boundaries": list(self.unused_piece_boundaries),
            "mismatched_params": self.mismatched_params(),
        }

    def __str__(self) -> str:
        aligned = sum(b.aligned for b in self.buckets)
        lines = [
            f"bucket alignment: {aligned}/{len(self.buckets)} observed bucket boundaries fall on planned "
            f"piece boundaries" + (" - OK" if self.ok else "")
        ]
        for b in self.mismatched:
            lines.append(
                f"WARNING: bucket {b.index} ends inside planned piece {b.piece}: "
                f"{_names(b.split_before)} | {_names(b.split_after)} are split across buckets, so that piece's "
                "backward must finish before either bucket can start its all-reduce"
            )
        if self.only_planned:
            lines.append(f"WARNING: planned but never all-reduced by DDP: {_names(self.only_planned)}")
        if self.only_observed:
            lines.append(f"WARNING: all-reduced by DDP but missing from the plan: {_names(self.only_observed)}")
        if self.unused_piece_boundaries:
            lines.append(
                f"note: planned pieces {list(self.unused_piece_boundaries)} end where no bucket ends "
                "(extra graph splits that buy no overlap)"
            )
        return "\n".join(lines)


def _names(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]"


def _prefix_sets(groups: Sequence[Sequence[str]]) -> list[frozenset[str]]:
    out, acc = [], set()
    for group in groups:
        acc.update(group)
        out.append(frozenset(acc))
    return out


def _validate_groups(label: str, groups: Any) -> list[list[str]]:
    if isinstance(groups, (str, bytes)) or not all(
        isinstance(g, (list, tuple)) and all(isinstance(n, str) for n in g) for g in groups
    ):
        raise ValueError(
            f"check_alignment({label}={groups!r}): pass a list of lists of parameter names, "
            "e.g. [['head.weight'], ['blocks.1.fc.weight', 'blocks.1.fc.bias']]"
        )
    counts = collections.Counter(n for g in groups for n in g)
    dupes = sorted(n for n, c in counts.items() if c > 1)
    if dupes:
        raise ValueError(f"check_alignment: {label} lists {dupes} more than once; each parameter belongs to one group")
    return [list(g) for g in groups]


def check_alignment(planned: Sequence[Sequence[str]], observed: Sequence[Sequence[str]]) -> AlignmentResult:
    """Compare planned graph pieces with DDP's observed buckets (both in backward order, user names).

    Observed bucket i is aligned when buckets 0..i hold exactly the parameters of planned pieces 0..k for
    some k -- i.e. the bucket ends where a piece ends, so the bucket's all-reduce can start as soon as that
    piece's backward finishes. Order inside a bucket or piece does not matter. Parameters present on only
    one side are reported separately and excluded from the boundary test.
    """
    planned = _validate_groups("planned", planned)
    observed = _validate_groups("observed", observed)
    planned_names = {n for g in planned for n in g}
    observed_names = {n for g in observed for n in g}
    common = planned_names & observed_names
    # Compare on the shared parameters only, so one unknown parameter produces one clear message instead
    # of making every later boundary look wrong.
    plan = [[n for n in g if n in common] for g in planned]
    obs = [[n for n in g if n in common] for g in observed]
    plan_prefixes = _prefix_sets(plan)
    piece_of = {n: i for i, g in enumerate(plan) for n in g}
    boundary_piece = {p: i for i, p in reversed(list(enumerate(plan_prefixes)))}

    results = []
    for i, prefix in enumerate(_prefix_sets(obs)):
        if prefix in boundary_piece:
            results.append(
                BucketAlignment(index=i, params=tuple(observed[i]), aligned=True, piece=boundary_piece[prefix])
            )
            continue
        cut = sorted({piece_of[n] for n in prefix} & {piece_of[n] for n in common - prefix})
        cut_names = [n for k in cut for n in plan[k]]
        results.append(
            BucketAlignment(
                index=i,
                params=tuple(observed[i]),
                aligned=False,
                piece=cut[0] if cut else None,
                split_before=tuple(n for n in cut_names if n in prefix),
                split_after=tuple(n for n in cut_names if n not in prefix),
            )
        )
    observed_prefixes = set(_prefix_sets(obs))
    unused = tuple(
        k for k, p in enumerate(plan_prefixes) if plan[k] and p not in observed_prefixes and k < len(plan) - 1
    )
    return AlignmentResult(
        buckets=tuple(results),
        only_planned=tuple(n for g in planned for n in g if n not in common),
        only_observed=tuple(n for g in observed for n in g if n not in common),
        unused_piece_boundaries=unused,
    )
