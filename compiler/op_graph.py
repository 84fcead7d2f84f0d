"""The jaxpr -> operator graph pass of the intra-op ILP (dissertation §3.4.2).

Nodes are the step's inputs, constants and equations; edges are the tensors between them. Three rewrites
keep the graph the ILP sees small and exact:

* ``alpa_marker`` equations are identities: their outputs *are* their operands' tensors.
* ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint`` and nested ``jit`` bodies are analysed in place
  of the call (safe: after differentiation the body is exactly the primal computation). Their equations
  have no index in the traced jaxpr, so only the call's outputs can be pinned later.
* Computationally trivial operators (element-wise, convert, reshape, transpose, broadcast, reductions, ...;
  see :mod:`alpa_like.compiler.propagation`) are *merged* into their deepest operand: "We do a
  breadth-first-search and compute the depth of each node. The node is merged to the deepest operand."
  Depth is the longest path from the inputs; ties go to the operand with the output's shape, then the
  larger one, then the first. One exception: an operand widened by a merged ``broadcast_in_dim`` (whose new
  dims are replicated in every strategy of its group) is taken only when no other operand can be, so the
  broadcast is sliced to its consumer's layout instead of forcing it (:meth:`_Builder.choose_operand`). A
  merged node shares its operand's decision variable in the ILP.

``scan`` bodies are analysed in place too, once, as one iteration: their nodes carry ``repeat = length``
(the ILP scales their costs by it), each scanned input reaches the body through a ``slice`` + ``squeeze``
of its leading axis and each stacked output leaves it through a ``broadcast_in_dim`` to ``(length, ...)``
(so the scan axis itself stays whole), and every carry gets a loop edge from the body's carry output
back to the carry input (:attr:`OpGraph.loop_aliases`): a carry whose layout changes inside the body pays
that resharding on every iteration. Only the scan's outputs can be pinned. ``while`` and ``cond`` stay one
node each (their trip count is unknown or conditional). Primitives without any rule are recorded in
:attr:`OpGraph.unsupported` and computed replicated.
"""
from __future__ import annotations

import dataclasses
import math
import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal, Var

from alpa_like.compiler import jax_compat
from alpa_like.compiler.markers import is_marker
from alpa_like.compiler.propagation import FOLLOW_RULES, SOURCE_PRIMITIVES
from alpa_like.compiler.strategies import ROOT_RULES

CONTROL_FLOW = frozenset({"while", "cond"})
"""Operators kept as one node with replicated-or-batch strategies."""

