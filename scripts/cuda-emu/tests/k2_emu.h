// A minimal CUDA-on-CPU emulation for the k2 kernel tests (xent, optimizer, lora, dequant):
// enough of CUDA C for those kernels to compile with g++ and run on the CPU. A stopgap until
// the shared harness (scripts/cuda-emu/) lands; it runs one std::thread per CUDA thread,
// blocks one after the other, so __shared__ (made `static`) is per block.
//
// Emulated: threadIdx/blockIdx/blockDim/gridDim (x only), __syncthreads, __syncthreads_or,
// __shfl_xor_sync / __shfl_down_sync (float, double; all 32 lanes must take part), the
// rounding intrinsics (__fadd_rn ... as plain IEEE operations: build with
// -ffp-contract=off), bit casts, __trap, min/max. The prelude's f16 inline PTX is replaced
// by run-k2.sh with calls to emu_f16_to_f32 / emu_f32_to_f16 (_Float16, round to nearest even).
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct EmuBlock {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
    std::vector<uint64_t> xchg;  // [blockDim]
    std::atomic<int> orflag{0};
};
inline thread_local EmuBlock* emu_blk = nullptr;

inline void __syncthreads() { emu_blk->bar->arrive_and_wait(); }
inline int __syncthreads_or(int p) {
    __syncthreads();
    if (p) emu_blk->orflag.store(1);
    __syncthreads();
    int r = emu_blk->orflag.load();
    __syncthreads();
    if (threadIdx.x == 0) emu_blk->orflag.store(0);
    return r;
}
[[noreturn]] inline void __trap() {
    fprintf(stderr, "__trap() in block %u thread %u\n", blockIdx.x, threadIdx.x);
    abort();
}

template <typename V>
inline V emu_shfl(V v, int src) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(V));
    emu_blk->xchg[threadIdx.x] = bits;
    emu_blk->warp_bar[warp]->arrive_and_wait();
    bits = emu_blk->xchg[warp * 32 + src];
    emu_blk->warp_bar[warp]->arrive_and_wait();
    V r;
    memcpy(&r, &bits, sizeof(V));
    (void)lane;
    return r;
}
template <typename V>
inline V __shfl_xor_sync(unsigned, V v, int mask, int width = 32) {
    const int lane = threadIdx.x & 31;
    int src = lane ^ mask;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return emu_shfl(v, src);
}
template <typename V>
inline V __shfl_down_sync(unsigned, V v, int delta, int width = 32) {
    const int lane = threadIdx.x & 31;
    const int src = (lane % width) + delta < width ? lane + delta : lane;
    return emu_shfl(v, src);
}

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline int __float_as_int(float f) { return (int)__float_as_uint(f); }
inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }



template <typename A>
inline A min(A a, A b) {
    return a < b ? a : b;
}
template <typename A>
inline A max(A a, A b) {
    return a < b ? b : a;
}

inline float emu_f16_to_f32(unsigned short bits) {
    _Float16 h;
    memcpy(&h, &bits, 2);
    return (float)h;
}
inline unsigned short emu_f32_to_f16(float x) {
    _Float16 h = (_Float16)x;
    unsigned short b;
    memcpy(&b, &h, 2);
    return b;
}

// Runs `body` (a call of the kernel) as a grid of `grid` blocks of `block` threads.
inline void emu_launch(unsigned grid, unsigned block, const std::function<void()>& body) {
    gridDim.x = grid;
    blockDim.x = block;
    for (unsigned b = 0; b < grid; b++) {
        EmuBlock blk;
        blk.bar = std::make_unique<std::barrier<>>(block);
        for (unsigned w = 0; w < (block + 31) / 32; w++)
            blk.warp_bar.push_back(std::make_unique<std::barrier<>>(std::min(32u, block - 32 * w)));
        blk.xchg.assign(block, 0);
        std::vector<std::thread> ts;
        ts.reserve(block);
        for (unsigned t = 0; t < block; t++)
            ts.emplace_back([&, t] {
                threadIdx.x = t;
                blockIdx.x = b;
                emu_blk = &blk;
                body();
                // An exited thread no longer takes part in barriers (as on the GPU).
                blk.warp_bar[t >> 5]->arrive_and_drop();
                blk.bar->arrive_and_drop();
            });
        for (auto& t : ts) t.join();
    }
}
