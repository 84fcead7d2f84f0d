"""The intra-op pass on one logical mesh: op graph -> strategies -> Eq. 3.1 -> a spec for every tensor.

Pipeline (each step a pure function):

1. :func:`strategy_table`: every node's strategy list. Roots enumerate theirs (inputs: every spec of
   their shape; heavy operators: :data:`~alpa_like.compiler.strategies.ROOT_RULES`); merged nodes derive
   one strategy per strategy of the node they follow (:mod:`alpa_like.compiler.propagation`), so a merged
   group shares one decision vector ``s_v``.
2. :func:`build_problem`: the ILP arrays. ``c_v`` sums the members' collectives (and the resharding
   inside the group); ``R_vu`` is Table 3.2's :func:`resharding_cost` of every tensor between two groups,
   tabulated once per (shape, spec pair) and gathered with numpy fancy indexing. Step outputs that update
   an input (``new_params -> params``) get an edge to that input, so the layout is stable across steps.
3. :func:`auto_shard`: solves and returns a :class:`ShardingSolution` (:func:`prepare` then
   :func:`solve_prepared`; a prepared pass can be solved again with some inputs limited to fewer specs,
   an exact restriction that skips steps 1 and 2, as the stage profiler's "params-sharded" variant does).
   :func:`price_on` turns a plan solved on another mesh of the same shape (e.g. :func:`without_latency`)
   into a solution of this one, its costs those of this mesh (``ShardParallel``'s measured selection).

A tie-break of ``1e-6`` of the cheapest per-byte link cost per byte of every tensor kept per device makes
the solver prefer sharded layouts when communication is equal; :attr:`ShardingSolution.objective` excludes
it (it is Eq. 3.1's communication cost exactly).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
import threading
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
from jax.extend.core import Literal

from alpa_like.compiler import jax_compat
from alpa_like.compiler.flops import ComputeRates
from alpa_like.compiler.ilp import DEFAULT_SOLVER, IlpEdge, IlpProblem, IlpSolution, restrict, solve
from alpa_like.compiler.logical_mesh import LogicalMesh
from alpa_like.compiler.op_graph import (
    CONTROL_FLOW,
    OpGraph,
    OpNode,
    gradient_nodes,
    gradient_producers,
    merged_groups,
)
from alpa_like.compiler.propagation import FOLLOW_RULES
from alpa_like.compiler.sharding_spec import (
    ReshardStep,
    ShardingSpec,
    clear_resharding_caches,
    describe_resharding,
    enumerate_specs,
    resharding_seconds,
)
from alpa_like.compiler.strategies import (
    HEAVY_PRIMITIVES,
    ROOT_RULES,
    Strategy,
    StrategyContext,
    make_spec,
    make_strategy,
    replicated,
    replicated_strategy,
    shards,
)

TIE_BREAK = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassOptions:
    """Knobs of the pass on one mesh (the user-facing ones live in ``AutoShardingOption``)."""

    memory_budget: float | None = None
    """Bytes per device for the tensors live at any time, or None."""
    allow_all_to_all: bool = True
    """False prices every resharding as all-gathers then a local slice."""
    input_candidates: Mapping[int, tuple[ShardingSpec, ...]] = dataclasses.field(default_factory=dict)
    """Per jaxpr input index, the specs allowed (default: every spec of its shape)."""
    solver_time_limit: float = 60.0
    solver: str = DEFAULT_SOLVER
    """MILP backend, one of :data:`alpa_like.compiler.ilp.SOLVERS`."""
    rates: ComputeRates = ComputeRates(1e12)
    """How fast one device computes (``ClusterSpec.compute_rates``), to price work a strategy repeats on
    replicated devices."""
    node_weights: tuple[float, ...] | None = None
    """Per graph node, how many times it runs per step (e.g. ``num_micro_batches`` for compute-grad
    equations under gradient accumulation); its costs and its operands' resharding are scaled by it."""
    gradient_outputs: frozenset[int] = frozenset()
    """Indices of the jaxpr's outputs that are gradients, for a piece of a step cut before its grad marker (a
    pipeline layer); in a whole step the marker says which values are gradients."""
    gradient_sync_weight: float = 1.0
    """Times per run of the jaxpr that the all-reduces of the operators computing gradients happen: 1 when
    every run reduces its gradients; ``1 / B`` for a pipeline stage that accumulates partial sums over ``B``
    micro-batches and reduces them once per step (:mod:`~alpa_like.compiler.gradient_sync`)."""
    combine_gradient_all_reduces: bool = True
    """Price the all-reduces of the operators that compute gradients as XLA runs them: independent of each
    other until the update, they are combined into one all-reduce per set of mesh axes, so each pays its
    bytes but not its own latency ``alpha`` (one ``alpha`` per step is added to the objective)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reshard:
    """A resharding the plan pays: ``tensor`` from ``src`` to ``dst`` for its consumer ``node``."""

    tensor: int
    node: int
    """Consuming node id (or the input node for a step output that updates it)."""
    src: ShardingSpec
    dst: ShardingSpec
    seconds: float
    steps: tuple[ReshardStep, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingSolution:
    """The pass's answer on one mesh."""

    mesh: LogicalMesh
    graph: OpGraph = dataclasses.field(repr=False, compare=False)
    strategies: tuple[Strategy, ...]
    """Chosen strategy per graph node."""
    reshards: tuple[Reshard, ...]
    ilp: IlpSolution
    objective: float
    """Eq. 3.1: seconds of communication of the chosen strategies plus resharding."""
    peak_memory: float | None = None
    """Largest per-device bytes of live tensors under the plan (computed when a memory budget is set)."""
    combined: frozenset[int] = frozenset()
    """Nodes whose all-reduces XLA combines into one per step (:attr:`PassOptions.combine_gradient_all_reduces`):
    each pays its bytes, and the step one latency."""

    def tensor_spec(self, tensor: int) -> ShardingSpec:
        t = self.graph.tensors[tensor]
        return self.strategies[t.producer].out_specs[t.out_index]

    def input_specs(self) -> tuple[ShardingSpec, ...]:
        return tuple(self.tensor_spec(t) for t in self.graph.input_tensors)

    def node_seconds(self, node: int) -> float:
        """The node's own cost plus the resharding of its operands."""
        return self.strategies[node].cost + sum(r.seconds for r in self.reshards if r.node == node)


