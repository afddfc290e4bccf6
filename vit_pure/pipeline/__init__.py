"""Pipeline parallelism over the 'pipe' mesh axis: the schedules' tables (schedules.py),
GPipe and the entry points (program.py), the table-driven program phase by phase with
every send in `ticks.exchange` (ticks.py), zb-h1's split of the backward (split.py)."""
from vit_pure.pipeline.program import (
                                       bubble_fraction,
                                       check_pipeline,
                                       pipeline_eval,
                                       pipeline_grads,
                                       pipelined_encoder,
                                       pipelined_logits,
                                       step_config,
)
from vit_pure.pipeline.schedules import SCHEDULES, Schedule, block_order, build, describe

__all__ = ["SCHEDULES", "Schedule", "block_order", "bubble_fraction", "build", "check_pipeline",
           "describe", "pipeline_eval", "pipeline_grads", "pipelined_encoder",
           "pipelined_logits", "step_config"]
