"""What the peers' children share: the recipe's optimizer constants and the child's side
of the runner. Nothing here imports JAX or the kit (whose package imports JAX), so that
the PyTorch child runs without them: the parent puts what a child needs of the kit
(the model's config, the normalisation's mean and std) into its job.
"""
from __future__ import annotations

import json
import os
from typing import Callable

from benchmarks import harness

LR, WEIGHT_DECAY, BETAS, CLIP, LABEL_SMOOTHING = 1e-3, 0.05, (0.9, 0.999), 1.0, 0.1


def child(run: Callable[[dict], dict], argv: list[str]) -> int:
    """`python -m benchmarks.peers.MODULE --child JOB`: run(job) in this process and print
    its row (harness.child_main), with the job's name and batch, the malloc setting the
    process ran under and the values it saw of the row's own environment variables."""
    job = json.loads(argv[argv.index("--child") + 1])

    def row(job: dict) -> dict:
        result = run(job)
        seen = {name: os.environ.get(name) for name in job.get("kit_env", {})}
        return {"name": job["name"], "batch": job["batch"], **result,
                "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "env": seen}

    return harness.child_main(row, job)
