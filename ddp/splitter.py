"""The DDP graph splitter: a Dynamo backend that cuts each captured graph at bucket boundaries.

Note [Graph splitting for DDP]
------------------------------
Background: see ddp/bucketing/planner.py for why pieces must equal buckets, and ddp/alignment.py for
how DDP's reducer is made to use the same buckets.

Algorithm: for every graph Dynamo hands us
  1. find the graph inputs that are trainable parameters of the DDP-wrapped module (by identity, so
     the names are the user's) and plan the buckets (`plan_buckets`);
  2. one bucket: compile the graph whole. Several: `split_module` cuts it into one submodule per
     bucket, keeping the original node order (so in-place ops stay where they were) and re-entering
     autocast / grad-mode regions that cross a cut in each piece;
  3. compile the pieces in forward order with the inner compiler, feeding each piece *fake* inputs
     that carry the metadata the previous compiled piece really produces. AOTAutograd is told to
     return fakes from its first call (`fakify_first_call`), so the strides Inductor picked for a
     piece's outputs reach the next piece's compile instead of the eager strides; symbolic sizes
     travel the same way (`dynamic=True`). Every piece returns a tuple so the compiled callables all
     share one calling convention; a thin module unwraps single outputs again.

Notes: the splitter knows nothing about backends or fallbacks: the caller passes `compile_piece`.
Dynamo keeps one TracingContext per frame, but each piece is its own AOT graph; the per-piece forward
metadata is stacked on `TracingContext.ddp_optimizer_ctx` (the slot torch reserves for this) so that
backward graphs compiled lazily (dynamic shapes) find their own piece's metadata.

Debugging: each recorded `SplitGraph` carries its plan; `str(plan)` shows pieces and parameters;
`TORCH_LOGS=+ddp.splitter` (or logging at DEBUG for `ddp.splitter`) prints the split graph.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Callable, Mapping
from unittest import mock

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from aot.torch_dynamo import PieceMetadata, fake_mode_of, is_fake, saved_tensors_hooks_disabled
from ddp.bucketing import BucketPlan, ParamInfo, plan_buckets, resolve_caps

log = logging.getLogger(__name__)

CompilePiece = Callable[[fx.GraphModule, list, str], "tuple[Callable[..., Any], bool]"]
"""(piece graph, fake example inputs, piece name) -> (compiled callable, whether AOTAutograd ran)."""


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
    """Calls a compiled piece and restores the submodule's own output convention."""

    def __init__(self, fn: Callable[..., Any], single_output: bool) -> None:
        super().__init__()
        self.fn = fn
        self.single_output = single_output

    def forward(self, *args: Any) -> Any:
        out = self.fn(*args)
        return out[0] if self.single_output else out


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
    ) -> None:
        self.config = config
        self.compile_piece = compile_piece
        self.on_graph = on_graph
        self.graph_count = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        name = f"graph_{self.graph_count}"
        table = graph_parameters(gm, self.config.param_names, list(example_inputs))
        plan = plan_buckets(
            gm.graph,
            {k: info for k, (info, _) in table.items()},
            bucket_cap_bytes=self.config.bucket_cap_bytes,
            first_bucket_cap_bytes=self.config.first_bucket_cap_bytes,
            ignore=self.config.ignore,
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
        split_gm = split_module(gm, None, lambda node: piece_of[node.name], keep_original_order=True)
        log.debug("%s split into %d pieces:\n%s", name, plan.num_pieces, split_gm.graph)
        _PieceCompilingInterpreter(split_gm, self.compile_piece, name).compile(example_inputs)
        self.graph_count += 1  # counted once compiled: Dynamo may restart a trace and call us again
        self.on_graph(SplitGraph(name=name, plan=plan, pieces=plan.num_pieces, params=params))
        return split_gm


class _PieceCompilingInterpreter(fx.Interpreter):
    """Runs the split graph on fake inputs, compiling each piece with the metadata it will really see."""

    def __init__(self, split_gm: fx.GraphModule, compile_piece: CompilePiece, graph_name: str) -> None:
        super().__init__(split_gm)
        self.compile_piece = compile_piece
        self.graph_name = graph_name
        self.fake_mode: Any = None
        self.metadata: PieceMetadata | None = None
        self.pieces_done = 0

    def compile(self, example_inputs: list) -> None:
        self.fake_mode = fake_mode_of(example_inputs)
        self.metadata = PieceMetadata()
        fake_inputs = [self._fake(x) for x in example_inputs]
        with saved_tensors_hooks_disabled():
            self.run(*fake_inputs)
        self.module.recompile()

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
        piece_name = f"{self.graph_name}.piece_{self.pieces_done}"
        self.pieces_done += 1

        with self.metadata.fakify_first_call():
            compiled, used_aot = self.compile_piece(submod, list(args), piece_name)
        wrapper = _Piece(compiled, single)
        self.module.delete_submodule(str(n.target))
        n.target = f"compiled_{n.target}"
        self.module.add_submodule(n.target, wrapper)

        # Outputs for the next piece: AOTAutograd returns fakes from its first call (with the strides
        # the compiled code produces) and records this piece's forward metadata.
        with self.fake_mode, mock.patch.object(self.fake_mode, "allow_non_fake_inputs", True):
            if used_aot and self.metadata.active:
                self.metadata.push_piece()
                return wrapper(*args)
            out = submod(*args)
            return out[0] if single else out
