// Transposing an e4m3 tile in shared memory for FP8 wgmma: ldmatrix.trans + prmt + stmatrix
// (PTX ISA 9.7.14.5.15-16, 9.7.8.7), sm_90.
//
// FP8 wgmma reads B only K-major, but V arrives (by TMA) with keys as rows: [keys x head_dim].
// P V needs Vt = [head_dim x keys]. One warp transposes a unit of 32 keys x 16 head_dim bytes:
//   ldmatrix.x4.trans (16-bit elements) of the four 8-key x 16-byte matrices gives lane (g, t)
//     r_i = { V[8i+2t][2g], V[8i+2t][2g+1], V[8i+2t+1][2g], V[8i+2t+1][2g+1] }   (bytes low->high)
//   prmt picks bytes 0,2 of r_i and r_{i+1} (column 2g) or bytes 1,3 (column 2g+1):
//     Vt[2g][4t..4t+3]   = V[2t][2g], V[2t+1][2g], V[8+2t][2g], V[9+2t][2g]     (from r0, r1)
//     Vt[2g][16+4t..]    = the same with keys + 16                                (from r2, r3)
//   stmatrix.x4 (16-bit elements) writes each of those b32 as 4 bytes of a Vt row.
// So within every 32 keys, Vt's byte p = 16h + 4t + j holds key
//     key_of(p) = 16h + 8 * (j / 2) + 2t + j % 2,
// a permutation that P's A fragment must follow: it is exactly the order in which a thread
// already holds S (columns 2t, 2t+1 of the 8-column tiles 2h' and 2h'+1, see mainloops/fwd_sm90.cuh), so P
// converts to the A fragment in registers with no shuffle. The permutation stays inside the
// k-step of 32 keys, where the product does not care about order as long as A and B agree.
//
// Both tiles are TMA-style swizzled over their row: the 16-byte chunk c of row r lives at chunk
// c ^ ((r * row_bytes / 128) % (row_bytes / 16)) (the span equals the row, 64 or 128 bytes). Rows
// of Vt are written in an order that keeps each 8-row stmatrix free of bank conflicts. A Vt with
// more keys than one row span holds is stored as regions of kDstRowBytes keys (all head_dim rows
// of keys 0..127, then of keys 128.., ...), each a K-major swizzled operand of its own.
#pragma once
#include "ptx/common.cuh"
#include "ptx/e4m3.cuh"
#include "ptx/mma_sync.cuh"
#include "ptx/tma.cuh"

namespace ptxattn {

// prmt.b32 d, a, b, selector: byte k of d is byte (selector >> 4k) & 7 of {b, a} (a = 0..3).
__device__ __forceinline__ uint32_t byte_permute(uint32_t a, uint32_t b, uint32_t selector) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
}

// Transposes src [kKeys x kCols] (kCols e4m3 per key, in slabs of kSrcRowBytes-byte rows, slab s
// holding columns s * kSrcRowBytes .. at src + s * kKeys * kSrcRowBytes) into dst [kCols x kKeys]
// (regions of kDstRowBytes keys, region r at dst + r * kCols * kDstRowBytes), with the key order
// described above. kWarps warps share the work, constructing it with warp = 0 .. kWarps - 1: in
// every region, warp w takes the 16-column chunks w, w + kWarps, ... (each kDstRowBytes / 32
// units of 32 keys, fewer in a last, partly used region).
// Built once per warp and applied to every tile: within a region the swizzle XOR of the source
// rows is the same for every unit (units are 32 keys, a multiple of the 8- or 4-row swizzle
// period) and the one of the destination rows is the same for every column chunk, so each of the
// warp's chunks has a per-lane source and destination offset, computed here, and everything else
// is a compile-time offset: a unit costs ldmatrix, 4 prmt and stmatrix, a chunk two adds.
template <int kKeys, int kCols, int kSrcRowBytes, int kDstRowBytes, int kWarps>
struct TransposeE4m3 {
    static constexpr int kSrcChunks = kSrcRowBytes / 16;
    static constexpr int kDstChunks = kDstRowBytes / 16;
    static constexpr int kUnitsPerRegion = kDstRowBytes / 32;
    static constexpr int kRegions = (kKeys + kDstRowBytes - 1) / kDstRowBytes;
    static constexpr int kLastRegionUnits = (kKeys - (kRegions - 1) * kDstRowBytes) / 32;
    static constexpr int kColChunks = kCols / 16;
    static constexpr int kChunksPerWarp = (kColChunks + kWarps - 1) / kWarps;
    static_assert(kKeys % 32 == 0 && kCols % 16 == 0, "units of 32 keys x 16 columns");
    static_assert(kDstRowBytes == 64 || kDstRowBytes == 128, "64- or 128-byte Vt rows");

