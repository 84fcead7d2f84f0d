r"""The integer linear program of Alpa's intra-op pass (dissertation Eq. 3.1), solved with HiGHS (default) or PuLP/CBC.

.. math::

    \min_s \sum_{v \in V} s_v^\top (c_v + d_v) + \sum_{(v,u) \in E} s_v^\top R_{vu} s_u

with one-hot :math:`s_v \in \{0,1\}^{k_v}`. The quadratic term is linearised with
:math:`e_{vu} \in [0,1]^{k_v k_u}` and the marginal constraints
:math:`\sum_j e_{vu,ij} = s_{v,i}`, :math:`\sum_i e_{vu,ij} = s_{u,j}`: with binary :math:`s` they force
:math:`e_{vu,ij} = s_{v,i} s_{u,j}`, so :math:`e` need not be declared integer (a tighter and smaller
model than the :math:`e \le s` form). An optional memory budget adds, per selected time step :math:`t`,
:math:`\sum_v m_{v,t}^\top s_v \le M - m_t^0`.

Exact reductions before the solver call (they never change the optimum):

* nodes with one strategy are constants: their edges fold into their neighbours' cost vectors;
* without a memory budget, a node with at most one neighbour is eliminated by
  :math:`c_u \mathrel{+}= \min_i (c_{v,i} + R_{vu,i\cdot})` (its best answer to each neighbour choice);
* edges between the same pair are summed; identical rows (or columns) of :math:`R_{vu}` share one
  :math:`e` row (column); an edge whose matrix has one distinct row or column folds into a cost vector.

The reduced model is assembled as sparse matrices with numpy (:func:`matrix_model`) and handed to HiGHS
(the default, through scipy: the LP relaxation first, which is integral on almost every intra-op model and
then already the optimum, the MILP only otherwise) or to CBC (the binary PuLP bundles, Alpa's solver; the
model goes through an MPS file, and CBC's presolve, which costs more than the solve on these models, is off). When the solver stops at the
time limit the best integer solution found is used; when it finds none, a stated heuristic is used
instead (greedy in node order: each node takes the strategy cheapest given the choices already made). The
report says which happened.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import optimize, sparse

from alpa_like.compiler.optional_imports import require


@dataclasses.dataclass(frozen=True, kw_only=True)
class IlpEdge:
    """Resharding costs between two nodes: ``cost[i, j]`` when ``src`` picks ``i`` and ``dst`` picks ``j``."""

    src: int
    dst: int
    cost: np.ndarray


@dataclasses.dataclass(frozen=True, kw_only=True)
class IlpProblem:
    """Eq. 3.1 as plain arrays."""

    node_costs: tuple[np.ndarray, ...]
    """``c_v + d_v`` per node: a vector of length ``k_v >= 1``."""
    edges: tuple[IlpEdge, ...] = ()
    memory_rows: tuple[tuple[tuple[int, np.ndarray], ...], ...] = ()
    """Per time step: (node, per-strategy bytes) pairs whose sum must stay within the budget."""
    memory_constants: tuple[float, ...] = ()
    """Per time step: bytes that do not depend on any choice."""
    memory_budget: float | None = None
    """Bytes per device, or None for no memory constraint."""

    def __post_init__(self):
        for v, c in enumerate(self.node_costs):
            if np.ndim(c) != 1 or len(c) < 1:
                raise ValueError(f"node_costs[{v}] must be a non-empty vector, got shape {np.shape(c)}")
        n = len(self.node_costs)
        for e in self.edges:
            if not (0 <= e.src < n and 0 <= e.dst < n) or e.src == e.dst:
                raise ValueError(f"edge ({e.src}, {e.dst}) must join two different nodes of {n}")
            if e.cost.shape != (len(self.node_costs[e.src]), len(self.node_costs[e.dst])):
                raise ValueError(f"edge ({e.src}, {e.dst}) cost has shape {e.cost.shape}, expected "
                                 f"{(len(self.node_costs[e.src]), len(self.node_costs[e.dst]))}")
        if len(self.memory_constants) != len(self.memory_rows):
            raise ValueError("memory_constants needs one entry per memory row")

    def objective(self, choice: Sequence[int]) -> float:
        """The Eq. 3.1 cost of an assignment (one strategy index per node)."""
        total = sum(float(c[choice[v]]) for v, c in enumerate(self.node_costs))
        return total + sum(float(e.cost[choice[e.src], choice[e.dst]]) for e in self.edges)

    def peak_memory(self, choice: Sequence[int]) -> float:
        """The largest memory row under ``choice`` (0 without rows)."""
        return max((const + sum(float(m[choice[v]]) for v, m in row)
                    for row, const in zip(self.memory_rows, self.memory_constants)), default=0.0)

    def feasible(self, choice: Sequence[int]) -> bool:
        return self.memory_budget is None or self.peak_memory(choice) <= self.memory_budget * (1 + 1e-9)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IlpSolution:
    """What the solver decided, and how."""

    choice: tuple[int, ...]
    """Strategy index per node."""
    objective: float
    """Eq. 3.1 cost of ``choice`` (seconds), recomputed from the problem."""
    status: str
    """``"optimal"``, ``"time limit (best feasible)"``, ``"heuristic (...)"`` or ``"infeasible"``."""
    solve_seconds: float
    num_nodes: int
    """Nodes of the problem as given."""
    num_edges: int
    num_variables: int
    """Variables handed to the solver after the exact reductions (0 when nothing was left to solve)."""
    num_constraints: int


def restrict(problem: IlpProblem, allowed: Mapping[int, Sequence[int]]) -> tuple[IlpProblem, tuple[np.ndarray, ...]]:
    """The same problem with node ``v`` limited to the strategies ``allowed[v]`` (nodes not listed keep all).

    Returns the restricted problem and, per node, the original index of each strategy it kept: a choice
    ``c`` of the restricted problem is the choice ``keep[v][c[v]]`` of ``problem``, at the same cost. Used to
    solve a variant of a problem (e.g. every parameter fully sharded) without building it again.
    """
    keep = []
    for v, c in enumerate(problem.node_costs):
        kept = np.arange(len(c)) if v not in allowed else np.unique(np.asarray(allowed[v], dtype=np.int64))
        if kept.size == 0 or kept[0] < 0 or kept[-1] >= len(c):
            raise ValueError(f"allowed[{v}] must be a non-empty set of strategy indices below {len(c)}, "
                             f"got {list(allowed[v])!r}")
        keep.append(kept)
    sub = IlpProblem(
        node_costs=tuple(np.asarray(c)[k] for c, k in zip(problem.node_costs, keep)),
        edges=tuple(IlpEdge(src=e.src, dst=e.dst, cost=e.cost[np.ix_(keep[e.src], keep[e.dst])])
                    for e in problem.edges),
        memory_rows=tuple(tuple((v, np.asarray(m)[keep[v]]) for v, m in row) for row in problem.memory_rows),
        memory_constants=problem.memory_constants, memory_budget=problem.memory_budget)
    return sub, tuple(keep)


def brute_force(problem: IlpProblem) -> tuple[tuple[int, ...], float]:
    """The optimum by enumerating every assignment (tests only: exponential). Infeasible: ((), inf)."""
    best, best_cost = (), float("inf")
    for choice in itertools.product(*(range(len(c)) for c in problem.node_costs)):
        if problem.feasible(choice):
            cost = problem.objective(choice)
            if cost < best_cost - 1e-12:
                best, best_cost = choice, cost
    return best, best_cost


def greedy(problem: IlpProblem) -> tuple[int, ...]:
    """The fallback heuristic: nodes in order, each taking the strategy cheapest given earlier choices."""
    choice = [-1] * len(problem.node_costs)
    by_node: dict[int, list[IlpEdge]] = {}
    for e in problem.edges:
        by_node.setdefault(max(e.src, e.dst), []).append(e)
    for v, c in enumerate(problem.node_costs):
        total = np.array(c, dtype=float)
        for e in by_node.get(v, ()):
            total += e.cost[choice[e.src], :] if e.dst == v else e.cost[:, choice[e.dst]]
        choice[v] = int(np.argmin(total))
    return tuple(choice)


# ------------------------------------------------------------------------------------------- reductions

def _merge_edges(problem: IlpProblem) -> dict[tuple[int, int], np.ndarray]:
    """Edges keyed ``(a, b)`` with ``a < b``, parallel edges summed, rows indexed by ``a``."""
    merged: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        key, cost = ((e.src, e.dst), e.cost) if e.src < e.dst else ((e.dst, e.src), e.cost.T)
        merged[key] = merged[key] + cost if key in merged else np.array(cost, dtype=float)
    return merged


def _eliminate(costs: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray], allow_leaves: bool):
    """Removes single-strategy nodes (and, with ``allow_leaves``, nodes of degree <= 1) exactly.

    Returns the elimination log ``[(node, neighbour | None, argmin per neighbour choice | chosen index)]``
    and the constant cost collected; ``costs`` and ``edges`` are updated in place.
    """
    neighbours: dict[int, set[int]] = {v: set() for v in range(len(costs))}
    for a, b in edges:
        neighbours[a].add(b)
        neighbours[b].add(a)
    alive = set(range(len(costs)))
    log, constant = [], 0.0
    queue = [v for v in range(len(costs)) if len(costs[v]) == 1 or (allow_leaves and len(neighbours[v]) <= 1)]
    while queue:
        v = queue.pop()
        if v not in alive:
            continue
        if len(costs[v]) == 1:
            for u in list(neighbours[v]):
                r = edges.pop((v, u) if v < u else (u, v))
                costs[u] = costs[u] + (r[0, :] if v < u else r[:, 0])
                neighbours[u].discard(v)
                if allow_leaves and len(neighbours[u]) <= 1 or len(costs[u]) == 1:
                    queue.append(u)
            neighbours[v].clear()
            constant += float(costs[v][0])
            log.append((v, None, 0))
        elif allow_leaves and not neighbours[v]:
            best = int(np.argmin(costs[v]))
            constant += float(costs[v][best])
            log.append((v, None, best))
        elif allow_leaves and len(neighbours[v]) == 1:
            (u,) = neighbours[v]
            r = edges.pop((v, u) if v < u else (u, v))
            r = r if v < u else r.T  # rows: v's choices
            total = costs[v][:, None] + r
            best = np.argmin(total, axis=0)
            costs[u] = costs[u] + total[best, np.arange(total.shape[1])]
            neighbours[u].discard(v)
            neighbours[v].clear()
            log.append((v, u, best))
            if len(neighbours[u]) <= 1:
                queue.append(u)
        else:
            continue
        alive.discard(v)
    return log, constant, alive


def _compress(r: np.ndarray):
    """(row class per row, column class per column, compressed matrix) of an edge cost matrix."""
    rows, row_of = np.unique(r, axis=0, return_inverse=True)
    cols, col_of = np.unique(rows, axis=1, return_inverse=True)
    return row_of.reshape(-1), col_of.reshape(-1), cols


# ----------------------------------------------------------------------------------------------- solving

SOLVERS = ("cbc", "highs")
"""``highs`` (the default): HiGHS through scipy (``linprog`` on the relaxation, then ``milp`` if needed);
``cbc``: PuLP's bundled CBC binary (Alpa's solver)."""

DEFAULT_SOLVER = "highs"

INTEGRALITY_TOLERANCE = 1e-6
"""An ``s`` of the LP relaxation within this of 0 or 1 counts as integral."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MatrixModel:
    """The reduced ILP as sparse matrices: ``min c x`` s.t. ``A_eq x = b_eq``, ``A_ub x <= b_ub``,
    ``0 <= x <= 1``, the first ``num_int`` variables binary (the ``s``), the rest the continuous ``e``."""

    c: np.ndarray
    a_eq: sparse.csr_matrix
    b_eq: np.ndarray
    a_ub: sparse.csr_matrix | None
    b_ub: np.ndarray | None
    num_int: int
    s_index: dict[int, np.ndarray]
    """Columns of each node's ``s_v``."""