# ------------------------------------------------------------------------------------------------ step 1

def input_strategies(shape: Sequence[int], specs: Sequence[ShardingSpec]) -> list[Strategy]:
    del shape  # Unused: the specs were enumerated for it.
    return [Strategy(name=str(s), out_specs=(s,), in_specs=()) for s in specs]


def control_flow_strategies(node: OpNode, ctx: StrategyContext) -> list[Strategy]:
    """Replicated, plus (for ``while``/``cond``) dim 0 of every operand and output of the output's dim-0
    size split over each mesh axis set: the batch strategy."""
    eqn = node.eqn
    out = [replicated_strategy(eqn)]
    if node.primitive == "scan" or not eqn.outvars or not eqn.outvars[0].aval.shape:
        return out
    batch = eqn.outvars[0].aval.shape[0]
    useful = [a for a, n in enumerate(ctx.mesh.shape) if n > 1]
    for axes in [(a,) for a in useful] + ([tuple(useful)] if len(useful) == 2 else []):
        n = math.prod(ctx.mesh.shape[a] for a in axes)
        if batch % n:
            continue

        def spec(v):
            shape = v.aval.shape
            return make_spec([axes] + [()] * (len(shape) - 1)) if shape and shape[0] == batch else replicated(
                len(shape))
        ins = tuple(None if isinstance(v, Literal) else spec(v) for v in eqn.invars)
        out.append(make_strategy(f"batch->{''.join(map(str, axes))}", tuple(spec(v) for v in eqn.outvars), ins,
                                 (), ctx))
    return out


def with_replicated_work(strategy: Strategy, node: OpNode, graph: OpGraph, ctx: StrategyContext) -> Strategy:
    """Adds to a light operator's ``d_v`` the time of the work it repeats on replicated devices.

    The dissertation sets ``d_v = 0`` for light operators ("their computation costs are negligible"); we
    charge one FLOP per element of the larger of its first operand and its outputs, at ``rates.peak_flops``,
    times ``1/shards - 1/devices`` (0 when the work is split over every device). This is orders of magnitude below
    any collective, so it only breaks ties between plans of equal communication in favour of split work.
    """
    elements = max([math.prod(graph.tensors[t].shape) for t in node.outputs]
                   + [math.prod(graph.tensors[t].shape) for t in node.operands[:1] if t is not None])
    spec = strategy.out_specs[0] if strategy.out_specs else None
    split = shards(spec, ctx.mesh.shape) if spec is not None else 1
    extra = elements / ctx.rates.peak_flops * (1.0 / split - 1.0 / ctx.mesh.num_devices)
    return dataclasses.replace(strategy, compute_seconds=strategy.compute_seconds + extra) if extra > 0 else strategy


