"""The device-side building blocks the attention kernels compose, each through a small probe
kernel (tests/probes/*_probe.cu) held against a NumPy model of what its header promises:

  block_info_probe.cu      block_info.cuh, mask.cuh: which key blocks a tile visits, which of
                           them need the mask, and the mask itself (apply_mask on accumulator
                           fragments), against the visibility rule of mask.cuh; SeqLens::of.
  tile_scheduler_probe.cu  tile_scheduler.cuh: TileOrder numbering, GridTiles, PersistentTiles
                           in static and dynamic order through the TileMailbox; the backward's
                           walk (BwdWalk, BwdSteps) and its deterministic turns.
  pipeline_probe.cu        pipeline.cuh: phases of the mbarrier ring over many wraps, filled by
                           one thread's stores.
  swizzle_probe.cu         tma.cuh: swizzled_offset against the layout TMA writes; smem_tile.cuh:
                           SlabbedTile::offset against TMA's boxes, one per 128-byte slab.
  mma_probe.cu             mma_sync.cuh: mma.sync, ldmatrix(.trans), C -> A fragment packing.
  wgmma_probe.cu           wgmma.cuh, wgmma_fp8.cuh: SS and RS wgmma with the descriptors the
                           Hopper kernel builds; the backward's dQ = dS K (SS with transposed
                           B) on a dS written by mma_sync.cuh's stmatrix_x4_trans.

CPU: every probe variant compiles for its architecture. GPU: the probes run; the GEMM inputs are
small integers, so every product is exact and the results are compared for equality, except in
the dQ probe, whose random inputs show the 16-bit rounding of the dS it stores (compared bit for
bit) and whose dQ is held to the bound of FP32 accumulation.
"""

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from probe_kernels import PROBE_DIR, probe_spec
from ptxattn import runtime

SM80_UP = ("sm_80", "sm_90a")  # probes of sm_80+ instructions; run on an H100 as sm_90a
SM90 = ("sm_90a",)


def _probe(name, source, entry, archs, smem_bytes=0):
    return probe_spec(name, source, entry, archs, smem_bytes=smem_bytes)


BLOCK_SHAPES = [(128, 128), (192, 64), (64, 32)]  # (kBlockM, kBlockN)
PIPELINE_STAGES = [2, 3]
SWIZZLE_CASES = [(128, 64), (64, 48)]  # (row bytes = swizzle span, box rows)
MAX_SWIZZLE_ROWS = 64
SLABBED_CASES = [(256, 64), (512, 64), (256, 128)]  # (row bytes, rows): the portable backward's
# Q and K tiles at head_dims 128 and 256
WGMMA16_SHAPES = [(64, 128), (128, 64)]  # (head_dim = N of P V, kBlockN = N of Q K^T)
E4M3_SHAPES = [(64, 128), (128, 64), (256, 128)]  # (head_dim = K, N)
DQ_HEAD_DIMS = [64, 128]  # one 64-column slab of K, and two
DQ_KEYS = 128  # keys of the dQ probe's dS tile: two 64-key K-major slabs
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def block_info_spec(block_m, block_n):
    return _probe(f"block_info_probe_{block_m}x{block_n}", "block_info_probe.cu",
                  f"ptxattn::probe::block_info_probe<{block_m}, {block_n}>", SM80_UP)


SEQLENS = _probe("seqlens_probe", "block_info_probe.cu", "seqlens_probe", SM80_UP)
TILE_ORDER = _probe("tile_order_probe", "tile_scheduler_probe.cu", "tile_order_probe", SM90)
GRID_TILES = _probe("grid_tiles_probe", "tile_scheduler_probe.cu", "grid_tiles_probe", SM90)
PERSISTENT_TILES = _probe("persistent_tiles_probe", "tile_scheduler_probe.cu",
                          "persistent_tiles_probe", SM90)
BWD_WALK_SHAPES = [(64, 128), (128, 128)]  # (kBlockM, kBlockN): the Hopper backward's tiles


def bwd_walk_spec(block_m, block_n):
    return _probe(f"bwd_walk_probe_{block_m}x{block_n}", "tile_scheduler_probe.cu",
                  f"ptxattn::probe::bwd_walk_probe<{block_m}, {block_n}>", SM90)


def pipeline_spec(stages):
    return _probe(f"pipeline_probe_{stages}", "pipeline_probe.cu",
                  f"ptxattn::probe::pipeline_probe<{stages}>", SM90)


def swizzle_spec(row_bytes):
    return _probe(f"swizzle_probe_{row_bytes}", "swizzle_probe.cu",
                  f"ptxattn::probe::swizzle_probe<{row_bytes}>", SM90,
                  smem_bytes=MAX_SWIZZLE_ROWS * row_bytes + 1024)


def slabbed_spec(row_bytes, rows):
    return _probe(f"slabbed_tile_probe_{row_bytes}x{rows}", "swizzle_probe.cu",
                  f"ptxattn::probe::slabbed_tile_probe<{row_bytes}, {rows}>", SM90,
                  smem_bytes=rows * row_bytes + 1024)


