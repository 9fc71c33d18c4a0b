// lora.cu: the elementwise steps of a LoRA adapter (Op::LoraForward, Op::LoraBackward) around
// its four thin GEMMs (backend/cpu/lora.rs), which the host runs on cuBLASLt.
//
// Ops served, step by step (GEMMs by the host; kernels here in [brackets]):
// Op::LoraForward (h = scale · x @ aᵀ; out[:, col..col+OC] += h @ bᵀ):
//   1. with dropout (training only): [lora_dropout_<S>] xd = mask ⊙ inp / (1 − p) into the
//      f32 workspace `ws` [N, IC]; the GEMM then reads xd in place of inp.
//   2. GEMM h[N, r] = (xd or inp) @ aᵀ, stored as T (the CPU rounds it to T once);
//   3. [lora_scale_<S>] h = T(to_f32(h) · scale) in place: the CPU scales the stored h
//      as a separate step (two roundings in bf16/f16; the same as alpha = scale in f32). If
//      the GEMM can only produce f32 (an f32 operand beside a T one), write it to f32 scratch
//      and use [lora_narrow_scale_<S>] (h = T(to_f32(T(acc)) · scale)) instead.
//   4. GEMM out[:, col..col+OC] += h @ bᵀ: cuBLASLt writes it directly (D = C = out + col,
//      ldc = ldd = ldo, beta = 1) when its types allow T output; otherwise the product goes
//      to f32 scratch [N, OC] and [lora_add_cols_<S>] adds it into the column block (one
//      rounding per element, as the CPU's accumulating GEMM).
// Op::LoraBackward:
//   1. GEMM db += dyᵀ @ h (dy = dout + col, ld ldo): a GEMM (or f32 scratch + lora_add_cols_<S>
//      with ld = r when its output cannot be T).
//   2. GEMM dh[N, r] (f32 scratch) = dy @ b, then [lora_scale_f32] dh ·= scale (the CPU's
//      separate step; bitwise alpha = scale in f32, so alpha may be used instead).
//   3. with dropout: [lora_dropout_<S>] xd again (the same mask) into ws; GEMM da += dhᵀ @ xd;
//      GEMM ws = dh @ a (f32, overwriting xd); [lora_add_masked_<S>] dinp += mask ⊙ ws / (1−p).
//      Without dropout: GEMM da += dhᵀ @ inp; GEMM dinp += dh @ a (directly with beta = 1, or
//      f32 scratch + [lora_add_cols_<S>] with ld = IC).
//   [lora_widen_<S>] widens a T buffer to f32 where a GEMM needs both operands f32.
//
// The dropout mask (backend/cpu/lora.rs `Dropout`, bit-exact, 64-bit integer arithmetic):
// element e (row-major index in this op's inp [N, IC]) is kept iff
//   mix(key + (first + e) · GOLDEN) >> 32 >= below          (wrapping u64 arithmetic)
// with GOLDEN = 0x9E3779B97F4A7C15 and mix the SplitMix64 finaliser. The host computes, as
// `lora::Dropout::new(p, ctx.dropout_seed, adapter, first)` does:
//   key   = mix(seed ^ mix(adapter + GOLDEN))          (u64)
//   below = (u64)((f64)p · 4294967296.0)                (u64)
//   keep_scale = 1 / (1 − p)                            (f32 arithmetic)
//   first = (ctx.first_micro + dropout.micro) · rows.n() · IC   (rows.n(): the plan's N)
// and the kernels take them as (key, below, keep_scale, first).
//
// All kernels here are elementwise and plain (one thread per element, grid-stride loops): no
// naive twins are needed.

#define LORA_GOLDEN 0x9E3779B97F4A7C15ull

__device__ __forceinline__ unsigned long long lora_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Whether element e of the op's input is kept (`Dropout::keeps`).
__device__ __forceinline__ bool lora_keeps(unsigned long long key, unsigned long long below,
                                           unsigned long long first, long long e) {
    const unsigned long long z = key + (first + (unsigned long long)e) * LORA_GOLDEN;
    return (lora_mix(z) >> 32) >= below;
}

