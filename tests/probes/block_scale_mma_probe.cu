// Runs one block-scaled mma.sync per warp on fragments, scale registers and selectors given in
// global memory, so tests can hold the instruction (native on sm_120a, emulated on sm_90a)
// against a model of the ISA's semantics.
//
// Per warp w, lane l (arrays indexed [w][l][...]): a[4], b[2], c[4], sfa, sfb as the
// instruction takes them; selector[w] picks the immediates:
//   mxfp8: ((byte_a * 2 + thread_a) * 4 + byte_b) * 4 + thread_b   (128 combinations)
//   nvfp4: thread_a * 4 + thread_b                                  (8 combinations)
// d[w][l][4] receives the result.
#include "ptx/common.cuh"
#include "ptx/block_scale_mma.cuh"

namespace ptxattn {
namespace {

struct Fragments {
    uint32_t a[4];
    uint32_t b[2];
    float c[4];
    uint32_t sfa, sfb;
};

__device__ __forceinline__ Fragments load_fragments(const uint32_t* a, const uint32_t* b,
                                                    const float* c, const uint32_t* sfa,
                                                    const uint32_t* sfb) {
    const int i = blockIdx.x * 32 + threadIdx.x;
    Fragments f;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        f.a[r] = a[4 * i + r];
        f.c[r] = c[4 * i + r];
    }
    f.b[0] = b[2 * i];
    f.b[1] = b[2 * i + 1];
    f.sfa = sfa[i];
    f.sfb = sfb[i];
    return f;
}

__device__ __forceinline__ void store(float* d, const float (&acc)[4]) {
    const int i = blockIdx.x * 32 + threadIdx.x;
#pragma unroll
    for (int r = 0; r < 4; ++r) d[4 * i + r] = acc[r];
}

// The MMA whose immediates are encoded by `sel` (warp-uniform), found by walking kSel up.
template <int kSel>
__device__ __forceinline__ void mxfp8_selected(int sel, Fragments& f) {
    if constexpr (kSel < 128) {
        if (sel == kSel) {
            mma_mxfp8<kSel / 32, (kSel / 16) % 2, (kSel / 4) % 4, kSel % 4>(f.c, f.a, f.b, f.sfa,
                                                                              f.sfb);
        } else {
            mxfp8_selected<kSel + 1>(sel, f);
        }
    }
}

template <int kSel>
__device__ __forceinline__ void nvfp4_selected(int sel, Fragments& f) {
    if constexpr (kSel < 8) {
        if (sel == kSel) {
            mma_nvfp4<kSel / 4, kSel % 4>(f.c, f.a, f.b, f.sfa, f.sfb);
        } else {
            nvfp4_selected<kSel + 1>(sel, f);
        }
    }
}

}  // namespace
}  // namespace ptxattn

using namespace ptxattn;

extern "C" __global__ void __launch_bounds__(32)
block_scale_probe_mxfp8(const uint32_t* a, const uint32_t* b, const float* c, const uint32_t* sfa,
                        const uint32_t* sfb, const int* selector, float* d) {
    Fragments f = load_fragments(a, b, c, sfa, sfb);
    mxfp8_selected<0>(selector[blockIdx.x], f);
    store(d, f.c);
}

extern "C" __global__ void __launch_bounds__(32)
block_scale_probe_nvfp4(const uint32_t* a, const uint32_t* b, const float* c, const uint32_t* sfa,
                        const uint32_t* sfb, const int* selector, float* d) {
    Fragments f = load_fragments(a, b, c, sfa, sfb);
    nvfp4_selected<0>(selector[blockIdx.x], f);
    store(d, f.c);
}