_PLAIN = (bool, int, float, str, type(None), np.generic, np.dtype, enum.Enum)

_RULE_CACHE: dict = {}
"""Strategies per (context, equation signature, ...), shared by the solves of one process: the layers of
a model and the stage profiler's layer jobs repeat the same equations on the same mesh."""
_RULE_CACHE_LIMIT = 1 << 17


def _plain(value):
    """``value`` as hashable plain data tagged with its types, or raises TypeError (e.g. a jaxpr)."""
    if isinstance(value, tuple):
        return (type(value).__name__, tuple(_plain(v) for v in value))
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    raise TypeError(f"not plain data: {type(value).__name__}")


def eqn_signature(eqn) -> tuple | None:
    """What the strategy rules read from an equation (primitive, parameters, operand and result shapes and
    dtypes, literal values), or None when a parameter is not plain data (then it is not cached)."""
    try:
        params = tuple(sorted((k, _plain(v)) for k, v in eqn.params.items()))
    except TypeError:
        return None
    ins = tuple(("lit", repr(v.val)) if isinstance(v, Literal) else (tuple(v.aval.shape), str(v.aval.dtype))
                for v in eqn.invars)
    outs = tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.outvars)
    return eqn.primitive.name, params, ins, outs


def clear_caches() -> None:
    """Forgets the memoised strategies and resharding costs (benchmarks measure every solve cold)."""
    clear_resharding_caches()
    _RULE_KEYS.clear()
    _RULE_CACHE.clear()
    _RESHARD_TABLES.clear()


def _rule_key(*parts) -> int | None:
    """A small int standing for ``parts`` (hashing a signature once per node, not once per strategy), never
    the same for two ``parts``: the stage profiler's solves may run on threads at once, and the ints are
    never reused after the caches are cleared (a solve may still hold one)."""
    if any(p is None for p in parts):
        return None
    with _RULE_LOCK:
        if len(_RULE_KEYS) >= _RULE_CACHE_LIMIT:
            _RULE_KEYS.clear()
            _RULE_CACHE.clear()
        key = _RULE_KEYS.get(parts)
        if key is None:
            key = _RULE_KEYS[parts] = next(_RULE_NUMBERS)
        return key


_RULE_KEYS: dict = {}
_RULE_NUMBERS = itertools.count()
_RULE_LOCK = threading.Lock()


def strategy_table(graph: OpGraph, ctx: StrategyContext,
                   input_candidates: Mapping[int, Sequence[ShardingSpec]] | None = None) -> list[list[Strategy]]:
    """Per node, its strategies; a merged node has exactly one per strategy of its group (same order).

    The rules' answers are memoised per (``ctx``, :func:`eqn_signature`, followed operand and spec): an
    equation's strategies depend on nothing else (not on its place in the graph)."""
    input_candidates = input_candidates or {}
    table: list[list[Strategy]] = []
    for node in graph.nodes:
        if node.kind == "input":
            shape = graph.tensors[node.outputs[0]].shape
            specs = input_candidates.get(node.input_index) or enumerate_specs(shape, ctx.mesh)
            table.append(input_strategies(shape, specs))
        elif node.kind == "const":
            ndim = len(graph.tensors[node.outputs[0]].shape)
            table.append([Strategy(name="constant", out_specs=(replicated(ndim),), in_specs=())])
        elif node.follow is not None:
            producer = graph.tensors[node.operands[node.follow]]
            rule = FOLLOW_RULES[node.primitive]
            signature = _rule_key(ctx, "follow", eqn_signature(node.eqn), node.follow)
            local: dict = {}
            cache = local if signature is None else _RULE_CACHE
            derived = []
            for s in table[producer.producer]:
                spec = s.out_specs[producer.out_index]
                key = (signature, node.id if signature is None else None, spec)
                strategy = cache.get(key)
                if strategy is None:
                    strategy = with_replicated_work(rule.derive(node.eqn, node.follow, spec, ctx), node, graph, ctx)
                    cache[key] = strategy
                derived.append(strategy)
            table.append(derived)
        elif node.primitive in ROOT_RULES:
            key = _rule_key(ctx, "root", eqn_signature(node.eqn))
            strategies = _RULE_CACHE.get(key) if key is not None else None
            if strategies is None:
                strategies = ROOT_RULES[node.primitive](node.eqn, ctx) or [replicated_strategy(node.eqn)]
                if node.primitive not in HEAVY_PRIMITIVES:  # heavy operators price their own replicated work
                    strategies = [with_replicated_work(s, node, graph, ctx) for s in strategies]
                strategies = tuple(strategies)
                if key is not None:
                    _RULE_CACHE[key] = strategies
            table.append(list(strategies))
        elif node.primitive in CONTROL_FLOW:
            table.append(control_flow_strategies(node, ctx))
        else:  # sources (iota, RNG) and primitives without rules: replicated
            table.append([replicated_strategy(node.eqn)])
    return table


