"""The Eq. 3.1 ILP against brute force on small random instances, with and without a memory budget."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpa_like.compiler.ilp import IlpEdge, IlpProblem, brute_force, greedy, restrict, solve


@st.composite
def problems(draw, with_memory: bool):
    """Up to 5 nodes with 1-4 strategies, random edges (parallel ones included), costs that tie often."""
    n = draw(st.integers(1, 5))
    ks = [draw(st.integers(1, 4)) for _ in range(n)]
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)

    def costs(shape):  # small integers make ties (and therefore alternative optima) common
        return rng.integers(0, 4, size=shape).astype(float) * draw(st.sampled_from([1e-6, 1.0, 1e3]))

    node_costs = tuple(costs(k) for k in ks)
    edges = []
    for _ in range(draw(st.integers(0, 7)) if n > 1 else 0):
        a, b = rng.choice(n, size=2, replace=False)
        edges.append(IlpEdge(src=int(a), dst=int(b), cost=costs((ks[a], ks[b]))))
    rows, consts, budget = (), (), None
    if with_memory:
        rows = tuple(tuple((v, rng.integers(1, 5, size=ks[v]).astype(float)) for v in range(n)
                           if rng.random() < 0.7) for _ in range(draw(st.integers(1, 3))))
        consts = tuple(float(rng.integers(0, 3)) for _ in rows)
        budget = float(draw(st.integers(2, 4 * n + 2)))
    return IlpProblem(node_costs=node_costs, edges=tuple(edges), memory_rows=rows, memory_constants=consts,
                      memory_budget=budget)


@pytest.mark.parametrize("solver", ["cbc", "highs"])
@settings(max_examples=40, deadline=None)
@given(problem=problems(with_memory=False))
def test_ilp_matches_brute_force(solver, problem):
    best, best_cost = brute_force(problem)
    solution = solve(problem, time_limit=30, solver=solver)
    assert solution.status == "optimal"
    assert solution.objective == pytest.approx(best_cost, rel=1e-6, abs=1e-9)
    assert problem.objective(solution.choice) == solution.objective


@settings(max_examples=40, deadline=None)
@given(problem=problems(with_memory=True))
def test_ilp_with_memory_budget_matches_brute_force(problem):
    best, best_cost = brute_force(problem)
    solution = solve(problem, time_limit=30)
    if not best:
        assert solution.status == "infeasible"
        return
    assert solution.status == "optimal"
    assert problem.feasible(solution.choice)
    assert solution.objective == pytest.approx(best_cost, rel=1e-6, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(problem=problems(with_memory=False), data=st.data())
def test_a_restricted_problem_is_solved_over_the_allowed_strategies_only(problem, data):
    allowed = {v: data.draw(st.lists(st.integers(0, len(c) - 1), min_size=1, unique=True))
               for v, c in enumerate(problem.node_costs) if data.draw(st.booleans())}
    sub, keep = restrict(problem, allowed)
    choice = tuple(int(k[c]) for k, c in zip(keep, solve(sub, time_limit=30).choice))
    best = min(problem.objective(c) for c in itertools.product(*(
        allowed.get(v, range(len(c))) for v, c in enumerate(problem.node_costs))))
    assert all(choice[v] in allowed[v] for v in allowed)
    assert sub.objective(tuple(np.searchsorted(k, c) for k, c in zip(keep, choice))) == problem.objective(choice)
    assert problem.objective(choice) == pytest.approx(best, rel=1e-6, abs=1e-9)


def test_restrict_rejects_an_empty_or_out_of_range_set():
    problem = IlpProblem(node_costs=(np.zeros(2), np.zeros(3)))
    with pytest.raises(ValueError, match=r"allowed\[1\] must be a non-empty set of strategy indices below 3"):
        restrict(problem, {1: []})
    with pytest.raises(ValueError, match=r"allowed\[0\] must be a non-empty set of strategy indices below 2"):
        restrict(problem, {0: [2]})


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_a_fractional_relaxation_still_gets_the_integer_optimum(solver):
    # An odd cycle whose edges charge 1 when both ends pick the same strategy: the LP relaxation takes every
    # s = 1/2 at cost 0 (each e puts its mass on the unequal pairs); no 2-colouring of a triangle exists,
    # so the integer optimum is 1. No node is a leaf: the solver (HiGHS: its MILP after the relaxation) runs.
    same = np.eye(2)
    problem = IlpProblem(node_costs=(np.zeros(2),) * 3,
                         edges=tuple(IlpEdge(src=a, dst=b, cost=same) for a, b in ((0, 1), (1, 2), (0, 2))))
    solution = solve(problem, solver=solver)
    assert solution.status == "optimal" and solution.num_variables > 0
    assert solution.objective == 1.0 == brute_force(problem)[1]


def test_chain_is_eliminated_exactly_without_calling_the_solver():
    # A path a - b - c: every node becomes a leaf in turn, nothing is left for CBC.
    r = np.array([[0.0, 5.0], [5.0, 0.0]])
    problem = IlpProblem(node_costs=(np.array([0.0, 1.0]), np.array([3.0, 0.0]), np.array([0.0, 0.0])),
                         edges=(IlpEdge(src=0, dst=1, cost=r), IlpEdge(src=1, dst=2, cost=r)))
    solution = solve(problem)
    assert solution.num_variables == 0
    assert solution.choice == (1, 1, 1) and solution.objective == 1.0


def test_an_impossible_memory_budget_is_reported_infeasible():
    problem = IlpProblem(node_costs=(np.zeros(2), np.zeros(2)), edges=(IlpEdge(src=0, dst=1, cost=np.ones((2, 2))),),
                         memory_rows=(((0, np.array([5.0, 6.0])), (1, np.array([5.0, 5.0]))),),
                         memory_constants=(0.0,), memory_budget=9.0)
    solution = solve(problem)
    assert solution.status == "infeasible"
    assert solution.choice == greedy(problem)


def test_greedy_takes_the_cheapest_strategy_given_earlier_choices():
    problem = IlpProblem(node_costs=(np.array([1.0, 0.0]), np.array([0.0, 0.5])),
                         edges=(IlpEdge(src=0, dst=1, cost=np.array([[0.0, 0.0], [2.0, 0.0]])),))
    assert greedy(problem) == (1, 1)


def test_bad_problems_and_options_are_rejected_with_the_argument_named():
    with pytest.raises(ValueError, match=r"node_costs\[0\] must be a non-empty vector"):
        IlpProblem(node_costs=(np.zeros(0),))
    with pytest.raises(ValueError, match=r"edge \(0, 1\) cost has shape \(1, 1\), expected \(2, 2\)"):
        IlpProblem(node_costs=(np.zeros(2), np.zeros(2)), edges=(IlpEdge(src=0, dst=1, cost=np.zeros((1, 1))),))
    with pytest.raises(ValueError, match="must join two different nodes"):
        IlpProblem(node_costs=(np.zeros(2),), edges=(IlpEdge(src=0, dst=0, cost=np.zeros((2, 2))),))
    problem = IlpProblem(node_costs=(np.zeros(2),))
    with pytest.raises(ValueError, match="time_limit must be > 0"):
        solve(problem, time_limit=0)
    with pytest.raises(ValueError, match=r"solver must be one of \('cbc', 'highs'\), got 'glpk'"):
        solve(problem, solver="glpk")
