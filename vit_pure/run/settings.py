"""The run's settings: the command line, turned once into a frozen value.

The scripts parse the flags (run/cli.py), then build two frozen values from them and hand
those down: `step.StepConfig` (what the compiled step computes: `step_config`)
and `RunConfig` (everything around the step: data, schedule, checkpoints, logging; the
loop's helpers each take one slice of it: `rc.data`, `rc.schedule`, `rc.logging`,
`rc.checkpoints`, each knob in one of them). `--plan N` takes a `PlanConfig` instead of a
RunConfig. No module below the scripts reads the argparse Namespace, so what a function
can depend on is what its signature shows.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import jax

from vit_pure import weights
from vit_pure.config import Execution
from vit_pure.data.cifar10 import NUM_CLASSES
from vit_pure.errors import UsageError, WeightsError
from vit_pure.run import backend
from vit_pure.step import OptimConfig, StepConfig


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """What feeds the steps: the data, the batches, their order."""
    dataset: str
    data_dir: str
    synthetic_sizes: tuple[tuple[str, int], ...]  # load_dataset keywords: (("n_train", N),)
    subset: tuple[int, int] | None  # --subset TRAIN,TEST of CIFAR-10 (None: all of it)
    val_fraction: float | None      # --val-fraction of CIFAR-10 (None: the loader's 0.1)
    eval_batch: int                 # --eval-batch, or --batch when not given
    repeat_aug: int
    seed: int

    @property
    def dataset_sizes(self) -> dict[str, Any]:
        """The sizes `data.cifar10.load_dataset` takes: the synthetic set's, or the subset."""
        if self.dataset == "synthetic":
            return dict(self.synthetic_sizes)
        sizes = {"subset": self.subset, "val_fraction": self.val_fraction}
        return {k: v for k, v in sizes.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class ScheduleSettings:
    """How long the run is, where it stops, and what each step of it applies."""
    batch: int                      # global batch of a training step
    epochs: int
    steps: int | None               # a cap on the optimizer steps
    stop_after: int | None          # stop (and save) after this step; the schedule is unchanged
    optim: OptimConfig
    accum_steps: int | str          # K, or "auto" (run/accum.py)
    memory_budget: float | None     # GiB over all local devices, for --accum-steps auto
    mix_off_epochs: int


@dataclasses.dataclass(frozen=True)
class LogSettings:
    """What the run reports: log lines, evaluations, profiles."""
    eval_every: int
    final_eval: bool
    eval_only: bool
    log_json: str | None
    log_every: int
    progress: bool
    profile: str | None
    profile_range: tuple[int, int] | None


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """Where and how often the run saves, and whether it resumes."""
    ckpt_dir: str | None
    ckpt_every: int
    ckpt_keep: int
    resume: bool


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What the training loop, its checkpoints and its logs take from the flags: four
    slices, each holding its own knobs once (the loop's helpers each take one), and the
    record.

    The values are the flags' (run/flags.py documents each); `from_args` builds it.
    `flags` is the whole command line's values, recorded in each checkpoint and compared
    on `--resume` (run/resume.py).
    """
    data: DataSettings
    schedule: ScheduleSettings
    logging: LogSettings
    checkpoints: CheckpointSettings
    flags: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        """The settings of a command line that `cli.parse_args` has checked."""
        return cls(
            data=DataSettings(
                dataset=args.dataset, data_dir=args.data_dir,
                synthetic_sizes=tuple(sorted(args.synthetic_sizes.items())),
                subset=tuple(args.subset) if args.subset else None,
                val_fraction=args.val_fraction,
                eval_batch=args.eval_batch or args.batch, repeat_aug=args.repeat_aug,
                seed=args.seed),
            schedule=ScheduleSettings(
                batch=args.batch, epochs=args.epochs, steps=args.steps,
                stop_after=args.stop_after,
                optim=OptimConfig(lr=args.lr, weight_decay=args.weight_decay,
                                  warmup_steps=args.warmup_steps, optimizer=args.optimizer,
                                  trainable=args.trainable, layer_decay=args.layer_decay),
                accum_steps=args.accum_steps, memory_budget=args.memory_budget,
                mix_off_epochs=args.mix_off_epochs),
            logging=LogSettings(
                eval_every=args.eval_every, final_eval=not args.no_final_eval,
                eval_only=args.eval_only, log_json=args.log_json, log_every=args.log_every,
                progress=not args.no_progress, profile=args.profile,
                profile_range=args.profile_range),
            checkpoints=CheckpointSettings(
                ckpt_dir=args.ckpt_dir, ckpt_every=args.ckpt_every, ckpt_keep=args.ckpt_keep,
                resume=args.resume),
            flags=tuple(recorded_flags(args).items()))


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What `--plan N` (vit_pure/run/planning.py) takes from the flags: the target, its
    overrides, and the step's batch and accumulation. `from_args` builds it."""
    plan: int                       # devices to plan for
    hardware: str                   # --hardware, as given
    gpus_per_node: int | None
    efficiency: float
    peak_tflops: float | None
    intra_gbps: float | None
    inter_gbps: float | None
    latency_us: float | None
    fabric: str | None              # the network between GPU nodes (plan/fabrics.py)
    algo: str                       # NCCL algorithm to price with, or "auto"
    plan_json: str | None
    batch: int
    accum_steps: int | str
    optim: OptimConfig
    multi_process: bool             # --distributed or --coordinator given

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlanConfig:
        """The plan's settings of a command line that `cli.parse_args` has checked."""
        return cls(
            plan=args.plan, hardware=args.hardware, gpus_per_node=args.gpus_per_node,
            efficiency=args.efficiency, peak_tflops=args.peak_tflops,
            intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps,
            latency_us=args.latency_us, fabric=args.fabric, algo=args.algo,
            plan_json=args.plan_json, batch=args.batch,
            accum_steps=args.accum_steps, optim=RunConfig.from_args(args).schedule.optim,
            multi_process=bool(args.distributed or args.coordinator is not None))


def step_config(args: argparse.Namespace, platform: str | None = None,
                device=None) -> StepConfig:
    """What the compiled step computes, from a parsed command line, for `platform`
    (default: the backend JAX runs on, so call this after jax.distributed is started).

    An execution flag not given (None) keeps `config.Execution`'s default, unless the
    hardware decides it (`backend.resolve`: the layer loop, attention, dropout masks, the
    matmul output dtype, --dtype auto); `notes` says what the hardware decided. `device`
    (default: JAX's first) decides whether cuDNN attention runs: the plan passes its
    target GPU's. `accum_steps` stays 1 here: run/accum.py `build_strategy` settles
    `--accum-steps K|auto`.
    """
    platform = platform or jax.default_backend()
    cfg = args.cfg
    choices = backend.resolve(
        args.policy or args.dtype, args.matmul_precision, args.scan, platform,
        attention=args.attention, dropout_masks=args.dropout_masks,
        cudnn=backend.cudnn_attention_usable(cfg, platform, device))
    backend.check_attention(choices.attention, choices.policy, platform, cfg)
    given = {"remat": args.remat, "last_block": args.last_block, "biases": args.biases,
             "fc1_output": args.fc1_output, "layer_norm": args.layer_norm,
             "qkv_data_grads": args.qkv_data_grads}
    execution = Execution(scan=choices.scan, attention=choices.attention,
                          dropout_masks=choices.dropout_masks,
                          packed_masks=choices.packed_masks,
                          **{k: v for k, v in given.items() if v is not None})
    return StepConfig(cfg, choices.policy, args.label_smoothing, args.grad_clip,
                      execution=execution, randaugment=tuple(args.randaugment),
                      mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, ema_decay=args.ema,
                      eval_flip=args.eval_flip, eval_corners=args.eval_corners,
                      trainable=args.trainable, notes=choices.notes)


def recorded_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag's value as JSON takes it, by attribute name, sorted: what a checkpoint
    records of the command line (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(vars(args).items())
            if isinstance(v, (str, int, float, bool, type(None), list, tuple))}


def pretrained_weights(args: argparse.Namespace, *, fit: bool = True) -> dict | None:
    """--image-size and --init-from: the model's resolution and the imported weights.

    Without --init-from, only --image-size changes `args.cfg`; returns None. With it, the
    file (fetched first if it is a URL: vit_pure/weights/fetch.py) fixes what the flags do
    not: the resolution (the file's, unless --image-size), the pooling (the file's, unless
    --pool), the patch size, layer scale, register tokens, GELU, LayerNorm epsilon and
    input scaling; the class count becomes the dataset's. Returns the file's weights
    fitted to that model (`weights.fit`: position embedding resampled as the file's library
    does it, new head), after one line per change on
    stdout, or, with `fit` False (--plan), None having set only `args.cfg`. Call it after
    `cli.start_runtime` when `fit`: fitting may run a JAX computation.
    """
    cfg = args.cfg
    if args.image_size is not None and args.image_size < 1:
        raise UsageError(f"--image-size must be positive, got {args.image_size}")
    if args.init_from is None:
        if args.recipe is not None and args.recipe.startswith("finetune-"):
            raise UsageError(f"--recipe {args.recipe} fine-tunes pretrained weights: give "
                             "--init-from FILE (docs/training.md, \"Fine-tuning a pretrained "
                             "ViT\")")
        if args.trainable == "head" and fit and not getattr(args, "eval_only", False):
            raise UsageError("--trainable head trains the head alone on a frozen backbone: "
                             "give --init-from FILE, its pretrained weights (a random "
                             "backbone's features are noise)")
        if args.image_size is not None:
            try:
                args.cfg = cfg.replace(image_size=args.image_size)
            except ValueError as e:
                raise UsageError(f"--image-size: {e}") from None
        return None
    try:  # the readers' errors name the file; the line says which flag gave it
        path = weights.resolve(args.init_from)
        params, found = weights.load_found(path, heads=cfg.heads)
        src = weights.config_of(params, found, f"{found.format}:{path.name}")
    except WeightsError as e:
        raise WeightsError(f"--init-from: {e}") from None
    try:
        args.cfg = cfg.replace(
            image_size=args.image_size or src.image_size, num_classes=NUM_CLASSES,
            pool=args.pool or src.pool, gelu=src.gelu, ln_eps=src.ln_eps, inputs=src.inputs,
            patch_size=src.patch_size, layer_scale=src.layer_scale, registers=src.registers)
    except ValueError as e:
        raise UsageError(f"--init-from {args.init_from}: {e}") from None
    if not fit:
        return None
    try:
        params, notes = weights.fit(params, src, args.cfg, str(path), found.resample)
    except WeightsError as e:
        raise WeightsError(f"--init-from: {e}") from None
    if getattr(args, "process_id", None) in (None, 0):
        c = args.cfg
        print(f"--init-from: {path} ({found.format}): {c.depth} layers, width {c.width}, "
              f"{c.heads} heads, {c.image_size} px in {c.patch_size} px patches, GELU "
              f"{c.gelu}, LayerNorm eps {c.ln_eps:g}, inputs {c.inputs}"
              f"{', layer scale' if c.layer_scale else ''}"
              f"{f', {c.registers} registers' if c.registers else ''}", flush=True)
        for note in (*found.notes, *notes):
            print(f"--init-from: {note}", file=sys.stdout, flush=True)
    return params
