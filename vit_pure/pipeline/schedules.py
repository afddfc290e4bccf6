"""Pipeline schedules as data: one table per schedule, read by everything else.

For every tick t and pipeline stage s (a device on the 'pipe' axis), a table says which
micro-batch the stage runs forward (F), which backward (B; zb-h1: I, the input gradient)
and which weight gradient (W, zb-h1), through which chunk of its layers. The same
`Schedule` drives the program (pipeline/tick.py), the start-up picture, the plan's bubble
and memory, and the tests; nothing here imports jax. The builders (`_gpipe`, `_1f1b`,
`_interleaved`, `_zb_h1`) say each schedule's order.

Time: `lockstep_time` (a tick lasts as long as its busiest stage), `pairwise_time` (a
send waits for its two stages only). The program's needs: `residual_slots` (the ring),
`segments` (the scans and their sends), `forward_only` (evaluation's table),
`block_order` (the layout's order of the stacked blocks).
"""
from __future__ import annotations

import dataclasses

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
IDLE = -1


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """One schedule's table. Each array is (ticks, stages) of int32, IDLE (-1) where the
    stage does not do that kind of work at that tick."""
    name: str
    stages: int           # P
    microbatches: int     # M
    virtual: int          # V: chunks of layers per stage (1 but for interleaved)
    fwd: np.ndarray       # micro-batch run forward
    fwd_chunk: np.ndarray  # ... through this chunk of the stage's layers
    bwd: np.ndarray       # micro-batch run backward (B; zb-h1: the input gradient I)
    bwd_chunk: np.ndarray
    wgt: np.ndarray       # zb-h1: micro-batch whose weight gradient W runs; else all IDLE
    wgt_chunk: np.ndarray

    @property
    def ticks(self) -> int:
        return self.fwd.shape[0]

    @property
    def split_backward(self) -> bool:
        return bool((self.wgt != IDLE).any())

    def rows(self) -> np.ndarray:
        """(ticks, 6, stages) int32: the table as the program's scan reads it."""
        return np.stack([self.fwd, self.fwd_chunk, self.bwd, self.bwd_chunk, self.wgt,
                         self.wgt_chunk], axis=1).astype(np.int32)


# ------------------------------------------------------------------------ the builders
def _gpipe(P: int, M: int) -> tuple:
    """All M forwards, then all M backwards: 2 (M + P - 1) ticks, M residual sets held per
    stage."""
    T = 2 * (M + P - 1)
    fwd, bwd = np.full((T, P), IDLE), np.full((T, P), IDLE)
    for s in range(P):
        for i in range(M):
            fwd[i + s, s] = i
            # The backwards in reverse (micro-batch M-1 first, from the last stage): the
            # order of autodiff of the forward ticks, the textbook GPipe.
            bwd[M + P - 1 + (M - 1 - i) + (P - 1 - s), s] = i
    return fwd, np.zeros_like(fwd), bwd, np.zeros_like(bwd)


def _greedy(P: int, M: int, V: int, fwd_order, bwd_order, cap) -> tuple:
    """List scheduling in lockstep: at each tick each stage runs the next forward of its
    order whose input arrived (it was computed at an earlier tick) if it holds fewer than
    cap[s] residual sets, and the next backward whose cotangent arrived (or, on the last
    virtual stage, whose forward ran this tick or earlier). Returns the four arrays."""
    last = P * V - 1                       # the last virtual stage: its B follows its F
    done_f, done_b = {}, {}                # (micro, virtual stage) -> tick
    nf, nb = [0] * P, [0] * P
    rows = []
    t = 0
    while any(nf[s] < len(fwd_order[s]) or nb[s] < len(bwd_order[s]) for s in range(P)):
        if t > 8 * (M * V + P) + 8:
            raise RuntimeError("pipeline schedule: no progress (a bug in the orders)")
        row = [[IDLE, 0, IDLE, 0] for _ in range(P)]
        for s in range(P):
            if nf[s] < len(fwd_order[s]) and nf[s] - nb[s] < cap[s]:
                i, v = fwd_order[s][nf[s]]
                j = v * P + s
                if j == 0 or done_f.get((i, j - 1), t) < t:
                    row[s][:2] = [i, v]
                    done_f[(i, j)] = t
                    nf[s] += 1
        for s in range(P):
            if nb[s] < len(bwd_order[s]):
                i, v = bwd_order[s][nb[s]]
                j = v * P + s
                ready = (done_f.get((i, j), t + 1) <= t if j == last
                         else done_b.get((i, j + 1), t) < t)
                if ready:
                    row[s][2:] = [i, v]
                    done_b[(i, j)] = t
                    nb[s] += 1
        rows.append(row)
        t += 1
    table = np.array(rows)  # (T, P, 4)
    return tuple(table[:, :, k] for k in range(4))


