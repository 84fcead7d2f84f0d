"""Reading collectives out of HLO text."""
from alpa_like.runtime.hlo_stats import collectives, count_by_kind

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