# ------------------------------------------------------------------------------------------------ step 2

class _ReshardTable:
    """Resharding costs per (shape, itemsize, src, dst), computed once each."""

    def __init__(self, mesh: LogicalMesh, allow_all_to_all: bool):
        self.mesh = mesh
        self.allow_all_to_all = allow_all_to_all
        self.cache: dict = {}
        self.matrices: dict = {}

    def cost(self, shape, itemsize, src: ShardingSpec, dst: ShardingSpec) -> float:
        if src == dst:
            return 0.0
        num_bytes = math.prod(shape) * itemsize
        key = (num_bytes, src, dst)
        value = self.cache.get(key)
        if value is None:
            target = dst if self.allow_all_to_all else _common_prefix(src, dst)
            value = resharding_seconds(src, target, num_bytes, self.mesh)
            self.cache[key] = value
        return value

    def matrix(self, shape, itemsize, srcs: Sequence[ShardingSpec], dsts: Sequence[ShardingSpec]) -> np.ndarray:
        """``R[i, j] = cost(srcs[i] -> dsts[j])``, computed on the distinct specs only (and once per
        (bytes, distinct sources, distinct destinations): the blocks of a model repeat them)."""
        us, si = _unique(srcs)
        ud, di = _unique(dsts)
        key = (math.prod(shape) * itemsize, tuple(us), tuple(ud))
        small = self.matrices.get(key)
        if small is None:
            small = np.array([[self.cost(shape, itemsize, a, b) for b in ud] for a in us], dtype=float)
            self.matrices[key] = small
        return small[np.ix_(si, di)]

    def steps(self, shape, itemsize, src, dst) -> tuple[ReshardStep, ...]:
        if not self.allow_all_to_all:
            return describe_resharding(src, _common_prefix(src, dst), shape, itemsize, self.mesh)
        return describe_resharding(src, dst, shape, itemsize, self.mesh)


_RESHARD_TABLES: dict[tuple[LogicalMesh, bool], _ReshardTable] = {}


def reshard_table(mesh: LogicalMesh, allow_all_to_all: bool) -> _ReshardTable:
    """The process's resharding-cost table of ``mesh`` (kept across solves: layers repeat tensor shapes)."""
    key = (mesh, bool(allow_all_to_all))
    table = _RESHARD_TABLES.get(key)
    if table is None:
        if len(_RESHARD_TABLES) >= 64:
            _RESHARD_TABLES.clear()
        table = _RESHARD_TABLES[key] = _ReshardTable(mesh, allow_all_to_all)
    return table


def _common_prefix(src: ShardingSpec, dst: ShardingSpec) -> ShardingSpec:
    """Per dim, the longest common prefix of the two axis tuples (from it, ``dst`` is a local slice)."""
    axes = []
    for a, b in zip(src.axes, dst.axes):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        axes.append(a[:k])
    return make_spec(axes)


def _unique(specs: Sequence[ShardingSpec]) -> tuple[list[ShardingSpec], np.ndarray]:
    index: dict[ShardingSpec, int] = {}
    inverse = np.array([index.setdefault(s, len(index)) for s in specs], dtype=np.int64)
    return list(index), inverse


def alias_pairs(graph: OpGraph, output_to_input: Sequence[int | None]) -> list[tuple[int, int]]:
    """(output tensor, input tensor) for each step output that replaces an input (``new_state -> state``)."""
    pairs = []
    for j, i in enumerate(output_to_input):
        t = graph.output_tensors[j]
        if i is not None and t is not None and t != graph.input_tensors[i]:
            pairs.append((t, graph.input_tensors[i]))
    return pairs


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Uses:
    """Every resharding site: tensor ``t`` must reach node ``node`` (operand ``pos``, or -1 for an alias:
    the layout of the node's output ``out_index``, paid ``times`` times)."""

    tensor: int
    node: int
    pos: int
    out_index: int = 0
    times: int = 1


