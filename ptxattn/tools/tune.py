"""Search the Hopper forward's tile schedules on this GPU and write the fastest into a table.

    python -m ptxattn tune --quick --output ptxattn/tuned/sm_90a.json   # the shipped table
    python -m ptxattn tune                  # every schedule that fits; into the user's table
    python -m ptxattn tune --dry-run ...    # no GPU, no compiles: the candidates, step 1's cuts
    python -m ptxattn tune --dry-run --compile ...  # no GPU: steps 1 and 2's cuts

What is searched: the fields of ``hopper.Schedule`` (keys per K/V tile, ring stages, two or
three consumer warpgroups, persistent grid, L2 sections, the stale-max softmax for 16-bit inputs,
Q in registers and the producer/consumer register split for FP8, the intra-warpgroup overlap of
the softmax with P V or blocks in turn), for every (family, dtype, head_dim, causal) asked for,
and picked per seqlen_k bucket (``tune_table``). ``--quick`` tries the built-in schedule and its
neighbours (each field moved one step); otherwise every combination is tried; the shipped
table's schedules for the key are always tried too. A run writes its keys into the table and
keeps the others.

1. Pruned on the CPU, with the accounting of ../shared seed 002 as the kernel does it
   (``Sm90Config`` in ptx_src/mainloops/fwd_sm90.cuh): shared memory
   (``hopper.schedule_smem_bytes`` against ``hopper.SMEM_LIMIT``), then a register estimate
   per consumer thread (the S, P, O and Q fragments against what setmaxnreg gives a consumer
   thread, less seed 002's allowance for everything else). A schedule over the estimate
   spills; one under it may still spill.
2. The survivors compiled by NVRTC in a process pool (the compile cache keeps them); a build
   that spills, serializes its wgmmas or does not compile is dropped, with the kernels CLI's
   checks (``python -m ptxattn kernels``). It shows a progress bar when its output is a
   terminal, else a line "compiled 40/161" on stderr now and then. --dry-run stops before this
   step (listing every candidate, with the reasons of step 1 for those dropped): over every key
   that takes about a second, where compiling the kernels kept (some 1,500) takes a quarter of
   an hour on 2 cores with an empty compile cache. --dry-run --compile runs this step too, and
   stops there.
3. Timed on the GPU, bucket by bucket, on the benchmarks' shapes: batch * seqlen = 16384 tokens,
   heads * head_dim = 2048, two seqlens per bucket (BUCKET_SEQLENS). Each candidate's
   output is first compared with the built-in schedule's on the same inputs (a schedule that
   computes something else is dropped), then all are timed in turns (``timing``); where there
   are more than FINALISTS, only the fastest FINALISTS of a short heat (geometric mean over the
   bucket's shapes) are. Every time is printed.
4. The winner of each key is the fastest (geometric mean over the bucket's shapes), unless it
   beats the key's incumbent by less than --min-gain (run-to-run noise on an H100 is 3-5%), in
   which case the incumbent stays. The incumbent is the schedule the table being written holds
   for the key, or the built-in one: so a new table starts from the built-in schedules, and
   tuning a table again changes only the keys that measured faster, not every key whose
   fastest moved within the noise (each moved key can add a compiled variant). The winner
   goes into the table with what was measured:

   ``tflops`` (the winner's), ``builtin_tflops``, ``shapes`` (batch, seqlen, heads and TFLOP/s of
   each timed shape), ``runner_up`` (the best other candidate: its schedule and TFLOP/s),
   ``margin`` (tflops / runner-up's - 1; negative when the incumbent stayed although
   another was faster by less than --min-gain), ``measured_dtype`` (the dtype that was timed).

16-bit kernels differ between bfloat16 and float16 only in conversions: a dtype not listed in
--dtypes (default: bfloat16) gets the measured one's winners, compiled for it as well.
FP8 keys are measured with bfloat16 output and hold for float16 output too.

The table written holds the keys of this run and keeps the other keys it held; a lookup of
any key it lacks falls through to the next table (``tune_table``: PTXATTN_TUNE_TABLE, the
user's, the shipped one, the built-in schedules). Without --output it is the user's table,
``<compile cache>/tuned/<arch>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

from .. import runtime
from ..launchers import hopper_forward as hopper, tune_table
from ..launchers.hopper_forward import Schedule
from . import kernels

ARCH = hopper.ARCHS[0]
TOKENS = 16384  # batch * seqlen of every timed shape
WIDTH = 2048    # heads * head_dim
# Timed seqlens of each bucket.
BUCKET_SEQLENS = {"short": (512, 1024), "medium": (2048, 4096), "long": (8192, 16384)}
assert tuple(BUCKET_SEQLENS) == tune_table.BUCKET_NAMES

# Keys per tile the kernel has wgmma shapes for (wgmma.cuh: N = 64..256 in steps of 16;
# wgmma_fp8.cuh: 64, 128..256 in steps of 32, FP8's Vt rows being 64 or 128 keys wide).
BLOCK_N = {False: tuple(range(64, 257, 16)), True: (64, 128, 160, 192, 224, 256)}
STAGES = (2, 3, 4)
CONSUMERS = (2, 3)
# Registers an FP8 producer thread may keep (below 32 its V transposer spills).
PRODUCER_REGS = (32, 40, 56)
# Registers per consumer thread that seed 002 leaves for everything but the S, P, O (and Q)
# fragments: addresses, loop state, softmax row statistics.
REGISTER_ALLOWANCE = {2: 24, 3: 32}
# Largest |difference| from the built-in schedule's output, relative to that output's largest
# magnitude, that still counts as the same result: other tiles sum in another order, and FP8
# rounds P against running maxima that other tiles reach at other keys.
AGREEMENT = {False: 0.02, True: 0.05}
FINALISTS = 8  # the fastest of a heat, timed in full, when there are more candidates


@dataclasses.dataclass(frozen=True)
class Target:
    """One search: inputs of ``dtype`` (bfloat16, float16 or hopper.FP8), head_dim, causal."""
    dtype: str
    head_dim: int
    causal: bool

    @property
    def fp8(self) -> bool:
        return self.dtype == hopper.FP8

    @property
    def builtin(self) -> Schedule:
        return (hopper.SCHEDULES_FP8 if self.fp8 else hopper.SCHEDULES)[self.head_dim, self.causal]

    def __str__(self) -> str:
        family, dtype = hopper.tune_key(self.dtype)
        return f"{family} {dtype} d{self.head_dim} {'causal' if self.causal else 'non-causal'}"


def describe_build(s: Schedule) -> str:
    return (f"n{s.block_n} s{s.stages} c{s.consumers}{' smf' if s.stale_max_first else ''}"
            f"{' qr' if s.q_in_registers else ''}"
            f"{f' p{s.producer_regs}' if s.producer_regs else ''}"
            f"{'' if s.intra_overlap else ' inturn'}")


def describe_grid(s: Schedule) -> str:
    return f"{'persistent' if s.persistent else 'grid'}{' l2' if s.l2_sections else ''}"


def describe(s: Schedule) -> str:
    return f"{describe_build(s)} {describe_grid(s)}"


def _build(s: Schedule) -> Schedule:
    """The part of a schedule that is compiled in: schedules differing only in the grid
    (persistent, l2_sections) run one kernel."""
    return dataclasses.replace(s, persistent=True, l2_sections=False)


# ---------------------------------------------------------------------------------------------
# Candidates and pruning (CPU)


def register_estimate(target: Target, s: Schedule) -> tuple[int, int]:
    """(registers a consumer thread holds in fragments, registers it may hold them in), as
    Sm90Config counts them (hopper.schedule_registers: kFragmentRegs; kConsumerRegs, what
    setmaxnreg gives a consumer thread once the producer warpgroup has dropped to its own) less
    REGISTER_ALLOWANCE."""
    fragments, _, consumer = hopper.schedule_registers(target.head_dim, s, target.fp8)
    return fragments, consumer - REGISTER_ALLOWANCE[s.consumers]


def cpu_problem(target: Target, s: Schedule) -> str | None:
    """Why ``s`` cannot run well for ``target`` by the accounting alone, or None."""
    smem = hopper.schedule_smem_bytes(target.head_dim, s, target.fp8)
    if smem > hopper.SMEM_LIMIT:
        return f"shared memory {smem} B > {hopper.SMEM_LIMIT} B"
    fragments, budget = register_estimate(target, s)
    if fragments > budget:
        return f"registers: {fragments} in fragments > {budget} a consumer thread has for them"
    return None


def candidates(target: Target, quick: bool,
               incumbents: dict[str, Schedule] | None = None) -> list[Schedule]:
    """The schedules to try, the built-in one first: its neighbours (--quick) or every
    combination of the fields, and always the shipped table's schedules for the target, so that
    a user's table, which a lookup reads first, never holds a slower schedule than the shipped
    one would have given, and the ``incumbents`` (bucket -> schedule) the winners must beat."""
    family, dtype = hopper.tune_key(target.dtype)
    shipped = [Schedule(**fields) for fields in
               tune_table.shipped(ARCH, family, dtype, target.head_dim, target.causal).values()]
    held = list((incumbents or {}).values())
    return list(dict.fromkeys(_searched(target, quick) + shipped + held))


def incumbents(target: Target, output: Path) -> dict[str, Schedule]:
    """Bucket -> the schedule the table in ``output`` holds for the target's key there (none
    for a table that does not exist, cannot be read or is another arch's)."""
    family, dtype = hopper.tune_key(target.dtype)
    try:
        held = tune_table.schedules_in(output, ARCH)
    except ValueError:
        return {}
    found = {}
    for bucket in tune_table.BUCKET_NAMES:
        fields = held.get((family, dtype, target.head_dim, target.causal, bucket))
        try:
            found[bucket] = Schedule(**fields)
        except TypeError:  # none, or fields of another ptxattn's Schedule: no incumbent
            continue
    return found


