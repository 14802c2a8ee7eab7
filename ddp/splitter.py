"""The DDP graph splitter: a Dynamo backend that cuts each captured graph at bucket boundaries.

Note [Graph splitting for DDP]
------------------------------
Background: see ddp/bucketing/planner.py for why pieces must equal buckets, and ddp/alignment.py for
how DDP's reducer is made to use the same buckets.

Algorithm: for every graph Dynamo hands us
  1. find the graph inputs that are trainable parameters of the DDP-wrapped module (by identity, so
     the names are the user's) and plan the buckets (`plan_buckets`), at the boundaries of repeated
     blocks when the model has them (ddp/bucketing/repeats.py), so that their pieces are alike;
  2. one bucket: compile the graph whole. Several: `split_module` cuts it into one submodule per
     bucket, keeping the original node order (so in-place ops stay where they were) and re-entering
     autocast / grad-mode regions that cross a cut in each piece; a float computed before a cut and
     used after it is computed again in the piece that uses it (`_recompute_floats_across_cuts`);
  3. run the split graph once on fake inputs, piece by piece, which gives every piece the metadata
     of its inputs (shapes, strides, symbolic sizes, requires_grad), and hand all pieces to
     `compile_pieces` at once: it may compile identical pieces once, and in any order. Every piece
     returns a tuple so the compiled callables all share one calling convention; a thin module
     unwraps single outputs again.
  4. The fake run gives eager strides. A compiler may choose other strides for a piece's outputs;
     the next piece was compiled for the eager ones, so a piece checks its outputs' strides at run
     time (dims of size > 1; a few tuple compares) and copies an output into the expected layout
     when they differ (`_Piece`). PyTorch's DDPOptimizer instead asks AOTAutograd to return fakes
     with the compiled strides from its first call ("fakify first call"), which makes AOTAutograd
     skip its cache and forces the pieces to be compiled one after the other.

Notes: the splitter knows nothing about backends or fallbacks: the caller passes `compile_piece`
(and, to compile many at once, `compile_pieces`). AOTAutograd compiles each piece's backward with
its forward (compile_core/pieces.py), so no per-piece forward metadata has to wait in Dynamo's
tracing context for a lazily compiled backward.

Debugging: each recorded `SplitGraph` carries its plan; `str(plan)` shows pieces and parameters;
`TORCH_LOGS=+ddp.splitter` (or logging at DEBUG for `ddp.splitter`) prints the split graph.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from aot.torch_aot import fake_mode_of, is_fake
from aot.torch_dynamo import saved_tensors_hooks_disabled
from ddp.bucketing import BucketPlan, ParamInfo, plan_buckets, resolve_caps
from ddp.bucketing.repeats import repeated_units

log = logging.getLogger(__name__)

CompilePiece = Callable[[fx.GraphModule, list, str], "tuple[Callable[..., Any], bool]"]
"""(piece graph, fake example inputs, piece name) -> (compiled callable, whether AOTAutograd ran)."""
CompilePieces = Callable[[list], "list[tuple[Callable[..., Any], bool]]"]
"""[(piece graph, fake example inputs, piece name), ...] in forward order -> one result per piece."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitterConfig:
    """What the splitter needs from the DDP module, frozen at compile time."""

    bucket_cap_bytes: int
    """DDP's bucket cap (or the user's override)."""
    first_bucket_cap_bytes: int
    """Cap of the first bucket (the gradients ready first)."""
    param_names: Mapping[int, str]
    """id(parameter) -> the user's fully qualified name, for the wrapped module's parameters."""
    ignore: frozenset[str] = frozenset()
    """User names DDP does not reduce."""
    split: bool = True
    """False: plan (for the report) but compile every graph whole."""
    align_to_repeats: bool = True
    """Keep cuts in step with repeated blocks where the model has them (ddp/bucketing/repeats.py)."""

    def __post_init__(self) -> None:
        resolve_caps(self.bucket_cap_bytes, self.first_bucket_cap_bytes)


@dataclasses.dataclass
class SplitGraph:
    """One graph as the splitter compiled it."""

    name: str
    """Our name for the graph (`graph_0`, ...)."""
    plan: BucketPlan
    """Its buckets, in backward order; one piece per bucket when split."""
    pieces: int
    """How many pieces were compiled."""
    params: list[list[torch.nn.Parameter]]
    """The real parameters of each bucket, in backward order (for reducer alignment)."""
    restrided: list[int] = dataclasses.field(default_factory=list)
    """Run-time count, per piece in forward order, of outputs copied into the layout the next
    piece was compiled for (see the Note, step 4); normally all zero."""