def _1f1b(P: int, M: int) -> tuple:
    """One F or B per stage per tick, in step: stage s runs micro-batch i's F at tick
    s + 2i and its B at tick 2P - 1 - s + 2i, so F on the ticks of one parity and B on the
    other. That is PipeDream-Flush's 1F1B in unit ticks (stage s holds P - s, 2(M + P - 1)
    ticks), and at each tick stage pairs (s, s+1) only swap: one send a tick."""
    T = 2 * (M + P - 1)
    fwd, bwd = np.full((T, P), IDLE), np.full((T, P), IDLE)
    for s in range(P):
        for i in range(M):
            fwd[s + 2 * i, s] = i
            bwd[2 * P - 1 - s + 2 * i, s] = i
    return fwd, np.zeros_like(fwd), bwd, np.zeros_like(bwd)


def _megatron_order(P: int, M: int, V: int, reverse: bool = False) -> list:
    """(micro-batch, chunk) in Megatron's order: groups of P micro-batches, chunk by chunk
    (the backward's chunks last to first)."""
    out = []
    for g in range(0, M, P):
        for v in (reversed(range(V)) if reverse else range(V)):
            out += [(i, v) for i in range(g, min(g + P, M))]
    return out


def _interleaved(P: int, M: int, V: int) -> tuple:
    """V chunks per stage, chunk v of stage s being virtual stage vP + s; micro-batches go
    round V times in groups of P (Megatron's order); F and B of different micro-batches
    may share a tick."""
    cap = [2 * (P - s) - 1 + (V - 1) * P for s in range(P)]
    return _greedy(P, M, V, [_megatron_order(P, M, V)] * P,
                   [_megatron_order(P, M, V, True)] * P, cap)


def _zb_h1(P: int, M: int, costs) -> tuple:
    """1F1B's table with each B split into I and W (ZB-H1, pipeline/split.py): each W in
    the first tick where it lengthens the tick by at most a quarter of a W (where its
    stage would idle), or where the stage would otherwise hold more residual sets than
    1F1B's P."""
    fwd, fwd_chunk, bwd, bwd_chunk = _1f1b(P, M)
    t_f, t_i, t_w = costs
    T = fwd.shape[0]
    load = (fwd != IDLE) * t_f + (bwd != IDLE) * t_i
    busiest = load.max(axis=1)
    cap = P  # its base table's peak (stage 0's): no stage holds more
    wgt = np.full((T, P), IDLE)
    pending, held = [[] for _ in range(P)], [0] * P
    for t in range(T):
        for s in range(P):
            held[s] += fwd[t, s] != IDLE
            if bwd[t, s] != IDLE:
                pending[s].append(bwd[t, s])
            # Run the oldest pending W here if it lengthens the tick by at most a quarter
            # of a W (the bubbles: the busiest stage is busy anyway), or if waiting would
            # hold more residual sets than 1F1B does.
            if pending[s] and (load[t, s] + t_w <= busiest[t] + t_w / 4 or held[s] >= cap):
                wgt[t, s] = pending[s].pop(0)
                held[s] -= 1
                busiest[t] = max(busiest[t], load[t, s] + t_w)
    extra = pending  # W ticks after the table's last tick
    n_extra = max(len(p) for p in extra)
    if n_extra:
        pad = np.full((n_extra, P), IDLE)
        fwd, bwd, wgt = (np.concatenate([a, pad]) for a in (fwd, bwd, wgt))
        fwd_chunk, bwd_chunk = (np.concatenate([a, np.zeros_like(pad)])
                                for a in (fwd_chunk, bwd_chunk))
        for s, pending in enumerate(extra):
            for k, i in enumerate(pending):
                wgt[T + k, s] = i
    return fwd, fwd_chunk, bwd, bwd_chunk, wgt