def _searched(target: Target, quick: bool) -> list[Schedule]:
    base = target.builtin
    if not quick:
        # The stale-max softmax is for 16-bit inputs (FP8 keeps the exact running max), Q in
        # registers for FP8 (its A fragment layout).
        flags = [(False, False), (False, True)] if target.fp8 else [(False, False), (True, False)]
        # Blocks in turn (no intra-warpgroup overlap) take the max pass.
        every = [split for n in BLOCK_N[target.fp8] for stages in STAGES
                 for consumers in CONSUMERS for smf, qr in flags
                 for overlap in ((True,) if smf else (True, False))
                 for persistent in (True, False) for l2 in (False, True)
                 for split in register_splits(target, Schedule(
                     block_n=n, stages=stages, persistent=persistent, l2_sections=l2,
                     consumers=consumers, stale_max_first=smf, q_in_registers=qr,
                     intra_overlap=overlap))]
        return list(dict.fromkeys([base] + every))
    sizes = BLOCK_N[target.fp8]
    at = sizes.index(base.block_n)
    moves = [dataclasses.replace(base, block_n=sizes[i]) for i in (at - 1, at + 1)
             if 0 <= i < len(sizes)]
    moves += [dataclasses.replace(base, stages=n) for n in (base.stages - 1, base.stages + 1)
              if n in STAGES]
    # The other consumer count with the most keys per tile that fit its register budget
    # (at head_dim 128 three consumer warpgroups fit 80 keys, not 128).
    others = [dataclasses.replace(base, consumers={2: 3, 3: 2}[base.consumers], block_n=n)
              for n in sizes if n <= base.block_n]
    fitting = [s for s in others if cpu_problem(target, s) is None]
    moves += fitting[-1:]
    moves += [dataclasses.replace(base, persistent=not base.persistent),
              dataclasses.replace(base, l2_sections=not base.l2_sections)]
    if target.fp8:
        moves.append(dataclasses.replace(base, q_in_registers=not base.q_in_registers))
        moves += register_splits(target, base)[1:]
    else:
        moves.append(dataclasses.replace(base, stale_max_first=not base.stale_max_first))
    moves.append(dataclasses.replace(base, intra_overlap=not base.intra_overlap,
                                     stale_max_first=False))
    return list(dict.fromkeys([base] + moves))