def solve(problem: IlpProblem, *, time_limit: float = 60.0, solver: str = DEFAULT_SOLVER) -> IlpSolution:
    """Solves Eq. 3.1 exactly (after the exact reductions in the module docstring).

    Args:
      problem: costs, edges and the optional memory budget.
      time_limit: seconds the MILP solver may run; it then returns its best integer solution.
      solver: one of :data:`SOLVERS`.

    Returns:
      The assignment, its objective and how it was obtained. A memory budget no assignment satisfies gives
      ``status == "infeasible"`` and the greedy assignment (which violates the budget).
    """
    if not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds, got {time_limit!r}")
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    start = time.perf_counter()
    costs = [np.array(c, dtype=float) for c in problem.node_costs]
    edges = _merge_edges(problem)
    log, _, alive = _eliminate(costs, edges, allow_leaves=problem.memory_budget is None)
    choice = [-1] * len(costs)
    status, num_vars, num_cons = "optimal", 0, 0
    if alive:
        model = matrix_model(problem, costs, edges, sorted(alive))
        num_vars = len(model.c)
        num_cons = model.a_eq.shape[0] + (0 if model.a_ub is None else model.a_ub.shape[0])
        x, status = (_solve_cbc if solver == "cbc" else _solve_highs)(model, time_limit)
        if x is not None:
            for v, cols in model.s_index.items():
                choice[v] = int(np.argmax(x[cols]))
        else:
            fallback = greedy(problem)
            for v in alive:
                choice[v] = fallback[v]
    for v, u, best in reversed(log):
        choice[v] = int(best) if u is None else int(best[choice[u]])
    choice = tuple(choice)
    if status != "infeasible" and not problem.feasible(choice):  # e.g. everything fixed, over budget
        status = "infeasible"
    if status == "infeasible":
        choice = greedy(problem)
    return IlpSolution(choice=choice, objective=problem.objective(choice), status=status,
                       solve_seconds=time.perf_counter() - start, num_nodes=len(problem.node_costs),
                       num_edges=len(problem.edges), num_variables=num_vars, num_constraints=num_cons)


