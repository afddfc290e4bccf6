"""Pipeline parallelism over the 'pipe' mesh axis: the schedules' tables (schedules.py)
and the one shard_map program that runs them (program.py)."""
from vit_pure.pipeline.program import (
                                       bubble_fraction,
                                       check_pipeline,
                                       pipeline_eval,
                                       pipeline_grads,
                                       pipelined_encoder,
                                       pipelined_logits,
)
from vit_pure.pipeline.schedules import SCHEDULES, Schedule, build, describe

__all__ = ["SCHEDULES", "Schedule", "bubble_fraction", "build", "check_pipeline", "describe",
           "pipeline_eval", "pipeline_grads", "pipelined_encoder", "pipelined_logits"]
