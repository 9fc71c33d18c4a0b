// The emulator's own semantics: shuffles with every width against CUDA's documented rules,
// votes and reductions over partial masks, barriers with predicates, 3-D indices, dynamic and
// namespace-scope shared memory, the 0xFF fill of shared memory at each block, per-thread
// parameter copies, inline PTX conversions.
//
//     python3 scripts/cuda-emu/run.py scripts/cuda-emu/tests/emu_test.cpp
#include "emu.h"
#include "src/backend/cuda/kernels/common.cuh"

// --- Shuffles ------------------------------------------------------------------------------

constexpr int WIDTHS[] = {1, 2, 4, 8, 16, 32};
constexpr int ARGS[] = {0, 1, 3, 6, 16, 17, 31, 37};
constexpr int NW = 6, NA = 8, THREADS = 64;

// out[((kind * NW + w) * NA + a) * THREADS + tid]: the int value every thread got.
__global__ void shuffles(int* out, float* outf, double* outd) {
    int tid = threadIdx.x, v = tid * 10 + 7;
    for (int w = 0; w < NW; w++) {
        for (int a = 0; a < NA; a++) {
            int width = WIDTHS[w], arg = ARGS[a];
            int base = (w * NA + a) * THREADS + tid, step = NW * NA * THREADS;
            out[0 * step + base] = __shfl_sync(0xffffffffu, v, arg, width);
            out[1 * step + base] = __shfl_up_sync(0xffffffffu, v, arg, width);
            out[2 * step + base] = __shfl_down_sync(0xffffffffu, v, arg, width);
            out[3 * step + base] = __shfl_xor_sync(0xffffffffu, v, arg, width);
            outf[base] = __shfl_xor_sync(0xffffffffu, (float)v + 0.5f, arg, width);
            outd[base] = __shfl_down_sync(0xffffffffu, (double)v + 0.25, arg, width);
        }
    }
}

// CUDA C++ Programming Guide, warp shuffle functions: lanes are split in groups of `width`;
// __shfl_sync reads lane srcLane % width of the caller's group; __shfl_up_sync lane - delta
// unless that leaves the group (then the caller's own value), __shfl_down_sync lane + delta
// likewise; __shfl_xor_sync lane ^ laneMask, which may reach an earlier group but returns the
// caller's own value for a later one. Lane arguments use their low 5 bits (PTX).
static int shfl_ref(int kind, int lane, int width, int arg) {
    int group = lane / width * width;
    int a = arg & 31;
    switch (kind) {
    case 0: return group + a % width;
    case 1: return lane - a >= group ? lane - a : lane;
    case 2: return lane + a < group + width ? lane + a : lane;
    default: return (lane ^ a) < group + width ? (lane ^ a) : lane;
    }
}

static void check_shuffles() {
    size_t step = NW * NA * THREADS;
    std::vector<int> out(4 * step);
    std::vector<float> outf(step);
    std::vector<double> outd(step);
    emu_launch(shuffles, dim3(1), dim3(THREADS), 0, out.data(), outf.data(), outd.data());
    static const char* names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                  "__shfl_xor_sync"};
    for (int kind = 0; kind < 4; kind++) {
        for (int w = 0; w < NW; w++) {
            for (int a = 0; a < NA; a++) {
                std::vector<int> got(THREADS), want(THREADS);
                for (int t = 0; t < THREADS; t++) {
                    int base = (w * NA + a) * THREADS + t;
                    got[t] = out[kind * step + base];
                    int src = (t & ~31) + shfl_ref(kind, t & 31, WIDTHS[w], ARGS[a]);
                    want[t] = src * 10 + 7;
                    if (kind == 3)
                        EMU_CHECK(outf[base] == (float)want[t] + 0.5f, "float xor shuffle");
                    if (kind == 2)
                        EMU_CHECK(outd[base] == (double)want[t] + 0.25, "double down shuffle");
                }
                char what[80];
                snprintf(what, sizeof what, "%s width %d arg %d", names[kind], WIDTHS[w], ARGS[a]);
                emu::expect_bits(what, got, want);
            }
        }
    }
}