def matrix_model(problem: IlpProblem, costs, edges, alive: list[int]) -> MatrixModel:
    """The sparse model over the nodes left after elimination (built with numpy, no per-variable objects).

    The objective is scaled so that its largest coefficient is 1e6: costs are seconds (1e-12 .. 1e-1),
    below the solvers' default tolerances otherwise.
    """
    s_index, offset = {}, 0
    for v in alive:
        s_index[v] = np.arange(offset, offset + len(costs[v]))
        offset += len(costs[v])
    num_int = offset
    node_c = {v: costs[v].copy() for v in alive}
    rows = [np.repeat(np.arange(len(alive)), [len(costs[v]) for v in alive])]
    cols = [np.concatenate([s_index[v] for v in alive])]
    vals = [np.ones(num_int)]
    edge_c = []
    row = len(alive)
    for (a, b), r in edges.items():
        if not np.any(r):
            continue
        row_of, col_of, rc = _compress(r)
        if rc.shape[0] == 1:
            node_c[b] += rc[0, col_of]
            continue
        if rc.shape[1] == 1:
            node_c[a] += rc[row_of, 0]
            continue
        nr, nc = rc.shape
        e = offset + np.arange(nr * nc).reshape(nr, nc)
        offset += nr * nc
        edge_c.append(rc.reshape(-1))
        # Row marginals: sum_j e[i, j] - sum_{k in class i} s_a[k] = 0, then column marginals likewise.
        rows += [row + np.repeat(np.arange(nr), nc), row + row_of,
                 row + nr + np.tile(np.arange(nc), nr), row + nr + col_of]
        cols += [e.reshape(-1), s_index[a], e.reshape(-1), s_index[b]]
        vals += [np.ones(nr * nc), -np.ones(len(row_of)), np.ones(nr * nc), -np.ones(len(col_of))]
        row += nr + nc
    c = np.concatenate([node_c[v] for v in alive] + edge_c)
    a_eq = sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                             shape=(row, offset))
    b_eq = np.zeros(row)
    b_eq[:len(alive)] = 1.0
    a_ub = b_ub = None
    if problem.memory_budget is not None and problem.memory_rows:
        u_rows, u_cols, u_vals, b_ub = [], [], [], []
        for t, (mem_row, const) in enumerate(zip(problem.memory_rows, problem.memory_constants)):
            fixed = const
            for v, m in mem_row:
                if v in s_index:
                    u_rows.append(np.full(len(m), t))
                    u_cols.append(s_index[v])
                    u_vals.append(np.asarray(m, dtype=float))
                else:
                    fixed += float(m[0])
            b_ub.append(problem.memory_budget - fixed)
        a_ub = sparse.csr_matrix((np.concatenate(u_vals or [np.zeros(0)]),
                                  (np.concatenate(u_rows or [np.zeros(0, int)]),
                                   np.concatenate(u_cols or [np.zeros(0, int)]))),
                                 shape=(len(b_ub), offset))
        b_ub = np.asarray(b_ub)
    peak = np.max(np.abs(c)) if c.size else 0.0
    c = c * (1e6 / peak) if peak > 0 else c
    return MatrixModel(c=c, a_eq=a_eq, b_eq=b_eq, a_ub=a_ub, b_ub=b_ub, num_int=num_int, s_index=s_index)


