"""Per step of `ddp="in_graph"`: which variant of the compiled graphs runs, and the ranks' agreement on
the graphs a step ran (Note [ddp="in_graph" at run time] in ddp/in_graph/runtime.py).

A variant is one of `VARIANTS`; `InGraphReducer` holds the current one in a plain string attribute that
the compiled code compares with, so Dynamo guards on it and keeps one cache entry per variant. What a
variant does is read from `accumulates` / `hooked`, never from its spelling.
"""

from __future__ import annotations

from typing import Any

import torch

from ddp.agreement import RankAgreement, RankMismatchError, RankTimeoutError

VARIANTS = ("local", "reduce", "reduce_acc", "reduce_update", "reduce_acc_update")
"""local: no collective (no_sync, no grad); reduce: all-reduce per bucket; _acc: plus the gradients
accumulated by earlier micro-batches; _update: plus the step's hook after each bucket's all-reduce
(ddp/in_graph/hooks.py; the optimizer update per bucket, which names it), whose name may carry
"@<generation>" (`variant_for`)."""

_ACCUMULATING = frozenset({"reduce_acc", "reduce_acc_update"})
_HOOKED = frozenset({"reduce_update", "reduce_acc_update"})


def variant_for(*, sync: bool, accumulated: bool, hooked: bool, generation: int = 0) -> str:
    """The variant of a forward: `sync` (grad mode on and DDP would sync), with gradients `accumulated`
    by earlier micro-batches handed to the graph, `hooked`: with a hook after each bucket's all-reduce,
    whose `generation` (`BackwardHook.generation`, ddp/in_graph/hooks.py) is part of a hooked variant's
    name: a hook that splices something else from now on gets graphs compiled anew, as a variant of
    their own (the old ones stay cached, never run again)."""
    if not sync:
        return "local"
    name = {
        (False, False): "reduce",
        (True, False): "reduce_acc",
        (False, True): "reduce_update",
        (True, True): "reduce_acc_update",
    }[(accumulated, hooked)]
    return f"{name}@{generation}" if hooked and generation else name


def _kind(variant: str) -> str:
    return variant.partition("@")[0]


def accumulates(variant: str) -> bool:
    """Whether the variant's graphs take the accumulated gradients as extra inputs and reduce their sum."""
    return _kind(variant) in _ACCUMULATING


def hooked(variant: str) -> bool:
    """Whether the variant's graphs are compiled with the step's hook after each bucket's all-reduce."""
    return _kind(variant) in _HOOKED


def guard_variant_in(module: torch.nn.Module, holder: Any) -> None:
    """Make every frame Dynamo compiles inside `module` guard on `holder.variant` (the reducer's).

    The compiled entry alone would not do: after a graph break, Dynamo compiles the rest of the
    forward in frames of its own, which never read the variant and would run one variant's graph
    in all of them. Each submodule's call reads it in a pre-hook (Dynamo inlines the hook, so
    compiled code pays nothing; eager code pays one Python call per module call). A frame that starts
    below a module's call (a skipped loop's layers) runs the hook outside itself: ddp/in_graph/dispatch.py.
    """
    read = VariantRead(holder)
    for sub in module.modules():
        sub.register_forward_pre_hook(read)


class VariantRead:
    """The pre-hook of `guard_variant_in`. A copy of the module (`copy.deepcopy`, `torch.save(model)`) gets a
    no-op hook in its place, never the reducer (which holds process groups and cannot be pickled)."""

    def __init__(self, holder: Any) -> None:
        self.holder = holder

    def __call__(self, mod: torch.nn.Module, args: Any) -> None:
        if self.holder.variant == "local":  # the comparison makes Dynamo guard on the value
            return None
        return None

    def __deepcopy__(self, memo: dict) -> Any:
        return _no_op_pre_hook

    def __reduce__(self) -> Any:
        return (_unpickled_variant_read, ())


def _no_op_pre_hook(mod: torch.nn.Module, args: Any) -> None:
    return None


def _unpickled_variant_read() -> Any:
    # what unpickling a `VariantRead` gives (pickle stores this function's name, not the reducer)
    return _no_op_pre_hook


Signature = tuple
"""The graphs one step ran, in order: per graph, its buckets (parameter names) and the wire dtype."""