NodeKind = str  # "input" | "const" | "op"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tensor:
    """A value flowing between nodes."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    producer: int
    """Node id that produces it."""
    out_index: int
    """Which output of the producer it is."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * jax_compat.numpy_dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpNode:
    """An input, a constant or one equation of the (partly inlined) jaxpr."""

    id: int
    kind: NodeKind
    primitive: str
    """Primitive name (``"input"`` / ``"const"`` for those kinds)."""
    eqn: JaxprEqn | None = dataclasses.field(default=None, compare=False, repr=False)
    operands: tuple[int | None, ...] = ()
    """Tensor id per operand of the equation (None for a literal)."""
    outputs: tuple[int, ...] = ()
    eqn_index: int | None = None
    """Index in the traced jaxpr's equations (of the enclosing call for an inlined equation); None for
    inputs and constants."""
    inlined: bool = False
    """True for an equation of an inlined call body (it cannot be pinned by index)."""
    input_index: int | None = None
    """Position among the jaxpr's invars (inputs only)."""
    name: str = ""
    """Readable name: the input path or ``name_stack/primitive``."""
    depth: int = 0
    follow: int | None = None
    """Operand position this node is merged into, or None when it has its own strategies."""
    repeat: int = 1
    """How many times the node runs per evaluation of the jaxpr (the product of the lengths of the
    ``scan`` bodies it sits in)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpGraph:
    """The operator graph, nodes in topological order."""

    nodes: tuple[OpNode, ...]
    tensors: tuple[Tensor, ...]
    input_tensors: tuple[int, ...]
    """Tensor of each jaxpr invar."""
    output_tensors: tuple[int | None, ...]
    """Tensor of each jaxpr outvar (None for a literal output)."""
    pins: dict[int, tuple[int, int]] = dataclasses.field(compare=False)
    """Tensor id -> (equation index, output index) in the traced jaxpr where it can be pinned."""
    markers: dict[int, tuple[tuple[int, int, str], ...]] = dataclasses.field(compare=False)
    """Tensor id -> the (equation index, operand position, kind) of the ``alpa_marker`` equations it passes."""
    unsupported: tuple[str, ...] = ()
    """Primitives with no rule: computed replicated."""
    loop_aliases: tuple[tuple[int, int, int], ...] = ()
    """(carry output tensor, carry input tensor, iterations) of every ``scan`` carry: the layouts should
    agree, else the carry is resharded on each iteration."""

    def consumers(self) -> list[list[tuple[int, int]]]:
        """Per tensor, the (node id, operand position) pairs that read it."""
        uses: list[list[tuple[int, int]]] = [[] for _ in self.tensors]
        for node in self.nodes:
            for pos, t in enumerate(node.operands):
                if t is not None:
                    uses[t].append((node.id, pos))
        return uses

    def last_use(self) -> np.ndarray:
        """Per tensor, the last node id reading it (``len(nodes)`` for step outputs, its producer if unused)."""
        last = np.array([t.producer for t in self.tensors], dtype=np.int64)
        for node in self.nodes:
            for t in node.operands:
                if t is not None:
                    last[t] = max(last[t], node.id)
        for t in self.output_tensors:
            if t is not None:
                last[t] = len(self.nodes)
        return last


class _Builder:
    def __init__(self):
        self.nodes: list[OpNode] = []
        self.tensors: list[Tensor] = []
        self.depth: list[int] = []  # per tensor
        self.widened: list[bool] = []  # per tensor: a broadcast's new dims, replicated by its merged group
        self.pins: dict[int, tuple[int, int]] = {}
        self.markers: dict[int, list[tuple[int, int, str]]] = {}
        self.unsupported: list[str] = []
        self.loop_aliases: list[tuple[int, int, int]] = []
        self.repeat = 1

    def tensor(self, aval, producer: int, out_index: int) -> int:
        tid = len(self.tensors)
        self.tensors.append(Tensor(id=tid, shape=tuple(int(d) for d in aval.shape),
                                   dtype=str(jax_compat.numpy_dtype(aval.dtype)), producer=producer, out_index=out_index))
        return tid

    def leaf(self, kind: NodeKind, aval, name: str, input_index: int | None = None) -> int:
        nid = len(self.nodes)
        tid = self.tensor(aval, nid, 0)
        self.nodes.append(OpNode(id=nid, kind=kind, primitive=kind, outputs=(tid,), input_index=input_index,
                                 name=name))
        self.depth.append(0)
        self.widened.append(False)
        return tid

    def read(self, env: dict, v) -> int | None:
        if isinstance(v, Literal):
            return None
        return env[v]

    def eqns(self, eqns: Sequence[JaxprEqn], env: dict, top_index: int | None) -> None:
        """Adds ``eqns``; ``top_index`` is the enclosing top-level equation of an inlined body (else None)."""
        top_level = top_index is None
        for position, eqn in enumerate(eqns):
            index = position if top_level else top_index
            operands = [self.read(env, v) for v in eqn.invars]
            if is_marker(eqn):
                for pos, (v, t) in enumerate(zip(eqn.outvars, operands, strict=True)):
                    env[v] = t if t is not None else self.leaf("const", v.aval, "literal")
                    if top_level:
                        self.markers.setdefault(env[v], []).append((index, pos, eqn.params["kind"]))
                continue
            if eqn.primitive.name == "scan":
                self.scan(eqn, operands, env, index, top_level)
                continue
            body = jax_compat.inlinable_body(eqn)
            if body is not None:
                inner_env = {}
                for v, t in zip(body.jaxpr.invars, operands, strict=True):
                    inner_env[v] = t if t is not None else self.leaf("const", v.aval, "literal")
                for v in body.jaxpr.constvars:
                    inner_env[v] = self.leaf("const", v.aval, "const")
                self.eqns(body.jaxpr.eqns, inner_env, top_index=index)
                for k, (v, inner) in enumerate(zip(eqn.outvars, body.jaxpr.outvars, strict=True)):
                    t = self.read(inner_env, inner)
                    env[v] = t if t is not None else self.leaf("const", v.aval, "literal")
                    if top_level:
                        self.pins.setdefault(env[v], (index, k))
                continue
            self.op(eqn, operands, env, index, inlined=not top_level)

    def scan(self, eqn: JaxprEqn, operands: list[int | None], env: dict, index: int, top_level: bool) -> None:
        """Adds one iteration of a ``scan`` body (see the module docstring)."""
        body = eqn.params["jaxpr"]
        (num_consts, num_carry), length = jax_compat.scan_counts(eqn), eqn.params["length"]
        outer_repeat = self.repeat
        self.repeat = outer_repeat * length
        inner_env = {}
        for k, (v, outer, t) in enumerate(zip(body.jaxpr.invars, eqn.invars, operands, strict=True)):
            t = t if t is not None else self.leaf("const", outer.aval, "literal")
            if k >= num_consts + num_carry:  # a scanned input: iteration i reads xs[i]
                t = self.through(_first_slice_jaxpr(_aval_key(outer.aval)), t, index)
            inner_env[v] = t
        for v in body.jaxpr.constvars:
            inner_env[v] = self.leaf("const", v.aval, "const")
        self.eqns(body.jaxpr.eqns, inner_env, top_index=index)
        for k, (v, inner) in enumerate(zip(eqn.outvars, body.jaxpr.outvars, strict=True)):
            t = self.read(inner_env, inner)
            t = t if t is not None else self.leaf("const", inner.aval, "literal")
            if k < num_carry:
                self.loop_aliases.append((t, inner_env[body.jaxpr.invars[num_consts + k]], self.repeat))
            else:  # a stacked output: iteration i writes ys[i]
                t = self.through(_stack_jaxpr(_aval_key(inner.aval), length), t, index)
            env[v] = t
            if top_level:
                self.pins.setdefault(t, (index, k))
        self.repeat = outer_repeat

    def through(self, closed: ClosedJaxpr, tensor: int, index: int) -> int:
        """Adds the equations of the one-input, one-output ``closed`` reading ``tensor``; returns its output."""
        inner_env = {closed.jaxpr.invars[0]: tensor}
        self.eqns(closed.jaxpr.eqns, inner_env, top_index=index)
        return inner_env[closed.jaxpr.outvars[0]]

    def op(self, eqn: JaxprEqn, operands: list[int | None], env: dict, eqn_index: int, inlined: bool) -> None:
        nid = len(self.nodes)
        name = eqn.primitive.name
        depth = 1 + max((self.depth[t] for t in operands if t is not None), default=-1)
        follow = None
        rule = FOLLOW_RULES.get(name)
        if rule is not None:
            follow = self.choose_operand(eqn, operands, rule.candidates(eqn))
        elif (name not in ROOT_RULES and name not in CONTROL_FLOW and name not in SOURCE_PRIMITIVES
              and not eqn.effects):  # an effect (jax.debug.print) computes nothing to shard
            self.unsupported.append(name)
        followed = None if follow is None else operands[follow]
        outputs = []
        for k, v in enumerate(eqn.outvars):
            tid = self.tensor(v.aval, nid, k)
            outputs.append(tid)
            self.depth.append(depth)
            self.widened.append(followed is not None and (
                name == "broadcast_in_dim" and math.prod(v.aval.shape) > math.prod(self.tensors[followed].shape)
                or self.widened[followed] and self.tensors[followed].shape == tuple(v.aval.shape)))
            env[v] = tid
            if not inlined:
                self.pins[tid] = (eqn_index, k)
        stack = jax_compat.name_stack(eqn)
        self.nodes.append(OpNode(id=nid, kind="op", primitive=name, eqn=eqn, operands=tuple(operands),
                                 outputs=tuple(outputs), eqn_index=eqn_index, inlined=inlined, depth=depth,
                                 follow=follow, repeat=self.repeat,
                                 name=f"{stack}/{name}" if stack else name))

    def choose_operand(self, eqn: JaxprEqn, operands: list[int | None], candidates: Sequence[int]) -> int | None:
        """The deepest candidate operand (ties: the output's shape, then the larger, then the first), among
        those not widened by a merged broadcast when there are any: a broadcast follows its operand, so its
        new dims are replicated in every strategy of its group, and an operator merged into that group could
        never split them (``mul(broadcast(scale), exp(logits))`` merged into the broadcast would all-gather
        the vocabulary-sharded logits; merged into ``exp`` the broadcast output is sliced locally)."""
        out_shape = tuple(eqn.outvars[0].aval.shape) if eqn.outvars else ()
        best, best_key = None, None
        for pos in candidates:
            t = operands[pos]
            if t is None:
                continue
            tensor = self.tensors[t]
            key = (not self.widened[t], self.depth[t], tensor.shape == out_shape, math.prod(tensor.shape), -pos)
            if best_key is None or key > best_key:
                best, best_key = pos, key
        return best


def build_op_graph(closed: ClosedJaxpr, input_names: Sequence[str] | None = None) -> OpGraph:
    """The operator graph of a flat step jaxpr, with trivial operators marked for merging.

    Args:
      closed: the traced step (``TracedStep.closed_jaxpr``); equation indices refer to its equations.
      input_names: a readable name per invar (e.g. the leaf paths); defaults to ``in[i]``.

    Raises:
      ValueError: ``input_names`` does not have one name per invar.
    """
    jaxpr = closed.jaxpr
    if input_names is None:
        input_names = [f"in[{i}]" for i in range(len(jaxpr.invars))]
    if len(input_names) != len(jaxpr.invars):
        raise ValueError(f"input_names has {len(input_names)} names for {len(jaxpr.invars)} jaxpr inputs")
    b = _Builder()
    env: dict[Var, int] = {}
    inputs = []
    for i, (v, name) in enumerate(zip(jaxpr.invars, input_names, strict=True)):
        env[v] = b.leaf("input", v.aval, name, input_index=i)
        inputs.append(env[v])
    for v in jaxpr.constvars:
        env[v] = b.leaf("const", v.aval, "const")
    b.eqns(jaxpr.eqns, env, top_index=None)
    outputs = tuple(b.read(env, v) for v in jaxpr.outvars)
    return OpGraph(nodes=tuple(b.nodes), tensors=tuple(b.tensors), input_tensors=tuple(inputs),
                   output_tensors=outputs, pins=b.pins, markers={t: tuple(m) for t, m in b.markers.items()},
                   unsupported=tuple(dict.fromkeys(b.unsupported)), loop_aliases=tuple(b.loop_aliases))


def _aval_key(aval) -> tuple[tuple[int, ...], str]:
    return tuple(int(d) for d in aval.shape), str(jax_compat.numpy_dtype(aval.dtype))


@functools.cache
def _first_slice_jaxpr(key: tuple[tuple[int, ...], str]) -> ClosedJaxpr:
    """``xs -> xs[0]``: how a scan body sees a scanned input (as ``slice`` + ``squeeze``)."""
    shape, dtype = key
    return jax.make_jaxpr(lambda xs: jax.lax.index_in_dim(xs, 0, axis=0, keepdims=False))(
        jax.ShapeDtypeStruct(shape, dtype))


@functools.cache
def _stack_jaxpr(key: tuple[tuple[int, ...], str], length: int) -> ClosedJaxpr:
    """``y -> ys`` of shape ``(length, *y.shape)``: how a scan stacks an output (as ``broadcast_in_dim``)."""
    shape, dtype = key
    return jax.make_jaxpr(lambda y: jax.lax.broadcast_in_dim(y, (length, *shape), tuple(range(1, len(shape) + 1))))(
        jax.ShapeDtypeStruct(shape, dtype))


def merged_groups(graph: OpGraph) -> np.ndarray:
    """Per node, the id of the node whose decision variable it shares (its own id for a root)."""
    group = np.arange(len(graph.nodes), dtype=np.int64)
    for node in graph.nodes:
        if node.follow is not None:
            producer = graph.tensors[node.operands[node.follow]].producer
            group[node.id] = group[producer]
    return group


def gradient_producers(graph: OpGraph, grad_tensor: int) -> set[int]:
    """Nodes that compute a gradient: backwards from it through merged (trivial) operators of the same
    number of elements, including the first non-merged operators reached."""
    size = math.prod(graph.tensors[grad_tensor].shape)
    nodes, stack = set(), [graph.tensors[grad_tensor].producer]
    while stack:
        n = stack.pop()
        node = graph.nodes[n]
        if n in nodes or node.kind != "op":
            continue
        nodes.add(n)
        if node.follow is None:
            continue
        stack.extend(graph.tensors[x].producer for x in node.operands
                     if x is not None and math.prod(graph.tensors[x].shape) == size)
    return nodes


def gradient_nodes(graph: OpGraph) -> frozenset[int]:
    """Every node that computes some gradient (a value of the ``"grad"`` marker): see
    :func:`gradient_producers`."""
    grads = [t for t, marks in graph.markers.items() if any(kind == "grad" for _, _, kind in marks)]
    return frozenset().union(*(gradient_producers(graph, g) for g in grads))