def _solve_highs(model: MatrixModel, time_limit: float) -> tuple[np.ndarray | None, str]:
    """HiGHS on the LP relaxation first; the MILP only when the relaxation's ``s`` are fractional.

    An optimal relaxation whose ``s`` are all 0 or 1 is an optimal integer solution (it is feasible for the
    MILP and no integer point can beat the relaxation's bound), and on the intra-op models the relaxation
    is often integral: the dual simplex without presolve finds it 10-15x faster than the MILP solver, whose
    presolve and root processing dominate. The MILP also runs without presolve (GPT-2.6B's 2x4 view, whose
    relaxation is fractional: 62 s instead of 100 s).
    """
    start = time.perf_counter()
    relaxation = optimize.linprog(model.c, A_ub=model.a_ub, b_ub=model.b_ub, A_eq=model.a_eq, b_eq=model.b_eq,
                                  bounds=(0.0, 1.0), method="highs-ds",
                                  options={"presolve": False, "time_limit": float(time_limit)})
    if relaxation.status == 2:
        return None, "infeasible"
    if relaxation.status == 0:
        s = relaxation.x[:model.num_int]
        if np.all(np.minimum(s, 1.0 - s) <= INTEGRALITY_TOLERANCE):
            return np.round(relaxation.x), "optimal"
    remaining = time_limit - (time.perf_counter() - start)
    if remaining <= 0:
        return None, "heuristic (greedy: the solver found no solution within the time limit)"
    constraints = [optimize.LinearConstraint(model.a_eq, model.b_eq, model.b_eq)]
    if model.a_ub is not None:
        constraints.append(optimize.LinearConstraint(model.a_ub, -np.inf, model.b_ub))
    integrality = np.zeros(len(model.c))
    integrality[:model.num_int] = 1
    res = optimize.milp(model.c, constraints=constraints, integrality=integrality,
                        bounds=optimize.Bounds(0.0, 1.0),
                        options={"time_limit": float(remaining), "presolve": False})
    if res.status == 0:
        return res.x, "optimal"
    if res.status == 2:
        return None, "infeasible"
    if res.x is not None:
        return res.x, "time limit (best feasible)"
    return None, "heuristic (greedy: the solver found no solution within the time limit)"