#define LORA_GRID_STRIDE(i, n)                                                               \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);            \
         i += (long long)gridDim.x * blockDim.x)

// lora_dropout_<S>: xd[e] = kept(e) ? to_f32(x[e]) · keep_scale : 0 (`Dropout::apply`).
//   x          T   [n]  the op's input inp [N, IC] (n = N·IC)
//   xd         f32 [n]  out: the dropout workspace `ws` [N, IC]
//   n          i64      N·IC (N = the rows of this call)
//   key, below, first   u64 (see the header); keep_scale f32
// Launch: grid = (min(ceil(n / 256), 65535)), block = (256) (any), dynamic smem 0. Scratch: none.
template <typename T>
__device__ void lora_dropout(const T* x, float* xd, long long n, unsigned long long key,
                             unsigned long long below, float keep_scale,
                             unsigned long long first) {
    LORA_GRID_STRIDE(e, n) {
        xd[e] = lora_keeps(key, below, first, e) ? __fmul_rn(to_f32(x[e]), keep_scale) : 0.0f;
    }
}
#define LORA_DROPOUT(T, S)                                                                   \
    extern "C" __global__ void lora_dropout_##S(const T* x, float* xd, long long n,         \
                                                unsigned long long key,                     \
                                                unsigned long long below, float keep_scale, \
                                                unsigned long long first) {                 \
        lora_dropout<T>(x, xd, n, key, below, keep_scale, first);                            \
    }
MW_STORAGE_ENTRIES(LORA_DROPOUT)

// lora_add_masked_<S>: dx[e] = T(to_f32(dx[e]) + t[e] · keep_scale) where kept(e); dropped
// elements untouched (`Dropout::add_into`): the backward's dinp += mask ⊙ (dh @ a) / (1 − p).
//   dx  T   [n]  dinp [N, IC], += (the frozen layer's backward wrote it first)
//   t   f32 [n]  dh @ a (the workspace `ws`)
//   n   i64      N·IC;  key, below, keep_scale, first as lora_dropout_<S> (the same mask)
// Launch: grid = (min(ceil(n / 256), 65535)), block = (256) (any), dynamic smem 0. Scratch: none.
template <typename T>
__device__ void lora_add_masked(T* dx, const float* t, long long n, unsigned long long key,
                                unsigned long long below, float keep_scale,
                                unsigned long long first) {
    LORA_GRID_STRIDE(e, n) {
        if (lora_keeps(key, below, first, e))
            dx[e] = from_f32<T>(__fadd_rn(to_f32(dx[e]), __fmul_rn(t[e], keep_scale)));
    }
}
#define LORA_ADD_MASKED(T, S)                                                                \
    extern "C" __global__ void lora_add_masked_##S(T* dx, const float* t, long long n,      \
                                                   unsigned long long key,                  \
                                                   unsigned long long below,                \
                                                   float keep_scale,                        \
                                                   unsigned long long first) {              \
        lora_add_masked<T>(dx, t, n, key, below, keep_scale, first);                         \
    }
MW_STORAGE_ENTRIES(LORA_ADD_MASKED)

// lora_scale_<S>: x[i] = T(to_f32(x[i]) · scale) in place: the forward's h (T) after its GEMM,
// and (lora_scale_f32) the backward's dh (f32) after its GEMM.
//   x T [n] in place;  n i64 (N·r);  scale f32 (the op's `scale`)
// Launch: grid = (min(ceil(n / 256), 65535)), block = (256) (any), dynamic smem 0. Scratch: none.
template <typename T>
__device__ void lora_scale(T* x, long long n, float scale) {
    LORA_GRID_STRIDE(i, n) { x[i] = from_f32<T>(__fmul_rn(to_f32(x[i]), scale)); }
}
#define LORA_SCALE(T, S)                                                                     \
    extern "C" __global__ void lora_scale_##S(T* x, long long n, float scale) {             \
        lora_scale<T>(x, n, scale);                                                          \
    }
