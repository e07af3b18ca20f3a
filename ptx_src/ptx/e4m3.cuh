// FP8 e4m3 conversion: cvt.rn.satfinite.e4m3x2.f32 (PTX ISA 9.7.9.21), sm_89+.
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

// E4M3 (and UE4M3, whose sign bit is 0) byte to FP32, exactly: cvt.rn.f16x2.e4m3x2, then
// cvt.f32.f16 (every e4m3 value is an f16 value).
__device__ __forceinline__ float e4m3_to_float(uint32_t byte) {
    uint32_t halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(static_cast<uint16_t>(byte & 0xff)));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<uint16_t>(halves & 0xffff)));
    return f;
}

}  // namespace ptxattn
