"""Matmul FLOPs of the ViT, counted from its shapes: the one convention the kit's
benchmarks (benchmarks/bench.py, MFU) and the communication plan (vit_pure/plan/build.py) share.

The count is of the program the kit runs: with the last block on the class token's row
(`config.class_token_rows`, Execution.last_block "class-token") that block's query,
attention, output projection and MLP count one row, not T.
"""
from __future__ import annotations

from vit_pure.config import Execution, ViTConfig, class_token_rows
from vit_pure.layers.linear import ONES_WIDTH


def _block_flops(cfg: ViTConfig, rows: int) -> int:
    """Multiply-adds of one block whose keys and values cover the T tokens and whose
    queries, output projection and MLP cover `rows` of them (T, or 1 for the class token)."""
    T, E, M = cfg.seq_len, cfg.width, cfg.mlp_dim
    return (T * E * 2 * E + rows * E * E   # k and v on T rows, q on `rows`
            + rows * T * E                 # q . k over all heads (H x D = E)
            + rows * T * E                 # probs . v
            + rows * E * E                 # output projection
            + 2 * rows * E * M)            # fc1, fc2


def _last_block_rows(cfg: ViTConfig, execution: Execution) -> int:
    """The rows the last block's query, output projection and MLP run on: 1 on the class
    token (`config.class_token_rows`), else every token."""
    return 1 if class_token_rows(cfg, execution) else cfg.seq_len


def forward_flops_per_image(cfg: ViTConfig, execution: Execution = Execution()) -> int:
    """Matmul FLOPs (2 per multiply-add) of one image's forward pass.

    the convolutional stem if any (per layer: output pixels x 9 C_in x C_out), the patch
    embedding (Np x P x E), then per block: qkv projection (T x E x 3E), attention
    scores (H x T x T x D), attention-weighted values (H x T x T x D), output projection
    (T x E x E), MLP (T x E x M twice); the head projects one feature per image (E x K).
    Elementwise work (LayerNorm, softmax, GELU, residual adds) is left out, as usual.
    """
    T, E = cfg.seq_len, cfg.width
    stem, side, c_in = 0, cfg.image_size, cfg.channels
    for c_out in cfg.stem:  # 3x3 stride-2 convolutions: (side/2)^2 x 9 C_in x C_out
        side //= 2
        stem += side * side * 9 * c_in * c_out
        c_in = c_out
    patch_embed = stem + cfg.num_patches * cfg.patch_dim * E
    blocks = ((cfg.depth - 1) * _block_flops(cfg, T)
              + _block_flops(cfg, _last_block_rows(cfg, execution)))
    head = E * cfg.num_classes
    return 2 * (patch_embed + blocks + head)


def train_flops_per_image(cfg: ViTConfig, execution: Execution = Execution()) -> int:
    """A training step's matmul FLOPs per image: the forward pass and a backward pass of
    twice its cost (for every matmul, one for the input's gradient and one for the
    weight's). The usual convention; exact but for the first layer's input gradient (the
    patch embedding's, or the stem's first convolution's), which nothing needs (0.06% of
    the total for vit-cifar)."""
    return 3 * forward_flops_per_image(cfg, execution)


def bias_column_flops_per_image(cfg: ViTConfig, train: bool = True,
                                execution: Execution = Execution()) -> int:
    """The FLOPs a program's dots do beyond `forward_flops_per_image`'s count: the ones
    columns through which `layers.linear.dense` adds the q, k, v and fc1 biases (one image,
    the layers' T rows, the class token's alone for q and fc1 in a last block on it;
    ONES_WIDTH extra input columns per product). Forward: the product; training also the
    weight gradient's (the input gradient leaves them out). Not model FLOPs: MFU counts
    `train_flops_per_image` alone."""
    T, E, M = cfg.seq_len, cfg.width, cfg.mlp_dim
    columns = ((cfg.depth - 1) * T * (3 * E + M) + T * 2 * E
               + _last_block_rows(cfg, execution) * (E + M))
    return 2 * ONES_WIDTH * columns * (2 if train else 1)


def outer_product_flops_per_image(cfg: ViTConfig, execution: Execution = Execution()) -> int:
    """The training FLOPs of `train_flops_per_image`'s count that a compiled program does
    without a dot: in a last block on the class token, the keys' and values' gradients of
    the two one-query products contract nothing (outer products, T x E multiply-adds
    each), and XLA's compiler turns those dots (in the lowered StableHLO) into elementwise
    multiplies."""
    return 2 * 2 * cfg.seq_len * cfg.width if class_token_rows(cfg, execution) else 0
