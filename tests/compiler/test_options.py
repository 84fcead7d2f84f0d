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