def register_splits(target: Target, s: Schedule) -> list[Schedule]:
    """``s``, and for FP8 ``s`` with each other split of the registers between the producer
    and the consumers (PRODUCER_REGS), one per register count a consumer thread gets (two
    producer counts that leave the consumers the same registers build the same kernel)."""
    if not target.fp8:
        return [s]
    splits = {hopper.schedule_registers(target.head_dim, s, True)[2]: s}
    for regs in PRODUCER_REGS:
        other = dataclasses.replace(s, producer_regs=regs)
        splits.setdefault(hopper.schedule_registers(target.head_dim, other, True)[2], other)
    return list(splits.values())


def build_specs(target: Target, build: Schedule) -> list:
    """The kernels a build needs: for 16-bit inputs, both types (one's winners go to the other
    too); for FP8, bfloat16 output and, when its tiles straddle 128 keys, the tiles taken
    instead for per-block k descales."""
    if not target.fp8:
        return [hopper.spec(dtype, target.head_dim, target.causal, schedule=build)
                for dtype in hopper.DTYPES]
    specs = [hopper.spec(hopper.FP8, target.head_dim, target.causal, schedule=build)]
    tiles = hopper._fp8_key_block_scaled_tiles(build, target.head_dim)
    if tiles is not None:
        specs.append(hopper.spec(hopper.FP8, target.head_dim, target.causal, tiles,
                                 schedule=build))
    return specs


