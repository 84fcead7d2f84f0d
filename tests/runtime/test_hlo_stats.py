"""Reading collectives out of HLO text."""
from alpa_like.runtime.hlo_stats import collectives, count_by_kind, reduced_bytes_by_piece

HLO = """
  %all-reduce.1 = f32[128,64]{1,0} all-reduce(f32[128,64]{1,0} %p), replica_groups={{0,1}}, to_apply=%add
  %ag = bf16[8,16]{1,0} all-gather(bf16[4,16]{1,0} %x), dimensions={0}
  %ars = (f32[4]{0}, f32[2]{0}) all-reduce-start(f32[4]{0} %a, f32[2]{0} %b), to_apply=%add
  %ard = (f32[4]{0}, f32[2]{0}) all-reduce-done((f32[4]{0}, f32[2]{0}) %ars)
  %rs = f32[16]{0} reduce-scatter(f32[128]{0} %g), dimensions={0}
  %t = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/f32[2]{0}) all-reduce(%a, %b), to_apply=%add
  %add = f32[] add(f32[] %a, f32[] %b)
"""


def test_collectives_are_found_with_their_result_bytes():
    found = collectives(HLO)
    assert [(c.kind, c.result_bytes) for c in found] == [
        ("all-reduce", 128 * 64 * 4), ("all-gather", 8 * 16 * 2), ("all-reduce", 24), ("reduce-scatter", 64),
        ("all-reduce", 48)]
    assert count_by_kind(HLO)["all-reduce"] == 3 and count_by_kind(HLO)["all-to-all"] == 0


LOOP_HLO = """
%branch_a (p: f32[16]) -> f32[16] {
  %ar = f32[16]{0} all-reduce(f32[16]{0} %p), to_apply=%add
}

%branch_b (p: f32[16]) -> f32[16] {
  ROOT %p = f32[16]{0} parameter(0)
}

%body (t: (s32[], f32[16])) -> (s32[], f32[16]) {
  %c = f32[16]{0} conditional(s32[] %i, f32[16]{0} %x, f32[16]{0} %x), branch_computations={%branch_a, %branch_b}
  %ag = f32[32]{0} all-gather(f32[16]{0} %c), dimensions={0}
}

ENTRY %main (x: f32[16]) -> f32[16] {
  %w = (s32[], f32[16]) while((s32[], f32[16]) %t), condition=%cond, body=%body
  %rs = f32[8]{0} reduce-scatter(f32[16]{0} %y), dimensions={0}
}
"""


def test_collectives_in_computations_a_loop_body_calls_are_in_the_loop():
    """An all-reduce in a conditional's branch inside a while body runs once per iteration, so it is reported
    in the loop."""
    assert [(c.kind, c.in_loop_body) for c in collectives(LOOP_HLO)] == [
        ("all-reduce", True), ("all-gather", True), ("reduce-scatter", False)]


def test_reduced_bytes_per_piece_of_a_pipeline():
    text = "// stage 0 fwd\n" + HLO + "// stage 1 bwd\n  %g = f32[8]{0} all-gather(f32[4]{0} %x)\n// stage 1 wgt\n" + HLO
    every = 128 * 64 * 4 + 24 + 64 + 48  # the all-reduces and the reduce-scatter, not the all-gather
    assert reduced_bytes_by_piece(text) == {(0, "fwd"): every, (1, "bwd"): 0, (1, "wgt"): every}
