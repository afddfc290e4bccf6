"""vit_pure: a framework-free Vision Transformer (jax.numpy + einops) and its training kit.

The reading path is the top of this folder, in this order:

    config.py    the model's sizes: one frozen dataclass, a table of presets
    model.py     init_params / apply over a dict of arrays; Megatron's two tensor-parallel
                 operators (_copy_to_tp, _reduce_from_tp)
    policy.py    the dtype policy: which dtype is stored, computed in and returned
    step.py      loss, per-device gradients, accumulation, optimizer update: no collectives
    pipeline/    the schedules over the 'pipe' mesh axis: tables, one program
    layout.py    where a layout puts the bytes

with ../train_pmap.py and ../train_shardmap.py beside it, which write the collectives.
model.py's block is a few calls into layers/ (norm, attention, MLP, dropout, remat), which
emit no collective.
The machinery sits in folders named for their role: data/ (CIFAR-10, augmentation),
run/ (the flags, turned once into frozen settings; the loop, checkpoints, several
processes), plan/ (the communication plan), weights/ (pretrained checkpoints in and
out), xla/ (reading compiled programs), tools/ (small command-line tools). Imports run
downwards only: the reading path imports layers/, data/ and errors.py, and run/,
plan/ and weights/ import the reading path.
"""
from vit_pure import quiet

quiet.import_jax_quietly()  # first: JAX's CUDA plugin where no GPU is (vit_pure/quiet.py)

from vit_pure.config import PRESETS, ViTConfig, get_preset  # noqa: E402
from vit_pure.model import apply, count_params, init_params, param_axes  # noqa: E402
from vit_pure.policy import LossScale, Policy  # noqa: E402

__all__ = ["PRESETS", "ViTConfig", "get_preset", "init_params", "apply", "param_axes",
           "count_params", "Policy", "LossScale"]