def graph_parameters(
    gm: fx.GraphModule, param_names: Mapping[int, str], example_inputs: list | None = None
) -> dict[str, tuple[ParamInfo, torch.nn.Parameter]]:
    """Graph node name -> (facts, parameter) for every node that is a trainable parameter we know.

    Dynamo hands a backend the real tensors behind the graph's placeholders, in order, as
    `example_inputs` (node meta holds only fakes once compilation is over).
    """
    found: dict[str, tuple[ParamInfo, torch.nn.Parameter]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    real = dict(zip(placeholders, example_inputs)) if example_inputs is not None else {}
    for node in gm.graph.nodes:
        value = None
        if node.op == "placeholder":
            value = real.get(node)
            if value is None:
                grapharg = node.meta.get("grapharg")
                value = getattr(grapharg, "example", None)
        elif node.op == "get_attr":
            try:
                value = operator.attrgetter(str(node.target))(gm)
            except AttributeError:
                value = None
        if not isinstance(value, torch.nn.Parameter) or not value.requires_grad:
            continue
        name = param_names.get(id(value))
        if name is None:
            continue
        key = f"{value.dtype}/{value.device}"
        found[node.name] = (ParamInfo(name=name, nbytes=value.numel() * value.element_size(), key=key), value)
    return found


class _Piece(torch.nn.Module):
    """Calls a compiled piece, keeps its outputs in the layout the next piece expects, and restores
    the submodule's own output convention."""

    def __init__(
        self, fn: Callable[..., Any], single_output: bool, expected: tuple | None, counts: list[int], index: int
    ) -> None:
        super().__init__()
        self.fn = fn
        self.single_output = single_output
        self.expected = expected
        self.counts = counts
        self.index = index

    def forward(self, *args: Any) -> Any:
        out = self.fn(*args)
        if self.expected is not None:
            out = self._relayout(out)
        return out[0] if self.single_output else out

    def _relayout(self, out: Any) -> Any:
        fixed = None
        for i, want in enumerate(self.expected):
            if want is None:
                continue
            t = out[i]
            if all(a == b for a, b, size in zip(t.stride(), want[1], want[0]) if size > 1):
                continue
            if fixed is None:
                fixed = list(out)
                if self.counts[self.index] == 0:
                    log.debug(
                        "piece %d output %d has strides %s, the next piece expects %s: copying",
                        self.index,
                        i,
                        t.stride(),
                        want[1],
                    )
                self.counts[self.index] += 1
            fixed[i] = t.new_empty_strided(want[0], want[1]).copy_(t)
        return out if fixed is None else type(out)(fixed)


def _expected_layouts(outputs: Any) -> tuple | None:
    """(shape, stride) per output tensor with concrete sizes, None for the rest; None if nothing to check."""
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    layouts = []
    for t in outs:
        if (
            isinstance(t, torch.Tensor)
            and t.layout == torch.strided
            and all(isinstance(v, int) for v in (*t.shape, *t.stride()))
        ):
            layouts.append((tuple(t.shape), tuple(t.stride())))
        else:
            layouts.append(None)
    return tuple(layouts) if any(x is not None for x in layouts) else None


def _returns_tuple(gm: fx.GraphModule) -> bool:
    """Make `gm` return a tuple; report whether it originally returned a single value."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    result = output.args[0]
    if isinstance(result, (tuple, list)):
        return False
    output.args = ((result,),)
    gm.recompile()
    return True


class DDPSplitter:
    """Dynamo backend: plan, split and compile each graph; report each graph through `on_graph`."""

    def __init__(
        self,
        config: SplitterConfig,
        compile_piece: CompilePiece,
        on_graph: Callable[[SplitGraph], None] = lambda g: None,
        *,
        compile_pieces: CompilePieces | None = None,
    ) -> None:
        self.config = config
        self.compile_piece = compile_piece
        self.compile_pieces: CompilePieces = compile_pieces or (
            lambda items: [compile_piece(gm, inputs, name) for gm, inputs, name in items]
        )
        self.on_graph = on_graph
        self.graph_count = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        name = f"graph_{self.graph_count}"
        table = graph_parameters(gm, self.config.param_names, list(example_inputs))
        infos = {k: info for k, (info, _) in table.items()}
        plan = plan_buckets(
            gm.graph,
            infos,
            bucket_cap_bytes=self.config.bucket_cap_bytes,
            first_bucket_cap_bytes=self.config.first_bucket_cap_bytes,
            ignore=self.config.ignore,
            repeats=repeated_units(infos.values()) if self.config.align_to_repeats else None,
        )
        by_name = {info.name: p for info, p in table.values()}
        params = [[by_name[n] for n in b.params] for b in plan.buckets]
        split = self.config.split and plan.num_pieces > 1
        log.debug("%s: %s", name, plan)
        if not split:
            compiled, _ = self.compile_piece(gm, list(example_inputs), name)
            self.graph_count += 1
            self.on_graph(SplitGraph(name=name, plan=plan, pieces=1, params=params))
            return compiled
        piece_of = plan.piece_of()
        _recompute_floats_across_cuts(gm, piece_of)
        split_gm = split_module(gm, None, lambda node: piece_of[node.name], keep_original_order=True)
        log.debug("%s split into %d pieces:\n%s", name, plan.num_pieces, split_gm.graph)
        pieces = _FakeRun(split_gm, name).run_pieces(example_inputs)
        results = self.compile_pieces([(p.submod, p.args, p.name) for p in pieces])
        restrided = [0] * len(pieces)
        for index, (piece, (compiled, used_aot)) in enumerate(zip(pieces, results)):
            expected = _expected_layouts(piece.outputs) if used_aot else None
            wrapper = _Piece(compiled, piece.single, expected, restrided, index)
            split_gm.delete_submodule(str(piece.node.target))
            piece.node.target = f"compiled_{piece.node.target}"
            split_gm.add_submodule(piece.node.target, wrapper)
        split_gm.recompile()
        self.graph_count += 1  # counted once compiled: Dynamo may restart a trace and call us again
        self.on_graph(SplitGraph(name=name, plan=plan, pieces=plan.num_pieces, params=params, restrided=restrided))
        return split_gm


_NUMBER_OPS = ("_operator", "math")
"""Modules whose functions, applied to numbers, have no side effect (Dynamo records Python arithmetic on
numbers as `operator.*` calls)."""


def _recompute_floats_across_cuts(gm: fx.GraphModule, piece_of: dict[str, int]) -> None:
    """Recompute, in the piece that uses it, a float that an earlier piece computed.

    Stochastic depth's `survival = 1.0 - self.p` is a float in the graph: computed from `p.item()`
    while Dynamo keeps `p` as a 0-d tensor, or from a constant once it specialized it. A cut between
    that node and a later use would make the float a piece output, and Inductor takes no float among a
    graph's outputs: the piece fell back to aot_eager, and the tensorified form, which AOTAutograd
    turns back into tensor math only within one graph, made Dynamo trace the whole graph again with
    `p` as a constant. Instead each piece that needs the float gets its own copy of the arithmetic
    (and of the `.item()` it starts from, whose tensor then crosses the cut instead of the float).
    Floats computed any other way stay piece outputs, as before.
    """
    copies: dict[tuple[fx.Node, int], fx.Node] = {}

    def recomputable(node: fx.Node) -> bool:
        if node.op in ("placeholder", "get_attr"):
            return True  # any piece can take it as an input
        if node.op == "call_method" and node.target == "item" and len(node.args) == 1 and not node.kwargs:
            tensor = node.args[0]  # read again later: only if nothing writes it in place
            return not any(
                u.op == "call_method" and str(u.target).endswith("_") and u.args[0] is tensor for u in tensor.users
            )
        if node.op != "call_function" or getattr(node.target, "__module__", None) not in _NUMBER_OPS:
            return False
        return all(recomputable(a) for a in [*node.args, *node.kwargs.values()] if isinstance(a, fx.Node))

    def copy_into(node: fx.Node, piece: int, before: fx.Node) -> fx.Node:
        if node.op in ("placeholder", "get_attr"):
            return node
        key = (node, piece)
        if key not in copies:
            # An `.item()` keeps its tensor (which then crosses the cut); arithmetic copies its operands.
            keep = node.op == "call_method"
            with gm.graph.inserting_before(before):
                copied = gm.graph.node_copy(node, lambda a: a if keep else copy_into(a, piece, before))
            piece_of[copied.name] = piece
            copies[key] = copied
        return copies[key]

    changed = False
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method") or node.name not in piece_of:
            continue
        if not isinstance(node.meta.get("example_value"), (float, torch.SymFloat)) or not recomputable(node):
            continue
        for user in list(node.users):
            piece = piece_of.get(user.name)
            if piece is None or piece == piece_of[node.name]:
                continue
            user.replace_input_with(node, copy_into(node, piece, user))
            changed = True
    if changed:
        gm.recompile()


@dataclasses.dataclass
class _PieceRun:
    """One piece as the fake run met it."""

    node: fx.Node
    submod: fx.GraphModule
    args: list
    single: bool
    name: str
    outputs: Any


class _FakeRun(fx.Interpreter):
    """Runs the split graph on fake inputs, recording what each piece is called with."""

    def __init__(self, split_gm: fx.GraphModule, graph_name: str) -> None:
        super().__init__(split_gm)
        self.graph_name = graph_name
        self.fake_mode: Any = None
        self.pieces: list[_PieceRun] = []

    def run_pieces(self, example_inputs: list) -> list[_PieceRun]:
        self.fake_mode = fake_mode_of(example_inputs)
        fake_inputs = [self._fake(x) for x in example_inputs]
        with saved_tensors_hooks_disabled():
            self.run(*fake_inputs)
        return self.pieces

    def _fake(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not is_fake(x):
            return self.fake_mode.from_tensor(x)
        return x

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_module":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if kwargs:
            raise AssertionError(f"split pieces take positional inputs only, got {list(kwargs)}")
        args = [self._fake(a) for a in args]
        submod = self.fetch_attr(str(n.target))
        single = _returns_tuple(submod)
        # Real tensors (a piece's constants) may meet fake ones in here, for this call only.
        allowed, self.fake_mode.allow_non_fake_inputs = self.fake_mode.allow_non_fake_inputs, True
        try:
            with self.fake_mode:
                out = submod(*args)
        finally:
            self.fake_mode.allow_non_fake_inputs = allowed
        name = f"{self.graph_name}.piece_{len(self.pieces)}"
        self.pieces.append(_PieceRun(node=n, submod=submod, args=list(args), single=single, name=name, outputs=out))
        return out[0] if single else out
