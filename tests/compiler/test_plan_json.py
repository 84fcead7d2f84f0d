"""ParallelPlan.from_json: every field checked on load, errors that name the field's path, and a fuzz test
over mutated valid plans (each loads to a plan that round-trips and prints, or raises ValueError)."""
import dataclasses
import doctest
import importlib
import json
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import alpa_like as al
from alpa_like.compiler import fields, plan_format
from alpa_like.compiler.plan import PlanCandidate
from tests.helpers import make_train_step, mlp_loss

plan_module = importlib.import_module("alpa_like.compiler.plan")  # al.plan is the planning function
CLUSTER = al.ClusterSpec.preset("p3.16xlarge")


def two_layer_loss(params, batch):
    x = jnp.tanh(batch["x"] @ params["w0"])
    al.mark_pipeline_boundary()
    return jnp.mean(jnp.tanh(x @ params["w1"]) ** 2)


def state_shapes(params):
    return jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adam(1e-3)),
                          params)


@pytest.fixture(scope="module")
def pipeline_plan():
    """Two stages of one layer each: per-stage parameters with their ILP specs."""
    params = {f"w{i}": jax.ShapeDtypeStruct((8, 8), jnp.float32) for i in range(2)}
    method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.ManualLayerOption(),
                                  stage_option=al.UniformStageOption(num_stages=2, show_progress=False))
    plan = al.plan(make_train_step(two_layer_loss), state_shapes(params),
                   {"x": jax.ShapeDtypeStruct((16, 8), jnp.float32)}, method=method, cluster=CLUSTER)
    assert len(plan.stages) == 2
    return plan


@pytest.fixture(scope="module")
def spmd_plan():
    """One stage with inputs, outputs, the ILP's report and its chosen strategies."""
    params = {f"dense_{i}": {"kernel": jax.ShapeDtypeStruct((a, b), jnp.float32),
                             "bias": jax.ShapeDtypeStruct((b,), jnp.float32)}
              for i, (a, b) in enumerate([(16, 32), (32, 8)])}
    batch = {"x": jax.ShapeDtypeStruct((16, 16), jnp.float32), "y": jax.ShapeDtypeStruct((16, 8), jnp.float32)}
    plan = al.plan(make_train_step(mlp_loss), state_shapes(params), batch, method=al.ShardParallel(),
                   cluster=CLUSTER)
    assert plan.stages[0].ops and plan.stages[0].solver is not None
    return plan


@pytest.fixture(scope="module")
def valid_docs(pipeline_plan, spmd_plan):
    """JSON objects of valid plans: the two above, and variants with the optional parts filled in (measured
    plan selection with candidates; TeraPipe token slicing)."""
    stage = spmd_plan.stages[0]
    candidates = (PlanCandidate(logical_mesh_shape=(2, 4), cost_model="alpha-beta", weight_update_sharding=True,
                                objective=1e-5, measured_seconds=2e-3, chosen=True),
                  PlanCandidate(logical_mesh_shape=(8,), cost_model="bandwidth only", weight_update_sharding=False,
                                objective=2e-5, measured_seconds=None, same_as=0))
    measured = dataclasses.replace(stage, solver=dataclasses.replace(
        stage.solver, selection="measured", candidates=candidates, selection_seconds=1.5))
    sliced = dataclasses.replace(pipeline_plan, pipeline_schedule="terapipe", token_slicing=((1, (4, 4)),) * 8,
                                 iteration_time_without_token_slicing=1e-3)
    plans = [pipeline_plan, spmd_plan, dataclasses.replace(spmd_plan, stages=(measured,)), sliced]
    return [json.loads(p.to_json()) for p in plans]


def at(doc, *where):
    """The value at the path ``where`` (keys and indices) in ``doc``."""
    for key in where:
        doc = doc[key]
    return doc


def replaced(doc, where, value):
    """A deep copy of ``doc`` with the value at ``where`` replaced by ``value``."""
    doc = json.loads(json.dumps(doc))
    at(doc, *where[:-1])[where[-1]] = value
    return doc