// --- Votes, warp reductions, barriers with predicates ----------------------------------------

// Two warps; in each, lanes 0..15 and 16..31 take different branches, with their own masks.
__global__ void votes(unsigned* out) {
    unsigned lane = threadIdx.x & 31, t = threadIdx.x;
    unsigned* o = out + t * 8;
    if (lane < 16) {
        o[0] = __ballot_sync(0x0000ffffu, lane & 1);
        o[1] = __any_sync(0x0000ffffu, lane == 3);
        o[2] = __all_sync(0x0000ffffu, lane < 16);
        o[3] = __reduce_add_sync(0x0000ffffu, lane);
    } else {
        o[0] = __ballot_sync(0xffff0000u, lane % 3 == 0);
        o[1] = __any_sync(0xffff0000u, lane == 3);
        o[2] = __all_sync(0xffff0000u, lane < 31);
        o[3] = __reduce_max_sync(0xffff0000u, lane * 2);
    }
    __syncwarp();
    o[4] = __match_any_sync(0xffffffffu, lane / 8);
    o[5] = __syncthreads_count(t % 5 == 0);
    o[6] = __syncthreads_and(t < 64);
    o[7] = __syncthreads_or(t == 63);
}

static void check_votes() {
    std::vector<unsigned> out(64 * 8);
    emu_launch(votes, dim3(1), dim3(64), 0, out.data());
    for (unsigned t = 0; t < 64; t++) {
        unsigned lane = t & 31, *o = &out[t * 8];
        unsigned ballot = 0, add = 0;
        if (lane < 16) {
            for (unsigned l = 0; l < 16; l++) ballot |= (l & 1) << l, add += l;
            EMU_CHECK(o[0] == ballot && o[1] == 1 && o[2] == 1 && o[3] == add,
                      "votes, lane %u: %x %u %u %u", lane, o[0], o[1], o[2], o[3]);
        } else {
            for (unsigned l = 16; l < 32; l++) ballot |= (unsigned)(l % 3 == 0) << l;
            EMU_CHECK(o[0] == ballot && o[1] == 0 && o[2] == 0 && o[3] == 62,
                      "votes, lane %u: %x %u %u %u", lane, o[0], o[1], o[2], o[3]);
        }
        EMU_CHECK(o[4] == 0xFFu << (lane / 8 * 8), "match_any, lane %u: %x", lane, o[4]);
        EMU_CHECK(o[5] == 13 && o[6] == 1 && o[7] == 1, "syncthreads_count/and/or: %u %u %u",
                  o[5], o[6], o[7]);
    }
}

// --- Indices, shared memory, parameters ------------------------------------------------------

// Every thread of a 3-D grid of 3-D blocks writes its coordinates at its linear index.
__global__ void indices(int* out) {
    int b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    int t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    int* o = out + (b * blockDim.x * blockDim.y * blockDim.z + t) * 6;
    o[0] = blockIdx.x, o[1] = blockIdx.y, o[2] = blockIdx.z;
    o[3] = threadIdx.x, o[4] = threadIdx.y, o[5] = threadIdx.z;
}

static void check_indices() {
    dim3 grid(2, 3, 2), block(4, 3, 2);
    int nb = 12, nt = 24;
    std::vector<int> out(nb * nt * 6, -1);
    emu_launch(indices, grid, block, 0, out.data());
    size_t bad = 0;
    for (int b = 0; b < nb; b++)
        for (int t = 0; t < nt; t++) {
            int* o = &out[(b * nt + t) * 6];
            int want[6] = {b % 2, b / 2 % 3, b / 6, t % 4, t / 4 % 3, t / 12};
            bad += memcmp(o, want, sizeof want) != 0;
        }
    EMU_CHECK(bad == 0, "3-D indices: %zu threads wrong", bad);
}

__shared__ int ns_shared[4];  // namespace scope: filled at every block
extern __shared__ unsigned char ns_dynamic[];

