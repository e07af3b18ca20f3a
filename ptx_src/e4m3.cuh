// FP8 e4m3 conversion: cvt.rn.satfinite.e4m3x2.f32 (PTX ISA 9.7.9.21), sm_89+.
//
// e4m3 ("fn" in ml_dtypes: no infinities, one NaN pattern per sign) has 4 exponent bits (bias 7)
// and 3 mantissa bits: normal values 2^-6 .. 448, subnormals down to 2^-9, a relative rounding
// step of 2^-4. The conversion rounds to nearest, ties to even, and with .satfinite clamps
// finite values beyond +-448 to +-448 (NaN stays NaN), so scaling data to at most 448 in
// magnitude and converting never overflows. Bytes are packed low element first, which is the
// order ml_dtypes and every FP8 MMA operand (wgmma, mma.sync) read them in.
#pragma once
#include "common.cuh"

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

}  // namespace ptxattn