def _uses(graph: OpGraph, aliases: Sequence[tuple[int, int]]) -> list[_Uses]:
    """Operands, step aliases and the carries of ``scan`` loops (:attr:`OpGraph.loop_aliases`)."""
    uses = [_Uses(tensor=t, node=node.id, pos=pos) for node in graph.nodes
            for pos, t in enumerate(node.operands) if t is not None]
    loops = [(out, inp, times) for out, inp, times in graph.loop_aliases if out != inp]
    uses += [_Uses(tensor=out, node=graph.tensors[inp].producer, pos=-1, out_index=graph.tensors[inp].out_index,
                   times=times) for out, inp, times in [(o, i, 1) for o, i in aliases] + loops]
    return uses


def _required(table, graph: OpGraph, use: _Uses) -> list[ShardingSpec]:
    if use.pos < 0:
        return [s.out_specs[use.out_index] for s in table[use.node]]
    return [s.in_specs[use.pos] for s in table[use.node]]


def build_problem(graph: OpGraph, table: list[list[Strategy]], mesh: LogicalMesh, *,
                  aliases: Sequence[tuple[int, int]] = (), memory_budget: float | None = None,
                  allow_all_to_all: bool = True,
                  node_weights: Sequence[float] | None = None,
                  combined: frozenset[int] = frozenset(), deferred: frozenset[int] = frozenset(),
                  deferred_weight: float = 1.0) -> tuple[IlpProblem, IlpProblem, np.ndarray]:
    """The ILP of Eq. 3.1 over the merged groups (costs scaled by each node's ``repeat`` times ``node_weights``).

    ``combined``: nodes whose all-reduces XLA combines into one (see
    :attr:`PassOptions.combine_gradient_all_reduces`); their ``c_v`` leaves out each all-reduce's latency.
    ``deferred``: nodes whose all-reduces run ``deferred_weight`` times per run of the graph (see
    :attr:`PassOptions.gradient_sync_weight`).

    Returns:
      (problem with the tie-break, the same problem without it, ILP node index of every graph node).
    """
    group = merged_groups(graph)
    roots = np.unique(group)
    index = np.full(len(graph.nodes), -1, dtype=np.int64)
    index[roots] = np.arange(len(roots))
    node_of = index[group]
    comm = [np.zeros(len(table[r])) for r in roots]
    tie = [np.zeros(len(table[r])) for r in roots]
    positive = [b for b, n in zip(mesh.beta, mesh.shape) if n > 1 and b > 0]
    per_byte = TIE_BREAK * (min(positive) if positive else 1e-12)
    weight = np.array([n.repeat for n in graph.nodes], dtype=float)
    if node_weights is not None:
        weight *= np.asarray(node_weights, dtype=float)
    for node in graph.nodes:
        v = node_of[node.id]
        costs = [s.cost - (all_reduce_latency(s, mesh) if node.id in combined else 0.0)
                 - (all_reduce_bandwidth(s, mesh) * (1.0 - deferred_weight) if node.id in deferred else 0.0)
                 for s in table[node.id]]
        comm[v] += weight[node.id] * np.array(costs)
        for k, t in enumerate(node.outputs):
            tensor = graph.tensors[t]
            tie[v] += per_byte * tensor.nbytes / np.array([shards(s.out_specs[k], mesh.shape)
                                                           for s in table[node.id]])
    reshard = reshard_table(mesh, allow_all_to_all)
    edges: dict[tuple[int, int], np.ndarray] = {}
    for use in _uses(graph, aliases):
        tensor = graph.tensors[use.tensor]
        srcs = [s.out_specs[tensor.out_index] for s in table[tensor.producer]]
        dsts = _required(table, graph, use)
        itemsize = jax_compat.numpy_dtype(tensor.dtype).itemsize
        r = reshard.matrix(tensor.shape, itemsize, srcs, dsts)
        r = r * (weight[use.node] if use.pos >= 0 else use.times)
        a, b = node_of[tensor.producer], node_of[use.node]
        if a == b:
            comm[a] += np.diagonal(r)
        elif np.any(r):
            edges[(a, b)] = edges[(a, b)] + r if (a, b) in edges else r
    edge_list = tuple(IlpEdge(src=int(a), dst=int(b), cost=r) for (a, b), r in edges.items())
    rows, consts = (), ()
    if memory_budget is not None:
        rows, consts = memory_rows(graph, table, node_of, mesh)
    with_tie = IlpProblem(node_costs=tuple(c + t for c, t in zip(comm, tie)), edges=edge_list, memory_rows=rows,
                          memory_constants=consts, memory_budget=memory_budget)
    exact = IlpProblem(node_costs=tuple(comm), edges=edge_list, memory_rows=rows, memory_constants=consts,
                       memory_budget=memory_budget)
    return with_tie, exact, node_of


