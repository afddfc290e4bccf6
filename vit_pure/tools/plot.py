"""Plot loss and accuracy curves from a training run's --log-json file (needs matplotlib).

    python -m vit_pure.tools.plot runs/quick.jsonl --out runs/quick.png
"""
from __future__ import annotations

import json
import pathlib
import sys

from vit_pure.run import cli


def read_log(path: pathlib.Path) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) from a JSON-lines log."""
    train, evals = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise SystemExit(f"error: {path}:{n} is not JSON") from None
        if "split" in record and "accuracy" in record:
            evals.append(record)
        elif "step" in record and "loss" in record:
            train.append(record)
    if not train and not evals:
        raise SystemExit(f"error: {path} has no training or evaluation records")
    return train, evals


def plot(train: list[dict], evals: list[dict], out: pathlib.Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
        if "accuracy" in train[0]:
            ax_acc.plot([r["step"] for r in train], [r["accuracy"] for r in train],
                        label="train (batch)", lw=1, alpha=0.6)
    for split, marker in (("val", "o-"), ("test", "s")):
        points = [r for r in evals if r["split"] == split]
        if points:
            steps = [r.get("step", 0) for r in points]
            ax_loss.plot(steps, [r["loss"] for r in points], marker, label=split)
            ax_acc.plot(steps, [r["accuracy"] for r in points], marker, label=split)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_acc.set(xlabel="step", ylabel="top-1 accuracy", title="accuracy", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    parser = cli.doc_parser(__doc__)
    parser.add_argument("log", type=pathlib.Path, help="a --log-json file")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="PNG path (default: LOG.png)")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    if not args.log.is_file():
        print(f"error: no such log file: {args.log}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    train, evals = read_log(args.log)
    out = args.out or args.log.with_suffix(".png")
    plot(train, evals, out, args.title)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