def mma_spec(dtype):
    return _probe(f"mma_probe_{dtype}", "mma_probe.cu",
                  f"ptxattn::probe::mma_probe<{str(dtype == 'bfloat16').lower()}>", SM80_UP)


def wgmma16_spec(head_dim, block_n, dtype):
    bf16 = str(dtype == "bfloat16").lower()
    return _probe(f"wgmma16_probe_d{head_dim}_n{block_n}_{dtype}", "wgmma_probe.cu",
                  f"ptxattn::probe::wgmma16_probe<{head_dim}, {block_n}, {bf16}>", SM90,
                  smem_bytes=(64 + 2 * block_n) * head_dim * 2 + 1024)


def wgmma16_dq_spec(head_dim, dtype):
    bf16 = str(dtype == "bfloat16").lower()
    return _probe(f"wgmma16_dq_probe_d{head_dim}_{dtype}", "wgmma_probe.cu",
                  f"ptxattn::probe::wgmma16_dq_probe<{head_dim}, {bf16}>", SM90,
                  smem_bytes=(64 + head_dim) * DQ_KEYS * 2 + 1024)


def e4m3_spec(head_dim, n):
    return _probe(f"wgmma_e4m3_probe_d{head_dim}_n{n}", "wgmma_probe.cu",
                  f"ptxattn::probe::wgmma_e4m3_probe<{head_dim}, {n}>", SM90,
                  smem_bytes=(64 + n) * head_dim + 1024)


ALL_PROBES = ([block_info_spec(*shape) for shape in BLOCK_SHAPES]
              + [SEQLENS, TILE_ORDER, GRID_TILES, PERSISTENT_TILES]
              + [bwd_walk_spec(*shape) for shape in BWD_WALK_SHAPES]
              + [pipeline_spec(stages) for stages in PIPELINE_STAGES]
              + [swizzle_spec(row_bytes) for row_bytes, _ in SWIZZLE_CASES]
              + [slabbed_spec(*case) for case in SLABBED_CASES]
              + [mma_spec(dtype) for dtype in DTYPES]
              + [wgmma16_spec(d, n, dtype) for d, n in WGMMA16_SHAPES for dtype in DTYPES]
              + [wgmma16_dq_spec(d, dtype) for d in DQ_HEAD_DIMS for dtype in DTYPES]
              + [e4m3_spec(d, n) for d, n in E4M3_SHAPES])


# ---------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("spec", ALL_PROBES, ids=lambda spec: spec.name)
def test_probe_compiles(spec):
    """Each probe for the oldest architecture it is built for (sm_80 for mma.sync and plain
    integer code, sm_90a for wgmma, TMA and mbarrier), so CI without a GPU catches a probe that
    a header change broke."""
    compiled = runtime.compile(spec, spec.archs[0])
    assert compiled.cubin[:4] == b"\x7fELF"


def test_probe_list_is_complete():
    """Every *_probe.cu this file owns is compiled above (a probe added without a spec would
    otherwise escape the CPU check)."""
    mine = {"block_info_probe.cu", "tile_scheduler_probe.cu", "pipeline_probe.cu",
            "swizzle_probe.cu", "mma_probe.cu", "wgmma_probe.cu"}
    assert {Path(spec.source).name for spec in ALL_PROBES} == mine
    assert all((PROBE_DIR / name).is_file() for name in mine)


# ---------------------------------------------------------------------------------------------
# GPU helpers


def _load(spec):
    arch = runtime.device_arch()
    if arch not in spec.archs:
        pytest.skip(f"{spec.name} is built for {spec.archs}; this GPU is {arch}")
    return runtime.load(spec)


NULL = np.uint64(0)  # a null pointer argument


# ---------------------------------------------------------------------------------------------
# 1. Block ranges and the mask (block_info.cuh, mask.cuh)

LENGTHS = [1, 17, 100, 129, 255, 256]
# (causal, window_left, window_right); -1 is unbounded. Causal ignores window_right (the last
# two causal entries check that it does).
MASKS = ([(False, -1, -1), (False, 0, 0), (False, 0, -1), (False, -1, 0), (False, 3, 5),
          (False, 40, 0), (False, 17, 100), (False, 1000, 1000), (False, -1, 7), (False, 64, -1)]
         + [(True, -1, -1), (True, 0, -1), (True, 3, -1), (True, 64, -1), (True, 1000, -1),
            (True, -1, 7), (True, 5, 5)])


def visible_sides(seqlen_q, seqlen_k, causal, window_left, window_right, keys):
    """(right, left): boolean [seqlen_q x keys] matrices of the two halves of mask.cuh's rule
    (bottom-right aligned: row i sits at key i + seqlen_k - seqlen_q); row i sees key j iff
    right[i, j] and left[i, j]. Keys past seqlen_k fail the right side."""
    right_window = 0 if causal else window_right
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(keys)[None, :]
    diag = i + seqlen_k - seqlen_q
    right = (j < seqlen_k) & ((j <= diag + right_window) if right_window >= 0 else True)
    left = (j >= diag - window_left) if window_left >= 0 else np.ones_like(right)
    return right, left


