"""The plan itself: the collectives priced per mesh axis, the compute, the memory, the
predicted step with and without overlap, and the verdict; as text and as JSON.
"""
from __future__ import annotations

import collections
import dataclasses
import math

from vit_pure.plan import interconnect as ic
from vit_pure.plan import nccl
from vit_pure.plan.collectives import (
    CPU_BARRIER_EXPANDER,
    CPU_COMBINER,
    GPU_COMBINE_BYTES,
    Collective,
)
from vit_pure.plan.overlap import CRITICAL
from vit_pure.xla import kernels


@dataclasses.dataclass(kw_only=True)
class Plan:
    script: str
    devices: int
    mesh: dict[str, int]
    hardware: ic.Hardware
    efficiency: float
    global_batch: int
    per_device_batch: int
    tokens_per_image: int
    params_per_device: int
    collectives: list[Collective]
    calls: dict[int, int]
    corrections: list[str]
    program_flops: int
    model_flops: float
    memory: dict[str, int]
    compile_s: float
    notes: list[str]
    compiled: object = None  # the executable the plan was read from (tests run it)
    platform: str = "cpu"  # what it was compiled for: "gpu" (a deviceless target) or "cpu"
    gpu_program: dict | None = None  # kernels and HBM traffic (xla/kernels.py), GPU only
    algorithm: str = nccl.AUTO  # NCCL's algorithm: auto (its tuner's pick) or one forced
    pipeline: dict | None = None  # the pipeline schedule's table (pipeline.schedules.summary)

    # -- time
    def priced(self, c: Collective) -> tuple[float, str]:
        """(seconds per step, the algorithm NCCL runs its calls with: vit_pure/plan/nccl.py)."""
        transfer, latency, algorithm = nccl.seconds(c.kind, c.nbytes, c.where, self.hardware,
                                                    self.algorithm, c.message)
        return c.count * transfer + self.calls.get(id(c), c.count) * latency, algorithm

    def seconds(self, c: Collective) -> float:
        return self.priced(c)[0]

    def per_axis(self) -> dict[str, dict]:
        out = {}
        for c in self.collectives:
            row = out.setdefault(c.axes, {"bytes": 0, "wire_bytes": 0.0, "calls": 0,
                                          "ops": 0, "seconds": 0.0, "critical_s": 0.0,
                                          "groups": 0, "straddling": 0, "nodes": 1,
                                          "algorithms": []})
            row["bytes"] += c.nbytes * c.count
            row["wire_bytes"] += c.count * ic.wire_bytes(c.kind, c.nbytes, c.where.n)
            row["calls"] += self.calls.get(id(c), c.count)
            row["ops"] += c.count
            seconds, algorithm = self.priced(c)
            if algorithm not in row["algorithms"]:
                row["algorithms"].append(algorithm)
            row["seconds"] += seconds
            row["critical_s"] += seconds if c.overlap == CRITICAL else 0.0
            if c.where.straddling >= row["straddling"]:
                row["groups"], row["straddling"] = c.where.groups, c.where.straddling
            row["nodes"] = max(row["nodes"], c.where.nodes)
        return out

    def compute_at(self, efficiency: float) -> float:
        return self.program_flops / (self.hardware.peak_flops * efficiency)

    @property
    def compute_s(self) -> float:
        return self.compute_at(self.efficiency)

    @property
    def comm_s(self) -> float:
        return sum(self.seconds(c) for c in self.collectives)

    @property
    def critical_s(self) -> float:
        """Collectives on the critical path: no compute can hide them."""
        return sum(self.seconds(c) for c in self.collectives if c.overlap == CRITICAL)

    def steps(self, efficiency: float) -> dict:
        """The step with no overlap, and its floor with overlap by dependency: compute plus
        the critical-path collectives, the overlappable ones hidden up to the compute."""
        compute, comm, critical = self.compute_at(efficiency), self.comm_s, self.critical_s
        no_overlap, floor = compute + comm, critical + max(compute, comm - critical)
        return {"efficiency": efficiency, "compute_s": compute, "step_s": no_overlap,
                "mfu": self.mfu(no_overlap), "step_overlap_s": floor,
                "mfu_overlap": self.mfu(floor)}

    def mfu(self, step_s: float) -> float:
        return self.model_flops / (step_s * self.hardware.peak_flops) if step_s else 0.0

    @property
    def memory_bytes(self) -> int:
        # Donated outputs reuse their argument's buffer (alias); the rest is live at once.
        m = self.memory
        return m["argument"] + m["output"] - m["alias"] + m["temp"]

    # -- verdict
    def verdict(self) -> tuple[str, str]:
        compute, comm = self.compute_s, self.comm_s
        axes = self.per_axis()
        rule = ("rule: collectives priced as NCCL runs them (vit_pure/plan/nccl.py; "
                f"algorithm {self.algorithm}); ratio = communication / compute (no overlap); "
                "ratio > 1: "
                "communication-bound on the axis with the most time; else compute-bound. "
                "On 'data' the gradient collectives do not grow with the per-device batch "
                "and the compute does, so the balance batch is b x t_axis / t_compute")
        fits = self.memory_bytes <= self.hardware.memory_bytes
        memory = ("" if fits else
                  f"; does not fit: {self.memory_bytes / 2**30:.1f} GiB per device > "
                  f"{self.hardware.memory_bytes / 2**30:.0f} GiB (--accum-steps K or "
                  f"--remat block{self._pipeline_advice()})")
        ratio = comm / compute if compute else math.inf
        if ratio <= 1 or not axes:
            return (f"compute-bound: communication is {ratio:.2f}x the compute "
                    f"({comm * 1e3:.2f} of {compute * 1e3:.2f} ms){memory}", rule)
        axis, row = max(axes.items(), key=lambda kv: kv[1]["seconds"])
        share = row["seconds"] / compute
        advice = self._advice(axis, row, compute)
        return (f"communication-bound {ratio:.2f}x; '{axis}' alone {share:.1f}x the compute "
                f"({row['seconds'] * 1e3:.2f} vs {compute * 1e3:.2f} ms): {advice}{memory}", rule)

    # -- the pipeline schedule (its table: vit_pure/pipeline/schedules.py)
    def _one_f_one_b_bytes(self) -> int | None:
        """GPipe's memory with its temporaries (where the activations live) scaled from
        the K residual sets it holds to the ones 1F1B holds: an estimate."""
        p = self.pipeline
        if not p or p["schedule"] != "gpipe" or p["held_1f1b"] >= p["held"]:
            return None
        temp = self.memory["temp"]
        return int(self.memory_bytes - temp + temp * p["held_1f1b"] / p["held"])

    def _pipeline_advice(self) -> str:
        est = self._one_f_one_b_bytes()
        if est is None or est > self.hardware.memory_bytes:
            return ""
        return (f", or --pipeline-schedule 1f1b: it holds {self.pipeline['held_1f1b']} of "
                f"{self.pipeline['held']} micro-batches' activations, so the temporaries "
                f"scaled give {est / 2**30:.1f} GiB, which fits; plan it to see its own")

    def _pipeline_lines(self) -> list[str]:
        p = self.pipeline
        if not p:
            return []
        sends = [c for c in self.collectives if c.kind == "collective-permute"]
        upper = [f"  (the GPU program's kernels and predicted step below count the ticks' F, B "
                 f"and W branches as taken at every tick, an upper bound: a stage takes each "
                 f"on {p['microbatches'] * p['virtual']} of the {p['ticks']} ticks)"]
        return [f"pipeline: {p['schedule']}" + (f" (V={p['virtual']})" if p["virtual"] > 1
                                                  else "")
                + f", {p['stages']} stages x {p['microbatches']} micro-batches, {p['ticks']} "
                f"ticks; bubble {p['bubble']:.3f} (from the table, lockstep, t_B = 2 t_F); "
                f"the busiest stage holds {p['held']} micro-batches' activations (1F1B: "
                f"{p['held_1f1b']}); point-to-point: {sum(c.count for c in sends)} sends, "
                f"{sum(c.count * c.nbytes for c in sends) / 1e6:.1f} MB per device per step "
                f"(compiled program)"] + upper

    def _advice(self, axis: str, row: dict, compute_s: float) -> str:
        b, per_node = self.per_device_batch, self.hardware.devices_per_node
        if axis == "data" or axis.startswith("data"):
            need = math.ceil(b * row["seconds"] / compute_s)
            return (f"raise the per-device batch from {b} to >= {need} images "
                    f"(>= {need * self.tokens_per_image:,} tokens), or fewer, larger "
                    f"devices on 'data'")
        if "model" in axis:
            size = self.mesh.get("model", 1)
            fits = ([d for d in range(1, per_node + 1) if per_node % d == 0])
            where = (f"model={size} does not divide the {per_node} devices of a node, so "
                     f"{row['straddling']} of its {row['groups']} groups straddle nodes; "
                     f"choose model in {{{', '.join(map(str, fits))}}}"
                     if per_node % size else f"'model' stays inside a node (model={size} "
                     f"divides {per_node})")
            return ("tensor parallelism's activation all-reduces grow with the batch and sit "
                    f"on the critical path: {where}, or use a smaller model= and more data=")
        if "pipe" in axis:
            return "fewer pipeline stages, or more micro-batches per stage"
        return "reduce the collectives on this axis"

    # -- output
    def record(self) -> dict:
        verdict, rule = self.verdict()
        measured = self.hardware.measured_efficiency
        return {
            "devices": self.devices, "mesh": self.mesh, "script": self.script,
            "hardware": dataclasses.asdict(self.hardware) | {"efficiency": self.efficiency},
            "params_per_device": self.params_per_device,
            "global_batch": self.global_batch, "per_device_batch": self.per_device_batch,
            "algorithm": self.algorithm,
            "collectives": [c.record() | {"algorithm": self.priced(c)[1]}
                            for c in self.collectives],
            "per_axis": self.per_axis(),
            "corrections": self.corrections,
            "flops": {"program_per_device": self.program_flops,
                      "model_per_device": self.model_flops},
            "memory": self.memory | {"total": self.memory_bytes},
            "predicted": self.steps(self.efficiency) | {
                "comm_s": self.comm_s, "critical_s": self.critical_s,
                "at_measured_efficiency": self.steps(measured) if measured else None},
            "verdict": verdict, "rule": rule, "compile_s": self.compile_s, "notes": self.notes,
            "compiled_for": self.platform, "gpu_program": self.gpu_program,
            "pipeline": self.pipeline,
        }

    def _efficiencies(self) -> list[tuple[str, float]]:
        """The given efficiency and, where the hardware table has one, the measured one."""
        hw = self.hardware
        out = [("given: --efficiency; the default is an assumption", self.efficiency)]
        if hw.measured_efficiency:
            out.append((f"measured: {hw.efficiency_source}", hw.measured_efficiency))
        return out

    def _compute_lines(self) -> list[str]:
        hw = self.hardware
        return [f"compute: {self.program_flops / 1e9:,.1f} GFLOP per device per step (dot ops "
                f"of the compiled program, trip counts included; model "
                f"{self.model_flops / 1e9:,.1f}) / ({hw.peak_flops / 1e12:.0f} TFLOP/s x "
                f"{eff:.3f}) = {self.compute_at(eff) * 1e3:.2f} ms ({label})"
                for label, eff in self._efficiencies()]

    def report(self) -> str:
        lines = [*self._header_lines(), *self._collective_lines(), *self._axis_lines(),
                 *self._compute_lines(), self._memory_line(), *self._pipeline_lines(),
                 *self._step_lines()]
        if self.gpu_program is not None:
            lines.append(kernels.report(self.gpu_program))
            lines.append(kernels.largest_report(self.gpu_program, 5))
        verdict, rule = self.verdict()
        lines += [f"verdict: {verdict}", rule]
        return "\n".join(lines)

    def _header_lines(self) -> list[str]:
        """What was planned (script, devices, mesh, batch, compile) and for which hardware."""
        hw = self.hardware
        return [f"plan: {self.script} for {self.devices} devices, mesh "
                + " x ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1 or k == "data")
                + f"; global batch {self.global_batch} ({self.per_device_batch} per data "
                f"rank); compiled for {self.devices} "
                f"{'GPUs (deviceless)' if self.platform == 'gpu' else 'fake CPU devices'} in "
                f"{self.compile_s:.1f} s",
                f"hardware {hw.describe()}", f"  sources: {hw.sources}",
                *(f"  {note}" for note in self.notes)]

    def _collective_lines(self) -> list[str]:
        """The collectives table, one row per kind, axes, dtype, source and overlap, the
        costliest first; after the corrections made for the target on a CPU compile."""
        if self.platform == "gpu":
            lines = ["collectives per device, as XLA:GPU emits them (async, combined; V = "
                     "bytes per execution; count = executions per optimizer step, loop "
                     "trip counts included; calls = launches):"]
        else:
            lines = ["corrections for the target:",
                     f"  XLA:CPU's {CPU_COMBINER} switched off; XLA:GPU's combining "
                     f"({GPU_COMBINE_BYTES / 2**20:.0f} MiB buckets of independent "
                     "collectives) modelled: one call per bucket, priced at its size",
                     f"  XLA:CPU's {CPU_BARRIER_EXPANDER} switched off: remat's barriers "
                     "stay, so recomputed values (and their re-gathers) stay as on a GPU"]
            lines += [f"  {c}" for c in self.corrections] or ["  dtypes: none needed"]
            lines.append("collectives per device (V = bytes per execution; count = executions "
                         "per optimizer step, loop trip counts included; calls = XLA:GPU "
                         "calls as modelled, a shared call counted on the row that opens it):")
        lines.append(f"  {'kind':<19}{'axes':<12}{'dtype':<6}{'ops':>5}{'V min..max':>22}"
                     f"{'count/step':>11}{'calls':>7}{'MB/step':>10}{'ms/step':>9}  "
                     f"{'algorithm':<10}{'overlap':<13}source")
        groups = collections.defaultdict(list)
        for c in self.collectives:
            groups[(c.kind, c.axes, c.dtype, c.source, c.overlap)].append(c)
        for (kind, axes, dtype, source, overlap), cs in sorted(
                groups.items(), key=lambda kv: -sum(self.seconds(c) for c in kv[1])):
            sizes = [c.nbytes for c in cs]
            algorithms = "/".join(dict.fromkeys(self.priced(c)[1] for c in cs))
            span = (_size(min(sizes)) if min(sizes) == max(sizes)
                    else f"{_size(min(sizes))}..{_size(max(sizes))}")
            lines.append(
                f"  {kind:<19}{axes:<12}{dtype:<6}{len(cs):>5}{span:>22}"
                f"{sum(c.count for c in cs):>11}"
                f"{sum(self.calls.get(id(c), c.count) for c in cs):>7}"
                f"{sum(c.nbytes * c.count for c in cs) / 1e6:>10.1f}"
                f"{sum(self.seconds(c) for c in cs) * 1e3:>9.3f}  {algorithms:<10}"
                f"{overlap:<13}{source}")
        lines.append("  (critical: a matmul makes its input and another waits for it; "
                     "overlappable: no matmul waits for it, or it needs none: a prefetch)")
        return lines

    def _axis_lines(self) -> list[str]:
        """Bytes, calls and time per mesh axis, the slowest first, and where its groups lie."""
        lines = ["per mesh axis (per device per step; each collective priced by its "
                 "slowest group):"]
        for axis, row in sorted(self.per_axis().items(), key=lambda kv: -kv[1]["seconds"]):
            lines.append(f"  {axis:<12} V {row['bytes'] / 1e6:9.1f} MB, sent on the wire "
                         f"{row['wire_bytes'] / 1e6:9.1f} MB, {row['ops']} executions in "
                         f"{row['calls']} calls: {row['seconds'] * 1e3:.3f} ms "
                         f"({row['critical_s'] * 1e3:.3f} critical), NCCL "
                         f"{'/'.join(row['algorithms'])}; {_placed(row, self.hardware)}")
        nodes = max((row["nodes"] for row in self.per_axis().values()), default=1)
        if nccl.scale_note(nodes) and self.hardware.fabric is not None:
            lines.append(f"  across {nccl.scale_note(nodes)}")
        return lines

    def _memory_line(self) -> str:
        m = self.memory
        return (f"memory: {self.memory_bytes / 2**30:.2f} GiB per device (XLA's "
                f"analysis of the {self.platform.upper()} compile: arguments "
                f"{_size(m['argument'])} + outputs "
                f"{_size(m['output'])} - aliased {_size(m['alias'])} + temporaries "
                f"{_size(m['temp'])}) of {self.hardware.memory_bytes / 2**30:.0f} GiB; params "
                f"{self.params_per_device:,} per device")

    def _step_lines(self) -> list[str]:
        """The communication, and the predicted step with and without overlap per efficiency."""
        lines = [f"communication {self.comm_s * 1e3:.2f} ms, of it critical-path "
                 f"{self.critical_s * 1e3:.2f} ms (never hidden) and overlappable "
                 f"{(self.comm_s - self.critical_s) * 1e3:.2f} ms (hidden up to the compute)"]
        for label, eff in self._efficiencies():
            step = self.steps(eff)
            lines.append(f"predicted step at efficiency {eff:.3f} ({label}): "
                         f"{step['step_s'] * 1e3:.2f} ms with no overlap (MFU "
                         f"{step['mfu']:.1%}), {step['step_overlap_s'] * 1e3:.2f} ms with "
                         f"overlap by dependency (MFU {step['mfu_overlap']:.1%})")
        return lines


def _placed(row: dict, hw: ic.Hardware) -> str:
    if row["straddling"] and row["straddling"] < row["groups"]:
        return (f"{row['straddling']} of {row['groups']} groups CROSS A NODE BOUNDARY "
                f"({hw.devices_per_node} devices a node): priced across nodes")
    if row["nodes"] > 1:
        return f"every group spans {row['nodes']} nodes"
    return "inside a node"


def _size(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"
