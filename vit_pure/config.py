"""Model configurations: one frozen dataclass, a table of named presets, and `Execution`,
the frozen value of the knobs that change how the model runs but not what it computes.

    >>> from vit_pure import PRESETS
    >>> PRESETS["vit-cifar"].width
    384
"""
from __future__ import annotations

import dataclasses

POOLS = ("cls", "mean", "gap", "cls+mean")  # ViTConfig.pool
GELUS = ("tanh", "exact")  # ViTConfig.gelu
# ViTConfig.inputs: how pixels in [0, 1] are scaled before the model, (x - mean) / std per
# channel (RGB). "cifar10": the kit's own normalisation (data/cifar10.py CIFAR10_MEAN /
# CIFAR10_STD); "minus1to1": [-1, 1], what big_vision's and the AugReg ViTs were trained
# on (timm's "inception" mean/std); "imagenet": torchvision's ImageNet mean/std (DeiT and
# most other timm / Hugging Face checkpoints).
INPUT_SCALINGS: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "minus1to1": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
# The choices of `Execution`'s knobs (the flags --attention, --dropout-masks, --remat,
# --last-block).
ATTENTION_IMPLS = ("einsum", "xla", "cudnn", "pallas", "pallas-interpret")
DROPOUT_MASKS = ("bernoulli", "threefry16")
LAST_BLOCKS = ("all", "class-token")
BIASES = ("ones-column", "fc1-epilogue", "epilogue")
FC1_OUTPUTS = ("matmul", "float32")
LAYER_NORMS = ("apply", "fold")
QKV_DATA_GRADS = ("chain", "sum")
REMAT_MODES = ("none", "gelu", "block", "block-save-dots")
REMAT_SAVE = "block-save:"  # + names from REMAT_SAVE_NAMES joined by "+"
# What a block may keep for its backward pass under "block-save:NAMES": the
# `checkpoint_name`s vit_pure/layers/remat.py puts on values in the model's block.
REMAT_SAVE_NAMES = ("dot", "ln", "gelu", "mask")