def build(name: str, stages: int, microbatches: int, virtual: int = 1,
          costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> Schedule:
    """The table of schedule `name` for P stages and M micro-batches (V chunks per stage
    for interleaved). `costs` (t_F, t_I, t_W) only steer zb-h1's placement of W."""
    check_schedule(name, stages, microbatches, virtual)
    P, M, V = stages, microbatches, virtual
    wgt = None
    if name == "gpipe":
        fwd, fwd_chunk, bwd, bwd_chunk = _gpipe(P, M)
    elif name == "1f1b":
        fwd, fwd_chunk, bwd, bwd_chunk = _1f1b(P, M)
    elif name == "interleaved":
        fwd, fwd_chunk, bwd, bwd_chunk = _interleaved(P, M, V)
    else:
        fwd, fwd_chunk, bwd, bwd_chunk, wgt = _zb_h1(P, M, costs)
    if wgt is None:
        wgt = np.full_like(fwd, IDLE)
    wgt_chunk = np.zeros_like(wgt)
    as32 = [np.asarray(a, np.int32) for a in (fwd, fwd_chunk, bwd, bwd_chunk, wgt, wgt_chunk)]
    return Schedule(name, P, M, V, *as32)


def forward_only(stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Evaluation's table: the forwards alone, in Megatron's order, each as soon as its
    input has arrived (no backward, no cap): GPipe's forward ticks where virtual = 1
    (stage s runs micro-batch t - s at tick t), M V + P - 1 ticks where P divides M."""
    P, M, V = stages, microbatches, virtual
    fwd, fwd_chunk, _, _ = _greedy(P, M, V, [_megatron_order(P, M, V)] * P, [[]] * P,
                                   [M * V] * P)
    idle, zero = np.full_like(fwd, IDLE), np.zeros_like(fwd)
    return Schedule("forward", P, M, V, *(np.asarray(a, np.int32) for a in
                                          (fwd, fwd_chunk, idle, zero, idle, zero)))


def block_order(depth: int, stages: int, virtual: int = 1) -> np.ndarray:
    """(depth,) the layout's order of the stacked blocks: position k of the layer axis
    holds layer block_order[k]. The axis is split evenly over the 'pipe' axis, so stage s
    holds positions s L/P .. (s+1) L/P - 1: with V chunks per stage those are its chunks
    v = 0 .. V-1, virtual stages vP + s (layers (vP + s) c .. (vP + s + 1) c - 1, c =
    L/(PV)), in that order. The identity for V = 1; `np.argsort` of it is the inverse,
    which puts saved files back in layer order."""
    c = depth // (stages * virtual)
    return np.array([(v * stages + s) * c + i for s in range(stages) for v in range(virtual)
                     for i in range(c)], np.int64)


def check_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """ValueError (one line) for a schedule that cannot be built."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r}: expected one of {', '.join(SCHEDULES)}")
    if virtual < 1:
        raise ValueError(f"--virtual-stages must be >= 1, got {virtual}")
    if virtual > 1 and name != "interleaved":
        raise ValueError(f"--virtual-stages {virtual} needs --pipeline-schedule interleaved")
    if name == "interleaved" and microbatches % stages:
        raise ValueError(f"interleaved schedule: --microbatches {microbatches} must be a "
                         f"multiple of the {stages} stages")


# --------------------------------------------------------------- what the table implies
def in_flight(s: Schedule) -> np.ndarray:
    """(stages,) the most residual sets (micro-batch x chunk activations kept for a
    backward) each stage holds at once: taken at F, given back at B (zb-h1: at W)."""
    out = np.zeros(s.stages, np.int64)
    release = s.wgt if s.split_backward else s.bwd
    for st in range(s.stages):
        held = peak = 0
        for t in range(s.ticks):
            held += s.fwd[t, st] != IDLE
            peak = max(peak, held)
            held -= release[t, st] != IDLE
        out[st] = peak
    return out


def tick_times(s: Schedule, t_f: float, t_b: float, t_w: float = 0.0,
               t_i: float | None = None) -> np.ndarray:
    """(ticks,) each tick's length in lockstep: its busiest stage's F + B (+ W) work.
    t_b is a whole backward; a split one costs t_i (default t_b - t_w) plus t_w."""
    t_back = (t_b - t_w if t_i is None else t_i) if s.split_backward else t_b
    work = (s.fwd != IDLE) * t_f + (s.bwd != IDLE) * t_back + (s.wgt != IDLE) * t_w
    return work.max(axis=1)


def lockstep_time(s: Schedule, t_f: float, t_b: float, t_w: float = 0.0,
                  t_i: float | None = None) -> float:
    """The step's modelled time: the sum over ticks of the busiest stage's work. With
    virtual stages, the costs are a whole stage's and each chunk costs 1/V of them."""
    v = s.virtual
    return float(tick_times(s, t_f / v, t_b / v, t_w / v,
                            None if t_i is None else t_i / v).sum())


def bubble(s: Schedule, t_f: float = 1.0, t_b: float = 2.0, t_w: float = 2.0 / 3.0,
           model=None) -> float:
    """The idle share of the stages' time: 1 - useful work / (P x modelled step time),
    in `model` (default `lockstep_time`; or `pairwise_time`). t_w (zb-h1): the weight
    matmuls' gradients, about a third of B (pipeline/split.py; ViT-B/16 measured 22.5 of
    B's 66.7 GFLOP), the rest of B being I."""
    useful = s.microbatches * (t_f + t_b)
    return 1.0 - useful / (model or lockstep_time)(s, t_f, t_b, t_w)


def messages(s: Schedule) -> int:
    """Point-to-point sends per stage per step that carry data (activations forward,
    cotangents backward), at most; what the program runs is `ticks.StaticPlan.sends`."""
    return int(2 * s.microbatches * s.virtual)


# ----------------------------------------------------------------------------- picture
def picture(s: Schedule, max_ticks: int = 26) -> str:
    """The table drawn tick by stage: `F3` forward of micro-batch 3, `B3` its backward
    (zb-h1: `I3` input gradient, `W3` weight gradient), `.` idle; with virtual stages the
    chunk follows the micro-batch (`F3b` = chunk 1)."""
    def cell(kind, m, c):
        return "" if m == IDLE else f"{kind}{m}" + ("abcdefgh"[c] if s.virtual > 1 else "")
    back = "I" if s.split_backward else "B"
    cells = [[cell("F", s.fwd[t, st], s.fwd_chunk[t, st])
              + cell(back, s.bwd[t, st], s.bwd_chunk[t, st])
              + cell("W", s.wgt[t, st], s.wgt_chunk[t, st]) or "."
              for t in range(min(s.ticks, max_ticks))] for st in range(s.stages)]
    width = max(len(c) for row in cells for c in row)
    lines = [f"    stage {st}: " + " ".join(c.ljust(width) for c in row).rstrip()
             + (" ..." if s.ticks > max_ticks else "") for st, row in enumerate(cells)]
    return "\n".join(lines)


def describe(depth: int, stages: int, microbatches: int, schedule: str = "gpipe",
             virtual: int = 1) -> str:
    """The stage assignment and the schedule's table as a picture, for the log at start."""
    per = depth // stages
    table = build(schedule, stages, microbatches, virtual)
    held = in_flight(table)
    lines = [f"pipeline: {stages} stages x {per} blocks, {schedule} schedule"
             + (f" ({virtual} chunks per stage)" if virtual > 1 else "")
             + f", {microbatches} micro-batches, {table.ticks} ticks, bubble "
             f"{bubble(table):.3f} in lockstep, {bubble(table, model=pairwise_time):.3f} with "
             f"pairwise sends (t_B = 2 t_F), residual sets held per stage "
             f"{'/'.join(str(int(h)) for h in held)}"]
    chunk = per // virtual
    for s in range(stages):
        parts = ["patch+class+position embedding"] if s == 0 else []
        # Chunk v of stage s is virtual stage vP + s: the blocks it runs, in order.
        runs = [(v * stages + s) * chunk for v in range(virtual)]
        parts.append("blocks " + ", ".join(
            (f"{a}" if chunk == 1 else f"{a}..{a + chunk - 1}")
            + (f" ({'abcdefgh'[v]})" if virtual > 1 else "") for v, a in enumerate(runs)))
        if s == stages - 1:
            parts.append("final LayerNorm, head, loss")
        lines.append(f"    stage {s}: " + ", ".join(parts))
    lines.append("  schedule, tick by stage (F forward, B backward, I input and W weight "
                 "gradient, . idle):")
    lines.append(picture(table))
    return "\n".join(lines)


# ------------------------------------------------------------- what the program needs
def arrivals(s: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """(ticks, stages) bool each: where a stage receives an activation from the previous
    stage (its F ran that tick, for a later virtual stage), and where it receives an input
    cotangent from the next one (its B ran that tick, for an earlier virtual stage). The
    value arrives at the end of the tick and is kept until the next one arrives."""
    P, V = s.stages, s.virtual
    fwd = np.zeros((s.ticks, P), bool)
    bwd = np.zeros((s.ticks, P), bool)
    for t in range(s.ticks):
        for st in range(P):
            if s.fwd[t, st] != IDLE and s.fwd_chunk[t, st] * P + st < P * V - 1:
                fwd[t, (st + 1) % P] = True
            if s.bwd[t, st] != IDLE and s.bwd_chunk[t, st] * P + st > 0:
                bwd[t, (st - 1) % P] = True
    return fwd, bwd


def check_sends(s: Schedule) -> None:
    """RuntimeError unless every value sent is read before the next one from the same
    neighbour arrives: the program keeps one receive buffer each way."""
    P = s.stages
    arrive = dict(zip("FB", arrivals(s)))
    at = {}  # (kind, micro, virtual stage) -> tick
    for t in range(s.ticks):
        for st in range(P):
            for kind, mb, ch in (("F", s.fwd[t, st], s.fwd_chunk[t, st]),
                                 ("B", s.bwd[t, st], s.bwd_chunk[t, st])):
                if mb != IDLE:
                    at[(kind, int(mb), int(ch) * P + st)] = t
    for (kind, i, j), t in at.items():
        src = (kind, i, j - 1 if kind == "F" else j + 1)
        if src not in at:  # stage 0's first chunk; the last virtual stage's B
            continue
        sent, st = at[src], j % P
        if not sent < t or arrive[kind][sent + 1:t, st].any():
            raise RuntimeError(f"{s.name}: {'forward' if kind == 'F' else 'backward'} of "
                               f"micro-batch {i} at virtual stage {j} (tick {t}) does not "
                               f"find its input (sent at tick {sent})")


@dataclasses.dataclass(frozen=True, eq=False)
class Slots:
    """A ring of `size` slots: `of[s]` maps each (micro-batch, chunk) set stage s holds to
    its slot (a set keeps its slot from its take to its release)."""
    size: int
    of: tuple

    def at(self, work: np.ndarray, chunk: np.ndarray) -> np.ndarray:
        """(ticks, stages) int32: the slot of the set each entry of `work` names (0 idle)."""
        out = np.zeros(work.shape, np.int32)
        for t, st in zip(*np.nonzero(work != IDLE)):
            out[t, st] = self.of[st][(int(work[t, st]), int(chunk[t, st]))]
        return out


def _allocate(s: Schedule, take, take_chunk, release, release_chunk) -> Slots:
    """Slots for the sets taken where `take` names a micro-batch and given back where
    `release` does: each take gets the lowest free slot, a release frees its set's slot
    after the takes of its tick (a tick writes before it reads). Sets held at once never
    share a slot, and the ring is exactly as large as the most sets held at once: a new
    slot is opened only when every open one is live."""
    of, size = [], 1
    for st in range(s.stages):
        free, live, slot_of = [], {}, {}
        for t in range(s.ticks):
            if take[t, st] != IDLE:
                slot = min(free) if free else len(live)
                if free:
                    free.remove(slot)
                key = (int(take[t, st]), int(take_chunk[t, st]))
                live[key] = slot_of[key] = slot
                size = max(size, slot + 1)
            if release[t, st] != IDLE:
                free.append(live.pop((int(release[t, st]), int(release_chunk[t, st]))))
        of.append(slot_of)
    return Slots(size, tuple(of))


def residual_slots(s: Schedule) -> Slots:
    """The residual ring: a set is taken at F and given back at B (zb-h1: at W)."""
    release, chunk = (s.wgt, s.wgt_chunk) if s.split_backward else (s.bwd, s.bwd_chunk)
    return _allocate(s, s.fwd, s.fwd_chunk, release, chunk)


def cotangent_slots(s: Schedule) -> Slots:
    """zb-h1: the ring of output cotangents I keeps for W (taken at I, given back at W);
    one slot, never written, for the other schedules."""
    if not s.split_backward:
        return Slots(1, tuple({} for _ in range(s.stages)))
    return _allocate(s, s.bwd, s.bwd_chunk, s.wgt, s.wgt_chunk)


def ring_size(s: Schedule) -> int:
    """The residual ring's slots: the most sets any stage holds at once."""
    return residual_slots(s).size


def kept_size(s: Schedule) -> int:
    """zb-h1: the slots of the ring of output cotangents (1 for the other schedules)."""
    return cotangent_slots(s).size


@dataclasses.dataclass(frozen=True)
class Segment:
    """Ticks start .. stop - 1, run by one `lax.scan` of `period` ticks a step. `sends`
    holds, for each tick of a period, its collective-permutes: (what, pairs) with what
    "f" (the F's output), "b" (B's input cotangent) or "fb" (each stage sends the one
    its tick made: a stage pair that swaps); `phases` the work any of its ticks runs."""
    start: int
    stop: int
    period: int
    sends: tuple
    phases: str


def _one_to_one(pairs) -> bool:
    return len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs})


