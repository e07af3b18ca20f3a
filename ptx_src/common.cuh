// Fixed-width integer types and the shared-memory address helper every header needs.
// NVRTC ships no C++ standard library headers, so <cstdint> is not available here.
#pragma once

typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef int int32_t;
typedef long long int64_t;

namespace ptxattn {

// 32-bit shared-window address of a generic pointer into shared memory, as PTX's .shared
// operands take it.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

}  // namespace ptxattn