def all_reduce_latency(strategy: Strategy, mesh: LogicalMesh) -> float:
    """The latency (``alpha``) part of the strategy's all-reduces: what combining them with others saves."""
    no_latency = without_latency(mesh)
    return sum(c.seconds(mesh) - c.seconds(no_latency) for c in strategy.collectives if c.kind == "all-reduce")


def all_reduce_bandwidth(strategy: Strategy, mesh: LogicalMesh) -> float:
    """The bandwidth (``beta``) part of the strategy's all-reduces."""
    no_latency = without_latency(mesh)
    return sum(c.seconds(no_latency) for c in strategy.collectives if c.kind == "all-reduce")


@functools.lru_cache(maxsize=64)
def without_latency(mesh: LogicalMesh) -> LogicalMesh:
    """``mesh`` with every latency set to 0 (the bandwidth terms kept), cached."""
    return mesh.without_latency()


def memory_rows(graph: OpGraph, table, node_of: np.ndarray, mesh: LogicalMesh):
    """Per-device bytes live at every node where some tensor is freed (other steps are dominated: nothing
    is freed there, so the next step holds a superset).

    A tensor is live from its producer to its last reader (step outputs to the end; inputs from the start).
    """
    last = graph.last_use()
    start = np.array([t.producer if graph.nodes[t.producer].kind == "op" else -1 for t in graph.tensors])
    times = np.unique(last[last < len(graph.nodes)])
    if times.size == 0:
        times = np.array([len(graph.nodes) - 1])
    lo = np.searchsorted(times, start, side="left")
    hi = np.searchsorted(times, last, side="right")
    per_node: dict[int, np.ndarray] = {}
    for t in graph.tensors:
        if lo[t.id] >= hi[t.id]:
            continue
        v = int(node_of[t.producer])
        strategies = table[t.producer]
        vec = t.nbytes / np.array([shards(s.out_specs[t.out_index], mesh.shape) for s in strategies])
        diff = per_node.setdefault(v, np.zeros((len(times) + 1, len(vec))))
        diff[lo[t.id]] += vec
        diff[hi[t.id]] -= vec
    live = {v: np.cumsum(d, axis=0)[:-1] for v, d in per_node.items()}
    rows = tuple(tuple((v, live[v][i]) for v in live if np.any(live[v][i])) for i in range(len(times)))
    return rows, tuple(0.0 for _ in rows)


# ------------------------------------------------------------------------------------------------ step 3

@dataclasses.dataclass(frozen=True, kw_only=True)
class PreparedPass:
    """Steps 1 and 2 of the pass on one mesh (strategies and the ILP), ready to be solved, possibly more
    than once with different input restrictions (:func:`solve_prepared`)."""

    graph: OpGraph = dataclasses.field(repr=False)
    mesh: LogicalMesh
    options: PassOptions
    aliases: tuple[tuple[int, int], ...]
    table: list[list[Strategy]] = dataclasses.field(repr=False)
    problem: IlpProblem = dataclasses.field(repr=False)
    """Eq. 3.1 with the tie-break."""
    exact: IlpProblem = dataclasses.field(repr=False)
    """Eq. 3.1 without it."""
    node_of: np.ndarray = dataclasses.field(repr=False)
    """ILP node index of every graph node."""
    combined: frozenset[int]