def _runs(f, b, phases, T: int) -> tuple:
    """The ticks cut into runs that send the same ways (forward, back, both or none),
    one scan of one tick a step each, each way's pairs one send."""
    out, t = [], 0
    while t < T:
        z = t
        while z < T and (bool(f[z]), bool(b[z])) == (bool(f[t]), bool(b[t])):
            z += 1
        ways = [(w, tuple(sorted(set().union(*sets[t:z])))) for w, sets in (("f", f), ("b", b))]
        out.append(Segment(t, z, 1, (tuple(x for x in ways if x[1]),), phases(t, z)))
        t = z
    return tuple(out)


def _swaps(f, b, phases, T: int) -> tuple | None:
    """Where stage pairs only swap: one scan of two ticks a step over the ticks that send
    (rounded up to pairs), each tick one send of whichever value each stage made, then a
    scan of the rest (zb-h1's last W's, which send nothing). None where pairs do not."""
    sending = 1 + max((t for t in range(T) if f[t] or b[t]), default=-1)
    paired = sending + sending % 2
    swaps = [set().union(*(f[t] | b[t] for t in range(k, paired, 2))) for k in (0, 1)]
    if paired > T or not all(_one_to_one(list(f[t]) + list(b[t])) for t in range(paired)) \
            or not all(_one_to_one(x) for x in swaps):
        return None
    rest = (Segment(paired, T, 1, ((),), phases(paired, T)),) if paired < T else ()
    return (Segment(0, paired, 2, tuple(((("fb", tuple(sorted(x))),) if x else ())
                                        for x in swaps), phases(0, paired)),) + rest