@dataclasses.dataclass
class Plan:
    """One target's candidates, for each build why it was dropped (None: kept), and for each
    bucket the schedule a winner must beat by --min-gain (the built-in one where the table
    holds none)."""
    target: Target
    candidates: list[Schedule]
    dropped: dict[Schedule, str | None]
    incumbents: dict[str, Schedule]

    def incumbent(self, bucket: str) -> Schedule:
        return self.incumbents.get(bucket, self.target.builtin)

    def kept(self) -> list[Schedule]:
        return [s for s in self.candidates if self.dropped[_build(s)] is None]


def plan(targets: list[Target], quick: bool, jobs: int, output: Path,
         compile: bool = True) -> list[Plan]:
    """Candidates of every target, pruned by the accounting, then (``compile``) by compiling
    what is left in ``jobs`` processes; the incumbents from the table in ``output``."""
    plans, needs = [], {}
    for target in targets:
        held = incumbents(target, output)
        schedules = candidates(target, quick, held)
        dropped = {}
        for build in dict.fromkeys(_build(s) for s in schedules):
            dropped[build] = cpu_problem(target, build)
            if dropped[build] is None:
                needs[target, build] = build_specs(target, build)
        plans.append(Plan(target, schedules, dropped, held))
    specs = list(dict.fromkeys(spec for specs in needs.values() for spec in specs))
    if not compile:
        print(f"not compiled: the {len(specs)} kernels of the builds kept (--compile compiles "
              f"them and drops the builds that spill, serialize their wgmmas or do not "
              f"compile)", flush=True)
        return plans
    print(f"compiling {len(specs)} kernels in {jobs} processes (those in the compile cache "
          f"{runtime.cache_dir()} are read from it)", flush=True)
    start = time.perf_counter()
    # Spawned, not forked: a process that already runs CUDA (tests, notebooks) has threads,
    # which a fork would copy in whatever state they are.
    rows = dict(zip(specs, kernels.for_each_spec(_budget_row, specs, ARCH, jobs,
                                                 kernels.progress(len(specs)),
                                                 multiprocessing.get_context("spawn"))))
    unchecked = sum(bool(row.get("unchecked")) for row in rows.values())
    print(f"compiled in {time.perf_counter() - start:.0f} s" + (
        f"; NVRTC {runtime.nvrtc_version()} gave no ptxas report for {unchecked}, whose spills "
        f"go unchecked" if unchecked else ""), flush=True)
    by_target = {p.target: p for p in plans}
    for (target, build), build_kernels in needs.items():
        problems = [f"{spec.name}: {problem}" for spec in build_kernels
                    if not rows[spec].get("unchecked")
                    for problem in kernels.budget_problems(rows[spec])]
        by_target[target].dropped[build] = "; ".join(problems) or None
    return plans


def _budget_row(spec: runtime.KernelSpec, arch: str) -> dict:
    """The kernels CLI's row of ``spec`` (registers, spills, shared memory, or the compile
    error), or {"unchecked": True} for a kernel that compiled without a ptxas report, which
    NVRTC 13.0 leaves out of some logs: it may run, but its budgets cannot be read."""
    try:
        runtime.compile(spec, arch).reported()
    except runtime.CompileError as err:  # kernels.budget_row's row, without compiling again
        return {"name": spec.name, "arch": arch, "error": err.log}
    except runtime.PtxattnError:
        return {"name": spec.name, "arch": arch, "unchecked": True}
    return kernels.budget_row(spec, arch)