INVALID = [  # (where, value, the start of the message after "ParallelPlan.from_json: ")
    (("num_micro_batches",), "abc", 'num_micro_batches: expected an int >= 1, got "abc"'),
    (("num_micro_batches",), -5, "num_micro_batches: expected an int >= 1, got -5"),
    (("num_micro_batches",), True, "num_micro_batches: expected an int >= 1, got true"),
    (("estimated_iteration_time",), math.nan, "estimated_iteration_time: expected a finite number >= 0, got NaN"),
    (("stages", 1, "compute_seconds"), -1.0, "stages[1].compute_seconds: expected a finite number >= 0, got -1.0"),
    (("stages", 1, "layer_ids"), "abc", 'stages[1].layer_ids: expected a list of ints >= 0, got "abc"'),
    (("stages", 1, "layer_ids"), [1, 1], "stages[1].layer_ids: expected a list of distinct ints >= 0"),
    (("stages", 0, "submesh_shape"), [1, 2, 2, 1], "stages[0].submesh_shape: expected a list of 2 ints >= 1"),
    (("stages", 0, "submesh_shape"), [-1, -4], "stages[0].submesh_shape[0]: expected an int >= 1, got -1"),
    (("stages", 0, "logical_mesh_shape"), [2, 4], "stages[0].logical_mesh_shape: expected a view of the "
                                                  "submesh's 4 devices, got [2, 4]"),
    (("stages", 0, "inputs", 0, "shape"), "abc", 'stages[0].inputs[0].shape: expected a list of ints >= 0, got '
                                                 '"abc"'),
    (("stages", 0, "inputs", 0, "dtype"), "float33", 'stages[0].inputs[0].dtype: expected a dtype name'),
    (("stages", 0, "inputs", 0, "dtype"), "object", 'stages[0].inputs[0].dtype: expected a dtype name'),
    (("stages", 0, "inputs", 0, "role"), "weights", "stages[0].inputs[0].role: expected one of ['param', "),
    (("stages", 0, "inputs", 0, "spec"), "RRR", 'stages[0].inputs[0].spec: expected a sharding spec of 2 dims'),
    (("stages", 0, "inputs", 0, "spec"), "S0S0", 'stages[0].inputs[0].spec: expected a sharding spec of 2 dims'),
    (("stages", 0, "inputs", 0, "bytes_per_device"), 2**70, "stages[0].inputs[0].bytes_per_device: expected an "
                                                            "int below 2**63"),
    (("stages", 1, "stage_id"), 0, "stages[1].stage_id: expected 1 (its position), got 0"),
    (("stages", 0, "communication", 0, "mesh_axes"), [0, 2], "stages[0].communication[0].mesh_axes: expected "
                                                            "axes of the 2-D logical mesh, got [0, 2]"),
    (("pipeline_schedule",), "zigzag", "pipeline_schedule: expected one of ['gpipe', '1f1b', "),
    (("pipeline_schedule",), None, "pipeline_schedule: expected a schedule name for 2 stages, got null"),
    (("token_slicing",), [[0, [4]]], "token_slicing[0][0]: expected an int >= 1, got 0"),
    (("compile_times",), [["trace", "1 s"]], 'compile_times[0][1]: expected a finite number >= 0, got "1 s"'),
    (("cluster", "num_nodes"), 0, "cluster: num_nodes: expected an int >= 1, got 0"),
    (("cluster",), [], "cluster: expected a JSON object (a ClusterSpec), got []"),
    (("stages", 0, "solver"), {"status": "optimal"}, "stages[0].solver: missing keys ['num_constraints', "),
    (("stages", 0, "ops"), [{}], "stages[0].ops[0]: missing keys ['communication', 'kind', "),
    (("warnings",), "none", 'warnings: expected a list, got "none"'),
]


@pytest.mark.parametrize("where, value, message", INVALID, ids=[".".join(map(str, w)) + f"={v!r}"
                                                                for w, v, _ in INVALID])
def test_from_json_names_the_invalid_field(pipeline_plan, where, value, message):
    text = json.dumps(replaced(json.loads(pipeline_plan.to_json()), where, value))
    with pytest.raises(ValueError) as info:
        al.ParallelPlan.from_json(text)
    assert str(info.value).startswith(f"ParallelPlan.from_json: {message}")


def test_from_json_checks_the_intra_op_report(spmd_plan):
    doc = json.loads(spmd_plan.to_json())
    bad = [(("stages", 0, "ops", 0, "spec"), None, "stages[0].ops[0].spec: expected a sharding spec of "),
           (("stages", 0, "solver", "views", 0), [[8], "fast"], 'stages[0].solver.views[0][1]: expected a finite '
                                                                'number >= 0, got "fast"'),
           (("stages", 0, "solver", "selection"), "best", "stages[0].solver.selection: expected one of "),
           (("stages", 0, "mesh_axis_names"), ["x", "x"], "stages[0].mesh_axis_names: expected 2 distinct names"),
           (("stages", 0, "unknown"), 1, "stages[0]: unknown keys ['unknown']")]
    for where, value, message in bad:
        with pytest.raises(ValueError) as info:
            al.ParallelPlan.from_json(json.dumps(replaced(doc, where, value)))
        assert str(info.value).startswith(f"ParallelPlan.from_json: {message}"), str(info.value)


