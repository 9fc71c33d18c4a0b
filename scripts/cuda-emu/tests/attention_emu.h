// A minimal CUDA emulation for running attention.cu's and attention_mma.cu's kernels with g++
// on the CPU (their tests only; see attention_run.py), the tensor cores' mma.sync m16n8k16
// included (emu_mma_m16n8k16, from warp shuffles). Each CTA runs as blockDim.x std::threads (CTAs
// one after another); __syncthreads, __syncthreads_or and __syncwarp are std::barrier waits,
// warp shuffles exchange through a per-warp buffer between two warp barriers. `__shared__`
// variables become function statics and the `extern __shared__` array a pointer into the
// emulator's buffer (attention_run.py rewrites the source so): right because CTAs never
// overlap.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

using std::max;
using std::min;

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

inline std::barrier<>* emu_block_bar;
inline std::barrier<>* emu_warp_bar[32];
inline unsigned long long emu_xchg[32][32];
inline int emu_or[1024];

inline void __syncthreads() { emu_block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
inline int __syncthreads_or(int p) {
    emu_or[threadIdx.x] = p;
    __syncthreads();
    int r = 0;
    for (unsigned i = 0; i < blockDim.x; ++i) r |= emu_or[i];
    __syncthreads();
    return r != 0;
}
template <class V> V __shfl_xor_sync(unsigned, V v, int o) {
    static_assert(sizeof(V) <= 8);
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(V));
    emu_xchg[w][l] = bits;
    __syncwarp();
    unsigned long long r = emu_xchg[w][l ^ o];
    __syncwarp();
    V out;
    std::memcpy(&out, &r, sizeof(V));
    return out;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }

template <class V> V __shfl_sync(unsigned, V v, int src) {
    static_assert(sizeof(V) <= 8);
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(V));
    emu_xchg[w][l] = bits;
    __syncwarp();
    unsigned long long r = emu_xchg[w][src & 31];
    __syncwarp();
    V out;
    std::memcpy(&out, &r, sizeof(V));
    return out;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 (attention_mma.cu's
// mw_mma_m16n8k16; attention_run.py puts this call in place of its asm): every lane of the warp
// calls it with its fragments, and gathers the whole A row and B columns its 4 outputs need
// from the lanes that hold them, by warp shuffles, following the PTX ISA's fragment layout
// (g = lane / 4, t = lane % 4; a 32-bit register holds two 16-bit values, the lower index in
// the low half):
//   A a0: (row g, cols 2t, 2t+1)  a1: (row g+8, cols 2t..)  a2: (row g, cols 2t+8..)
//     a3: (row g+8, cols 2t+8..);  B b0: (k 2t, 2t+1, col g)  b1: (k 2t+8, 2t+9, col g);
//   C c0, c1: (row g, cols 2t, 2t+1)  c2, c3: (row g+8, cols 2t, 2t+1).
// The 16 products of an output (exact in f64) are summed in f64 in k order and added to c
// once, rounded to f32: the tensor cores' own order and rounding differ (their bits are not
// emulated), their result is as close.
inline double emu_half(unsigned reg, int hi, bool bf) {
    unsigned short h = (unsigned short)(hi ? reg >> 16 : reg & 0xffffu);
    if (bf) return (double)__uint_as_float((unsigned)h << 16);
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (double)x;
}
inline void emu_mma_m16n8k16(float c[4], const unsigned a[4], const unsigned b[2], bool bf) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    double A[2][16], Bc[2][16];  // rows g, g+8 of A; columns 2t, 2t+1 of B
    for (int tt = 0; tt < 4; ++tt) {
        const int src = 4 * g + tt;  // holds A rows g, g+8 at cols 2tt.. and 2tt+8..
        unsigned r[4];
        for (int q = 0; q < 4; ++q) r[q] = __shfl_sync(0xffffffffu, a[q], src);
        for (int hi = 0; hi < 2; ++hi) {
            A[0][2 * tt + hi] = emu_half(r[0], hi, bf);
            A[1][2 * tt + hi] = emu_half(r[1], hi, bf);
            A[0][2 * tt + 8 + hi] = emu_half(r[2], hi, bf);
            A[1][2 * tt + 8 + hi] = emu_half(r[3], hi, bf);
        }
        for (int j = 0; j < 2; ++j) {
            const int bs = 4 * (2 * t + j) + tt;  // holds column 2t+j at k 2tt.. and 2tt+8..
            unsigned b0 = __shfl_sync(0xffffffffu, b[0], bs);
            unsigned b1 = __shfl_sync(0xffffffffu, b[1], bs);
            for (int hi = 0; hi < 2; ++hi) {
                Bc[j][2 * tt + hi] = emu_half(b0, hi, bf);
                Bc[j][2 * tt + 8 + hi] = emu_half(b1, hi, bf);
            }
        }
    }
    for (int r = 0; r < 2; ++r)
        for (int j = 0; j < 2; ++j) {
            double acc = 0;
            for (int k = 0; k < 16; ++k) acc += A[r][k] * Bc[j][k];
            c[2 * r + j] = (float)((double)c[2 * r + j] + acc);
        }
}