def write_mps(path: str, model: MatrixModel) -> None:
    """Writes ``model`` as an MPS file, indented like PuLP's (which CBC's reader accepts): columns ``x<j>``,
    equality rows ``e<i>``, memory rows ``m<i>``."""
    a = sparse.vstack([model.a_eq] + ([model.a_ub] if model.a_ub is not None else [])).tocsc()
    n_eq = model.a_eq.shape[0]
    n_ub = 0 if model.a_ub is None else model.a_ub.shape[0]
    names = np.array([f"e{i}" for i in range(n_eq)] + [f"m{i}" for i in range(n_ub)], dtype=object)
    lines = ["NAME alpa_intra_op", "ROWS", " N obj"]
    lines += [f" E e{i}" for i in range(n_eq)] + [f" L m{i}" for i in range(n_ub)]
    lines.append("COLUMNS")
    lines.append("    MARKER0 'MARKER' 'INTORG'")
    for j in range(a.shape[1]):
        if j == model.num_int:
            lines.append("    MARKER1 'MARKER' 'INTEND'")
        if model.c[j] != 0:
            lines.append(f"    x{j} obj {float(model.c[j])!r}")
        lo, hi = a.indptr[j], a.indptr[j + 1]
        lines += [f"    x{j} {r} {v!r}" for r, v in zip(names[a.indices[lo:hi]], a.data[lo:hi].tolist())]
    if model.num_int == a.shape[1]:
        lines.append("    MARKER1 'MARKER' 'INTEND'")
    lines.append("RHS")
    rhs = np.concatenate([model.b_eq, model.b_ub if model.b_ub is not None else np.zeros(0)])
    lines += [f"    rhs {r} {v!r}" for r, v in zip(names, rhs.tolist()) if v != 0]
    lines.append("BOUNDS")
    lines += [f" UP bnd x{j} 1" for j in range(a.shape[1])]
    lines.append("ENDATA")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def cbc_path() -> str:
    """The CBC binary: PuLP's bundled one (as Alpa used), else ``cbc`` on the PATH."""
    coin_api = require("pulp.apis.coin_api", "the intra-op ILP with solver='cbc'", package="pulp")

    bundled = coin_api.PULP_CBC_CMD.pulp_cbc_path
    if bundled and os.path.exists(bundled):
        return bundled
    found = shutil.which("cbc")
    if found is None:
        raise RuntimeError("no CBC binary: PuLP's bundled one is missing and `cbc` is not on the PATH; "
                           "use solver='highs'")
    return found