MW_STORAGE_ENTRIES(LORA_SCALE)

// lora_narrow_scale_<S>: h[i] = T(to_f32(T(acc[i])) · scale): the forward's h from an f32 GEMM
// result, rounded to T first and then scaled, as the CPU (GEMM into T, then lora_scale).
//   acc f32 [n]  the GEMM's f32 result (scratch);  h T [n] out;  n i64 (N·r);  scale f32
// Launch: grid = (min(ceil(n / 256), 65535)), block = (256) (any), dynamic smem 0. Scratch: none.
template <typename T>
__device__ void lora_narrow_scale(const float* acc, T* h, long long n, float scale) {
    LORA_GRID_STRIDE(i, n) {
        h[i] = from_f32<T>(__fmul_rn(to_f32(from_f32<T>(acc[i])), scale));
    }
}
#define LORA_NARROW_SCALE(T, S)                                                              \
    extern "C" __global__ void lora_narrow_scale_##S(const float* acc, T* h, long long n,   \
                                                     float scale) {                         \
        lora_narrow_scale<T>(acc, h, n, scale);                                              \
    }
MW_STORAGE_ENTRIES(LORA_NARROW_SCALE)

// lora_add_cols_<S>: dst[i·ld_dst + j] = T(to_f32(dst[i·ld_dst + j]) + src[i·ld_src + j]) for
// i < rows, j < cols: an f32 GEMM result added into a (strided) block of a T buffer with one
// rounding per element, as the CPU's accumulating mixed GEMM (out[:, col..col+OC] += h @ bᵀ
// with dst = out + col, ld_dst = ldo; or dinp += dh @ a with ld_dst = IC; or a gradient).
//   dst    T   [rows, ld_dst] (pointer offset to the block's first column), +=
//   ld_dst int  (>= cols)
//   src    f32 [rows, ld_src]
//   ld_src int  (>= cols)
//   rows, cols int
// Launch: grid = (min(ceil(rows·cols / 256), 65535)), block = (256) (any), dynamic smem 0.
// Scratch: none.
template <typename T>
__device__ void lora_add_cols(T* dst, int ld_dst, const float* src, int ld_src, int rows,
                              int cols) {
    const long long n = (long long)rows * cols;
    LORA_GRID_STRIDE(e, n) {
        const long long i = e / cols, j = e % cols;
        T* d = dst + i * ld_dst + j;
        *d = from_f32<T>(__fadd_rn(to_f32(*d), src[i * ld_src + j]));
    }
}
#define LORA_ADD_COLS(T, S)                                                                  \
    extern "C" __global__ void lora_add_cols_##S(T* dst, int ld_dst, const float* src,      \
                                                 int ld_src, int rows, int cols) {          \
        lora_add_cols<T>(dst, ld_dst, src, ld_src, rows, cols);                              \
    }
MW_STORAGE_ENTRIES(LORA_ADD_COLS)

// lora_widen_<S>: y[i] = to_f32(x[i]) (exact): a T operand widened for an f32 GEMM.
//   x T [n];  y f32 [n] out;  n i64
// Launch: grid = (min(ceil(n / 256), 65535)), block = (256) (any), dynamic smem 0. Scratch: none.
template <typename T>
__device__ void lora_widen(const T* x, float* y, long long n) {
    LORA_GRID_STRIDE(i, n) { y[i] = to_f32(x[i]); }
}
#define LORA_WIDEN(T, S)                                                                     \
    extern "C" __global__ void lora_widen_##S(const T* x, float* y, long long n) {          \
        lora_widen<T>(x, y, n);                                                              \
    }
MW_STORAGE_ENTRIES(LORA_WIDEN)