class GraphsAgreement:
    """The graphs every rank ran in a synchronising step, as last agreed through the store.

    Ranks exchange only when this rank's signature differs from the last agreed one (the first step, a
    new graph, a rank that took another branch): in steady state nothing is exchanged.
    """

    def __init__(self, agreement: RankAgreement) -> None:
        self.agreement = agreement
        self.agreed: Signature | None = None

    def changed(self, signature: Signature) -> bool:
        """Whether `signature` differs from the last agreed one (the ranks will exchange on it)."""
        return signature != self.agreed

    def agree(self, signature: Signature, *, compiled_this_step: bool) -> bool:
        """Agree on `signature` unless it is the last agreed one; True when the ranks exchanged.

        The first agreement waits `first_timeout_s` when this rank compiled (the others may still be
        compiling). A later step that compiled waits `timeout_s`, and on up to `first_timeout_s` only while a
        rank it waits for announces compiles (Note [Rank agreement]): the others either compiled too, or ran
        the graphs agreed before and wait in their all-reduces for this rank, where only this rank's path
        changed (a module hook with a graph break, registered on this rank alone).
        """
        if not self.changed(signature):
            return False
        timeouts = self.agreement.timeouts
        first = compiled_this_step and self.agreed is None
        timeout_s = timeouts.first_timeout_s if first else timeouts.timeout_s
        mid_run = compiled_this_step and not first  # wait longer only for ranks that announce compiles
        busy_up_to_s = timeouts.first_timeout_s if mid_run else None
        try:
            self.agreement.agree(
                "graphs run", signature, describe=describe_signature, timeout_s=timeout_s, busy_up_to_s=busy_up_to_s
            )
        except RankTimeoutError as err:
            if self.agreed is None or err.compiling:
                raise
            # The ranks it waits for may have run the graphs agreed before, which they need not agree on
            # again: they wait in those graphs' all-reduces for this rank, which waits here for them.
            if mid_run:
                why = (
                    "they did not compile what this rank compiled at this step: they run the graphs agreed "
                    "before, whose all-reduces wait for this rank. Make the change that recompiled on every rank "
                    "(register a module hook that breaks the graph, such as one calling .item() or printing a "
                    "tensor, on every rank, or keep it free of graph breaks), or use ddp='split'"
                )
            else:
                why = (
                    "they ran the graphs agreed before and wait in their all-reduces for this rank, which ran "
                    f"other graphs ({describe_signature(signature)}; agreed before: "
                    f"{describe_signature(self.agreed)}) without compiling anything: control flow on this rank's "
                    "data (experts that receive no tokens on some ranks, a branch on a tensor's value) chose other "
                    "parameters. ddp='in_graph' needs the same graphs on every rank at every step; use "
                    "ddp='split' (DDP's reducer, with find_unused_parameters=True for parameters some ranks skip)"
                )
            raise RankTimeoutError(
                f"{err}\nddp='in_graph': if the ranks it waits for are alive, {why}", compiling=err.compiling
            ) from None
        except RankMismatchError as err:
            # Raised on every rank, before any of this step's collectives: nothing hangs.
            raise RankMismatchError(
                f"{err}\nddp='in_graph' needs every rank to run the same compiled graphs in a step (each "
                "graph's backward issues its own all-reduces); these ranks took different paths (control flow "
                "that depends on the rank or its data, or a recompile on one rank). Use ddp='split': DDP's reducer "
                "keeps doing the reduction (with find_unused_parameters=True for branches some ranks skip)"
            ) from err
        self.agreed = signature
        return True

    def check_reduced(self, grads: list[tuple[str, torch.Tensor | None]]) -> None:
        """After the backward of a step whose graphs the ranks just agreed on: the gradients (user name, `.grad`)
        the graphs reduced are the same on every rank, else raise on every rank.

        A compile that leaves the inserted all-reduces out of the backward it builds (Inductor's lite settings
        did, while the report named each bucket's all-reduce) would otherwise train every rank on its own
        gradient, silently. One store exchange of two sums per gradient, only when the graphs change (the first
        step, a new branch, a recompile), never in steady state.
        """
        present = [(name, g.detach()) for name, g in grads if g is not None]
        pairs = [torch.stack([g.double().sum(), g.double().abs().sum()]) for _, g in present]
        sums = torch.stack(pairs).tolist() if pairs else []  # one device sync; every rank exchanges, even empty
        mine = dict(zip([name for name, _ in present], sums))
        for rank, theirs in self.agreement.exchange("reduced gradients", mine).items():
            apart = [n for n, pair in theirs.items() if n in mine and not _same_sums(mine[n], pair)]
            if apart:
                name = apart[0]
                raise RuntimeError(
                    f"ddp='in_graph': after the compiled backward, the gradients of {apart[:5]} differ between rank "
                    f"{self.agreement.rank} and rank {rank} ({name}: sum {mine[name][0]:.6g} against "
                    f"{theirs[name][0]:.6g}): the compiled backward did not all-reduce them, and each rank would "
                    "train its own model. Compile settings that drop the graph's collectives do this (Inductor's "
                    "lite mode, a backend of your own that rebuilds the graph); use ddp='split' with them"
                )


def _same_sums(a: list[float], b: list[float]) -> bool:
    # Every rank receives the same all-reduce result, so the sums agree to the bit; the slack only keeps a
    # backend that sums in another order from stopping a run.
    scale = 1e-6 * max(a[1], b[1]) + 1e-30
    return abs(a[0] - b[0]) <= scale and abs(a[1] - b[1]) <= scale


def describe_signature(signature: Signature) -> str:
    """The graphs of a signature, for people (in a mismatch error)."""
    if not signature:
        return "no compiled graph with collectives"
    graphs = []
    for buckets, wire in signature:
        names = [n for b in buckets for n in b]
        graphs.append(f"{len(buckets)} bucket(s) [{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}] ({wire})")
    return "; ".join(graphs)