    // Per chunk of this warp: the offsets of this lane's ldmatrix row in the source and of its
    // stmatrix row in the destination's first region.
    uint32_t src_chunk[kChunksPerWarp];
    uint32_t dst_chunk[kChunksPerWarp];
    int chunks;  // this warp's chunks: kChunksPerWarp, or one fewer
    // The swizzle XOR of the lane's destination chunk, in the bits the unit index meets: unit u
    // of a region stores at 32 * (u ^ dst_xor_units) past the chunk's offset.
    uint32_t dst_xor_units;
    uint32_t select_first;  // prmt selectors: which of the even / odd columns this lane stores first

    __device__ __forceinline__ TransposeE4m3(int warp, int lane)
        : chunks((kColChunks - warp + kWarps - 1) / kWarps) {
        const int g = lane % 8;  // row of the matrix this lane addresses
        const int i = lane / 8;  // the matrix
        const int src_row = 8 * i + g;
        const uint32_t src_xor = (src_row * kSrcRowBytes / 128) % kSrcChunks;
        // Bank-conflict-free store order: matrix rows 0-3 take the even Vt row of the pair, 4-7
        // the odd one (rows 2g + s, s = g / 4 for matrices 0, 2 and 1 - s for 1, 3).
        const int dst_row = 2 * g + ((i % 2) ^ (g / 4));
        const int dst_xor = (dst_row * kDstRowBytes / 128) % kDstChunks;
        dst_xor_units = dst_xor / 2;
        const bool odd_first = (lane / 4) % 8 >= 4;
        select_first = odd_first ? 0x7531 : 0x6420;
#pragma unroll
        for (int j = 0; j < kChunksPerWarp; ++j) {
            const int chunk = warp + j * kWarps;
            src_chunk[j] = src_row * kSrcRowBytes + (chunk / kSrcChunks) * (kKeys * kSrcRowBytes) +
                           16 * ((chunk % kSrcChunks) ^ src_xor);
            dst_chunk[j] = dst_row * kDstRowBytes + 16 * ((i / 2) ^ (dst_xor % 2)) +
                           chunk * (16 * kDstRowBytes);
        }
    }

    __device__ __forceinline__ void store(uint32_t dst_job, int unit, const uint32_t (&r)[4]) const {
        const uint32_t select_second = select_first ^ 0x1111;  // the other of 0x6420 / 0x7531
        stmatrix_x4(dst_job + 32 * (unit ^ dst_xor_units), byte_permute(r[0], r[1], select_first),
                    byte_permute(r[0], r[1], select_second),
                    byte_permute(r[2], r[3], select_first),
                    byte_permute(r[2], r[3], select_second));
    }

    __device__ __forceinline__ void operator()(uint32_t src, uint32_t dst) const {
#pragma unroll
        for (int region = 0; region < kRegions; ++region) {
            const int units = region == kRegions - 1 ? kLastRegionUnits : kUnitsPerRegion;
#pragma unroll
            for (int j = 0; j < kChunksPerWarp; ++j) {
                if (j < chunks) {
                    const uint32_t src_job =
                        src + src_chunk[j] + region * (kDstRowBytes * kSrcRowBytes);
                    const uint32_t dst_job = dst + dst_chunk[j] + region * (kCols * kDstRowBytes);
                    // Two units in flight: their loads overlap, within the warps' registers.
#pragma unroll
                    for (int u = 0; u < units; u += 2) {
                        uint32_t r[2][4];
                        ldmatrix_x4_trans(r[0], src_job + u * 32 * kSrcRowBytes);
                        if (u + 1 < units) {
                            ldmatrix_x4_trans(r[1], src_job + (u + 1) * 32 * kSrcRowBytes);
                        }
                        store(dst_job, u, r[0]);
                        if (u + 1 < units) store(dst_job, u + 1, r[1]);
                    }
                }
            }
        }
    }
};

// A wgmma accumulator S (m64nN, fp32, wgmma.cuh layout) rounded to e4m3 as the A fragments of
// the product S Vt, one b32 per 4 keys: p[4kk .. 4kk+3] is k-step kk (keys 32kk ..), in the key
// order above: a0 = row g, tiles 4kk and 4kk+1; a1 = row g+8, same tiles; a2, a3 = tiles 4kk+2
// and 4kk+3.
template <int kN>
__device__ __forceinline__ void accumulator_to_e4m3_a(uint32_t (&p)[kN / 8],
                                                      const float (&s)[kN / 2]) {
#pragma unroll
    for (int kk = 0; kk < kN / 32; ++kk) {
        const float* t = s + 16 * kk;
        p[4 * kk + 0] = e4m3x4(t[0], t[1], t[4], t[5]);
        p[4 * kk + 1] = e4m3x4(t[2], t[3], t[6], t[7]);
        p[4 * kk + 2] = e4m3x4(t[8], t[9], t[12], t[13]);
        p[4 * kk + 3] = e4m3x4(t[10], t[11], t[14], t[15]);
    }
}

}  // namespace ptxattn
