"""Pipeline parallelism over the 'pipe' mesh axis: the schedules' tables (schedules.py),
the residual ring (ring.py), one tick of the program and its scans (tick.py), zb-h1's split
of the backward (split.py), the entry points (program.py)."""
from vit_pure.pipeline.program import (
                                       bubble_fraction,
                                       check_pipeline,
                                       pipeline_eval,
                                       pipeline_grads,
                                       step_config,
)
from vit_pure.pipeline.schedules import SCHEDULES, Schedule, block_order, build, describe

__all__ = ["SCHEDULES", "Schedule", "block_order", "bubble_fraction", "build", "check_pipeline",
           "describe", "pipeline_eval", "pipeline_grads", "step_config"]