def _solve_cbc(model: MatrixModel, time_limit: float) -> tuple[np.ndarray | None, str]:
    """Runs PuLP's bundled CBC on the model written as MPS; parses its solution file."""
    cbc = cbc_path()
    with tempfile.TemporaryDirectory(prefix="alpa_ilp_") as tmp:
        mps, sol = os.path.join(tmp, "model.mps"), os.path.join(tmp, "model.sol")
        write_mps(mps, model)
        # CBC's presolve and preprocessing take most of the time on these LPs (whose relaxation is usually
        # integral already) without shrinking them: off.
        subprocess.run([cbc, mps, "-sec", str(float(time_limit)), "-timeMode", "elapsed", "-presolve", "off",
                        "-preprocess", "off", "-solve", "-solution", sol],
                       check=False, capture_output=True, text=True)
        if not os.path.exists(sol):
            return None, "heuristic (greedy: CBC did not run)"
        with open(sol) as f:
            header = f.readline()
            x = np.zeros(len(model.c))
            for line in f:
                parts = line.replace("**", " ").split()
                if len(parts) >= 3 and parts[1].startswith("x"):
                    x[int(parts[1][1:])] = float(parts[2])
    if header.startswith("Optimal"):
        return x, "optimal"
    if "nfeasible" in header:
        return None, "infeasible"
    if header.startswith("Stopped") and "objective value" in header and "no integer" not in header:
        return x, "time limit (best feasible)"
    return None, "heuristic (greedy: CBC found no solution within the time limit)"
