// FP8 e4m3 conversion: cvt.rn.satfinite.e4m3x2.f32 and cvt.rn.f16x2.e4m3x2 (PTX ISA 9.7.9.21),
// sm_89+; e4m3x4_to_16bit builds on sm_80 too, from integer instructions and fma.rn.{f16,bf16}x2.
//
// e4m3 ("fn" in ml_dtypes: no infinities, one NaN pattern per sign) has 4 exponent bits (bias 7)
// and 3 mantissa bits: normal values 2^-6 .. 448, subnormals down to 2^-9, a relative rounding
// step of 2^-4. The conversion rounds to nearest, ties to even, and with .satfinite clamps
// finite values beyond +-448 to +-448 (NaN stays NaN), so scaling data to at most 448 in
// magnitude and converting never overflows. Bytes are packed low element first, which is the
// order ml_dtypes and every FP8 MMA operand (wgmma, mma.sync) read them in.
#pragma once
#include "ptx/common.cuh"

namespace ptxattn {

// e4m3's largest finite magnitude: data scaled to it (amax * 448 / amax) uses the whole range.
constexpr float kE4m3Max = 448.0f;

// Two floats -> two e4m3 bytes, `lo` in the low byte. cvt's first source goes to the high byte.
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// Four floats -> one b32 of e4m3 bytes, b0 in the lowest byte.
__device__ __forceinline__ uint32_t e4m3x4(float b0, float b1, float b2, float b3) {
    uint32_t r;
    asm("{\n"
        ".reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi};\n"
        "}\n"
        : "=r"(r)
        : "f"(b0), "f"(b1), "f"(b2), "f"(b3));
    return r;
}

// Two f16x2 values times `scale` (f16x2, both halves; mul.rn.f16x2) -> one b32 of e4m3 bytes:
// a's low half in the lowest byte, then a's high half, b's low, b's high (cvt.rn.satfinite
// .e4m3x2.f16x2 keeps each half's place). The products must hold in f16.
__device__ __forceinline__ uint32_t scaled_f16x2_to_e4m3x4(uint32_t a, uint32_t b,
                                                          uint32_t scale) {
    uint32_t r;
    asm("{\n"
        ".reg .b32 sa, sb;\n"
        ".reg .b16 lo, hi;\n"
        "mul.rn.f16x2 sa, %1, %3;\n"
        "mul.rn.f16x2 sb, %2, %3;\n"
        "cvt.rn.satfinite.e4m3x2.f16x2 lo, sa;\n"
        "cvt.rn.satfinite.e4m3x2.f16x2 hi, sb;\n"
        "mov.b32 %0, {lo, hi};\n"
        "}\n"
        : "=r"(r)
        : "r"(a), "r"(b), "r"(scale));
    return r;
}

// E4M3 (and UE4M3, whose sign bit is 0) byte to FP32, exactly: cvt.rn.f16x2.e4m3x2, then
// cvt.f32.f16 (every e4m3 value is an f16 value).
__device__ __forceinline__ float e4m3_to_float(uint32_t byte) {
    uint32_t halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(static_cast<uint16_t>(byte & 0xff)));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<uint16_t>(halves & 0xffff)));
    return f;
}

// Four e4m3 bytes (b0 the lowest) -> four bf16 (kBf16) or f16 values as two b32 pairs, b0 in the
// low half of .x: exact, every e4m3 value being both an f16 and a bf16 value. f16 on sm_89+:
// cvt.rn.f16x2.e4m3x2, one instruction a pair. Otherwise integer instructions and one multiply
// (bf16 has no such cvt, and f16 -> f32 -> bf16 after it costs four conversions a pair, at 16 a
// clock an SM): a byte's exponent and mantissa bits moved into place in a 16-bit half (sign
// kept, prmt and a shift) read as the value times 2^-8 (f16: exponent bias 15 against e4m3's 7)
// or 2^-120 (bf16: bias 127), subnormals alike, and fma.rn by 2^8 or 2^120 (plus -0, which
// keeps a zero's sign) makes it exact. The NaN bytes 0x7f, 0xff (written only for NaN input:
// .satfinite keeps NaN) become +-480 there, where cvt keeps them NaN.
template <bool kBf16>
__device__ __forceinline__ uint2 e4m3x4_to_16bit(uint32_t bytes) {
#if __CUDA_ARCH__ >= 890
    if constexpr (!kBf16) {
        uint2 halves;
        asm("{\n"
            ".reg .b16 lo, hi;\n"
            "mov.b32 {lo, hi}, %2;\n"
            "cvt.rn.f16x2.e4m3x2 %0, lo;\n"
            "cvt.rn.f16x2.e4m3x2 %1, hi;\n"
            "}\n"
            : "=r"(halves.x), "=r"(halves.y)
            : "r"(bytes));
        return halves;
    }
#endif
    constexpr int kShift = kBf16 ? 4 : 1;  // the byte's bit 6 to the half's exponent bit 3
    constexpr uint32_t kScale = kBf16 ? 0x7b807b80u : 0x5c005c00u;  // 2^120, 2^8
    const uint32_t magnitude = bytes & 0x7f7f7f7fu;
    uint32_t halves[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        // bytes 2i and 2i+1 into the high byte of each half
        const uint32_t select = i == 0 ? 0x1404 : 0x3424;
        const uint32_t bits = (__byte_perm(bytes, 0, select) & 0x80008000u) |
                              (__byte_perm(magnitude, 0, select) >> kShift);
        if constexpr (kBf16) {
            asm("fma.rn.bf16x2 %0, %1, %2, %3;"
                : "=r"(halves[i]) : "r"(bits), "r"(kScale), "r"(0x80008000u));
        } else {
            asm("fma.rn.f16x2 %0, %1, %2, %3;"
                : "=r"(halves[i]) : "r"(bits), "r"(kScale), "r"(0x80008000u));
        }
    }
    return make_uint2(halves[0], halves[1]);
}

}  // namespace ptxattn
