"""Golden sharding plans of the textbook cases (one JSON per case and logical mesh).

Each golden holds, for an ILP solved under the byte-count cost model of ``test_auto_sharding`` (alpha 0,
beta 1 s/B), the spec of every step input, the chosen strategy and output spec of every matmul (in program
order), and the objective in bytes. A missing golden fails; regenerate only with ``ALPA_LIKE_REGEN_GOLDEN=1``
and review the diff. A mismatch lists every differing entry.
"""
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import pytest

from tests.compiler.test_auto_sharding import mesh, mlp_args, moe_step, sgd_step, solve_step
from tests.helpers import mlp_loss

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"
REGEN = os.environ.get("ALPA_LIKE_REGEN_GOLDEN") == "1"


def _moe_args():
    groups, seq, experts, capacity, model, ffn = 8, 16, 8, 4, 64, 256
    params = {"wi": jax.ShapeDtypeStruct((experts, model, ffn), jnp.float32),
              "wo": jax.ShapeDtypeStruct((experts, ffn, model), jnp.float32)}
    batch = {"dispatch": jax.ShapeDtypeStruct((groups, seq, experts, capacity), jnp.float32),
             "x": jax.ShapeDtypeStruct((groups, seq, model), jnp.float32),
             "y": jax.ShapeDtypeStruct((groups, seq, model), jnp.float32)}
    return params, batch


CASES = {
    # name: (step, args, logical mesh shape)
    "mlp_data_parallel_1x8": (sgd_step(mlp_loss), mlp_args(512, (16, 32, 8)), (1, 8)),
    "mlp_megatron_1x8": (sgd_step(mlp_loss), mlp_args(8, (256, 1024, 256)), (1, 8)),
    "mlp_2d_mix_2x4": (sgd_step(mlp_loss), mlp_args(128, (32, 128, 32)), (2, 4)),
    "moe_expert_parallel_1x8": (moe_step(), _moe_args(), (1, 8)),
}


def plan_record(name: str) -> dict:
    step, args, shape = CASES[name]
    solution, specs, graph = solve_step(step, args, mesh(shape))
    matmuls = [{"op": n.name, "strategy": solution.strategies[n.id].name,
                "out": str(solution.strategies[n.id].out_specs[0])}
               for n in graph.nodes if n.primitive == "dot_general"]
    return {"mesh": list(shape), "objective_bytes": round(solution.objective, 3),
            "inputs": {path: str(spec) for path, spec in specs.items()}, "matmuls": matmuls}


def _diff(want, got, where="") -> list[str]:
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got), key=str):
            if k not in got:
                out.append(f"  {where}{k}: golden {want[k]!r}, now missing")
            elif k not in want:
                out.append(f"  {where}{k}: golden missing, now {got[k]!r}")
            else:
                out += _diff(want[k], got[k], f"{where}{k}.")
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [line for i, (w, g) in enumerate(zip(want, got)) for line in _diff(w, g, f"{where}{i}.")]
    return [] if want == got else [f"  {where.rstrip('.')}: golden {want!r} != now {got!r}"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_matches_golden(name):
    path = GOLDEN_DIR / f"{name}.json"
    now = plan_record(name)
    if REGEN:
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    if not path.exists():
        pytest.fail(f"missing golden {path}; write it with ALPA_LIKE_REGEN_GOLDEN=1 and review the diff")
    diff = _diff(json.loads(path.read_text()), now)
    assert not diff, f"{path.name} differs in {len(diff)} entries (ALPA_LIKE_REGEN_GOLDEN=1 to accept):\n" + \
        "\n".join(diff)


def test_goldens_hold_the_textbook_answers():
    """The goldens themselves say what the textbook says (so a regeneration cannot silently accept a
    wrong plan)."""
    def load(name):
        return json.loads((GOLDEN_DIR / f"{name}.json").read_text())
    dp = load("mlp_data_parallel_1x8")
    assert dp["inputs"]["batch.x"] == "S1R" and dp["inputs"]["params.dense_0.kernel"] == "RR"
    megatron = load("mlp_megatron_1x8")
    assert megatron["inputs"]["params.dense_0.kernel"] == "RS1"
    assert megatron["inputs"]["params.dense_1.kernel"] == "S1R"
    mix = load("mlp_2d_mix_2x4")
    assert mix["inputs"]["batch.x"] == "S0R" and mix["inputs"]["params.dense_0.kernel"] == "RS1"
    moe = load("moe_expert_parallel_1x8")
    assert moe["inputs"]["params.wi"] == "S1RR" and moe["inputs"]["params.wo"] == "S1RR"
