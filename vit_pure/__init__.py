"""vit_pure: a framework-free Vision Transformer (jax.numpy + einops) and its training kit."""
from vit_pure.config import PRESETS, ViTConfig, get_preset
from vit_pure.model import apply, count_params, init_params, param_axes
from vit_pure.policy import LossScale, Policy

__all__ = ["PRESETS", "ViTConfig", "get_preset", "init_params", "apply", "param_axes",
           "count_params", "Policy", "LossScale"]