// Dynamic shared memory: a launch's `smem` bytes end where a guard of NaNs starts, so a kernel
// reading past the size its launch declares reads NaN (and fails its test), and one writing
// there is caught by the guard check after the launch. `extern __shared__ float att_sm[]` is
// rewritten as `float* att_sm = emu_dyn_smem;`.
constexpr size_t EMU_SMEM_CAP = 1 << 16, EMU_GUARD = 4096;  // floats
alignas(16) inline float emu_smem_buf[EMU_SMEM_CAP + EMU_GUARD];
inline float* emu_dyn_smem;

// Runs kernel(args...) over grid × block; dynamic shared memory `smem` bytes (checked).
template <class F, class... A>
void emu_launch(dim3 grid, dim3 block, size_t smem, F kernel, A... args) {
    if (smem > EMU_SMEM_CAP * 4 || smem % 4) { fprintf(stderr, "bad smem %zu\n", smem); abort(); }
    if (block.y != 1 || block.z != 1 || block.x % 32 || block.x > 1024) abort();
    // Poison the shared memory: a kernel must not read what it did not write.
    float nan = __int_as_float(0x7fc00001);
    std::fill(emu_smem_buf, emu_smem_buf + EMU_SMEM_CAP + EMU_GUARD, nan);
    emu_dyn_smem = emu_smem_buf + EMU_SMEM_CAP - smem / 4;
    gridDim = grid;
    blockDim = block;
    int warps = block.x / 32;
    std::barrier<> bb(block.x);
    std::vector<std::unique_ptr<std::barrier<>>> wb;
    for (int w = 0; w < warps; ++w) {
        wb.emplace_back(new std::barrier<>(32));
        emu_warp_bar[w] = wb.back().get();
    }
    emu_block_bar = &bb;
    // One std::thread per thread of a CTA, each running the CTAs in order (a block barrier
    // between two CTAs, after the kernel returned: early returns are fine).
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < block.x; ++t)
        ts.emplace_back([=, &bb] {
            threadIdx = dim3{t, 0, 0};
            for (unsigned z = 0; z < grid.z; ++z)
                for (unsigned y = 0; y < grid.y; ++y)
                    for (unsigned x = 0; x < grid.x; ++x) {
                        blockIdx = dim3{x, y, z};
                        kernel(args...);
                        bb.arrive_and_wait();
                    }
        });
    for (auto& t : ts) t.join();
    for (size_t i = EMU_SMEM_CAP; i < EMU_SMEM_CAP + EMU_GUARD; ++i)
        if (__float_as_uint(emu_smem_buf[i]) != 0x7fc00001u) {
            fprintf(stderr, "a kernel wrote past its %zu bytes of dynamic shared memory\n", smem);
            abort();
        }
}