def prepare(graph: OpGraph, mesh: LogicalMesh, options: PassOptions = PassOptions(), *,
            aliases: Sequence[tuple[int, int]] = ()) -> PreparedPass:
    """Strategies (step 1) and the ILP (step 2) of the pass; see :func:`auto_shard` for the arguments."""
    ctx = StrategyContext(mesh=mesh, rates=options.rates)
    table = strategy_table(graph, ctx, options.input_candidates)
    gradients = gradient_nodes(graph).union(*(gradient_producers(graph, graph.output_tensors[i])
                                              for i in options.gradient_outputs
                                              if graph.output_tensors[i] is not None))
    combined = gradients if options.combine_gradient_all_reduces else frozenset()
    problem, exact, node_of = build_problem(graph, table, mesh, aliases=aliases,
                                            memory_budget=options.memory_budget,
                                            allow_all_to_all=options.allow_all_to_all,
                                            node_weights=options.node_weights, combined=combined,
                                            deferred=gradients if options.gradient_sync_weight != 1.0 else frozenset(),
                                            deferred_weight=options.gradient_sync_weight)
    return PreparedPass(graph=graph, mesh=mesh, options=options, aliases=tuple(aliases), table=table,
                        problem=problem, exact=exact, node_of=node_of, combined=combined)


def restricted_inputs(prepared: PreparedPass,
                      input_candidates: Mapping[int, Sequence[ShardingSpec]]) -> dict[int, np.ndarray] | None:
    """Per ILP node of a restricted input, the indices of its strategies whose spec is a candidate; None if
    some candidate is not among the input's strategies (then the restriction is not the problem that
    :func:`prepare` would build with those candidates, and the caller must prepare it anew)."""
    allowed = {}
    for node in prepared.graph.nodes:
        if node.kind != "input" or node.input_index not in input_candidates:
            continue
        specs = [s.out_specs[0] for s in prepared.table[node.id]]
        wanted = set(input_candidates[node.input_index])
        if not wanted or not wanted <= set(specs):
            return None
        allowed[int(prepared.node_of[node.id])] = np.array([j for j, spec in enumerate(specs) if spec in wanted])
    return allowed


def solve_prepared(prepared: PreparedPass,
                   input_candidates: Mapping[int, Sequence[ShardingSpec]] | None = None) -> ShardingSolution:
    """Step 3: solves the prepared ILP, with each input in ``input_candidates`` (jaxpr input index -> specs)
    limited to those specs (an exact restriction of the same problem: :func:`~alpa_like.compiler.ilp.restrict`).

    Raises:
      ValueError: a candidate spec is not among the input's strategies in ``prepared``.
    """
    problem, keep = prepared.problem, None
    if input_candidates:
        allowed = restricted_inputs(prepared, input_candidates)
        if allowed is None:
            raise ValueError("input_candidates must name specs among the prepared inputs' strategies")
        problem, keep = restrict(problem, allowed)
    options = prepared.options
    solution = solve(problem, time_limit=options.solver_time_limit, solver=options.solver)
    if keep is not None:
        solution = dataclasses.replace(solution, choice=tuple(int(k[c]) for k, c in zip(keep, solution.choice)))
    if solution.status == "infeasible":
        warnings.warn(f"no sharding plan fits memory_budget={options.memory_budget} bytes per device on mesh "
                      f"{prepared.mesh.shape}; the greedy plan is used", stacklevel=2)
    return _solution(prepared, solution)


def _solution(prepared: PreparedPass, solution: IlpSolution) -> ShardingSolution:
    """The :class:`ShardingSolution` of the ILP choice ``solution.choice`` of ``prepared``."""
    options, mesh, graph = prepared.options, prepared.mesh, prepared.graph
    chosen = tuple(prepared.table[n.id][solution.choice[prepared.node_of[n.id]]] for n in graph.nodes)
    reshards = _reshards(graph, chosen, mesh, prepared.aliases, options.allow_all_to_all)
    peak = prepared.exact.peak_memory(solution.choice) if options.memory_budget is not None else None
    latencies = [all_reduce_latency(chosen[n], mesh) for n in prepared.combined]
    return ShardingSolution(mesh=mesh, graph=graph, strategies=chosen, reshards=reshards, ilp=solution,
                            objective=prepared.exact.objective(solution.choice) + max(latencies, default=0.0),
                            peak_memory=peak, combined=prepared.combined)


def auto_shard(graph: OpGraph, mesh: LogicalMesh, options: PassOptions = PassOptions(), *,
               aliases: Sequence[tuple[int, int]] = ()) -> ShardingSolution:
    """Chooses a strategy for every node of ``graph`` on ``mesh`` by solving Eq. 3.1.

    Args:
      graph: from :func:`~alpa_like.compiler.op_graph.build_op_graph`.
      mesh: the logical mesh and its per-axis alpha-beta costs.
      options: memory budget, all-to-all, allowed input specs, time limit, device speed.
      aliases: (output tensor, input tensor) pairs whose layouts should agree (see :func:`alias_pairs`).
    """
    return solve_prepared(prepare(graph, mesh, options, aliases=aliases))


