// memwall's CUDA prelude: every kernel source is compiled with this text before it (NVRTC,
// no include path needed: nothing here includes a CUDA header), so the storage types and
// reductions below are the same in every kernel.
//
// Storage types. Activations and gradients are stored as f32, bf16 or f16 (the plan's
// storage type); weights, statistics, moments and workspaces are f32. `bf16` and `f16` are
// their bits: conversions are written here, bitwise those of memwall's `dtype` on the CPU
// (round to nearest even; a NaN stays a quiet NaN), so no `cuda_bf16.h` is needed.
//
// Kernels are templates over the storage type `T`, instantiated as `extern "C"` entries with
// the suffix `_f32`, `_bf16` or `_f16` (MW_STORAGE_ENTRIES below): the host launches
// `NAME_SUFFIX` for the plan's storage type.
//
// Determinism: no atomics in reductions. A sum over rows is reduced in a fixed order:
// a warp by `warp_sum` (xor butterfly: the same order on every run), a block by `block_sum`,
// and across blocks by partials written to scratch and summed by one block in index order.

struct bf16 {
    unsigned short bits;
};
struct f16 {
    unsigned short bits;
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);
}
__device__ __forceinline__ float to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    unsigned int b = __float_as_uint(x);
    unsigned int rounded = b + 0x7FFFu + ((b >> 16) & 1u);
    // A NaN is truncated and made quiet, never rounded (as `half` does).
    unsigned int bits = (x != x) ? (b | 0x00400000u) : rounded;
    bf16 r;
    r.bits = (unsigned short)(bits >> 16);
    return r;
}
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

// The sum of `v` over the 32 lanes of a warp, in every lane (a fixed butterfly order).
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), in every
// thread. `shared` holds 32 floats; the block must not be using it. Two barriers.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : 0.0f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : __int_as_float(0xff800000);
    return warp_max(v);
}

// Instantiates `MACRO(T, suffix)` for each storage type: a kernel template `k<T>` becomes the
// entries `k_f32`, `k_bf16`, `k_f16` through a macro the source defines.
#define MW_STORAGE_ENTRIES(MACRO) MACRO(float, f32) MACRO(bf16, bf16) MACRO(f16, f16)

// 16-byte accesses. The element-wise kernels move 16 bytes per thread per access (8 bf16/f16
// values, 4 f32) where their pointers are 16-byte aligned, and one value at a time otherwise,
// with the same arithmetic per element, so the path taken does not change a bit. One 2-byte
// access per thread kept GELU, the bias and the f32 → bf16 rounding near 1.2 TB/s on an
// H200, whose memory moves 4.3.
template <typename T>
struct alignas(16) MwPack {
    T v[16 / sizeof(T)];
};
template <typename T>
__device__ __forceinline__ bool mw_aligned16(const T* p) {
    return ((unsigned long long)p & 15ull) == 0;
}
template <typename T>
__device__ __forceinline__ MwPack<T> mw_load16(const T* p) {
    return *reinterpret_cast<const MwPack<T>*>(p);
}
template <typename T>
__device__ __forceinline__ void mw_store16(T* p, const MwPack<T>& x) {
    *reinterpret_cast<MwPack<T>*>(p) = x;
}

// The first key query i of row b attends to, for both attention sources: i − pos[b·T + i]
// (clamped to 0) for rows that pack examples, 0 without pos; with a sliding window W ≥ 1, no
// earlier than i + 1 − W (W ≤ 0: no window).
__device__ __forceinline__ int mw_first_key(const unsigned int* pos, int b, int Tn, int i, int W) {
    int lo = 0;
    if (pos != nullptr) {
        unsigned int p = pos[(long long)b * Tn + i];
        lo = p > (unsigned int)i ? 0 : i - (int)p;
    }
    return W > 0 ? max(lo, i + 1 - W) : lo;
}