def segments(schedule: Schedule) -> tuple:
    """The table's ticks cut into scans whose sends are the same at every step: of the
    two cuts, runs of ticks that send the same ways (GPipe, interleaved, evaluation: a
    ramp up, a steady state, a ramp down, a tail) and, where stage pairs only swap, one
    scan of two ticks a step (1F1B, zb-h1, whose ways alternate tick by tick), the one
    with fewer sends among those of at most four scans, so the scans do not grow with
    the micro-batches."""
    P, V, T = schedule.stages, schedule.virtual, schedule.ticks
    fwd, bwd, wgt = schedule.fwd, schedule.bwd, schedule.wgt
    f = [{(s, (s + 1) % P) for s in range(P) if fwd[t, s] != IDLE
          and schedule.fwd_chunk[t, s] * P + s < P * V - 1} for t in range(T)]
    b = [{(s, (s - 1) % P) for s in range(P) if bwd[t, s] != IDLE
          and schedule.bwd_chunk[t, s] * P + s > 0} for t in range(T)]

    def phases(a, z):
        return "".join(k for k, arr in zip("FBW", (fwd, bwd, wgt)) if (arr[a:z] != IDLE).any())

    cuts = [c for c in (_runs(f, b, phases, T), _swaps(f, b, phases, T)) if c]
    few = [c for c in cuts if len(c) <= 4] or cuts
    return min(few, key=sends)


