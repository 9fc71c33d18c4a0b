// convert.cu: the small kernels around the GEMMs the host runs on cuBLASLt (ops/linear.rs,
// ops/lm_head.rs, ops/adapter.rs; the GEMM wrapper is gemm.rs).
//
// Ops served:
// - every GEMM of a bf16/f16 plan that reads an f32 operand beside a storage-type one: cuBLASLt
//   multiplies operands of one type, so the f32 operand is first rounded to the storage type
//   T by [f32_to_storage_<S>] into the backend's scratch (`weight_tile`): a linear layer's,
//   the LM head's or a LoRA adapter's f32 master weight; the LM head's f32 dlogits chunk
//   before its two backward GEMMs; a LoRA backward's f32 dh. (The CPU's AVX512_BF16 path
//   rounds such operands to bf16 the same way as it packs them.)
// - Op::MatmulBackward's bias gradient db += Σ_rows dout: [col_sum_partials_<S>] sums the rows
//   in chunks of R into f32 partials, then norm.cu's norm_reduce_partials_<S> adds each
//   column's partials in order to db, rounded to T once (deterministic, no atomics).

// f32_to_storage_<S>: y[i] = T(x[i]) (round to nearest even; the prelude's from_f32<T>;
// `_f32` copies).
//   x  f32 [n];  y  T [n] out (may not overlap x);  n  i64
// Launch: grid = (min(ceil(n / 8 / 256), 65535)), block = (256) (any: grid-stride), dynamic
// smem 0. Scratch: none. A thread rounds 16 bytes of `y` at a time where both pointers are
// 16-byte aligned, else one value: the same rounding either way. Elementwise: no naive twin.
template <typename T>
__device__ void f32_to_storage(const float* x, T* y, long long n) {
    constexpr int E = 16 / sizeof(T);  // values a pack of y; E / 4 packs of x
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long packs = mw_aligned16(x) && mw_aligned16(y) ? n / E : 0;
    for (long long p = t0; p < packs; p += stride) {
        MwPack<T> o;
#pragma unroll
        for (int q = 0; q < E / 4; q++) {
            const MwPack<float> f = mw_load16(x + p * E + q * 4);
#pragma unroll
            for (int k = 0; k < 4; k++) o.v[q * 4 + k] = from_f32<T>(f.v[k]);
        }
        mw_store16(y + p * E, o);
    }
    for (long long i = packs * E + t0; i < n; i += stride) y[i] = from_f32<T>(x[i]);
}
#define F32_TO_STORAGE(T, S)                                                                 \
    extern "C" __global__ void f32_to_storage_##S(const float* x, T* y, long long n) {       \
        f32_to_storage<T>(x, y, n);                                                          \
    }
MW_STORAGE_ENTRIES(F32_TO_STORAGE)

// col_sum_partials_<S>: per-chunk column sums of x [N, C]: for chunk p (rows p·R …
// min(N, p·R + R) − 1, added in row order in f32) and column c,
//   partials[p, c] = Σ x[r, c],   P = ceil(N / R) chunks.
//   partials  f32 [P, C] scratch (written)
//   x         T [N, C]
//   N, C, R   int (R rows per chunk, >= 1)
// One thread per (chunk, column). Launch (grid-stride both ways, any shape is correct):
// block = 256 (columns), grid = (ceil(C / 256), min(P, 65535)). No shared memory. Then
// norm_reduce_partials_<S>(db, partials, P, C) (norm.cu). The sums depend on R only: the host
// chooses it from N alone.
template <typename T>
__device__ void col_sum_partials(float* partials, const T* x, int N, int C, int R) {
    long long P = ((long long)N + R - 1) / R;
    for (long long p = blockIdx.y; p < P; p += gridDim.y) {
        long long r0 = p * R;
        long long r1 = r0 + R < N ? r0 + R : N;
        for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < C;
             c += (long long)gridDim.x * blockDim.x) {
            float s = 0.0f;
#pragma unroll 8
            for (long long r = r0; r < r1; r++) s = __fadd_rn(s, to_f32(x[r * C + c]));
            partials[p * C + c] = s;
        }
    }
}
#define COL_SUM_PARTIALS(T, S)                                                               \
    extern "C" __global__ void col_sum_partials_##S(float* partials, const T* x, int N,      \
                                                    int C, int R) {                          \
        col_sum_partials<T>(partials, x, N, C, R);                                           \
    }
MW_STORAGE_ENTRIES(COL_SUM_PARTIALS)