def _leading_run(flags):
    """How many of the leading entries of a 1-d boolean array are true."""
    return len(flags) if flags.all() else int(np.argmin(flags))


def check_block_info(case, block_m, block_n, info, scores):
    """Checks the probe's output for one (seqlen_q, seqlen_k, causal, window_left,
    window_right) case: info [query blocks x 4] (n_min, n_max, n_right_masked,
    n_left_unmasked), scores [query blocks * block_m x key blocks * block_n] (1 where the mask
    lets a score through, -inf where it does not).

    Per query block m, over its real rows (< seqlen_q):
      * [n_min, n_max) is exactly the range of key blocks holding a key some real row sees
        (every visible key inside; the first and last block hold one). A tile that sees no key
        has n_max == 0, so the range is empty whatever n_min is.
      * Blocks in [n_left_unmasked, n_right_masked) within [n_min, n_max) are fully visible to
        every real row: skipping the mask there is safe.
      * No block is masked needlessly: n_right_masked is the number of leading blocks whose
        every key every real row sees as far as the right side (seqlen_k, causal diagonal,
        right window) goes, n_left_unmasked the number of leading blocks holding a key some
        real row does not see for the left window.
    And the mask equals the rule for every real row and every key of every key block,
    including the keys past seqlen_k in the last block."""
    seqlen_q, seqlen_k = case[:2]
    num_m, num_n = info.shape[0], scores.shape[1] // block_n
    right, left = visible_sides(*case, num_n * block_n)
    visible = right & left

    expected = np.where(visible, np.float32(1), np.float32(-np.inf))
    wrong = np.argwhere(scores[:seqlen_q] != expected)
    assert wrong.size == 0, (f"{case}: the mask is wrong at {len(wrong)} (row, key) pairs, "
                             f"first {wrong[:4].tolist()}")

    def per_block(flags, reduce, pad):
        padded = np.full((num_m * block_m, num_n * block_n), pad)
        padded[:seqlen_q] = flags
        return reduce(padded.reshape(num_m, block_m, num_n, block_n), axis=(1, 3))

    any_visible = per_block(visible, np.any, False)
    all_visible = per_block(visible, np.all, True)
    all_right = per_block(right, np.all, True)
    all_left = per_block(left, np.all, True)
    for m in range(num_m):
        n_min, n_max, n_right_masked, n_left_unmasked = (int(x) for x in info[m])
        where = f"{case}, query block {m}: n_min {n_min}, n_max {n_max}, n_right_masked " \
                f"{n_right_masked}, n_left_unmasked {n_left_unmasked}"
        seen = np.flatnonzero(any_visible[m])
        if seen.size == 0:
            assert n_max == 0, f"{where}: the tile sees no key"
            continue
        assert (n_min, n_max) == (seen[0], seen[-1] + 1), \
            f"{where}: the visible keys lie in blocks {seen[0]} .. {seen[-1]}"
        unmasked = range(max(n_min, n_left_unmasked), min(n_max, n_right_masked))
        hidden = [n for n in unmasked if not all_visible[m, n]]
        assert not hidden, f"{where}: blocks {hidden} skip the mask but hide some keys"
        assert n_right_masked == _leading_run(all_right[m]), f"{where}: right mask boundary"
        assert n_left_unmasked == _leading_run(~all_left[m]), f"{where}: left mask boundary"


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,block_n", BLOCK_SHAPES)
def test_block_info_and_mask_match_the_visibility_rule(block_m, block_n):
    import cupy
    kernel = _load(block_info_spec(block_m, block_n))
    for seqlen_q in LENGTHS:
        for seqlen_k in LENGTHS:
            for causal, window_left, window_right in MASKS:
                case = (seqlen_q, seqlen_k, causal, window_left, window_right)
                num_m, num_n = math.ceil(seqlen_q / block_m), math.ceil(seqlen_k / block_n)
                info = cupy.full((num_m, 4), -7, cupy.int32)
                scores = cupy.full((num_m * block_m, num_n * block_n), np.nan, cupy.float32)
                runtime.launch(kernel, (num_m, num_n), (block_m,),
                               [np.int32(seqlen_q), np.int32(seqlen_k), np.int32(causal),
                                np.int32(window_left), np.int32(window_right), info, scores])
                check_block_info(case, block_m, block_n, info.get(), scores.get())


