r"""The integer linear program of Alpa's intra-op pass (dissertation Eq. 3.1), solved with PuLP/CBC.

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

When CBC stops at the time limit the best integer solution found is used; when it finds none, a stated
heuristic is used instead (greedy in node order: each node takes the strategy cheapest given the choices
already made). The report says which happened.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

import numpy as np
import pulp


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
    """Variables handed to CBC after the exact reductions (0 when nothing was left to solve)."""
    num_constraints: int


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

def solve(problem: IlpProblem, *, time_limit: float = 60.0, threads: int | None = None) -> IlpSolution:
    """Solves Eq. 3.1 exactly with CBC (after the exact reductions in the module docstring).

    Args:
      problem: costs, edges and the optional memory budget.
      time_limit: seconds CBC may run; it then returns its best integer solution.
      threads: CBC threads (default: CBC's own default).

    Returns:
      The assignment, its objective and how it was obtained. A memory budget no assignment satisfies gives
      ``status == "infeasible"`` and the greedy assignment (which violates the budget).
    """
    if not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds, got {time_limit!r}")
    start = time.perf_counter()
    costs = [np.array(c, dtype=float) for c in problem.node_costs]
    edges = _merge_edges(problem)
    log, _, alive = _eliminate(costs, edges, allow_leaves=problem.memory_budget is None)
    choice = [-1] * len(costs)
    status, num_vars, num_cons = "optimal", 0, 0
    if alive:
        model, s_vars, num_vars, num_cons = _build_model(problem, costs, edges, sorted(alive))
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, threads=threads)
        model.solve(solver)
        found = model.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        if found:
            for v, variables in s_vars.items():
                values = [var.value() or 0.0 for var in variables]
                choice[v] = int(np.argmax(values))
            if model.sol_status != pulp.LpSolutionOptimal:
                status = "time limit (best feasible)"
        elif model.status == pulp.LpStatusInfeasible:
            status = "infeasible"
        else:
            status = "heuristic (greedy: CBC found no solution within the time limit)"
        if not found:
            fallback = greedy(problem)
            for v in alive:
                choice[v] = fallback[v]
    for v, u, best in reversed(log):
        choice[v] = int(best) if u is None else int(best[choice[u]])
    choice = tuple(choice)
    if status == "infeasible":
        choice = greedy(problem)
    return IlpSolution(choice=choice, objective=problem.objective(choice), status=status,
                       solve_seconds=time.perf_counter() - start, num_nodes=len(problem.node_costs),
                       num_edges=len(problem.edges), num_variables=num_vars, num_constraints=num_cons)


def _build_model(problem: IlpProblem, costs, edges, alive: list[int]):
    """The PuLP model over the nodes left after elimination."""
    model = pulp.LpProblem("alpa_intra_op", pulp.LpMinimize)
    s_vars = {v: [pulp.LpVariable(f"s_{v}_{i}", cat=pulp.LpBinary) for i in range(len(costs[v]))] for v in alive}
    objective: list[tuple[pulp.LpVariable, float]] = []
    num_vars = sum(len(x) for x in s_vars.values())
    num_cons = 0
    for v in alive:
        model += pulp.LpAffineExpression([(x, 1.0) for x in s_vars[v]]) == 1, f"one_hot_{v}"
        num_cons += 1
    extra = {v: np.zeros(len(costs[v])) for v in alive}
    for (a, b), r in edges.items():
        if not np.any(r):
            continue
        row_of, col_of, rc = _compress(r)
        if rc.shape[0] == 1:
            extra[b] += rc[0, col_of]
            continue
        if rc.shape[1] == 1:
            extra[a] += rc[row_of, 0]
            continue
        e = [[pulp.LpVariable(f"e_{a}_{b}_{i}_{j}", lowBound=0.0, upBound=1.0) for j in range(rc.shape[1])]
             for i in range(rc.shape[0])]
        num_vars += rc.size
        for i in range(rc.shape[0]):
            terms = [(x, 1.0) for x in e[i]] + [(s_vars[a][k], -1.0) for k in np.flatnonzero(row_of == i)]
            model += pulp.LpAffineExpression(terms) == 0
        for j in range(rc.shape[1]):
            terms = [(e[i][j], 1.0) for i in range(rc.shape[0])]
            terms += [(s_vars[b][k], -1.0) for k in np.flatnonzero(col_of == j)]
            model += pulp.LpAffineExpression(terms) == 0
        num_cons += rc.shape[0] + rc.shape[1]
        objective += [(e[i][j], float(rc[i, j])) for i in range(rc.shape[0]) for j in range(rc.shape[1])
                      if rc[i, j] != 0]
    for v in alive:
        total = costs[v] + extra[v]
        objective += [(x, float(c)) for x, c in zip(s_vars[v], total) if c != 0]
    model += pulp.LpAffineExpression(objective)
    if problem.memory_budget is not None:
        for t, (row, const) in enumerate(zip(problem.memory_rows, problem.memory_constants)):
            terms = [(s_vars[v][i], float(m[i])) for v, m in row if v in s_vars for i in range(len(m)) if m[i]]
            fixed = const + sum(float(m[0]) for v, m in row if v not in s_vars)
            model += pulp.LpAffineExpression(terms) <= problem.memory_budget - fixed, f"memory_{t}"
            num_cons += 1
    return model, s_vars, num_vars, num_cons
