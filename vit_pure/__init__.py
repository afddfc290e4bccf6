"""vit_pure: a framework-free Vision Transformer (jax.numpy + einops) and its training kit.

The reading path, in this order: config.py (the model's sizes; `Execution`, each
performance knob's one default), model.py (init_params / apply over a dict of arrays;
`Parallel`, where its collectives go; Megatron's two tensor-parallel operators),
policy.py (the dtype policy), step.py (loss, gradients, accumulation, update: no
collectives), pipeline/ (the schedules over the 'pipe' axis), layout.py (where a layout
puts the bytes); ../train_pmap.py and ../train_shardmap.py beside it write the
collectives. model.py's block calls into layers/ (norm, attention, MLP, dropout, remat),
which emit no collective. The machinery sits in folders named for their role: data/, run/
(flags, settings, the scripts' shared entry, the loop, checkpoints, processes), plan/ (the
communication plan), weights/, xla/ (reading compiled programs), tools/.
"""
from vit_pure import quiet

quiet.import_jax_quietly()  # first: JAX's CUDA plugin where no GPU is (vit_pure/quiet.py)

from vit_pure.config import PRESETS, ViTConfig, get_preset  # noqa: E402
from vit_pure.model import apply, count_params, init_params, param_axes  # noqa: E402
from vit_pure.policy import LossScale, Policy  # noqa: E402

__all__ = ["PRESETS", "ViTConfig", "get_preset", "init_params", "apply", "param_axes",
           "count_params", "Policy", "LossScale"]
