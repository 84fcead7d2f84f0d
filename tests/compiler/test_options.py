"""The methods and options: one module defines them, the API names them, and they check their fields."""
import dataclasses

import pytest

import alpa_like as al
from alpa_like.compiler import options
from alpa_like.compiler.plan_format import method_summary
from alpa_like.compiler.schedules import ScheduleName


@pytest.mark.parametrize("cls", options.OPTION_CLASSES, ids=lambda cls: cls.__name__)
def test_every_method_and_option_is_defined_once_and_named_by_the_api(cls):
    assert dataclasses.is_dataclass(cls) and cls.__module__ == "alpa_like.compiler.options"
    assert getattr(al, cls.__name__) is cls


def test_pipeline_schedule_takes_a_schedule_name_or_its_string():
    by_string = al.PipeshardParallel(pipeline_schedule="breadth_first", virtual_stages=2)
    assert by_string.pipeline_schedule is ScheduleName.BREADTH_FIRST
    assert by_string == al.PipeshardParallel(pipeline_schedule=ScheduleName.BREADTH_FIRST, virtual_stages=2)
    assert "pipeline_schedule='breadth_first'" in repr(by_string)  # plans hold the repr: it reads as written
    assert method_summary(repr(al.PipeshardParallel(pipeline_schedule="1f1b"))) == "PipeshardParallel()"
    with pytest.raises(ValueError, match=r"pipeline_schedule must be one of \('gpipe', '1f1b', 'interleaved_1f1b', "
                                         r"'breadth_first', 'terapipe', 'zb_h1', 'zb_h2'\), got 'zb'"):
        al.PipeshardParallel(pipeline_schedule="zb")


def test_submesh_shape_space_auto_searches_every_shape_on_small_clusters_only():
    from alpa_like.compiler.stage_choice import candidate_meshes
    from alpa_like.compiler.submesh import submesh_shapes
    auto = al.AutoStageOption()
    small, large = (al.ClusterSpec.preset("p3.16xlarge", num_nodes=n) for n in (options.ALL_SHAPES_MAX_NODES,
                                                                                 options.ALL_SHAPES_MAX_NODES + 1))
    assert candidate_meshes(auto, small, 4)[0] == list(submesh_shapes(small.num_nodes, 8))
    assert candidate_meshes(auto, large, 4)[0] == list(submesh_shapes(large.num_nodes, 8, "power_of_two"))
    every = al.AutoStageOption(submesh_shape_space="all")
    assert candidate_meshes(every, large, 4)[0] == list(submesh_shapes(large.num_nodes, 8))
    assert candidate_meshes(al.AutoStageOption(submesh_shape_space="power_of_two"), small, 4)[0][-1] == (8, 8)
    with pytest.raises(ValueError, match=r"submesh_shape_space must be one of \('auto', 'all', 'power_of_two'\), "
                                         r"got 'pow2'"):
        al.AutoStageOption(submesh_shape_space="pow2")
    with pytest.raises(ValueError, match="takes submesh_shapes or submesh_shape_space, not both"):
        al.AutoStageOption(submesh_shapes=((1, 8),), submesh_shape_space="all")
