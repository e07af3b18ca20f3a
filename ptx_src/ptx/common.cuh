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

// The first kAlign-aligned byte of dynamic shared memory at or after `raw` (swizzled TMA tiles
// need their 1024-byte atoms aligned; the launcher requests kAlign bytes more than it uses).
template <uint32_t kAlign>
__device__ __forceinline__ uint8_t* align_smem(uint8_t* raw) {
    return raw + (kAlign - smem_addr(raw) % kAlign) % kAlign;
}

}  // namespace ptxattn