def _one_of(field: str, value, choices, prefix: str = "") -> None:
    """Raise ValueError unless value is one of choices, naming the field and the choices."""
    if value not in choices:
        raise ValueError(f"{prefix}{field} must be one of {', '.join(choices)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Everything that fixes the shapes (and the regularisation) of a ViT."""

    name: str
    image_size: int  # square images, pixels per side
    patch_size: int  # square patches, pixels per side
    num_classes: int
    width: int  # embedding size E
    depth: int  # number of encoder blocks L
    heads: int  # attention heads H (E must divide by H)
    mlp_dim: int  # MLP hidden size M
    channels: int = 3
    dropout: float = 0.0  # after the embedding and on each residual branch
    drop_path: float = 0.0  # stochastic depth, largest at the last block (linear rule)
    ln_eps: float = 1e-6
    # A convolutional stem before the patch embedding (model.embed): one 3x3 convolution
    # of stride 2 + GELU per entry, with that many output channels, each halving the
    # resolution. () is the plain ViT. patch_size stays in image pixels: the patch
    # embedding reads patches of patch_size / 2**len(stem) positions of the stem's output.
    stem: tuple[int, ...] = ()
    # What the head reads: "cls", the class token (the ViT paper's choice); "mean", the mean
    # of the patch tokens (the class token is then still in the sequence, unread); or
    # "gap", global average pooling with no class token at all (Beyer et al. 2022, "Better
    # plain ViT baselines for ImageNet-1k", arXiv:2205.01580): one token fewer (64 instead
    # of vit-cifar's 65) and no cls_token parameter, so a different model. "cls+mean":
    # DINOv2's linear head, on the class token and the mean patch token side by side, each
    # token through the final LayerNorm first (head/kernel (2E, K)).
    pool: str = "cls"
    # Locality self-attention (Lee et al. 2021, "Vision Transformer for Small-Size Datasets",
    # arXiv:2112.13492): a learned temperature per layer and head in place of the fixed
    # 1/sqrt(head_dim) scale, and no token attends to itself (the score matrix's diagonal
    # is masked), which sharpens the attention towards the other tokens.
    lsa: bool = False
    # The MLP's GELU: "tanh", the tanh approximation (jax.nn.gelu's default; the kit's
    # presets, big_vision), or "exact", x * Phi(x) with erf (timm's and Hugging Face's
    # ViTs; an imported checkpoint sets it, vit_pure/weights/).
    gelu: str = "tanh"
    # The input scaling the weights were trained with: a name of INPUT_SCALINGS, applied
    # by the data pipeline (step.prepare_images).
    inputs: str = "cifar10"
    # LayerScale (Touvron et al. 2021, "Going deeper with image transformers" (CaiT),
    # arXiv:2103.17239; DeiT III; DINOv2): a learned per-channel gain on each residual
    # branch's output, params blocks/ls1/gamma and blocks/ls2/gamma (L, E), starting at this
    # value (CaiT 0.1 to 1e-6 with depth, DINOv2 1e-5). None: no gain, the plain ViT.
    layer_scale: float | None = None
    # Register tokens (Darcet et al. 2023, "Vision Transformers Need Registers",
    # arXiv:2309.16588): this many learned tokens (param reg_tokens (R, E)) after the class
    # token, with no position embedding (DINOv2's layout); no head reads them.
    registers: int = 0

    def __post_init__(self):
        # A tuple, also when read back from a JSON record (a list there): the config is a
        # static argument of jitted functions (model.init_params), so it must hash.
        object.__setattr__(self, "stem", tuple(self.stem))
        if self.image_size % self.patch_size:
            raise ValueError(
                f"{self.name}: image_size {self.image_size} is not divisible by "
                f"patch_size {self.patch_size}")
        _one_of("pool", self.pool, POOLS, f"{self.name}: ")
        _one_of("gelu", self.gelu, GELUS, f"{self.name}: ")
        _one_of("inputs", self.inputs, INPUT_SCALINGS, f"{self.name}: ")
        if any(c < 1 for c in self.stem) or self.patch_size % (2 ** len(self.stem)):
            raise ValueError(
                f"{self.name}: a stem of {len(self.stem)} stride-2 convolutions needs "
                f"patch_size divisible by {2 ** len(self.stem)} and positive channel "
                f"counts, got patch_size {self.patch_size}, stem {self.stem}")
        if self.width % self.heads:
            raise ValueError(
                f"{self.name}: width {self.width} is not divisible by heads {self.heads}")
        for field in ("dropout", "drop_path"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ValueError(f"{self.name}: {field} must be in [0, 1)")
        if self.layer_scale is not None and (isinstance(self.layer_scale, bool)
                                             or not self.layer_scale > 0):
            raise ValueError(f"{self.name}: layer_scale must be None (off) or a positive "
                             f"initial gain, got {self.layer_scale!r}")
        if self.registers < 0:
            raise ValueError(f"{self.name}: registers must be >= 0, got {self.registers}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def class_token(self) -> bool:  # whether the sequence starts with a class token
        return self.pool != "gap"

    @property
    def prefix_tokens(self) -> int:  # the tokens before the patches: class token, registers
        return int(self.class_token) + self.registers

    @property
    def pos_tokens(self) -> int:  # the rows of pos_embed: patches + the class token, if any
        return self.num_patches + int(self.class_token)

    @property
    def seq_len(self) -> int:  # patches + the class token, if any, + the registers
        return self.num_patches + self.prefix_tokens

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def stem_patch(self) -> int:  # a patch's side in positions of the stem's output
        return self.patch_size // 2 ** len(self.stem)

    @property
    def patch_dim(self) -> int:  # the patch embedding's input size
        return self.stem_patch ** 2 * (self.stem[-1] if self.stem else self.channels)

    def replace(self, **changes) -> "ViTConfig":
        return dataclasses.replace(self, **changes)


def remat_saved_names(remat: str) -> tuple[str, ...]:
    """The names `remat` keeps for the backward pass: () for "none", "gelu" and "block"
    (no block checkpoint, or one that saves nothing inside), ("dot",) for
    "block-save-dots", the names listed in "block-save:NAME+NAME..." (from
    REMAT_SAVE_NAMES). ValueError for anything else."""
    if remat in REMAT_MODES:
        return ("dot",) if remat == "block-save-dots" else ()
    names = remat[len(REMAT_SAVE):].split("+") if remat.startswith(REMAT_SAVE) else []
    if not names or any(n not in REMAT_SAVE_NAMES for n in names) or len(set(names)) < len(names):
        raise ValueError(f"remat must be one of {', '.join(REMAT_MODES)} or {REMAT_SAVE}NAMES "
                         f"with distinct NAMES from {'+'.join(REMAT_SAVE_NAMES)}, got {remat!r}")
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the model runs: nine performance knobs, each a choice between programs that
    compute the same function (up to rounding; `dropout_masks` draws other masks from the
    same distribution). The defaults are the one home of each knob's default: the program
    the training scripts run when no flag says otherwise, exactly so on a CPU. On an
    accelerator, run/backend.py fills the knobs whose best program depends on the hardware
    (`scan`, `attention`, `dropout_masks`, `packed_masks`) where no flag was given, and
    says so in the start-up log.

    scan           the layer loop: a `lax.scan` over the stacked blocks (True) or a
                   Python loop, unrolled in the trace (False: measured faster on CPU
                   and GPU, docs/performance.md).
    remat          what the backward pass keeps (vit_pure/layers/remat.py tags the values):
      "none"             every activation the backward pass needs, nothing recomputed;
      "gelu"             all of those but the GELU's output, which the backward pass
                         recomputes in the kernel of its derivative (layers/mlp.py's
                         `_gelu_matmul`): a (B*T, M) array less a block, written once more;
      "block"            only each block's input: the whole block forward is recomputed
                         in the backward pass (about one more forward pass);
      "block-save-dots"  the outputs of the block's matmuls and attention products (with
                         cuDNN attention, its kernel's outputs), recomputing only the
                         cheap elementwise work between them (LayerNorm, softmax, GELU,
                         dropout masks); in between in memory;
      "block-save:NAMES" the values named (REMAT_SAVE_NAMES joined by "+": "dot" as
                         above, "ln" the LayerNorm outputs, "gelu" the GELU output,
                         "mask" the dropout and drop-path masks), e.g.
                         "block-save:dot+mask"; "block-save:dot" is "block-save-dots".
                   Under tensor parallelism "block" also repeats a forward all-reduce in
                   the backward pass (the attention output's, which the MLP's input is
                   recomputed from), as does a "block-save:NAMES" without "dot";
                   "block-save-dots" keeps its result (the name sits after the psum).
    attention      "einsum" (the reference, in model.py), "xla" or "cudnn"
                   (vit_pure/layers/attention.py), "pallas" (a Mosaic GPU kernel,
                   vit_pure/layers/attention_pallas.py; NVIDIA Hopper GPUs) or
                   "pallas-interpret" (that kernel in JAX's interpreter, on the CPU: a
                   check, slow): the same results within the rounding of the compute dtype.
    dropout_masks  "bernoulli" or "threefry16" (vit_pure/layers/dropout.py).
    packed_masks   keep each dropout mask for the backward pass packed eight elements to
                   a byte (`dropout.pack`; True) or a byte an element (False): the same
                   masks and results; less memory and HBM traffic on a GPU.
    last_block     "all" or "class-token": with ViTConfig.pool "cls" the head reads the
                   class token alone, so after the last block's attention (whose keys and
                   values need every token) only that token's row is needed. "class-token"
                   computes its query, attention, output projection and MLP for that row
                   alone (`model.encoder`'s `class_token_only`; 13.7% fewer FLOPs a step
                   for vit-cifar); the same logits, loss and gradients. Pipelines run
                   every row (`pipeline.step_config`). Other pools read every token:
                   "all" regardless (`class_token_rows`).
    biases         how the biases of fc1 and of the q, k, v projection ride with their
                   matmuls (vit_pure/layers/linear.py): "ones-column", inside the product
                   (the input gets a column of ones, the weight the bias as a row: the
                   weight gradient's product makes the bias gradient); "epilogue", added
                   after the product (what cuBLASLt's bias epilogues take; the GEMMs keep
                   K = E; fc1's bias gradient summed where the GELU's derivative is made,
                   layers/mlp.py; q's, k's and v's by sums of their own);
                   "fc1-epilogue", fc1's so and q's, k's and v's inside. The same results
                   to rounding.
    layer_norm     the blocks' two LayerNorms: "apply" their scale and bias, or "fold"
                   them into the matmuls that read them (q, k, v; fc1), the LayerNorm
                   writing the standardised x (layers/norm.py `fold_affine`): the same
                   function, rounded elsewhere; the scale and bias gradients then come
                   from those matmuls' weight and bias gradients, not from column sums
                   over the activation. Under tensor parallelism "apply" regardless.
    fc1_output     the dtype fc1's product returns before its bias and GELU: "matmul"
                   (the policy's matmul dtype) or "float32" (the bias and the GELU then in
                   float32, the result cast to the compute dtype; layers/mlp.py): the
                   same function, a different rounding point; a code form for XLA's GEMM
                   epilogue matcher.
    qkv_data_grads where q, k and v come from products of their own (the padded
                   attention paths; the class-token block's keys and values), how their
                   data gradients add up: "chain", each accumulated into the next by its
                   GEMM (`linear.fan_out`: cuBLAS's beta = 1 on a GPU), or "sum", JAX's
                   own sum of the products. The same function, added in another order; a
                   code form for XLA's GEMM rewriter.
    """

    scan: bool = False
    remat: str = "none"
    attention: str = "einsum"
    dropout_masks: str = "bernoulli"
    packed_masks: bool = False
    last_block: str = "class-token"
    biases: str = "ones-column"
    fc1_output: str = "matmul"
    layer_norm: str = "apply"
    qkv_data_grads: str = "chain"

    def __post_init__(self):
        remat_saved_names(self.remat)  # raises on an unknown mode
        _one_of("attention", self.attention, ATTENTION_IMPLS)
        _one_of("dropout_masks", self.dropout_masks, DROPOUT_MASKS)
        _one_of("last_block", self.last_block, LAST_BLOCKS)
        _one_of("biases", self.biases, BIASES)
        _one_of("fc1_output", self.fc1_output, FC1_OUTPUTS)
        _one_of("layer_norm", self.layer_norm, LAYER_NORMS)
        _one_of("qkv_data_grads", self.qkv_data_grads, QKV_DATA_GRADS)

    @property
    def qkv_biases(self) -> str:
        """How the q, k, v projection's bias rides: "epilogue" or "ones-column" (the
        latter under "fc1-epilogue" too), the value `layers.linear.biased` takes."""
        return "epilogue" if self.biases == "epilogue" else "ones-column"

    def replace(self, **changes) -> "Execution":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line for the start-up log: every knob's value, under its flag's name."""
        return (f"--{'scan' if self.scan else 'no-scan'}, --remat {self.remat}, --attention "
                f"{self.attention}, --dropout-masks {self.dropout_masks} (kept "
                f"{'packed eight to a byte' if self.packed_masks else 'a byte an element'}), "
                f"--last-block {self.last_block}, --biases {self.biases}, --fc1-output "
                f"{self.fc1_output}, --layer-norm {self.layer_norm}, --qkv-data-grads "
                f"{self.qkv_data_grads}")


def class_token_rows(cfg: ViTConfig, execution: Execution) -> bool:
    """Whether the whole model's last block computes the class token's row alone: the
    head reads that token only (pool "cls") and `execution.last_block` says so."""
    return cfg.pool == "cls" and execution.last_block == "class-token"


PRESETS: dict[str, ViTConfig] = {
    # The reference CIFAR-10 model: 10,695,562 parameters.
    "vit-cifar": ViTConfig(
        name="vit-cifar", image_size=32, patch_size=4, num_classes=10,
        width=384, depth=6, heads=8, mlp_dim=1536, dropout=0.1),
    # For tests: odd, distinct sizes so that a swapped axis fails loudly.
    # 4 heads x 6 = 24 wide, 40 hidden, depth 4 (divisible by 2 and 4 for pipelines),
    # CIFAR-sized 32px images in 8px patches -> 16 patches + class token = 17 tokens.
    # 10 classes so that it trains on CIFAR-10 data as it is.
    "tiny": ViTConfig(
        name="tiny", image_size=32, patch_size=8, num_classes=10,
        width=24, depth=4, heads=4, mlp_dim=40, dropout=0.1, drop_path=0.1),
    # A small but real model for quick CPU runs on CIFAR-sized images.
    "vit-cifar-small": ViTConfig(
        name="vit-cifar-small", image_size=32, patch_size=4, num_classes=10,
        width=192, depth=6, heads=6, mlp_dim=576, dropout=0.1),
    # The model of `--recipe gpu-small-data` (and of cpu-quick before vit-cifar-conv).
    "vit-cifar-quick": ViTConfig(
        name="vit-cifar-quick", image_size=32, patch_size=4, num_classes=10,
        width=128, depth=4, heads=4, mlp_dim=256, dropout=0.0),
    # The model of `--recipe cpu-quick`: vit-cifar-quick's width behind a convolutional
    # stem (Xiao et al. 2021, arXiv:2106.14881): three 3x3 stride-2 convolutions (32, 64,
    # 128 channels) turn the 32x32 image into 4x4 positions of 128 values, one token each
    # (8-pixel patches of the image): 16 tokens + the class token, 643,530 parameters.
    # Fewer tokens than vit-cifar-quick's 64, and the convolutions' locality: more
    # accuracy per CPU minute on small data (docs/training.md, "Accuracy").
    "vit-cifar-conv": ViTConfig(
        name="vit-cifar-conv", image_size=32, patch_size=8, num_classes=10,
        width=128, depth=4, heads=4, mlp_dim=256, dropout=0.0, stem=(32, 64, 128)),
    # vit-cifar-conv with locality self-attention (ViTConfig.lsa; Lee et al. 2021,
    # arXiv:2112.13492): a learned temperature per layer and head (16 more parameters,
    # 643,546) and no attention of a token to itself.
    "vit-cifar-conv-lsa": ViTConfig(
        name="vit-cifar-conv-lsa", image_size=32, patch_size=8, num_classes=10,
        width=128, depth=4, heads=4, mlp_dim=256, dropout=0.0, stem=(32, 64, 128), lsa=True),
    # The ImageNet-style variants (Dosovitskiy et al. 2020; Touvron et al. 2021).
    "vit-ti16": ViTConfig(
        name="vit-ti16", image_size=224, patch_size=16, num_classes=1000,
        width=192, depth=12, heads=3, mlp_dim=768),
    "vit-s16": ViTConfig(
        name="vit-s16", image_size=224, patch_size=16, num_classes=1000,
        width=384, depth=12, heads=6, mlp_dim=1536),
    "vit-b16": ViTConfig(
        name="vit-b16", image_size=224, patch_size=16, num_classes=1000,
        width=768, depth=12, heads=12, mlp_dim=3072),
    # 24 blocks: the depth that splits into 8 pipeline stages (ViT-B/16's 12 do not).
    "vit-l16": ViTConfig(
        name="vit-l16", image_size=224, patch_size=16, num_classes=1000,
        width=1024, depth=24, heads=16, mlp_dim=4096),
}


def get_preset(name: str) -> ViTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(PRESETS)}") from None
