"""The jaxpr -> operator graph pass: markers, inlined calls, merging into the deepest operand."""
import jax
import jax.numpy as jnp
import numpy as np

import alpa_like as al
from alpa_like.compiler.op_graph import build_op_graph, merged_groups


def graph_of(fn, *args):
    return build_op_graph(jax.make_jaxpr(fn)(*args))


def test_trivial_operators_merge_into_their_deepest_operand():
    def f(x, w, b):
        return jnp.tanh(x @ w + b)  # add and tanh follow the matmul, not the (shallow) bias
    g = graph_of(f, jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.ones(16))
    group = merged_groups(g)
    dot = next(n for n in g.nodes if n.primitive == "dot_general")
    for name in ("add", "tanh"):
        node = next(n for n in g.nodes if n.primitive == name)
        assert group[node.id] == dot.id
    broadcast = next(n for n in g.nodes if n.primitive == "broadcast_in_dim")
    assert group[broadcast.id] == g.nodes[g.tensors[g.input_tensors[2]].producer].id  # follows the bias


def test_markers_are_identities_and_are_recorded():
    def f(p, x):
        return al.grad(lambda p: jnp.sum(x @ p))(p)
    closed = jax.make_jaxpr(f)(jnp.ones((8, 4)), jnp.ones((2, 8)))
    g = build_op_graph(closed)
    assert not any(n.primitive == "alpa_marker" for n in g.nodes)
    kinds = {kind for marks in g.markers.values() for _, _, kind in marks}
    assert kinds == {"param", "grad"}
    (grad_tensor,) = [t for t, marks in g.markers.items() if any(k == "grad" for _, _, k in marks)]
    assert g.output_tensors == (grad_tensor,)


def test_custom_jvp_bodies_are_inlined_and_control_flow_stays_one_node():
    def f(x):
        y = jax.nn.relu(x)  # custom_jvp_call around max(x, 0)
        return jax.lax.while_loop(lambda c: c[0, 0] < 10.0, lambda c: c * 2.0, y)
    g = graph_of(f, jnp.ones((3, 4)))
    prims = [n.primitive for n in g.nodes]
    assert "custom_jvp_call" not in prims and "max" in prims and prims.count("while") == 1
    relu = next(n for n in g.nodes if n.primitive == "max")
    assert relu.inlined and relu.eqn_index == 0
    # The call's output can still be pinned at the call equation.
    assert g.pins[relu.outputs[0]] == (0, 0)


def test_unsupported_primitives_are_listed():
    g = graph_of(lambda x: jnp.linalg.eigh(x)[0], jnp.eye(4))
    assert g.unsupported == ("eigh",)


def test_liveness_ends_at_the_last_reader():
    g = graph_of(lambda x: jnp.sin(x) * 2 + jnp.cos(x), jnp.ones(3))
    last = g.last_use()
    x = g.input_tensors[0]
    cos = next(n for n in g.nodes if n.primitive == "cos")
    assert last[x] == cos.id
    assert last[g.output_tensors[0]] == len(g.nodes)
    assert np.all(last >= np.array([t.producer for t in g.tensors]))


def test_scan_bodies_are_analysed_once_with_their_trip_count():
    def f(h, ws):
        def body(c, w):
            y = jnp.tanh(c @ w)
            return y, y.sum(axis=1)
        return jax.lax.scan(body, h, ws)
    g = graph_of(f, jnp.ones((8, 4)), jnp.ones((5, 4, 4)))
    assert "scan" not in [n.primitive for n in g.nodes]
    (dot,) = [n for n in g.nodes if n.primitive == "dot_general"]
    assert dot.repeat == 5 and dot.inlined
    # Iteration i reads ws[i]: the scanned input reaches the matmul through slice + squeeze of its leading axis.
    w_in = g.tensors[dot.operands[1]]
    assert w_in.shape == (4, 4) and g.nodes[w_in.producer].primitive == "squeeze"
    # The carry loops back (new carry -> carry input, paid on every iteration); ys are stacked to (5, 8).
    (tanh,) = [n for n in g.nodes if n.primitive == "tanh"]
    assert g.loop_aliases == ((tanh.outputs[0], g.input_tensors[0], 5),)
    final_carry, ys = g.output_tensors
    assert final_carry == tanh.outputs[0]
    assert g.tensors[ys].shape == (5, 8) and g.nodes[g.tensors[ys].producer].primitive == "broadcast_in_dim"
    # Only the scan's outputs can be pinned, at the scan equation.
    assert g.pins[final_carry] == (0, 0) and g.pins[ys] == (0, 1)


def test_nested_scans_multiply_their_trip_counts():
    def f(x):
        inner = lambda c, _: (jnp.sin(c), None)
        outer = lambda c, _: (jax.lax.scan(inner, c, None, length=3)[0], None)
        return jax.lax.scan(outer, x, None, length=4)[0]
    g = graph_of(f, jnp.ones((2,)))
    (sin,) = [n for n in g.nodes if n.primitive == "sin"]
    assert sin.repeat == 12