def print_plan(plans: list[Plan]) -> None:
    """Each target's builds, each with why it was dropped or the grids it is tried with."""
    for p in plans:
        print(f"{p.target}: {len(p.candidates)} candidates in {len(p.dropped)} builds, "
              f"{len(p.kept())} candidates kept")
        grids = {}
        for s in p.candidates:
            grids.setdefault(_build(s), []).append(describe_grid(s))
        for build, reason in p.dropped.items():
            label = describe_build(build) + (" (built-in)" if build == _build(p.target.builtin)
                                             else "")
            print(f"  {label:26} "
                  f"{'kept: ' + ', '.join(grids[build]) if reason is None else reason}")


# ---------------------------------------------------------------------------------------------
# Timing (GPU)


@dataclasses.dataclass
class Shape:
    batch: int
    seqlen: int
    heads: int


def bucket_shapes(head_dim: int, bucket: str) -> list[Shape]:
    return [Shape(TOKENS // seqlen, seqlen, WIDTH // head_dim) for seqlen in BUCKET_SEQLENS[bucket]]


def _launch_overrides(target: Target, s: Schedule, shape: Shape) -> dict:
    """hopper.launcher's overrides that run ``s`` whatever the tables say."""
    itemsize = 1 if target.fp8 else 2
    sections = (hopper.section_heads(shape.batch, shape.heads, shape.heads, shape.seqlen,
                                     target.head_dim, itemsize) if s.l2_sections else 1)
    return dict(tiles=(s.block_n, s.stages), consumers=s.consumers,
                stale_max_first=s.stale_max_first, q_in_registers=s.q_in_registers,
                producer_regs=s.producer_regs, intra_overlap=s.intra_overlap,
                persistent=s.persistent, sections=sections)


class ShapeRun:
    """Random q, k, v of one shape (quantized per (batch, head) for FP8), an output and an LSE
    buffer, and the launch of each schedule on them that computes what the first one does."""

    def __init__(self, target: Target, shape: Shape, seed: int, schedules: list[Schedule]):
        import cupy

        from .. import fp8
        from .timing import attention_flops

        dims = (shape.batch, shape.seqlen, shape.heads, target.head_dim)
        rng = cupy.random.default_rng(seed)
        q, k, v = (rng.standard_normal(dims, dtype=cupy.float32).astype(
            "bfloat16" if target.fp8 else target.dtype) for _ in range(3))
        descales = None
        if target.fp8:
            q8, k8, v8, scales = fp8.quantize_qkv(q, k, v, granularity="head")
            descales = tuple(fp8.descale_operand(scales[f"{name}_descale"], shape.batch,
                                                 shape.heads, shape.seqlen)
                             for name in ("q", "k", "v"))
            q, k, v = q8.bytes, k8.bytes, v8.bytes
        out = cupy.empty(dims, dtype="bfloat16" if target.fp8 else target.dtype)
        lse = cupy.empty((shape.batch, shape.heads, shape.seqlen), dtype=cupy.float32)
        self.flops = attention_flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen,
                                     target.head_dim, target.causal)
        # Schedules that launch the same (L2 sections of a single pair, say) share one launch.
        self.key = {s: tuple(sorted(_launch_overrides(target, s, shape).items()))
                    for s in schedules}
        self.launches, self.wrong, reference = {}, {}, None
        for s in schedules:
            if self.key[s] in self.launches:
                continue
            launch = hopper.launcher(q, k, v, out, lse, causal=target.causal,
                                     softmax_scale=target.head_dim ** -0.5, descales=descales,
                                     **dict(self.key[s]))
            out.fill(float("nan"))
            launch()
            result = out.astype(cupy.float32)
            if reference is None:
                reference, scale = result, float(cupy.abs(result).max())
            difference = float(cupy.abs(result - reference).max())
            if not difference <= AGREEMENT[target.fp8] * scale:  # NaN fails too
                self.wrong[s] = (f"wrong results at seqlen {shape.seqlen}: differs from "
                                 f"{describe(schedules[0])}'s by {difference:.3g} (whose "
                                 f"largest value is {scale:.3g})")
                continue
            self.launches[self.key[s]] = launch

    def tflops(self, schedules: list[Schedule], **timing) -> dict[Schedule, float]:
        """TFLOP/s of each schedule, timed in turns (timing.time_ms_interleaved's arguments)."""
        from .timing import time_ms_interleaved

        ms = time_ms_interleaved({self.key[s]: self.launches[self.key[s]] for s in schedules},
                                 **timing)
        return {s: self.flops / ms[self.key[s]] / 1e9 for s in schedules}


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


@dataclasses.dataclass
class Outcome:
    """A key's measurements: TFLOP/s on each shape of every schedule timed in full, the winner
    and the best other."""
    target: Target
    bucket: str
    shapes: list[Shape]
    tflops: dict[Schedule, list[float]]
    incumbent: Schedule
    winner: Schedule
    runner_up: Schedule | None

    def mean(self, s: Schedule) -> float:
        return _geomean(self.tflops[s])


def pick_winner(means: dict[Schedule, float], incumbent: Schedule, min_gain: float) -> Schedule:
    """The fastest of ``means`` (schedule -> TFLOP/s), or ``incumbent`` where it was timed and
    the fastest beats it by less than the fraction ``min_gain``."""
    fastest = max(means, key=means.get)
    if incumbent in means and means[fastest] < means[incumbent] * (1 + min_gain):
        return incumbent
    return fastest


def measure(target: Target, bucket: str, schedules: list[Schedule], repeats: int,
            min_gain: float, progress: str, incumbent: Schedule) -> Outcome | None:
    """Times ``schedules`` on the bucket's shapes, printing every result; None if none ran."""
    shapes = bucket_shapes(target.head_dim, bucket)
    print(f"{progress} {target} {bucket}: " + ", ".join(
        f"batch {x.batch} seqlen {x.seqlen}" for x in shapes) +
        f", heads {shapes[0].heads}; {len(schedules)} candidates", flush=True)
    runs = [ShapeRun(target, shape, seed, schedules) for seed, shape in enumerate(shapes)]
    notes = {s: "; ".join(run.wrong[s] for run in runs if s in run.wrong)
             for s in schedules if any(s in run.wrong for run in runs)}
    finalists = [s for s in schedules if s not in notes]

    def launches_of(s):
        return tuple(run.key[s] for run in runs)

    if len(set(map(launches_of, finalists))) > FINALISTS:
        heats = [run.tflops(finalists, warmup=1, repeats=3, launches=3) for run in runs]
        heat = {s: _geomean(h[s] for h in heats) for s in finalists}
        ranked = sorted(finalists, key=heat.get, reverse=True)
        fastest = list(dict.fromkeys(map(launches_of, ranked)))[:FINALISTS]
        # The yardstick of --min-gain and builtin_tflops' schedule run in the final too.
        fastest += [launches_of(s) for s in (incumbent, target.builtin) if s in heat]
        for s in ranked:
            if launches_of(s) not in fastest:
                notes[s] = f"{heat[s]:.1f} TFLOP/s in the heat, not a finalist"
        finalists = [s for s in finalists if launches_of(s) in fastest]
    if not finalists:
        for s, note in notes.items():
            print(f"  {_label(target, s):42} {note}")
        return None
    finals = [run.tflops(finalists, warmup=3, repeats=repeats) for run in runs]
    tflops = {s: [final[s] for final in finals] for s in finalists}
    outcome = Outcome(target, bucket, shapes, tflops, incumbent, incumbent, None)
    ranked = sorted(finalists, key=outcome.mean, reverse=True)
    print(f"  {'':42} " + " ".join(f"{'seqlen ' + str(x.seqlen):>20}" for x in shapes))
    for s in ranked:
        cells = (f"{run.flops / t / 1e9:8.4f} ms {t:6.1f}" for run, t in zip(runs, tflops[s]))
        print(f"  {_label(target, s, incumbent):42} {' '.join(cells)} TFLOP/s, "
              f"mean {outcome.mean(s):.1f}")
    for s, note in notes.items():
        print(f"  {_label(target, s, incumbent):42} {note}")
    outcome.winner = pick_winner({s: outcome.mean(s) for s in ranked}, incumbent, min_gain)
    outcome.runner_up = next((s for s in ranked if s != outcome.winner), None)
    return outcome


def _label(target: Target, s: Schedule, incumbent: Schedule | None = None) -> str:
    marks = [mark for mark, holds in (("built-in", s == target.builtin),
                                      ("in the table", s == incumbent != target.builtin)) if holds]
    return describe(s) + "".join(f" ({mark})" for mark in marks)


# ---------------------------------------------------------------------------------------------
# The table


def table_entry(outcome: Outcome, dtype: str) -> dict:
    """The table entry of ``outcome`` for inputs of ``dtype`` (the measured one, or the other
    16-bit type)."""
    family, key_dtype = hopper.tune_key(dtype)
    winner, runner_up = outcome.winner, outcome.runner_up
    mean = outcome.mean(winner)
    return {
        "family": family, "dtype": key_dtype, "head_dim": outcome.target.head_dim,
        "causal": outcome.target.causal, "bucket": outcome.bucket,
        "schedule": dataclasses.asdict(winner),
        "measured_dtype": hopper.tune_key(outcome.target.dtype)[1],
        "tflops": round(mean, 1),
        "builtin_tflops": (round(outcome.mean(outcome.target.builtin), 1)
                           if outcome.target.builtin in outcome.tflops else None),
        "shapes": [{"batch": shape.batch, "seqlen": shape.seqlen, "heads": shape.heads,
                    "tflops": round(t, 1)}
                   for shape, t in zip(outcome.shapes, outcome.tflops[winner])],
        "runner_up": (None if runner_up is None else
                      {"schedule": dataclasses.asdict(runner_up),
                       "tflops": round(outcome.mean(runner_up), 1)}),
        "margin": None if runner_up is None else round(mean / outcome.mean(runner_up) - 1, 4),
    }


def table(entries: list[dict], device: str | None, command: str) -> dict:
    return {"version": tune_table.VERSION, "arch": ARCH, "device": device,
            "measured": device is not None, "command": command, "entries": entries}


# ---------------------------------------------------------------------------------------------
# Command line


def _csv(kind):
    def items(text: str) -> tuple:
        return tuple(kind(item) for item in text.split(",") if item)
    items.__name__ = f"comma-separated {kind.__name__}"  # argparse's name for a bad value
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ptxattn tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="only the built-in schedule, its neighbours and the shipped table's")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU, no compiles: print the candidates and why each was "
                             "dropped by the shared-memory and register accounting")
    parser.add_argument("--compile", action="store_true",
                        help="with --dry-run: also compile the candidates, dropping those that "
                             "spill, serialize their wgmmas or do not compile")
    parser.add_argument("--output", help="the table to write (default: the user's, "
                                         "<compile cache>/tuned/<arch>.json)")
    parser.add_argument("--head-dims", type=_csv(int), default=hopper.HEAD_DIMS,
                        help="comma-separated (default: "
                             f"{','.join(map(str, hopper.HEAD_DIMS))}; FP8 keys those of "
                             f"{','.join(map(str, hopper.FP8_HEAD_DIMS))})")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction,
                        help="causal keys only (--causal) or non-causal only (--no-causal); "
                             "default both")
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction,
                        help="FP8 keys only (--fp8) or 16-bit only (--no-fp8); default both")
    parser.add_argument("--dtypes", type=_csv(str), default=("bfloat16",),
                        help="16-bit input types to time (default bfloat16; the other gets its "
                             "winners)")
    parser.add_argument("--buckets", type=_csv(str), default=tune_table.BUCKET_NAMES,
                        help="seqlen_k buckets, comma-separated (default: short,medium,long)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed samples per candidate and shape (default 10)")
    parser.add_argument("--min-gain", type=float, default=2.0,
                        help="percent a candidate must beat the key's incumbent (the written "
                             "table's schedule, else the built-in one) by to replace it "
                             "(default 2)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compile processes (default: one per CPU)")
    args = parser.parse_args(argv)
    if args.compile and not args.dry_run:
        parser.error("--compile goes with --dry-run (a tuning run always compiles)")
    for name, given, known in (("--head-dims", args.head_dims, hopper.HEAD_DIMS),
                               ("--dtypes", args.dtypes, tuple(hopper.DTYPES)),
                               ("--buckets", args.buckets, tune_table.BUCKET_NAMES)):
        unknown = [item for item in given if item not in known]
        if unknown or not given:
            parser.error(f"{name}: {', '.join(map(str, unknown)) or 'none given'}; choose "
                         f"from {', '.join(map(str, known))}")
    return args