def sends(segments) -> int:
    """Collective-permutes per step of a program run as `segments`."""
    return sum((g.stop - g.start) // g.period * sum(len(x) for x in g.sends) for g in segments)


def pairwise_time(s: Schedule, t_f: float, t_b: float, t_w: float = 0.0,
                  t_i: float | None = None) -> float:
    """The step's modelled time where each send is a meeting of its two stages only (as
    NCCL's send / recv are), not of the whole mesh: a stage's tick ends when its work is
    done and, for each pair it sends or receives on, its partner's is. Costs as in
    `lockstep_time` (a whole stage's; 1/V of them per chunk)."""
    v = s.virtual
    t_back = ((t_b - t_w if t_i is None else t_i) if s.split_backward else t_b) / v
    work = ((s.fwd != IDLE) * t_f / v + (s.bwd != IDLE) * t_back + (s.wgt != IDLE) * t_w / v)
    end = np.zeros(s.stages)
    for g in segments(s):
        for t in range(g.start, g.stop):
            ready = end + work[t]
            end = ready.copy()
            for _, pairs in g.sends[(t - g.start) % g.period]:
                for a, b in pairs:
                    end[a] = end[b] = max(end[a], end[b], ready[a], ready[b])
    return float(end.max())


def summary(name: str, stages: int, microbatches: int, virtual: int = 1) -> dict:
    """What --plan reports of a schedule, from its table (t_B = 2 t_F, t_W = t_B / 3): ticks,
    bubble, residual sets the busiest stage holds, and what 1F1B would hold instead."""
    s = build(name, stages, microbatches, virtual)
    return {"schedule": name, "stages": stages, "microbatches": microbatches,
            "virtual": virtual, "ticks": s.ticks, "bubble": bubble(s),
            "held": int(in_flight(s).max()),
            "held_1f1b": int(in_flight(build("1f1b", stages, microbatches)).max())}