@pytest.mark.gpu
def test_seqlens_of_reads_cumulative_offsets():
    import cupy
    kernel = _load(SEQLENS)
    cu_q = np.array([0, 5, 5, 17, 100], np.int32)  # sequence 1 is empty
    cu_k = np.array([0, 30, 31, 31, 64], np.int32)
    batch, seqlen_q, seqlen_k = len(cu_q) - 1, 7, 9
    for with_q in (False, True):
        for with_k in (False, True):
            lens = cupy.full((batch, 4), -7, cupy.int32)
            runtime.launch(kernel, (1,), (32,),
                           [np.int32(batch), np.int32(seqlen_q), np.int32(seqlen_k),
                            cupy.asarray(cu_q) if with_q else NULL,
                            cupy.asarray(cu_k) if with_k else NULL, lens])
            expected = np.zeros((batch, 4), np.int32)
            expected[:, 0] = np.diff(cu_q) if with_q else seqlen_q
            expected[:, 1] = np.diff(cu_k) if with_k else seqlen_k
            expected[:, 2] = cu_q[:-1] if with_q else 0
            expected[:, 3] = cu_k[:-1] if with_k else 0
            np.testing.assert_array_equal(lens.get(), expected,
                                          err_msg=f"cu_seqlens_q given: {with_q}, "
                                                  f"cu_seqlens_k given: {with_k}")


# ---------------------------------------------------------------------------------------------
# 2. Tile schedulers (tile_scheduler.cuh)

# (num_m_blocks, batch, heads_q, section_heads): section_heads 1, dividing the (batch, head)
# pairs, not dividing them, and larger than their number.
ORDER_CASES = [(5, 2, 3, 1), (4, 3, 5, 4), (1, 1, 1, 1), (7, 2, 8, 16), (3, 5, 7, 6),
               (2, 4, 6, 8), (6, 2, 4, 2)]