def targets_of(args: argparse.Namespace) -> list[Target]:
    dtypes = {None: args.dtypes + (hopper.FP8,), True: (hopper.FP8,), False: args.dtypes}[args.fp8]
    causals = (False, True) if args.causal is None else (args.causal,)
    return [Target(dtype, head_dim, causal) for dtype in dtypes for head_dim in args.head_dims
            if dtype != hopper.FP8 or head_dim in hopper.FP8_HEAD_DIMS for causal in causals]


@kernels.quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = " ".join(["python -m ptxattn tune", *(sys.argv[1:] if argv is None else argv)])
    targets = targets_of(args)
    output = Path(args.output) if args.output else tune_table.user_path(ARCH)
    if args.dry_run:
        print_plan(plan(targets, args.quick, args.jobs, output, compile=args.compile))
        return 0

    # Before compiling, which takes minutes: no GPU, no tuning.
    from .doctor import gpu_problem
    problem = gpu_problem()
    if problem:
        print(f"ptxattn tune: cannot time without a GPU: {problem}\nptxattn tune: --dry-run "
              f"runs without one; python -m ptxattn doctor says what this machine has",
              file=sys.stderr)
        return 2
    if runtime.device_arch() != ARCH:
        print(f"ptxattn tune: this GPU is {runtime.device_arch()}; the tuned kernels run on "
              f"{ARCH}", file=sys.stderr)
        return 2
    plans = plan(targets, args.quick, args.jobs, output)
    print_plan(plans)

    import cupy
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    work = [(p, bucket) for p in plans for bucket in args.buckets]
    print(f"# {device} ({ARCH}): {len(work)} keys, median of {args.repeats} samples each",
          flush=True)
    start = time.perf_counter()
    outcomes = []
    for index, (p, bucket) in enumerate(work, 1):
        outcome = measure(p.target, bucket, p.kept(), args.repeats, args.min_gain / 100,
                          progress=f"[{index}/{len(work)}]", incumbent=p.incumbent(bucket))
        if outcome is None:
            print(f"  no candidate of {p.target} {bucket} ran", file=sys.stderr)
            continue
        outcomes.append(outcome)
    entries = []
    measured_16bit = [t.dtype for t in targets if not t.fp8]
    for outcome in outcomes:
        dtype = outcome.target.dtype
        entries.append(table_entry(outcome, dtype))
        if not outcome.target.fp8:  # the other 16-bit type, unless it was timed itself
            entries += [table_entry(outcome, other) for other in hopper.DTYPES
                        if other != dtype and other not in measured_16bit]
    print_summary(outcomes)
    entries = merged_entries(output, entries)
    tune_table.write(output, table(entries, device, command))
    print(f"wrote {len(entries)} entries to {output} ({time.perf_counter() - start:.0f} s "
          f"on the GPU)")
    return 0


