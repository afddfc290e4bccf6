"""Matmul FLOPs of the ViT, counted from its shapes: the one convention the kit's
benchmarks (benchmarks/bench.py, MFU) and the communication plan (vit_pure/plan/build.py) share.
"""
from __future__ import annotations

from vit_pure.config import ViTConfig
from vit_pure.layers.linear import ONES_WIDTH


def forward_flops_per_image(cfg: ViTConfig) -> int:
    """Matmul FLOPs (2 per multiply-add) of one image's forward pass.

    the convolutional stem if any (per layer: output pixels x 9 C_in x C_out), the patch
    embedding (Np x P x E), then per block: qkv projection (T x E x 3E), attention
    scores (H x T x T x D), attention-weighted values (H x T x T x D), output projection
    (T x E x E), MLP (T x E x M twice); the head projects one feature per image (E x K).
    Elementwise work (LayerNorm, softmax, GELU, residual adds) is left out, as usual.
    """
    T, E, M = cfg.seq_len, cfg.width, cfg.mlp_dim
    stem, side, c_in = 0, cfg.image_size, cfg.channels
    for c_out in cfg.stem:  # 3x3 stride-2 convolutions: (side/2)^2 x 9 C_in x C_out
        side //= 2
        stem += side * side * 9 * c_in * c_out
        c_in = c_out
    patch_embed = stem + cfg.num_patches * cfg.patch_dim * E
    block = (T * E * 3 * E          # qkv
             + T * T * E            # q . k over all heads (H x D = E)
             + T * T * E            # probs . v
             + T * E * E            # output projection
             + 2 * T * E * M)       # fc1, fc2
    head = E * cfg.num_classes
    return 2 * (patch_embed + cfg.depth * block + head)


def train_flops_per_image(cfg: ViTConfig) -> int:
    """A training step's matmul FLOPs per image: the forward pass and a backward pass of
    twice its cost (for every matmul, one for the input's gradient and one for the
    weight's). The usual convention; exact but for the first layer's input gradient (the
    patch embedding's, or the stem's first convolution's), which nothing needs (0.06% of
    the total for vit-cifar)."""
    return 3 * forward_flops_per_image(cfg)


def bias_column_flops_per_image(cfg: ViTConfig, train: bool = True) -> int:
    """The FLOPs a program's dots do beyond `forward_flops_per_image`'s count: the ones
    columns through which `layers.linear.dense` adds the q, k, v and fc1 biases (one image,
    the layers' T rows; ONES_WIDTH extra input columns per product). Forward: the product;
    training also the weight gradient's (the input gradient leaves them out). Not model
    FLOPs: MFU counts `train_flops_per_image` alone."""
    per_pass = 2 * cfg.depth * cfg.seq_len * ONES_WIDTH * (3 * cfg.width + cfg.mlp_dim)
    return per_pass * (2 if train else 1)
