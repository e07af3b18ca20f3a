"""Launcher of the Hopper (sm_90a) forward kernel, ``ptx_src/kernels/fwd_sm90.cu``: fixed-length
16-bit attention (:func:`forward`), FP8 (the same function given descales) and the serving
build (:func:`serve`).

TMA descriptors are built here: 4-d maps over the (batch, seqlen, heads, head_dim) arrays with a
box of one swizzle span of head_dim columns (128 bytes: 64 16-bit or 128 e4m3 values; FP8
head_dim 64 takes its 64-byte rows whole with the 64-byte swizzle) by a tile of rows, so the
kernel loads a tile of bf16 head_dim 128 as two boxes; rows past seqlen are zero-filled by the
TMA unit. The output goes out through a TMA store of 64-row boxes (clipped at seqlen) where shared
memory has room to stage it, otherwise from registers with the strides passed here.

The same kernel source runs FP8 (e4m3) inputs (reached through ``ptxattn.fp8.attention``),
with its own tile schedules: its data take half the shared memory, and V is transposed in shared
memory into one more ring of buffers.

The serving build (``Sm90Config::kServing``) runs prefill: packed varlen batches and KV caches
(new query tokens over a contiguous cache's filled rows), with a local window, a logit softcap
and attention sinks (all run-time fields of one variant), at the fixed-length kernel's tiles,
splitting the keys (launchers/split_kv.py) when its tiles cannot fill the GPU. Decoding (a few
query rows a sequence, where reading K and V once per kv head matters more than the tensor
cores) and paged caches run in the portable decode launcher (launchers/portable_decode.py);
dispatch.py routes each call to one or the other by its features.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from .. import params, runtime
from . import kernel_head_dim, split_kv, tune_table

ARCHS = ("sm_90a",)
# Compiled head dims (a call of another head_dim runs on the next one up: kernel_head_dim).
# FP8 rows of 192 would end half-way through a 128-byte swizzle span of e4m3, so FP8 runs 192 on
# 256.
HEAD_DIMS = (64, 128, 192, 256)
FP8_HEAD_DIMS = (64, 128, 256)
# Builds whose v and output are narrower than q and k (16-bit): head_dim -> head_dim_v. A call
# whose head_dim runs on 192 and whose head_dim_v is at most 128 runs on the 192/128 build (the
# DeepSeek-V3 prefill shape), which holds O in 64 registers instead of 96 and reads V tiles of
# 128 columns; any other head_dim_v runs on its head_dim's build, V's columns zero-filled.
NARROW_V = {192: 128}
DTYPES = {"bfloat16": 1, "float16": 0}  # 16-bit inputs, and FP8's output types
FP8 = "float8_e4m3fn"

ROWS_PER_CONSUMER = 64  # query rows per consumer warpgroup; a tile has 2 or 3 of them
BOX_COLS = 64           # head_dim columns per TMA box (128 bytes of 16-bit data)

@dataclasses.dataclass(frozen=True)
class Schedule:
    """Tuned per (head_dim, causal) on an H100 SXM, bf16, batch*seqlen = 16384, seqlen 2048 and
    8192 (scripts/check_hopper.py --sweep; docs/design/scheduling.md#persistent-grid has the
    sweep).

    block_n, stages: keys per K/V tile and ring depth. Registers per consumer thread grow with
      head_dim / 2 (O) + 3/4 * block_n (S in fp32, P in 16 bits); shared memory is
      (block_m + 2 * stages * block_n) * head_dim * 2 bytes (227 KB at most), plus
      block_m * head_dim * 2 to stage the output for a TMA store when that still fits.
    persistent: one block per SM going through the tiles, instead of one block per tile; with
      causal masking, whose tiles differ in length, each block takes the next unclaimed tile
      as it frees up (dynamic order), otherwise the order is static.
    l2_sections: group (batch, head) pairs whose K/V fit in L2 together and run each group's
      query tiles longest-first across the group; otherwise pair by pair.
    consumers: consumer warpgroups, 64 query rows each (block_m = 64 * consumers). Three leave
      each warpgroup's softmax two others' GEMMs to hide under, where the GEMMs are short next
      to the softmax (head_dim 64), at 160 registers per consumer thread instead of 240.
    stale_max_first: after the first unmasked key block of a tile, the softmax first tries
      keeping the row maxima (no max pass; softmax.cuh), falling back to Q K^T again and the
      max pass for a block where a max grew by more than 2^8; the results are the same bits.
      Off for FP8, whose kernel keeps the exact running max (mainloops/fwd_sm90.cuh, Consumer::softmax), so
      the fast path would seldom hold.
    q_in_registers: FP8 only: each consumer warpgroup loads its Q tile into registers once per
      tile and Q K^T reads only K from shared memory, whose bandwidth the FP8 kernel keeps about
      as busy as the tensor cores. Costs head_dim / 8 registers per consumer thread: at head_dim
      64 (three consumers, 128 registers each) it lost 4%, at 256 it would spill.
    producer_regs: FP8 only: the registers each producer thread keeps (the producer warpgroup's
      other three warps transpose V), the consumers sharing the rest (schedule_registers); 0 for
      the kernel's own split. Below 32 the transposer spills.
    intra_overlap: a consumer warpgroup's softmax of key block j + 1 runs while its P V of block
      j is in flight (FlashAttention-3's intra-warpgroup overlap); off, each block's Q K^T,
      softmax and P V run in turn, so block j's P and block j + 1's S are never live together,
      and only the other consumer warpgroups' GEMMs hide the softmax. registers() counts P's
      registers either way (P and the S it is made from are live together), as the kernel's
      producer split does. Off takes the max pass (not stale_max_first) and is not a serving
      build's.
    """
    block_n: int
    stages: int
    persistent: bool
    l2_sections: bool
    consumers: int = 2
    stale_max_first: bool = False
    q_in_registers: bool = False
    producer_regs: int = 0
    intra_overlap: bool = True


SCHEDULES = {
    (64, False): Schedule(128, 2, persistent=True, l2_sections=False, consumers=3,
                          stale_max_first=True),
    (64, True): Schedule(128, 2, persistent=True, l2_sections=True, consumers=3),
    (128, False): Schedule(128, 2, persistent=True, l2_sections=False, stale_max_first=True),
    (128, True): Schedule(128, 2, persistent=True, l2_sections=False),
    # head_dim 192: O takes 96 registers, so S and P fit 112 keys (180 in fragments);
    # (128 + 4 * 112) rows of 384 bytes is 216 KB, no room to stage the output.
    (192, False): Schedule(112, 2, persistent=True, l2_sections=False),
    (192, True): Schedule(112, 2, persistent=True, l2_sections=False),
    (256, False): Schedule(64, 2, persistent=True, l2_sections=False),
    (256, True): Schedule(64, 2, persistent=True, l2_sections=False),
}

# The NARROW_V builds', per (head_dim, head_dim_v, causal). 192/128: O in 64 registers leaves S
# and P 128 keys, as at head_dim 128; Q, two stages of K (384-byte rows) and V (256-byte rows)
# take 208 KB, leaving room to stage the output 64 columns at a time.
SCHEDULES_NARROW_V = {
    (192, 128, False): Schedule(128, 2, persistent=True, l2_sections=False),
    (192, 128, True): Schedule(128, 2, persistent=True, l2_sections=False),
}

# FP8: block_n is 64 or a multiple of 32 from 128 (V is transposed into regions of 128 keys).
# Shared memory: (block_m + 2 * stages * block_n) * head_dim bytes for Q, K, V plus the Vt ring.
SCHEDULES_FP8 = {  # from scripts/check_fp8.py --sweep and its throughput table on an H100
    # head_dim 64 non-causal: two stages since the role split (+1-5% over three,
    # docs/design/scheduling.md#tuning-table).
    (64, False): Schedule(128, 2, persistent=True, l2_sections=False, consumers=3),
    (64, True): Schedule(128, 3, persistent=True, l2_sections=True, consumers=3),
    (128, False): Schedule(192, 2, persistent=True, l2_sections=False, q_in_registers=True),
    (128, True): Schedule(192, 2, persistent=True, l2_sections=False, q_in_registers=True),
    (256, False): Schedule(64, 3, persistent=True, l2_sections=False),
    (256, True): Schedule(64, 3, persistent=False, l2_sections=False),
}
# The serving build: as the fixed-length one, except that head_dim 64 runs two consumer
# warpgroups, since at three (160 registers each) the per-sequence bookkeeping spills.
SCHEDULES_SERVING = {
    **SCHEDULES,
    (64, False): Schedule(128, 2, persistent=True, l2_sections=False, stale_max_first=True),
    (64, True): Schedule(128, 2, persistent=True, l2_sections=False),
}
# FP8 with k descales that vary per 128 keys: a key block must lie inside one descale block, so
# block_n divides 128 (keys per tile, stages) per head_dim.
FP8_KEY_BLOCK_SCALED_TILES = {64: (128, 4), 128: (128, 2), 256: (64, 3)}

# K/V bytes that the heads of one scheduling section may keep in L2 together (H100: 50 MB).
L2_SECTION_BYTES = 32 << 20


def kernel_head_dims(head_dim: int, head_dim_v: int, fp8: bool = False) -> tuple[int, int]:
    """(head_dim, head_dim_v) of the build that runs a call of these head dims: the next
    compiled head_dim up, and its NARROW_V width where the call's values fit it."""
    dim = kernel_head_dim(FP8_HEAD_DIMS if fp8 else HEAD_DIMS, head_dim)
    narrow = None if fp8 else NARROW_V.get(dim)
    return (dim, narrow) if narrow is not None and head_dim_v <= narrow else (dim, dim)


SMEM_LIMIT = 227 * 1024  # dynamic shared memory one block may have on sm_90


def _smem_bytes(head_dim: int, block_n: int, stages: int, fp8: bool = False,
                out_round_cols: int = 0, consumers: int = 2,
                head_dim_v: int | None = None) -> int:
    block_m = ROWS_PER_CONSUMER * consumers
    head_dim_v = head_dim_v or head_dim
    out = block_m * out_round_cols * 2  # every consumer's 16-bit output staging
    if fp8:  # Q, K, V, and V transposed in regions of up to 128 keys; two more barriers a stage
        vt_bytes = -(-block_n // 128) * head_dim * min(block_n, 128)
        tiles = (block_m + 2 * stages * block_n) * head_dim + stages * vt_bytes
        barriers = 8 * (2 + 6 * stages) + 128  # + the Vt ring's; mailbox and v_end as below
    else:
        tiles = ((block_m + stages * block_n) * head_dim + stages * block_n * head_dim_v) * 2
        barriers = 8 * (2 + 4 * stages) + 128  # + the tile mailbox (two TileWork slots) and v_end
    return tiles + out + barriers + 1024  # + alignment of the base to the 1024-byte swizzle atom


def schedule_smem_bytes(head_dim: int, schedule: Schedule, fp8: bool,
                        head_dim_v: int | None = None) -> int:
    """The least shared memory a schedule's kernel needs (the output not staged): above
    SMEM_LIMIT it cannot run."""
    return _smem_bytes(head_dim, schedule.block_n, schedule.stages, fp8,
                       consumers=schedule.consumers, head_dim_v=head_dim_v)


def registers(head_dim: int, block_n: int, consumers: int, fp8: bool, q_in_registers: bool,
              producer_regs: int, head_dim_v: int | None = None) -> tuple[int, int, int]:
    """(registers a consumer thread holds in S, O, P and Q fragments, registers a producer
    thread keeps, registers a consumer thread gets): Sm90Config's kFragmentRegs, kProducerRegs
    and kConsumerRegs, which register_check_source holds this arithmetic to."""
    row_bytes = head_dim * (1 if fp8 else 2)
    score_accumulators = max(1, row_bytes // 128) if fp8 else 1
    p_regs = block_n // 8 if fp8 else block_n // 4
    q_regs = head_dim // 8 if q_in_registers else 0
    o_regs = (head_dim_v or head_dim) // 2
    fragments = score_accumulators * block_n // 2 + o_regs + p_regs + q_regs
    launch = 65536 // (128 * (1 + consumers)) // 8 * 8
    producer = producer_regs or (24 if not fp8 else 40 if fragments >= 200 else 56)
    consumer = ((1 + consumers) * launch - producer) // consumers // 8 * 8
    return fragments, producer, consumer


def schedule_registers(head_dim: int, schedule: Schedule, fp8: bool) -> tuple[int, int, int]:
    """registers() of a schedule's kernel."""
    return registers(head_dim, schedule.block_n, schedule.consumers, fp8,
                     schedule.q_in_registers, schedule.producer_regs)


@dataclasses.dataclass(frozen=True)
class Sm90Config:
    """The template arguments of one ``attn_fwd_sm90<Sm90Config<...>>`` instantiation, in its
    order (ptx_src/mainloops/fwd_sm90.cuh documents each)."""
    head_dim: int
    head_dim_v: int
    block_n: int
    stages: int
    fp8: bool
    bf16: bool
    causal: bool
    consumers: int
    out_round_cols: int  # output columns staged for TMA stores at a time (0: none)
    stale_max_first: bool
    q_in_registers: bool
    serving: bool
    producer_regs: int  # FP8: the producer's registers, 0 for the kernel's own split
    intra_overlap: bool
    smem_bytes: int

    @property
    def block_m(self) -> int:
        return ROWS_PER_CONSUMER * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)  # producer + consumer warpgroups


def variant(dtype: str, head_dim: int, causal: bool, tiles: tuple[int, int] | None = None,
            out_dtype: str = "bfloat16", consumers: int | None = None,
            stale_max_first: bool | None = None, q_in_registers: bool | None = None,
            serving: bool = False, seqlen_k: int | None = None,
            schedule: Schedule | None = None, producer_regs: int | None = None,
            intra_overlap: bool | None = None, head_dim_v: int | None = None) -> Sm90Config:
    """The kernel variant for inputs of ``dtype`` (bfloat16, float16 or float8_e4m3fn; FP8
    writes ``out_dtype``, 16-bit inputs their own type); ``serving``: the build that takes
    per-sequence lengths and the window (:func:`serve`). Its schedule is ``schedule``, or the
    tuned one for calls with ``seqlen_k`` keys (_schedule); the other arguments replace fields
    of it. ``head_dim_v``: a NARROW_V build's v width (default head_dim)."""
    fp8 = dtype == FP8
    head_dim_v = head_dim_v or head_dim
    if head_dim_v != head_dim and (fp8 or NARROW_V.get(head_dim) != head_dim_v):
        raise ValueError(f"no {dtype} build of head_dim {head_dim} with head_dim_v {head_dim_v} "
                         f"(16-bit NARROW_V: {NARROW_V})")
    schedule = schedule or _schedule(dtype, head_dim, causal, seqlen_k, serving, head_dim_v)
    block_n, stages = tiles or (schedule.block_n, schedule.stages)
    consumers = consumers or schedule.consumers
    if stale_max_first is None:
        stale_max_first = schedule.stale_max_first
    if q_in_registers is None:
        q_in_registers = schedule.q_in_registers
    if producer_regs is None:
        producer_regs = schedule.producer_regs
    if intra_overlap is None:  # the stale-max softmax runs in the overlapped mainloop only
        intra_overlap = schedule.intra_overlap or stale_max_first
    if not intra_overlap and (serving or stale_max_first):
        raise ValueError("intra_overlap=False runs fixed-length builds with the max pass only "
                         f"(serving={serving}, stale_max_first={stale_max_first})")
    if producer_regs and not fp8:
        raise ValueError(f"producer_regs is an FP8 schedule field (its producer warps transpose "
                         f"V); the {dtype} kernel's producer keeps 24, got {producer_regs}")
    out = out_dtype if fp8 else dtype
    # The output goes through shared memory and TMA stores, all its columns at once where there
    # is room for them, else half of them at a time (head_dim 256 with two stages of 64 keys),
    # else from registers.
    out_round_cols = next((cols for cols in (head_dim_v, head_dim_v // 2)
                           if cols % 64 == 0 and _smem_bytes(head_dim, block_n, stages, fp8, cols,
                                                             consumers, head_dim_v) <= SMEM_LIMIT),
                          0)
    smem = _smem_bytes(head_dim, block_n, stages, fp8, out_round_cols, consumers, head_dim_v)
    return Sm90Config(head_dim, head_dim_v, block_n, stages, fp8, bool(DTYPES[out]), causal,
                      consumers,
                      out_round_cols, stale_max_first, q_in_registers, serving, producer_regs,
                      intra_overlap, smem)


def spec_of(v: Sm90Config, out_dtype: str) -> runtime.KernelSpec:
    return runtime.KernelSpec(
        name=(f"fwd_sm90_{'e4m3_' + out_dtype if v.fp8 else out_dtype}_d{v.head_dim}"
              f"{f'_v{v.head_dim_v}' if v.head_dim_v != v.head_dim else ''}"
              f"_n{v.block_n}_s{v.stages}{'_c3' if v.consumers == 3 else ''}"
              f"{'_smf' if v.stale_max_first else ''}{'_qr' if v.q_in_registers else ''}"
              f"{f'_p{v.producer_regs}' if v.producer_regs else ''}"
              f"{'' if v.intra_overlap else '_inturn'}"
              f"{'_causal' if v.causal else ''}{'_serving' if v.serving else ''}"),
        source="kernels/fwd_sm90.cu",
        entry=f"ptxattn::attn_fwd_sm90<ptxattn::Sm90Config<{runtime.template_arguments(v)}>>",
        smem_bytes=v.smem_bytes,
        archs=ARCHS,
    )


def spec(dtype: str, head_dim: int, causal: bool, tiles: tuple[int, int] | None = None,
         out_dtype: str = "bfloat16", **choices) -> runtime.KernelSpec:
    """The KernelSpec of variant(...)."""
    v = variant(dtype, head_dim, causal, tiles, out_dtype, **choices)
    return spec_of(v, out_dtype if v.fp8 else dtype)


def shipped_configs() -> list[tuple[Sm90Config, str]]:
    """(kernel, output dtype) of every variant a call can reach without a user's tuning
    table: each seqlen_k bucket's schedule from the shipped table, or the built-in one, and
    the serving builds."""
    configs = [(variant(dtype, head_dim, causal, schedule=schedule), dtype)
               for dtype in DTYPES for head_dim in HEAD_DIMS for causal in (False, True)
               for schedule in _shipped_schedules(dtype, head_dim, causal)]
    configs += [(variant(FP8, head_dim, causal, tiles, out_dtype=out, schedule=schedule), out)
                for out in DTYPES for head_dim in FP8_HEAD_DIMS for causal in (False, True)
                for schedule in _shipped_schedules(FP8, head_dim, causal)
                for tiles in dict.fromkeys([None,
                                            _fp8_key_block_scaled_tiles(schedule, head_dim)])]
    configs += [(variant(dtype, head_dim, causal, serving=True), dtype) for dtype in DTYPES
                for head_dim in HEAD_DIMS for causal in (False, True)]
    configs += [(variant(dtype, head_dim, causal, serving=serving, head_dim_v=head_dim_v), dtype)
                for dtype in DTYPES for head_dim, head_dim_v in NARROW_V.items()
                for causal in (False, True) for serving in (False, True)]
    return list(dict.fromkeys(configs))


def variants() -> list[runtime.KernelSpec]:
    return list(dict.fromkeys(spec_of(config, out) for config, out in shipped_configs()))


def register_check_source(configs) -> str:
    """CUDA source asserting, for each Sm90Config of ``configs``, that the kernel counts its
    registers as registers() does (runtime.check_source compiles it; tests/test_mirrors.py)."""
    lines = ['#include "mainloops/fwd_sm90.cuh"']
    for config in configs:
        cfg = f"ptxattn::Sm90Config<{runtime.template_arguments(config)}>"
        fragments, producer, consumer = registers(
            config.head_dim, config.block_n, config.consumers, config.fp8,
            config.q_in_registers, config.producer_regs, config.head_dim_v)
        for field, value in (("kFragmentRegs", fragments), ("kProducerRegs", producer),
                             ("kConsumerRegs", consumer)):
            lines.append(f"static_assert({cfg}::{field} == {value}, \"{cfg}::{field} is not "
                         f"{value} as hopper_forward.registers counts it\");")
    return "\n".join(lines) + "\n"


def tune_key(dtype: str) -> tuple[str, str]:
    """(family, dtype) of the tuning tables' keys (launchers/tune_table.py) for inputs of
    ``dtype``."""
    return ("hopper-fp8", "e4m3") if dtype == FP8 else ("hopper", dtype)


def _schedule(dtype: str, head_dim: int, causal: bool, seqlen_k: int | None,
              serving: bool, head_dim_v: int | None = None) -> Schedule:
    """The schedule of a call: the serving build's own; otherwise the first tuning table's for
    the bucket of ``seqlen_k`` (tune_table.lookup), or the built-in one. NARROW_V builds have
    the built-in one, serving or not."""
    if head_dim_v and head_dim_v != head_dim:
        return SCHEDULES_NARROW_V[head_dim, head_dim_v, causal]
    if serving:
        return SCHEDULES_SERVING[head_dim, causal]
    tuned = tune_table.lookup(ARCHS[0], *tune_key(dtype), head_dim, causal, seqlen_k)
    if tuned is not None:
        def refuse(problem: str) -> ValueError:
            tables = ", ".join(map(str, tune_table.table_paths(ARCHS[0])))
            return ValueError(f"the tuning table's schedule {tuned!r} for {tune_key(dtype)}, "
                              f"head_dim {head_dim}, causal={causal} (tables: {tables}) "
                              f"{problem}; write a new table with python -m ptxattn tune")
        try:
            schedule = Schedule(**tuned)
        except TypeError as err:
            raise refuse(f"does not fit: {err}") from err
        smem = schedule_smem_bytes(head_dim, schedule, dtype == FP8)
        if smem > SMEM_LIMIT:
            raise refuse(f"needs {smem} bytes of shared memory, more than {SMEM_LIMIT}")
        return schedule
    return (SCHEDULES_FP8 if dtype == FP8 else SCHEDULES)[head_dim, causal]


def _shipped_schedules(dtype: str, head_dim: int, causal: bool) -> list[Schedule]:
    """The schedule of each seqlen_k bucket on a machine with no tuning table of its own."""
    builtin = (SCHEDULES_FP8 if dtype == FP8 else SCHEDULES)[head_dim, causal]
    tuned = tune_table.shipped(ARCHS[0], *tune_key(dtype), head_dim, causal)
    return [Schedule(**tuned[name]) if name in tuned else builtin
            for name in tune_table.BUCKET_NAMES]


def _fp8_key_block_scaled_tiles(schedule: Schedule, head_dim: int) -> tuple[int, int] | None:
    """The FP8 tiles for k descales varying per 128 keys: None if the schedule's do."""
    return None if 128 % schedule.block_n == 0 else FP8_KEY_BLOCK_SCALED_TILES[head_dim]


def section_heads(batch: int, heads_q: int, heads_kv: int, seqlen_k: int, head_dim: int,
                  itemsize: int) -> int:
    """How many (batch, head) pairs the kernel schedules together (TileOrder in
    ptx_src/roles/tile_scheduler.cuh)."""
    kv_bytes_per_q_head = 2 * seqlen_k * head_dim * itemsize * heads_kv / heads_q
    return int(max(1, min(batch * heads_q, L2_SECTION_BYTES // max(kv_bytes_per_q_head, 1))))


_tile_counters: dict = {}


def _tile_counter(device_id: int):
    """Two zeroed int32 the kernel's dynamic tile order counts in (it leaves them zeroed), one
    pair per (device, stream): launches on one stream run one after another, never together."""
    import cupy
    key = (device_id, cupy.cuda.get_current_stream().ptr)
    counter = _tile_counters.get(key)
    if counter is None:
        counter = _tile_counters[key] = cupy.zeros(2, dtype=cupy.int32)
    return counter


_launches = runtime.LaunchCache()


@dataclasses.dataclass(frozen=True)
class Sequences:
    """The sequences of a serving call, for the serving build: ``batch`` sequences of at most
    ``seqlen_q`` queries and ``seqlen_k`` keys, located by cu_seqlens_q / cu_seqlens_k (int32
    cumulative lengths: the arrays are packed, passed as one batch of all rows) and cut at
    seqused_k (int32 filled lengths of a KV cache), each None where the call has none; the
    window (left, right) as mask.cuh takes it; ``total_q`` query rows in all; float32 sinks
    (heads_q,) or None; the logit softcap (0: off). run_serving() fills in the split-KV fields:
    ``num_splits`` and the partials' accumulators (split_kv.split_accumulators) when it is above
    1."""
    batch: int
    seqlen_q: int
    seqlen_k: int
    total_q: int
    window: tuple[int, int] = (-1, -1)
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    seqused_k: object = None
    sinks: object = None
    softcap: float = 0.0
    num_splits: int = 1
    accum: tuple | None = None


def launcher(q, k, v, out, lse, *, causal: bool, softmax_scale: float, descales=None,
             **overrides) -> Callable[[], None]:
    """Everything forward() does except the launch itself, which the returned callable performs
    (benchmarks time that alone). ``overrides`` (``tiles``: keys per tile and stages,
    ``consumers``, ``stale_max_first``, ``q_in_registers``, ``sections``, ``persistent``,
    ``grid_blocks``: blocks taking tiles, ``producer_regs``, ``intra_overlap``) replace the
    tuned defaults, for tests and benchmarks.
    With ``descales`` (the (q, k, v) ``ptxattn.fp8.Descale`` operands) q, k and v are uint8
    arrays of e4m3 bytes and the FP8 kernel runs. Launches are prepared once per set of arrays,
    arguments and stream."""
    key = runtime.launch_key((q, k, v, out, lse), causal, softmax_scale,
                             tuple(sorted(overrides.items())))
    if descales is not None:
        key += tuple((runtime.array_key(d.array), d.stride_b, d.stride_h, d.stride_block)
                     for d in descales)
    return _launches.get(key, lambda: _prepare(q, k, v, out, lse, causal=causal,
                                               softmax_scale=softmax_scale, descales=descales,
                                               **overrides))


def _prepare(q, k, v, out, lse, *, causal: bool, softmax_scale: float,
             tiles: tuple[int, int] | None = None, sections: int | None = None,
             persistent: bool | None = None, grid_blocks: int | None = None, descales=None,
             consumers: int | None = None, stale_max_first: bool | None = None,
             q_in_registers: bool | None = None, producer_regs: int | None = None,
             intra_overlap: bool | None = None,
             seqs: Sequences | None = None) -> runtime.PreparedLaunch:
    batch, seqlen_q, heads_q, _ = q.shape
    fp8 = descales is not None
    head_dim, head_dim_v = kernel_head_dims(q.shape[3], v.shape[3], fp8)
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    if seqs is not None:
        batch, seqlen_q, seqlen_k = seqs.batch, seqs.seqlen_q, seqs.seqlen_k
    schedule = _schedule(FP8 if fp8 else str(q.dtype), head_dim, causal, seqlen_k,
                         seqs is not None, head_dim_v)
    if fp8 and descales[1].stride_block:
        if tiles is None:
            tiles = _fp8_key_block_scaled_tiles(schedule, head_dim)
        elif 128 % tiles[0]:
            raise ValueError(f"k descales that vary per 128 keys need keys per tile dividing 128, "
                             f"got {tiles[0]}")
    v_info = variant(FP8 if fp8 else str(q.dtype), head_dim, causal, tiles,
                     out_dtype=str(out.dtype), consumers=consumers,
                     stale_max_first=stale_max_first, q_in_registers=q_in_registers,
                     serving=seqs is not None, schedule=schedule, producer_regs=producer_regs,
                     intra_overlap=intra_overlap, head_dim_v=head_dim_v)
    kernel = runtime.load(spec_of(v_info, str(out.dtype)))
    box_cols = min(head_dim, 128) if fp8 else BOX_COLS
    swizzle = box_cols * q.itemsize
    num_m_blocks = math.ceil(seqlen_q / v_info.block_m)
    num_tiles = batch * heads_q * num_m_blocks * (seqs.num_splits if seqs is not None else 1)
    if sections is None:
        sections = (section_heads(batch, heads_q, heads_kv, seqlen_k, head_dim, q.itemsize)
                    if schedule.l2_sections else 1)
    if persistent is None:
        persistent = schedule.persistent
    blocks = num_tiles
    if persistent:
        blocks = min(num_tiles, runtime.sm_count(q.device.id))
    if grid_blocks is not None:
        blocks = min(num_tiles, grid_blocks)
    scale_log2, softcap_scale = params.score_scales(softmax_scale,
                                             seqs.softcap if seqs is not None else 0.0)
    p = params.FwdParams(
        q_map=runtime.tensor_map(q, (1, v_info.block_m, 1, box_cols), swizzle=swizzle),
        k_map=runtime.tensor_map(k, (1, v_info.block_n, 1, box_cols), swizzle=swizzle),
        v_map=runtime.tensor_map(v, (1, v_info.block_n, 1, box_cols), swizzle=swizzle),
        out_map=runtime.tensor_map(out, (1, ROWS_PER_CONSUMER, 1, BOX_COLS),
                                   swizzle=BOX_COLS * out.itemsize),
        q=q, k=k, v=v, out=out, lse=lse, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        heads_q=heads_q, heads_kv=heads_kv, q_per_kv=heads_q // heads_kv,
        scale_log2=scale_log2, softcap_scale=softcap_scale, causal=int(causal),
        num_m_blocks=num_m_blocks, section_heads=sections,
        tile_counter=_tile_counter(q.device.id) if persistent and causal else 0)
    params.set_strides(p, q, k, v, out, lse)
    if seqs is not None:
        p.window_left, p.window_right = seqs.window
        p.total_q, p.num_splits = seqs.total_q, seqs.num_splits
        for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "sinks"):
            if getattr(seqs, name) is not None:
                setattr(p, name, getattr(seqs, name))
        if seqs.accum is not None:
            p.out_accum, p.lse_accum = seqs.accum
    if fp8:
        q_d, k_d, v_d = descales
        p.q_descale, p.k_descale, p.v_descale = q_d.array, k_d.array, v_d.array
        (p.q_descale_stride_b, p.q_descale_stride_h, p.q_descale_stride_block) = (
            q_d.stride_b, q_d.stride_h, q_d.stride_block)
        (p.k_descale_stride_b, p.k_descale_stride_h, p.k_descale_stride_block) = (
            k_d.stride_b, k_d.stride_h, k_d.stride_block)
        (p.v_descale_stride_b, p.v_descale_stride_h) = (v_d.stride_b, v_d.stride_h)
    return runtime.PreparedLaunch(kernel, grid=(blocks, 1, 1), block=(v_info.threads, 1, 1),
                                  args=[p])


def run(q, k, v, out, lse, *, causal: bool, softmax_scale: float, **overrides) -> None:
    """The fixed-length forward with launcher()'s arguments (benchmarks and tests pass
    overrides; with ``descales`` q, k and v are uint8 arrays of e4m3 bytes)."""
    launcher(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, **overrides)()


def forward(problem, q, k, v, out, lse, *, descales=None) -> None:
    """Attention of ``problem`` (AttentionProblem.from_16bit, or from_fp8 with the (q, k, v)
    ``ptxattn.fp8.Descale`` operands and q, k, v the e4m3 bytes) into ``out`` and ``lse``."""
    run(q, k, v, out, lse, causal=problem.causal, softmax_scale=problem.softmax_scale,
        descales=descales)


def serve(problem, q, k, v, out, lse, *, seqused_k=None, block_table=None, cu_seqlens_q=None,
          cu_seqlens_k=None, sinks=None) -> None:
    """Attention of ``problem`` (from AttentionProblem.from_kvcache or from_varlen) through the
    serving build, with portable_decode.serve's arguments and layouts: q and out (batch,
    seqlen_q, heads_q, D), or with cu_seqlens_q (1, total_q, heads_q, D) and lse (1, heads_q,
    total_q); k and v the contiguous cache (batch, capacity, heads_kv, D) or, with cu_seqlens_k,
    (1, total_k, heads_kv, D)."""
    if block_table is not None:
        raise runtime.PtxattnError("the Hopper serving build takes no paged cache (dispatch "
                                   "routes it to the decode launcher)")
    seqs = Sequences(problem.batch, problem.seqlen_q, problem.seqlen_k, problem.total_q,
                     problem.window, cu_seqlens_q, cu_seqlens_k, seqused_k, sinks,
                     softcap=problem.softcap)
    run_serving(q, k, v, out, lse, seqs, causal=problem.causal,
                softmax_scale=problem.softmax_scale, num_splits=problem.num_splits)


def run_serving(q, k, v, out, lse, seqs: Sequences, *, causal: bool, softmax_scale: float,
                num_splits: int = 0, **overrides) -> None:
    """The serving build over ``seqs``. When its tiles cannot fill the GPU, the keys of each are
    split over several (``num_splits``, 0: split_kv.choose_splits) and combine.cu merges the
    partial states. The launches (and the partials' buffers) are prepared once per set of
    arrays, lengths and stream: the kernel reads cu_seqlens and seqused_k when it runs, so a
    server that refills the same length buffers every step reuses them. (Prepared per call,
    the host work took 600 us against a 134 us launch for 256 tokens over a 16k cache.)"""
    if not (seqs.batch and seqs.seqlen_q):
        return
    optional = (seqs.cu_seqlens_q, seqs.cu_seqlens_k, seqs.seqused_k, seqs.sinks)
    key = runtime.launch_key(
        (q, k, v, out, lse, *(x for x in optional if x is not None)),
        tuple(x is None for x in optional), causal, softmax_scale, num_splits, seqs.batch,
        seqs.seqlen_q, seqs.seqlen_k, seqs.total_q, seqs.window, seqs.softcap,
        tuple(sorted(overrides.items())))
    _serving_launches.get(key, lambda: _prepare_serving(
        q, k, v, out, lse, seqs, causal=causal, softmax_scale=softmax_scale,
        num_splits=num_splits, **overrides))()


_serving_launches = runtime.LaunchCache()


def _prepare_serving(q, k, v, out, lse, seqs: Sequences, *, causal: bool, softmax_scale: float,
                     num_splits: int, **overrides) -> Callable[[], None]:
    head_dim, head_dim_v = kernel_head_dims(q.shape[3], v.shape[3])
    heads_q = q.shape[2]
    v_info = variant(str(q.dtype), head_dim, causal, serving=True, head_dim_v=head_dim_v)
    tiles = seqs.batch * heads_q * math.ceil(seqs.seqlen_q / v_info.block_m)
    keys = seqs.seqlen_k
    if seqs.window[0] >= 0:  # a tile's rows see at most its height plus the window's width
        keys = min(keys, v_info.block_m + seqs.window[0] + max(seqs.window[1], 0))
    key_blocks = max(1, math.ceil(keys / v_info.block_n))
    splits = min(num_splits or split_kv.choose_splits(tiles, key_blocks,
                                                      runtime.sm_count(q.device.id)),
                 key_blocks)
    if splits == 1:
        return _prepare(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                        seqs=seqs, **overrides)
    seqs = dataclasses.replace(seqs, num_splits=splits, accum=split_kv.split_accumulators(
        splits, seqs.total_q, heads_q, head_dim_v))
    attend = _prepare(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, seqs=seqs,
                      **overrides)
    merge = split_kv.prepare_combine_splits(seqs.accum, out, lse, seqs.sinks, seqs.batch,
                                            seqs.seqlen_q, packed=seqs.cu_seqlens_q is not None)
    return split_kv.SplitLaunch(attend, merge, seqs.accum)