def merged_entries(output: Path, entries: list[dict]) -> list[dict]:
    """``entries`` and the entries for other keys already in ``output`` (one of this arch that
    this ptxattn reads), so that a narrowed run (--head-dims, --fp8, --buckets ...) replaces
    only its own keys."""
    try:
        earlier = tune_table.read(output) if output.is_file() else None
    except ValueError:
        earlier = None
    if earlier is None or earlier["arch"] != ARCH:
        return entries
    new_keys = {tune_table.entry_key(e) for e in entries}
    return [e for e in earlier["entries"] if tune_table.entry_key(e) not in new_keys] + entries


def print_summary(outcomes: list[Outcome]) -> None:
    print(f"\n{'key':40} {'winner':34} {'TFLOP/s':>8} {'built-in':>8} {'before':>8} "
          f"{'margin':>7}")
    for o in outcomes:
        before = [f"{o.mean(s):8.1f}" if s in o.tflops else f"{'-':>8}"
                  for s in (o.target.builtin, o.incumbent)]
        margin = (f"{o.mean(o.winner) / o.mean(o.runner_up) - 1:+7.1%}" if o.runner_up
                  else f"{'-':>7}")
        print(f"{str(o.target) + ' ' + o.bucket:40} {describe(o.winner):34} "
              f"{o.mean(o.winner):8.1f} {' '.join(before)} {margin}")


if __name__ == "__main__":
    sys.exit(main())
