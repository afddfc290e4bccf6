"""The rows `python -m benchmarks.bench` measures, two ways to name one.

`--config STRATEGY:LAYOUT:POLICY[:OPTIONS]` (bench.py's docstring has the grammar) names a
strategy, a layout, a dtype policy and a few options; `--kit LABEL=FLAGS` gives
train_shardmap.py's own flags, the grammar benchmarks.peers and benchmarks.deviceless take
(harness.parse_kit_row). Both are checked here, before any row runs.
"""
from __future__ import annotations

import dataclasses
import math
import re

import train_shardmap
from vit_pure.policy import Policy
from vit_pure.run import cli


# ---------------------------------------------------------------- configuration syntax
@dataclasses.dataclass(frozen=True)
class BenchConfig:
    strategy: str                  # "pmap" | "shard_map"
    layout: str                    # "" | "N" | "data=D[,model=M][,pipe=S]"
    policy: str                    # as --policy
    options: dict                  # scan, remat, accum, precision, fsdp, mb (after defaults)

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.strategy}:{self.layout}:{self.policy}" + (f":{opts}" if opts else "")


_OPTION_KEYS = ("scan", "remat", "accum", "precision", "fsdp", "mb")


def parse_configs(texts: list[str]) -> list[BenchConfig]:
    """The --config values -> BenchConfigs (options only as given; defaults come later)."""
    out = []
    for text in texts:
        for item in (s.strip() for s in text.split(";")):
            if not item:
                continue
            fields = item.split(":", 3)  # an option's value may hold ":" (remat=block-save:...)
            if len(fields) not in (3, 4) or fields[0] not in ("pmap", "shard_map"):
                raise cli.UsageError(
                    f"--config {item!r}: expected STRATEGY:LAYOUT:POLICY[:OPTIONS] with "
                    f"STRATEGY pmap or shard_map")
            strategy, layout, policy = (f.strip() for f in fields[:3])
            try:
                Policy.parse(policy)
            except ValueError as e:
                raise cli.UsageError(f"--config {item!r}: {e}") from None
            if strategy == "pmap" and layout and not layout.isdigit():
                raise cli.UsageError(f"--config {item!r}: pmap's layout is a device count")
            if not (re.fullmatch(r"\d*", layout) or re.fullmatch(
                    r"(data|model|pipe)=\d+(,(data|model|pipe)=\d+)*", layout)):
                raise cli.UsageError(f"--config {item!r}: layout is N or data=D,model=M,pipe=S")
            options = {}
            for pair in (fields[3].split(",") if len(fields) == 4 and fields[3] else []):
                key, sep, value = pair.partition("=")
                if not sep or key.strip() not in _OPTION_KEYS:
                    raise cli.UsageError(f"--config {item!r}: options are key=value with key "
                                         f"in {', '.join(_OPTION_KEYS)}")
                options[key.strip()] = value.strip()
            if strategy == "pmap" and ({"fsdp", "mb"} & options.keys()):
                raise cli.UsageError(f"--config {item!r}: fsdp and mb are shard_map options")
            out.append(BenchConfig(strategy, layout, policy, options))
    if not out:
        raise cli.UsageError("no --config given")
    return out


def layout_devices(layout: str, default: int | None) -> int | None:
    """How many devices a layout names (None: every device)."""
    if not layout:
        return default
    if layout.isdigit():
        return int(layout)
    sizes = dict(p.split("=", 1) for p in layout.split(",") if "=" in p)
    try:
        return math.prod(int(v) for v in sizes.values())
    except ValueError:
        raise cli.UsageError(f"layout {layout!r}: expected N or data=D,model=M") from None


# ------------------------------------------------------------------ kit rows
def kit_argv(model: str, batch: int, flags: list[str]) -> list[str]:
    """train_shardmap.py's command line of a `--kit` row: the bench's model and batch,
    synthetic data, no accumulation, then the row's own flags (which win)."""
    return ["--model", model, "--batch", str(batch), "--dataset", "synthetic",
            "--accum-steps", "1", *flags]


def kit_args(argv: list[str], text: str):
    """The parsed flags of a `--kit` row; a UsageError naming the row where the training
    script refuses them."""
    def refuse(message):
        raise cli.UsageError(f"--kit {text!r}: the training script refuses it: {message}")
    parser = train_shardmap.build_parser()
    parser.error = refuse
    return cli.parse_args(parser, argv)