// Block b: `before` reads the shared variables before anything is written (the fill), then
// the block writes, synchronises and reads its neighbours (sharing).
__global__ void shared_mem(unsigned* before, int* after, const int* base) {
    __shared__ float s[64];
    volatile __shared__ int vol;
    extern __shared__ int dyn[];
    int t = threadIdx.x, b = blockIdx.x;
    base += t;  // a parameter is each thread's own copy
    if (t == 0) {
        before[b * 4 + 0] = __float_as_uint(s[5]);
        before[b * 4 + 1] = (unsigned)dyn[7];
        before[b * 4 + 2] = (unsigned)ns_shared[1];
        before[b * 4 + 3] = ns_dynamic[3];
    }
    __syncthreads();
    s[t] = (float)(*base + b);
    dyn[t] = *base * 2 + b;
    if (t < 4) ns_shared[t] = t + b;
    if (t == 0) vol = 7;
    __syncthreads();
    after[b * 64 + t] = (int)s[(t + 1) % 64] + dyn[(t + 63) % 64] + ns_shared[t % 4] + (vol - 7) +
                        (int)((unsigned char*)dyn == ns_dynamic);
}

static void check_shared() {
    const int blocks = 3;
    std::vector<unsigned> before(blocks * 4);
    std::vector<int> after(blocks * 64), base(64);
    for (int i = 0; i < 64; i++) base[i] = i * 3;
    emu_launch(shared_mem, dim3(blocks), dim3(64), 64 * sizeof(int), before.data(), after.data(),
               base.data());
    for (int b = 0; b < blocks; b++) {
        EMU_CHECK(before[b * 4] == 0xFFFFFFFFu && before[b * 4 + 1] == 0xFFFFFFFFu &&
                      before[b * 4 + 2] == 0xFFFFFFFFu && before[b * 4 + 3] == 0xFF,
                  "block %d: shared memory before any write: %x %x %x %x (want 0xFF bytes)", b,
                  before[b * 4], before[b * 4 + 1], before[b * 4 + 2], before[b * 4 + 3]);
        for (int t = 0; t < 64; t++) {
            int want = (base[(t + 1) % 64] + b) + (base[(t + 63) % 64] * 2 + b) + (t % 4 + b) + 1;
            EMU_CHECK(after[b * 64 + t] == want, "block %d thread %d: %d, want %d", b, t,
                      after[b * 64 + t], want);
        }
    }
}

// --- Inline PTX, atomics -----------------------------------------------------------------------

__global__ void ptx(const float* x, unsigned short* bf, float* back, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x[i]));
    bf[i] = h;
    float f;
    asm volatile("{ cvt.f32.bf16 %0, %1; }" : "=f"(f) : "h"(h));
    back[i] = f;
}

static void check_ptx() {
    const int n = 1000;
    std::vector<float> x(n), back(n);
    std::vector<unsigned short> bf(n), want(n);
    std::mt19937 rng(3);
    for (int i = 0; i < n; i++) {
        x[i] = std::uniform_real_distribution<float>(-100, 100)(rng);
        want[i] = from_f32<bf16>(x[i]).bits;  // the prelude's rounding: the same for non-NaN
    }
    emu_launch(ptx, dim3((n + 255) / 256), dim3(256), 0, x.data(), bf.data(), back.data(), n);
    emu::expect_bits("cvt.rn.bf16.f32", bf, want);
    for (int i = 0; i < n; i++) EMU_CHECK(back[i] == to_f32(bf16{want[i]}), "cvt.f32.bf16");
}

__global__ void counts(int* total) { atomicAdd(total, (int)threadIdx.x); }

static void check_atomics() {
    int total = 0;
    emu_launch(counts, dim3(4), dim3(128), 0, &total);
    EMU_CHECK(total == 4 * 127 * 128 / 2, "atomicAdd total %d", total);
}

int main() {
    check_shuffles();
    check_votes();
    check_indices();
    check_shared();
    check_ptx();
    check_atomics();
    return emu::finish();
}