def price_on(prepared: PreparedPass, other: ShardingSolution) -> ShardingSolution:
    """``other``'s plan (the same graph, solved on a mesh of the same shape but other alpha-beta costs,
    e.g. :func:`without_latency`) as a solution of ``prepared``: at every node the strategy with the same
    name and specs, its costs, resharding and objective those of ``prepared``'s mesh.

    Raises:
      ValueError: the graphs differ, or a chosen strategy is not among ``prepared``'s.
    """
    graph = prepared.graph
    if other.graph is not graph or other.mesh.shape != prepared.mesh.shape:
        raise ValueError(f"price_on needs a solution of the same graph on a mesh of shape {prepared.mesh.shape}, "
                         f"got mesh {other.mesh.shape}")
    roots = np.unique(merged_groups(graph))
    choice = []
    for root in roots:
        wanted = _strategy_key(other.strategies[root])
        index = next((j for j, s in enumerate(prepared.table[root]) if _strategy_key(s) == wanted), None)
        if index is None:
            raise ValueError(f"strategy {other.strategies[root].name} of node {graph.nodes[root].name} is not "
                             f"among the prepared strategies on mesh {prepared.mesh.shape}")
        choice.append(index)
    ilp = dataclasses.replace(other.ilp, choice=tuple(choice), objective=prepared.problem.objective(choice))
    return _solution(prepared, ilp)


def _strategy_key(strategy: Strategy) -> tuple:
    return strategy.name, strategy.out_specs, strategy.in_specs


def _reshards(graph: OpGraph, chosen: Sequence[Strategy], mesh: LogicalMesh, aliases, allow_all_to_all: bool):
    reshard = reshard_table(mesh, allow_all_to_all)
    out = []
    for use in _uses(graph, aliases):
        tensor = graph.tensors[use.tensor]
        src = chosen[tensor.producer].out_specs[tensor.out_index]
        dst = chosen[use.node].out_specs[use.out_index] if use.pos < 0 else chosen[use.node].in_specs[use.pos]
        itemsize = jax_compat.numpy_dtype(tensor.dtype).itemsize
        seconds = reshard.cost(tensor.shape, itemsize, src, dst)
        if src != dst and seconds > 0:
            out.append(Reshard(tensor=use.tensor, node=use.node, src=src, dst=dst, seconds=seconds,
                               steps=reshard.steps(tensor.shape, itemsize, src, dst)))
    return tuple(out)


# --------------------------------------------------------------------------------------- realisation

PINNED_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated", "gather", "scatter-add", "scatter"})
"""Operators whose operands are pinned, as each reads them, to the layouts of its chosen strategy."""


def pins(graph: OpGraph, solution: ShardingSolution, skip=frozenset()) -> list[tuple[int, int, ShardingSpec]]:
    """``with_sharding_constraint`` sites on values that make XLA follow the plan.

    Every value of the step that has an equation index gets the layout the plan gives it where it is
    produced, so that XLA's propagation cannot move a layout change elsewhere. ``skip``: nodes whose output
    layout another pass decides (the weight-update sharding).
    """
    sites: dict[tuple[int, int], ShardingSpec] = {}
    for t, site in graph.pins.items():
        if graph.tensors[t].producer not in skip:
            sites[site] = solution.tensor_spec(t)
    return [(eqn, k, spec) for (eqn, k), spec in sites.items()]


def operand_pins(graph: OpGraph, solution: ShardingSolution) -> list[tuple[int, int, ShardingSpec]]:
    """(equation index, operand position, spec): every operand of a pinned operator (matmul, convolution,
    gather, scatter) as that operator reads it, in the layout its chosen algorithm needs.

    With the value pinned where it is produced and again as each heavy reader sees it, the resharding the
    plan pays on that edge happens between the two constraints, and XLA's partitioner sees the algorithm's
    operand and output layouts, which leaves it one way to compute the operator; a value read by several
    operators in different layouts is resharded once per reader, as Eq. 3.1 prices it.
    """
    out = []
    for node in graph.nodes:
        if node.primitive not in PINNED_PRIMITIVES or node.inlined:
            continue
        for pos, (t, spec) in enumerate(zip(node.operands, solution.strategies[node.id].in_specs)):
            if t is not None and spec is not None:
                out.append((node.eqn_index, pos, spec))
    return out