def tile_order(num_m_blocks, batch, heads_q, section_heads, alternate_sections):
    """The (m_block, head, batch) of every tile index, as tile_scheduler.cuh documents the order:
    sections of section_heads (batch, head) pairs in pair order, within one the query blocks
    from the last to the first, all pairs of the section at each; with alternate_sections, the
    sections before the last alternately from the first to the last (the one just before the
    last, then every other one going back)."""
    pairs = batch * heads_q
    firsts = list(range(0, pairs, section_heads))
    order = []
    for index, first in enumerate(firsts):
        shortest_first = alternate_sections and (len(firsts) - 1 - index) % 2 == 1
        blocks = range(num_m_blocks) if shortest_first else reversed(range(num_m_blocks))
        for m in blocks:
            for pair in range(first, min(first + section_heads, pairs)):
                order.append((m, pair % heads_q, pair // heads_q))
    return order


@pytest.mark.gpu
@pytest.mark.parametrize("alternate_sections", [False, True])
@pytest.mark.parametrize("num_m_blocks,batch,heads_q,section_heads", ORDER_CASES)
def test_tile_order_decodes_every_tile_once(num_m_blocks, batch, heads_q, section_heads,
                                            alternate_sections):
    import cupy
    kernel = _load(TILE_ORDER)
    num_tiles = num_m_blocks * batch * heads_q
    coords = cupy.full((num_tiles, 3), -1, cupy.int32)
    runtime.launch(kernel, (math.ceil(num_tiles / 128),), (128,),
                   [np.int32(num_m_blocks), np.int32(batch * heads_q), np.int32(section_heads),
                    np.int32(heads_q), np.int32(alternate_sections), coords])
    got = [tuple(int(x) for x in row) for row in coords.get()]
    every = {(m, h, b) for m in range(num_m_blocks) for h in range(heads_q) for b in range(batch)}
    assert set(got) == every and len(got) == len(every), "decode is not a bijection"
    assert got == tile_order(num_m_blocks, batch, heads_q, section_heads, alternate_sections)


RECEIVING_WARPS = 8  # as the Hopper kernel's two consumer warpgroups


def _schedule(kernel, grid, num_tiles, *counter):
    """Runs a scheduler probe (`counter`: persistent_tiles_probe's counter argument, none for
    grid_tiles_probe); (log [grid x warps x cap], taken [grid x warps]) on the host."""
    import cupy
    warps = 1 + RECEIVING_WARPS
    cap = num_tiles + 2
    log = cupy.full((grid, warps, cap), -1, cupy.int32)
    taken = cupy.full((grid, warps), -1, cupy.int32)
    args = [np.int32(num_tiles), *counter, np.int32(cap), log, taken]
    runtime.launch(kernel, (grid,), (32 * warps,), args)
    return log.get(), taken.get()


def check_schedule(log, taken, num_tiles):
    """Every warp of a block got the producer's sequence, which ends with one index at or past
    num_tiles; the blocks' sequences together hold every tile exactly once. Returns each
    block's tiles (the closing index left off)."""
    tiles = []
    for block in range(log.shape[0]):
        count = int(taken[block, 0])
        assert 1 <= count <= num_tiles + 1, f"block {block} took {count} indices"
        assert (taken[block] == count).all(), \
            f"block {block}: its warps got {taken[block].tolist()} indices"
        sequence = log[block, 0, :count]
        bad = [w for w in range(1, log.shape[1]) if (log[block, w, :count] != sequence).any()]
        assert not bad, f"block {block}: warps {bad} received other tiles than the producer took"
        assert sequence[-1] >= num_tiles and (sequence[:-1] >= 0).all() \
            and (sequence[:-1] < num_tiles).all(), f"block {block}: sequence {sequence.tolist()}"
        tiles.append(sequence[:-1])
    counts = np.bincount(np.concatenate(tiles), minlength=num_tiles)
    assert (counts == 1).all(), (f"tiles never taken: {np.flatnonzero(counts == 0)[:8].tolist()}, "
                                 f"taken twice or more: {np.flatnonzero(counts > 1)[:8].tolist()}")
    return tiles


@pytest.mark.gpu
@pytest.mark.parametrize("num_tiles", [1, 37, 300])
def test_grid_tiles_gives_each_block_its_own_tile(num_tiles):
    kernel = _load(GRID_TILES)
    log, taken = _schedule(kernel, num_tiles, num_tiles)
    tiles = check_schedule(log, taken, num_tiles)
    assert [t.tolist() for t in tiles] == [[b] for b in range(num_tiles)]
    assert (log[:, :, 1] == num_tiles).all()


# (num_tiles, grid): many tiles per block, a few, and fewer tiles than blocks.
PERSISTENT_CASES = [(1000, 7), (37, 5), (3, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tiles,grid", PERSISTENT_CASES)
def test_persistent_tiles_static_order(num_tiles, grid):
    kernel = _load(PERSISTENT_TILES)
    tiles = check_schedule(*_schedule(kernel, grid, num_tiles, NULL), num_tiles)
    for block, got in enumerate(tiles):
        assert got.tolist() == list(range(block, num_tiles, grid)), f"block {block}"


@pytest.mark.gpu
@pytest.mark.parametrize("num_tiles,grid", PERSISTENT_CASES)
def test_persistent_tiles_dynamic_order_and_counter_reset(num_tiles, grid):
    """Dynamic order through the mailbox, launched twice on one counter pair: the last block
    to run out must leave it zeroed, or the second launch would skip tiles (a stale first
    counter) or never reset it (a stale second one)."""
    import cupy
    kernel = _load(PERSISTENT_TILES)
    counter = cupy.zeros(2, cupy.int32)
    for launch in range(2):
        tiles = check_schedule(*_schedule(kernel, grid, num_tiles, counter), num_tiles)
        for block, got in enumerate(tiles):
            if block < num_tiles:
                assert got[0] == block, f"launch {launch}, block {block}: first tile {got[0]}"
            assert (np.diff(got) > 0).all(), f"launch {launch}, block {block}: {got.tolist()}"
        assert counter.get().tolist() == [0, 0], f"launch {launch} left the counters set"


# (seqlen_q, seqlen_k, group): more query tiles than blocks, fewer, tails, and groups smaller
# than the key blocks (a partial last group).
BWD_WALK_CASES = [(1000, 1000, 132), (2048, 1024, 132), (300, 1100, 132), (1024, 1024, 3),
                  (777, 1500, 4), (64, 640, 132)]


def _bwd_walk(kernel, block_m, block_n, seqlen_q, seqlen_k, causal, deterministic, group,
              q_per_kv, window=(-1, -1)):
    """Runs bwd_walk_probe: (n_block per block, steps per block as (head, tile, turn) rows),
    after checking that BwdSteps::Cursor visits the same (head, tile) at every step."""
    import cupy
    blocks = math.ceil(seqlen_k / block_n)
    cap = math.ceil(seqlen_q / block_m) * q_per_kv
    n_block = cupy.full(blocks, -1, cupy.int32)
    counts = cupy.full(blocks, -1, cupy.int32)
    steps = cupy.full((blocks, cap, 5), -1, cupy.int32)
    runtime.launch(kernel, (math.ceil(blocks / 128),), (128,),
                   [np.int32(seqlen_q), np.int32(seqlen_k), np.int32(causal),
                    np.int32(deterministic), np.int32(group), np.int32(q_per_kv), np.int32(cap),
                    np.int32(window[0]), np.int32(window[1]), n_block, counts, steps])
    counts = counts.get()
    assert (counts <= cap).all(), f"step counts {counts.tolist()} over {cap}"
    steps = steps.get()
    for b in range(blocks):
        np.testing.assert_array_equal(steps[b, :counts[b], 3:], steps[b, :counts[b], :2],
                                      err_msg=f"block {b}: the cursor's (head, tile) steps")
    return n_block.get(), [steps[b, :counts[b], :3] for b in range(blocks)]


def _visible_tiles(n, block_m, block_n, seqlen_q, seqlen_k, causal, window=(-1, -1)):
    """The query tiles holding a row that sees a key of block n (mask.cuh's rule)."""
    rows = np.arange(seqlen_q)
    left, right = window[0], 0 if causal else window[1]
    diagonal = rows + seqlen_k - seqlen_q
    last_key_seen = np.minimum(seqlen_k - 1, diagonal + right) if right >= 0 else seqlen_k - 1
    first_key_seen = np.maximum(0, diagonal - left) if left >= 0 else np.zeros(seqlen_q)
    block_keys = (n * block_n, min(seqlen_k, (n + 1) * block_n) - 1)
    sees = ((last_key_seen >= block_keys[0]) & (first_key_seen <= block_keys[1])
            & (first_key_seen <= last_key_seen))
    return sorted(set((rows[sees] // block_m).tolist()))


def _run_turns(walks, capacity):
    """Plays the blocks' adds in rounds: `capacity` blocks resident at once, launched in index
    order as the hardware does; each round every resident block makes its next add if the
    tile's counter (at the round's start) reads its turn. Returns the rounds in which some
    block waited; fails on a round in which none could move (a deadlock)."""
    counters, position = {}, [0] * len(walks)
    resident, launched, waits = [], 0, []
    rounds = 0
    while True:
        while len(resident) < capacity and launched < len(walks):
            if len(walks[launched]):  # a block no query sees (windows) adds nothing and exits
                resident.append(launched)
            launched += 1
        if not resident:
            return waits
        ready = [b for b in resident
                 if counters.get(tuple(walks[b][position[b], :2]), 0) == walks[b][position[b], 2]]
        assert ready, f"deadlock in round {rounds}: resident blocks {resident} all wait"
        if len(ready) < len(resident):
            waits.append(rounds)
        for b in ready:
            key = tuple(walks[b][position[b], :2])
            counters[key] = counters.get(key, 0) + 1
            position[b] += 1
        resident = [b for b in resident if position[b] < len(walks[b])]
        rounds += 1


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(-1, -1), (300, 0), (100, 200), (-1, 50), (50, -1), (3, 5)],
                         ids=lambda w: f"window{w[0]}_{w[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("block_m,block_n", BWD_WALK_SHAPES)
@pytest.mark.parametrize("seqlen_q,seqlen_k,group", BWD_WALK_CASES)
def test_bwd_walk_visits_and_turns(seqlen_q, seqlen_k, group, block_m, block_n, causal, window):
    """Every key block of the backward visits each query tile that sees its keys once per q
    head; with deterministic sums the blocks' turns at each tile are 0, 1, 2, ..., the adds
    finish with `group` blocks resident (the launcher passes the SM count), and with every
    block resident and moving in lockstep no block ever waits where BwdWalk promises it: causal
    with no more keys than queries (with more, the blocks left of the diagonal all start at
    tile 0), non-causal with the blocks in one group and at least as many tiles (otherwise a
    group waits for the one before, or the walk falls back to index order). Windows skip the
    tiles no row of which sees the block, and keep the turns unique and free of deadlock."""
    kernel = _load(bwd_walk_spec(block_m, block_n))
    blocks = math.ceil(seqlen_k / block_n)
    num_m = math.ceil(seqlen_q / block_m)
    q_per_kv = 2
    for deterministic in (False, True):
        n_block, walks = _bwd_walk(kernel, block_m, block_n, seqlen_q, seqlen_k, causal,
                                   deterministic, group, q_per_kv, window)
        assert sorted(n_block.tolist()) == list(range(blocks))
        for b, steps in enumerate(walks):
            visible = _visible_tiles(n_block[b], block_m, block_n, seqlen_q, seqlen_k, causal,
                                     window)
            for head in range(q_per_kv):
                mine = steps[steps[:, 0] == head]
                assert sorted(mine[:, 1].tolist()) == visible, \
                    f"deterministic={deterministic} block {b} head {head}: {mine[:, 1].tolist()}"
            assert (np.diff(steps[:, 0]) >= 0).all(), f"block {b}: heads not in order"
        if not deterministic:
            continue
        turns = {}
        for steps in walks:
            for head, tile, turn in steps.tolist():
                turns.setdefault((head, tile), []).append(turn)
        for (head, tile), got in turns.items():
            assert sorted(got) == list(range(len(got))), f"head {head} tile {tile}: turns {got}"
        _run_turns(walks, capacity=group)
        lockstep_waits = _run_turns(walks, capacity=blocks)
        if window != (-1, -1):
            continue
        if seqlen_q >= seqlen_k if causal else blocks <= min(group, num_m):
            assert not lockstep_waits, f"blocks waited in lockstep rounds {lockstep_waits[:8]}"


# ---------------------------------------------------------------------------------------------
# 3. The mbarrier pipeline (pipeline.cuh)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", PIPELINE_STAGES)
def test_pipeline_passes_every_item_once_in_order(stages, rng):
    """1537 items, so 500+ wraps of the ring ending mid-ring; items are 32 distinct ints, so a
    lost, repeated or stale (earlier) item shows."""
    import cupy
    kernel = _load(pipeline_spec(stages))
    items, consumers = 1537, 3
    src = rng.permutation(items * 32).astype(np.int32).reshape(items, 32)
    out = cupy.full((consumers, items, 32), -1, cupy.int32)
    runtime.launch(kernel, (1,), (32 * (1 + consumers),),
                   [cupy.asarray(src), np.int32(items), out])
    got = out.get()
    item_of = np.empty(items * 32, np.int64)
    item_of[src.ravel()] = np.repeat(np.arange(items), 32)
    for warp in range(consumers):
        wrong = np.argwhere(got[warp] != src)
        if wrong.size:
            i, lane = wrong[0]
            value = got[warp, i, lane]
            source = f"item {item_of[value]}" if 0 <= value < items * 32 else "no item"
            pytest.fail(f"consumer warp {warp}: {len(wrong)} wrong words; item {i} word {lane} "
                        f"holds {value}, from {source}")


# ---------------------------------------------------------------------------------------------
# 4. Swizzled addressing (tma.cuh)


@pytest.mark.gpu
@pytest.mark.parametrize("row_bytes,rows", SWIZZLE_CASES)
def test_swizzled_offset_matches_the_tma_layout(row_bytes, rows, rng):
    """A TMA box of distinct float32 values with rows of one swizzle span, read back through
    swizzled_offset; the box starts off the tensor's origin in both dimensions."""
    import cupy
    kernel = _load(swizzle_spec(row_bytes))
    src = cupy.asarray(rng.permutation(200 * 80).astype(np.float32).reshape(200, 80))
    width = row_bytes // 4
    col, row = 16, 37
    out = cupy.zeros(rows * width, cupy.uint32)
    runtime.launch(kernel, (1,), (128,),
                   [runtime.tensor_map(src, (rows, width), swizzle=row_bytes), np.int32(col),
                    np.int32(row), np.int32(rows), out])
    expected = src[row:row + rows, col:col + width].get()
    got = out.get().view(np.float32).reshape(rows, width)
    wrong = np.argwhere(got != expected)
    assert wrong.size == 0, f"{len(wrong)} words differ, first (row, word) {wrong[:4].tolist()}"


@pytest.mark.gpu
@pytest.mark.parametrize("row_bytes,rows", SLABBED_CASES)
def test_slabbed_tile_matches_the_tma_layout(row_bytes, rows, rng):
    """Boxes of 128-byte rows, one per slab, read back through SlabbedTile::offset: the layout
    the portable backward's TMA loads write is the one its ldmatrix and cp.async address."""
    import cupy
    kernel = _load(slabbed_spec(row_bytes, rows))
    src = cupy.asarray(rng.permutation(200 * 160).astype(np.float32).reshape(200, 160))
    width = row_bytes // 4
    col, row = 16, 37
    out = cupy.zeros(rows * width, cupy.uint32)
    runtime.launch(kernel, (1,), (128,),
                   [runtime.tensor_map(src, (rows, 32), swizzle=128), np.int32(col),
                    np.int32(row), out])
    expected = src[row:row + rows, col:col + width].get()
    got = out.get().view(np.float32).reshape(rows, width)
    wrong = np.argwhere(got != expected)
    assert wrong.size == 0, f"{len(wrong)} words differ, first (row, word) {wrong[:4].tolist()}"


# ---------------------------------------------------------------------------------------------
# 5. Tensor-core GEMMs (mma_sync.cuh, wgmma.cuh, wgmma_fp8.cuh)


def _small_ints(rng, shape, low, high):
    return rng.integers(low, high + 1, size=shape).astype(np.float32)


def _bits16(x, dtype):
    """x (exactly representable) as raw 16-bit patterns of dtype, on the device."""
    import cupy
    return cupy.asarray(x.astype(DTYPES[dtype]).view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_mma_sync_products(dtype, rng):
    """A [16 x 32], Kt [16 x 32], V [16 x 16] in [-2, 2]: |A Kt^T| <= 128, exact in 16 bits."""
    import cupy
    kernel = _load(mma_spec(dtype))
    a, kt, v = (_small_ints(rng, shape, -2, 2) for shape in ((16, 32), (16, 32), (16, 16)))
    d8, d, o = (cupy.full(shape, np.nan, cupy.float32) for shape in ((16, 8), (16, 16), (16, 16)))
    runtime.launch(kernel, (1,), (32,), [_bits16(a, dtype), _bits16(kt, dtype),
                                         _bits16(v, dtype), d8, d, o])
    s = a @ kt.T
    np.testing.assert_array_equal(d8.get(), s[:, :8], err_msg="mma_m16n8k16")
    np.testing.assert_array_equal(d.get(), s, err_msg="ldmatrix_x4 + mma_m16n16k16")
    np.testing.assert_array_equal(o.get(), s @ v,
                                  err_msg="pack_f32x2 (C -> A) + ldmatrix_x4_trans + mma_m16n16k16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim,block_n", WGMMA16_SHAPES)
def test_wgmma16_ss_and_rs(head_dim, block_n, dtype, rng):
    """S = Q K^T (SS, K-major), O = 1 + S V (RS, V MN-major). Q in [-1, 1], K and V in
    [-2, 2]: |S| <= 2 head_dim <= 256, exact in bf16 and fp16, so P = S."""
    import cupy
    kernel = _load(wgmma16_spec(head_dim, block_n, dtype))
    q = _small_ints(rng, (64, head_dim), -1, 1)
    k, v = (_small_ints(rng, (block_n, head_dim), -2, 2) for _ in range(2))
    s = cupy.full((64, block_n), np.nan, cupy.float32)
    o = cupy.full((64, head_dim), np.nan, cupy.float32)
    runtime.launch(kernel, (1,), (128,),
                   [_bits16(q, dtype), _bits16(k, dtype), _bits16(v, dtype), s, o])
    expected_s = q @ k.T
    np.testing.assert_array_equal(s.get(), expected_s, err_msg=f"Wgmma16<{block_n}>::ss")
    np.testing.assert_array_equal(o.get(), 1 + expected_s @ v,
                                  err_msg=f"Wgmma16<{head_dim}>::rs")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", DQ_HEAD_DIMS)
def test_wgmma16_dq_stmatrix_trans_and_transposed_operands(head_dim, dtype, rng):
    """The backward's dQ = dS K, and dQ^T = K^T dS^T (the transposed A form that the head_dim 128
    kernel uses). dS^T [128 keys x 64 queries], random FP32, goes through the
    accumulator layout, pack_f32x2 and stmatrix_x4_trans into two swizzled K-major slabs; read
    back, dS must be the transpose of the inputs rounded to 16 bits, bit for bit (cvt.rn and
    NumPy / ml_dtypes both round to nearest even). dQ = dS K (Wgmma16<64>::ss with transposed B
    over each 64-column slab of K, random 16-bit) against the float64 product of the same
    16-bit operands: their products are exact in FP32, and the tensor cores add the 128 of them
    in FP32 truncating (aligned to the largest exponent) rather than rounding, each addition
    within 2^-23 of the magnitudes summed so far, so |error| <= 128 * 2^-23 = 2^-16 of the
    largest sum of magnitudes; one k-step misplaced by 16 keys is far outside that. dQ^T, the
    same sums, must be dQ's transpose within the same bound."""
    import cupy
    kernel = _load(wgmma16_dq_spec(head_dim, dtype))
    st = rng.standard_normal((DQ_KEYS, 64)).astype(np.float32)
    k = rng.standard_normal((DQ_KEYS, head_dim)).astype(np.float32).astype(DTYPES[dtype])
    ds = cupy.zeros((64, DQ_KEYS), cupy.uint16)
    dq = cupy.full((head_dim // 64, 64, 64), np.nan, cupy.float32)
    dqt = cupy.full((head_dim // 64, 64, 64), np.nan, cupy.float32)
    runtime.launch(kernel, (1,), (128,),
                   [cupy.asarray(st), cupy.asarray(k.view(np.uint16)), ds, dq, dqt])
    ds16 = np.ascontiguousarray(st.T).astype(DTYPES[dtype])
    wrong = np.argwhere(ds.get() != ds16.view(np.uint16))
    assert wrong.size == 0, (f"stmatrix_x4_trans: {len(wrong)} of dS's 16-bit values differ, "
                             f"first (query, key) {wrong[:4].tolist()}")

    a, b = ds16.astype(np.float64), k.astype(np.float64)
    got = dq.get().transpose(1, 0, 2).reshape(64, head_dim)  # the slabs side by side
    tolerance = float((np.abs(a) @ np.abs(b)).max()) * 2.0 ** -16
    np.testing.assert_allclose(got, a @ b, rtol=0, atol=tolerance,
                               err_msg="Wgmma16<64>::ss<kBf16, true>")
    assert not np.allclose(got, a @ np.roll(b, 16, axis=0), rtol=0, atol=tolerance), \
        "the check would not notice K read one k-step off"
    got_t = dqt.get().transpose(2, 0, 1).reshape(64, head_dim)  # each slab [column, query]
    np.testing.assert_allclose(got_t, a @ b, rtol=0, atol=tolerance,
                               err_msg="Wgmma16<64>::ss<kBf16, false, true>")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,n", E4M3_SHAPES)
def test_wgmma_e4m3_ss_and_rs(head_dim, n, rng):
    """S = Q K^T twice: SS, and RS with Q's A fragments from global memory. Q in [-1, 1], K in
    [-2, 2]: |S| <= 512, within what the FP8 accumulator holds exactly."""
    import cupy
    kernel = _load(e4m3_spec(head_dim, n))
    q = _small_ints(rng, (64, head_dim), -1, 1)
    k = _small_ints(rng, (n, head_dim), -2, 2)
    s, t = (cupy.full((64, n), np.nan, cupy.float32) for _ in range(2))
    runtime.launch(kernel, (1,), (128,),
                   [cupy.asarray(x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)) for x in (q, k)]
                   + [s, t])
    np.testing.assert_array_equal(s.get(), q @ k.T, err_msg=f"WgmmaE4m3<{n}>::ss")
    np.testing.assert_array_equal(t.get(), q @ k.T, err_msg=f"WgmmaE4m3<{n}>::rs")
