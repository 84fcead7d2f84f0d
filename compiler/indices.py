"""The pipeline's index types: which stage, mesh, submesh shape or micro-batch a number names.

Each is a ``NewType`` of ``int`` with one meaning everywhere (STYLE principle 11): the stage DP, the
schedules, the instruction programs and the simulator speak of the same stage as a :data:`StageIdx`.
"""
from __future__ import annotations

from typing import NewType

StageIdx = NewType("StageIdx", int)
"""Position of a stage in the pipeline, 0 = first. With ``v`` virtual stages per mesh, ``S = p v`` stages."""
MeshIdx = NewType("MeshIdx", int)
"""Position of a mesh (a pipeline device group) in the pipeline, 0 = first."""
SubmeshIdx = NewType("SubmeshIdx", int)
"""Index into the candidate submesh shapes of a stage cost table
(:attr:`alpa_like.compiler.stage_costs.StageCosts.submeshes`): a shape, not a mesh of the pipeline."""
MicroBatchIdx = NewType("MicroBatchIdx", int)
"""Index of a micro-batch within one step, 0 = first."""