@pytest.mark.parametrize("text", ["[]", "null", "3", '"plan"', "[" * 100_000 + "]" * 100_000,
                                  '{"a":' * 100_000 + "1" + "}" * 100_000, "1" * 5000])
def test_from_json_rejects_what_is_not_a_plan_object(text):
    with pytest.raises(ValueError, match="ParallelPlan.from_json: "):
        al.ParallelPlan.from_json(text)


def test_from_dict_rejects_what_is_not_a_mapping():
    for value in ([], None, 3):
        with pytest.raises(ValueError, match=r"^ParallelPlan: expected a JSON object \(a ParallelPlan\)"):
            al.ParallelPlan.from_dict(value)


def test_plans_saved_without_the_optional_fields_load_with_their_defaults(spmd_plan):
    doc = json.loads(spmd_plan.to_json())
    for key in ("warnings", "compile_times", "token_slicing", "iteration_time_without_token_slicing"):
        del doc[key]
    for key in ("ops", "solver"):
        del doc["stages"][0][key]
    plan = al.ParallelPlan.from_json(json.dumps(doc))
    assert plan == dataclasses.replace(spmd_plan, warnings=(), compile_times=(), stages=(
        dataclasses.replace(spmd_plan.stages[0], ops=(), solver=None),))


# ------------------------------------------------------------------------------------------------ fuzzing

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10) | st.integers() | st.floats(allow_nan=True)
    | st.sampled_from(["", "R", "S0R", "float32", "param", "1f1b", "x"]) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


def locations(doc, where=()):
    """Every (path, value) in the JSON tree ``doc``, the root included."""
    yield where, doc
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in children:
        yield from locations(value, (*where, key))


def nudged(value):
    """Values near ``value`` in type or range: what a hand-edited or damaged plan file holds."""
    if isinstance(value, bool):
        return st.sampled_from([not value, int(value), str(value).lower()])
    if isinstance(value, (int, float)):
        return st.sampled_from([-value, -1, 0, value + 0.5, str(value), math.nan, math.inf, True, None, [value]])
    if isinstance(value, str):
        return st.sampled_from(["", value + "x", value[:-1], value.upper(), 1, None, [value]])
    if isinstance(value, list):
        return st.sampled_from([value[:-1], value + value[-1:], [], value[::-1], {}, "abc"]) if value else \
            st.sampled_from([[0], [""], [{}], None])
    return st.sampled_from([{}, [], None])


def put(doc, where, value):
    """``doc`` with the value at ``where`` set to ``value`` (in place below the root)."""
    if not where:
        return value
    at(doc, *where[:-1])[where[-1]] = value
    return doc


@st.composite
def mutated_plans(draw, docs):
    """A valid plan's JSON with one to three mutations: a value anywhere (the root included) replaced by a
    random JSON value or a nearby one, or wrapped in a list; a key deleted or added."""
    doc = json.loads(json.dumps(draw(st.sampled_from(docs))))
    for _ in range(draw(st.integers(1, 3))):
        where, value = draw(st.sampled_from(list(locations(doc))))
        kind = draw(st.sampled_from(["replace", "nudge", "nudge", "wrap", "delete", "add"]))
        if kind == "replace":
            doc = put(doc, where, draw(JSON_VALUES))
        elif kind == "nudge":
            doc = put(doc, where, draw(nudged(value)))
        elif kind == "wrap":
            doc = put(doc, where, [value])
        elif kind == "delete" and where:
            del at(doc, *where[:-1])[where[-1]]
        elif kind == "add" and isinstance(value, dict):
            value[draw(st.sampled_from(["extra", "spec", "role", "shape", "ops"]))] = draw(JSON_VALUES)
    return json.dumps(doc)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_plans_load_to_valid_plans_or_raise_value_error(valid_docs, data):
    text = data.draw(mutated_plans(valid_docs))
    try:
        plan = al.ParallelPlan.from_json(text)
    except ValueError as e:
        assert str(e).startswith("ParallelPlan.from_json: ")
        return
    assert al.ParallelPlan.from_json(plan.to_json()) == plan
    str(plan)  # a plan that loads also prints


def test_doctests():
    assert doctest.testmod(fields).failed == 0
    assert doctest.testmod(plan_module).failed == 0
    assert doctest.testmod(plan_format).failed == 0
