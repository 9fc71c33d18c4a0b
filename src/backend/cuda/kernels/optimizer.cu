// optimizer.cu: the optimizer family (Op::GradNorm, Op::AdamW).
//
// Ops served:
// - Op::GradNorm { range, out, slot }: out[slot] (f64) = Σ grad² over the gradients of
//   `range` (storage type T), in two launches: `gradnorm_partials_<S>` (one f64 partial per
//   GN_CHUNK elements, into scratch) then `gradnorm_finish` (one block sums the partials in a
//   fixed order and WRITES out[slot]). Naive twin: `gradnorm_naive_<S>` (one thread).
// - Op::AdamW { tensors, state }: one launch per tensor (ParamSlice), by the moments' format:
//   `adamw_m32_<S>` (f32 m, v), `adamw_mbf16_<S>` (bf16 m, v), `adamw_m8_<S>` (8-bit block
//   codes; naive twin `adamw_m8_naive_<S>`). <S> is the gradients' storage type.
//
// AdamW arithmetic is bitwise the CPU's (`backend/cpu/adamw.rs` update_chunk, and
// `backend/cpu/quant.rs` for the compressed states), written with __fmul_rn/__fadd_rn/
// __fdiv_rn/__fsqrt_rn so no FMA contraction changes a rounding:
//   g  = to_f32(grad) · gs
//   m' = b1·m + c1·g
//   v' = b2·v + (c2·g)·g
//   p' = p·decay − (step_size·m') / (sqrt(v')·inv_sqrt_bc2 + eps)
// The per-step constants are the host's, computed exactly as `adamw::consts(hp)` does (with
// hp.weight_decay = 0 for a tensor whose `decay` is false), in f64 where it uses f64:
//   b1 = beta1, b2 = beta2, c1 = 1 − beta1 (f32), c2 = 1 − beta2 (f32), eps, gs = grad_scale,
//   step_size = (f32)(lr (as f64) / (1 − beta1^t)), bc = 1 − beta2^t (f64 powf, t = step),
//   inv_sqrt_bc2 = (f32)(1 / sqrt(bc)), decay = 1 − lr·weight_decay (f32; 1 without decay).
// Every AdamW entry takes them in this order after its buffers and length:
//   (b1, b2, c1, c2, eps, gs, step_size, inv_sqrt_bc2, decay).
//
// 8-bit state (QBLOCK = 2048 values per block, counted per tensor: block b of a tensor covers
// its elements [b·2048, min((b+1)·2048, len)), the last block possibly shorter; one f32
// absmax scale per block for m and one for v; m codes i8, v codes u8, log-spaced, 8 levels per
// octave): for each block, decode m and v, run the update above, then re-encode with the new
// block absmax (NaN if any value is NaN). Codes: m: 0 ↔ 0, ±k ↔ ±scale·2^((k−127)/8);
// v: 0 ↔ 0, k ↔ scale·2^((k−255)/8). Encoding: y = |x| / scale (IEEE division), code =
// clamp(top + round8log2(y)) from y's bits and the thresholds 2^((j−0.5)/8); a nonzero v
// never gets code 0; −128 is never produced and decodes like −127. Bitwise the CPU's.

#define QBLOCK 2048
// Elements per partial of gradnorm_partials, and its (required) block size.
#define GN_CHUNK 16384
#define GN_THREADS 256

// ---------------------------------------------------------------- gradient norm

// The sum of `v` over a block of GN_THREADS threads in a fixed order (warp butterflies, then
// the 8 warp sums in index order by thread 0); valid in thread 0. `sh` holds 8 doubles.
__device__ __forceinline__ double gn_block_sum(double v, double* sh) {
    v = warp_sum(v);
    __syncthreads();  // sh is free
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    double t = 0.0;
    if (threadIdx.x == 0)
        for (int w = 0; w < GN_THREADS / 32; w++) t = __dadd_rn(t, sh[w]);
    return t;
}

template <typename T>
__device__ void gradnorm_partials(const T* g, long long len, double* partials) {
    __shared__ double sh[GN_THREADS / 32];
    if (blockDim.x != GN_THREADS) __trap();
    const long long nparts = (len + GN_CHUNK - 1) / GN_CHUNK;
    for (long long c = blockIdx.x; c < nparts; c += gridDim.x) {
        const long long start = c * GN_CHUNK;
        const long long end = min(len, start + GN_CHUNK);
        double acc = 0.0;
        for (long long i = start + threadIdx.x; i < end; i += GN_THREADS) {
            const double v = (double)to_f32(g[i]);
            acc = __dadd_rn(acc, __dmul_rn(v, v));
        }
        const double s = gn_block_sum(acc, sh);
        if (threadIdx.x == 0) partials[c] = s;
    }
}

// gradnorm_partials_<S>: Op::GradNorm, phase 1: partials[c] = Σ g[i]² (f64) over elements
// [c·GN_CHUNK, min((c+1)·GN_CHUNK, len)) of the group's gradients.
//   g        T      [len]     the gradients of `range` (pointer offset to range.start)
//   len      i64              range.len() (> 0; for len = 0 skip this launch)
//   partials f64    [nparts]  out, nparts = ceil(len / 16384)
// Launch: grid = (min(nparts, 65535)) (any grid: blocks stride over the chunks, the results are
// the same bits), block = (256) EXACTLY (traps otherwise), dynamic smem 0.
// Scratch: `partials`, nparts = ceil(len / GN_CHUNK) f64 (GN_CHUNK = 16384).
#define GRADNORM_PARTIALS(T, S)                                                              \
    extern "C" __global__ void gradnorm_partials_##S(const T* g, long long len,             \
                                                     double* partials) {                    \
        gradnorm_partials<T>(g, len, partials);                                              \
    }
MW_STORAGE_ENTRIES(GRADNORM_PARTIALS)

// gradnorm_finish: Op::GradNorm, phase 2: out[slot] = Σ partials (f64), thread t summing
// partials t, t+256, ... in order, then the 256 sums in a fixed tree. WRITES out[slot].
//   partials f64 [nparts]   from gradnorm_partials_<S>
//   nparts   i64            ceil(len / 16384) (0 writes out[slot] = 0)
//   out      f64 [groups]   the step's grad_norm shares
//   slot     int            the group's index
// Launch: grid = (1), block = (256) EXACTLY (traps otherwise), dynamic smem 0. Scratch: none.
extern "C" __global__ void gradnorm_finish(const double* partials, long long nparts,
                                           double* out, int slot) {
    __shared__ double sh[GN_THREADS / 32];
    if (blockDim.x != GN_THREADS) __trap();
    if (blockIdx.x != 0) return;
    double acc = 0.0;
    for (long long i = threadIdx.x; i < nparts; i += GN_THREADS) acc = __dadd_rn(acc, partials[i]);
    const double s = gn_block_sum(acc, sh);
    if (threadIdx.x == 0) out[slot] = s;
}

// gradnorm_naive_<S>: the naive twin of the two launches above: out[slot] = Σ g[i]² summed
// serially by one thread (f64; the same value to rounding, not bitwise).
//   g T [len], len i64, out f64 [groups], slot int.
// Launch: grid = (1), block = (1), dynamic smem 0. Scratch: none.
template <typename T>
__device__ void gradnorm_naive(const T* g, long long len, double* out, int slot) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double acc = 0.0;
    for (long long i = 0; i < len; i++) {
        const double v = (double)to_f32(g[i]);
        acc = __dadd_rn(acc, __dmul_rn(v, v));
    }
    out[slot] = acc;
}
#define GRADNORM_NAIVE(T, S)                                                                 \
    extern "C" __global__ void gradnorm_naive_##S(const T* g, long long len, double* out,   \
                                                  int slot) {                               \
        gradnorm_naive<T>(g, len, out, slot);                                                \
    }
MW_STORAGE_ENTRIES(GRADNORM_NAIVE)

// ---------------------------------------------------------------- AdamW

struct AdamConsts {
    float b1, b2, c1, c2, eps, gs, step_size, inv_sqrt_bc2, decay;
};

// The CPU's `update_chunk` on one element, op for op: updates p, m, v (f32) from gradient
// `graw` (the stored gradient widened to f32).
__device__ __forceinline__ void adam_elem(float& p, float graw, float& m, float& v,
                                          const AdamConsts& k) {
    const float g = __fmul_rn(graw, k.gs);
    const float mi = __fadd_rn(__fmul_rn(k.b1, m), __fmul_rn(k.c1, g));
    const float vi = __fadd_rn(__fmul_rn(k.b2, v), __fmul_rn(__fmul_rn(k.c2, g), g));
    m = mi;
    v = vi;
    const float den = __fadd_rn(__fmul_rn(__fsqrt_rn(vi), k.inv_sqrt_bc2), k.eps);
    p = __fsub_rn(__fmul_rn(p, k.decay), __fdiv_rn(__fmul_rn(k.step_size, mi), den));
}

#define ADAM_CONST_PARAMS                                                                    \
    float b1, float b2, float c1, float c2, float eps, float gs, float step_size,           \
        float inv_sqrt_bc2, float decay
#define ADAM_CONST_INIT {b1, b2, c1, c2, eps, gs, step_size, inv_sqrt_bc2, decay}

template <typename T>
__device__ void adamw_m32(float* p, const T* g, float* m, float* v, long long n,
                          AdamConsts k) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float pi = p[i], mi = m[i], vi = v[i];
        adam_elem(pi, to_f32(g[i]), mi, vi, k);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
    }
}

// adamw_m32_<S>: Op::AdamW on one tensor, f32 moments (OptimState::F32); elementwise, plain
// (no twin needed).
//   p  f32 [n]  master weights of the tensor (pointer offset to its first element), updated
//   g  T   [n]  its gradients
//   m  f32 [n]  first moment (pointer offset to the tensor: element range.start − state.base)
//   v  f32 [n]  second moment (same offset)
//   n  i64      range.len()
//   then the 9 constants (see the header).
// Launch: grid = (min(ceil(n / 256), 65535)), block = (256) (any: grid-stride loop), dynamic
// smem 0. Scratch: none.
#define ADAMW_M32(T, S)                                                                      \
    extern "C" __global__ void adamw_m32_##S(float* p, const T* g, float* m, float* v,      \
                                             long long n, ADAM_CONST_PARAMS) {              \
        adamw_m32<T>(p, g, m, v, n, AdamConsts ADAM_CONST_INIT);                             \
    }
MW_STORAGE_ENTRIES(ADAMW_M32)

template <typename T>
__device__ void adamw_mbf16(float* p, const T* g, bf16* m, bf16* v, long long n,
                            AdamConsts k) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float pi = p[i], mi = to_f32(m[i]), vi = to_f32(v[i]);
        adam_elem(pi, to_f32(g[i]), mi, vi, k);
        p[i] = pi;
        m[i] = from_f32<bf16>(mi);
        v[i] = from_f32<bf16>(vi);
    }
}

// adamw_mbf16_<S>: Op::AdamW on one tensor, bf16 moments (OptimState::Bf16): widened, the f32
// update, narrowed back (round to nearest even); elementwise, plain (no twin needed).
//   p f32 [n], g T [n], m bf16 [n], v bf16 [n] (offsets as adamw_m32), n i64, 9 constants.
// Launch: grid = (min(ceil(n / 256), 65535)), block = (256) (any), dynamic smem 0.
// Scratch: none.
#define ADAMW_MBF16(T, S)                                                                    \
    extern "C" __global__ void adamw_mbf16_##S(float* p, const T* g, bf16* m, bf16* v,      \
                                               long long n, ADAM_CONST_PARAMS) {            \
        adamw_mbf16<T>(p, g, m, v, n, AdamConsts ADAM_CONST_INIT);                           \
    }
MW_STORAGE_ENTRIES(ADAMW_MBF16)

// ---- 8-bit codes (backend/cpu/quant.rs, op for op)

// 2^(r/8), r = 0..8, correctly rounded to f32 (quant.rs OCTAVE).
__device__ __forceinline__ float q8_octave(int r) {
    unsigned int b = 0x3f800000u;      // 1.0
    b = r == 1 ? 0x3f8b95c2u : b;      // 1.090_507_7
    b = r == 2 ? 0x3f9837f0u : b;      // 1.189_207_1
    b = r == 3 ? 0x3fa5fed7u : b;      // 1.296_839_6
    b = r == 4 ? 0x3fb504f3u : b;      // SQRT_2
    b = r == 5 ? 0x3fc5672au : b;      // 1.542_210_8
    b = r == 6 ? 0x3fd744fdu : b;      // 1.681_792_9
    b = r == 7 ? 0x3feac0c7u : b;      // 1.834_008_1
    return __uint_as_float(b);
}

// `level_from_bits(k, top)`: 2^((k − top)/8) for 1 <= k <= top, from bits.
__device__ __forceinline__ float q8_level(int k, int top) {
    const int d = k - top;
    const int e = d >> 3, r = d & 7;  // arithmetic shift: e = floor(d / 8)
    return __uint_as_float(__float_as_uint(q8_octave(r)) + ((unsigned int)e << 23));
}

// `log_code(y)`: round(8·log2 y) for y > 0 from the bits (not clamped).
__device__ __forceinline__ int q8_log_code(float y) {
    const unsigned int b = __float_as_uint(y);
    const int e = (int)((b >> 23) & 0xffu) - 127;
    const float f = __uint_as_float((b & 0x007fffffu) | 0x3f800000u);
    int c = 8 * e;
    c += f >= __uint_as_float(0x3f85aac3u);  // 1.044_273_7
    c += f >= __uint_as_float(0x3f91c3d3u);  // 1.138_788_6
    c += f >= __uint_as_float(0x3f9ef532u);  // 1.241_857_8
    c += f >= __uint_as_float(0x3fad583fu);  // 1.354_255_6
    c += f >= __uint_as_float(0x3fbd08a4u);  // 1.476_826_2
    c += f >= __uint_as_float(0x3fce248cu);  // 1.610_490_3
    c += f >= __uint_as_float(0x3fe0ccdfu);  // 1.756_252_2
    c += f >= __uint_as_float(0x3ff5257du);  // 1.915_206_6
    return c;
}

__device__ __forceinline__ float q8_decode_m(signed char q, float scale) {
    const int qi = (int)q;
    const int k = min(qi < 0 ? -qi : qi, 127);
    const float mag = k == 0 ? 0.0f : q8_level(k, 127);
    return __fmul_rn(qi < 0 ? -mag : mag, scale);
}

__device__ __forceinline__ float q8_decode_v(unsigned char q, float scale) {
    const int k = (int)q;
    const float l = k == 0 ? 0.0f : q8_level(k, 255);
    return __fmul_rn(l, scale);
}

// The code of m-value x in a block of scale `scale` (scale != 0).
__device__ __forceinline__ signed char q8_encode_m(float x, float scale) {
    const float y = __fdiv_rn(fabsf(x), scale);
    const int k = max(0, min(127, 127 + q8_log_code(y)));
    return (signed char)(x < 0.0f ? -k : k);
}

// The code of v-value x in a block of scale `scale` (scale != 0).
__device__ __forceinline__ unsigned char q8_encode_v(float x, float scale) {
    const float y = __fdiv_rn(fabsf(x), scale);
    const int k = max(1, min(255, 255 + q8_log_code(y)));
    return (unsigned char)(x == 0.0f ? 0 : k);
}

__device__ __forceinline__ float q8_nan() { return __uint_as_float(0x7fc00000u); }

template <typename T>
__device__ void adamw_m8(float* p, const T* g, signed char* mq, float* ms, unsigned char* vq,
                         float* vs, long long n, AdamConsts k) {
    __shared__ float mnew[QBLOCK];
    __shared__ float vnew[QBLOCK];
    __shared__ float red[32];
    const long long nblocks = (n + QBLOCK - 1) / QBLOCK;
    for (long long b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const long long base = b * QBLOCK;
        const int cnt = (int)min((long long)QBLOCK, n - base);
        const float msc = ms[b], vsc = vs[b];
        float mmax = 0.0f, vmax = 0.0f;
        int nan = 0;
        for (int j = threadIdx.x; j < cnt; j += blockDim.x) {
            const long long i = base + j;
            float pi = p[i];
            float mi = q8_decode_m(mq[i], msc);
            float vi = q8_decode_v(vq[i], vsc);
            adam_elem(pi, to_f32(g[i]), mi, vi, k);
            p[i] = pi;
            mnew[j] = mi;
            vnew[j] = vi;
            mmax = fmaxf(mmax, fabsf(mi));
            vmax = fmaxf(vmax, fabsf(vi));
            nan |= (mi != mi) ? 1 : 0;
            nan |= (vi != vi) ? 2 : 0;
        }
        // Block absmax (order-free), NaN if any value is NaN (as quant.rs `absmax`).
        mmax = block_max(mmax, red);
        vmax = block_max(vmax, red);
        const int mnan = __syncthreads_or(nan & 1), vnan = __syncthreads_or(nan & 2);
        const float mscale = mnan ? q8_nan() : mmax;
        const float vscale = vnan ? q8_nan() : vmax;
        for (int j = threadIdx.x; j < cnt; j += blockDim.x) {
            const long long i = base + j;
            mq[i] = mscale == 0.0f ? (signed char)0 : q8_encode_m(mnew[j], mscale);
            vq[i] = vscale == 0.0f ? (unsigned char)0 : q8_encode_v(vnew[j], vscale);
        }
        if (threadIdx.x == 0) {
            ms[b] = mscale;
            vs[b] = vscale;
        }
        __syncthreads();  // mnew, vnew, red are reused by the next block
    }
}

// adamw_m8_<S>: Op::AdamW on one tensor, 8-bit block states (OptimState::Int8), one CUDA block
// per QBLOCK (2048) values of the tensor.
//   p  f32 [n]          master weights of the tensor (offset to its first element), updated
//   g  T   [n]          its gradients
//   mq i8  [n]          m codes (offset: element range.start − state.base)
//   ms f32 [ceil(n/2048)]  m block scales (offset: block state_block − state.block_base)
//   vq u8  [n]          v codes (same offset as mq)
//   vs f32 [ceil(n/2048)]  v block scales (same offset as ms)
//   n  i64              range.len()
//   then the 9 constants (see the header).
// Launch: grid = (min(ceil(n / 2048), 65535)) (any grid: blocks stride over the QBLOCKs),
// block = (256) (any multiple of 32 from 32 to 1024: the same bits), dynamic smem 0 (16.1 KiB
// static). Scratch: none.
#define ADAMW_M8(T, S)                                                                       \
    extern "C" __global__ void adamw_m8_##S(float* p, const T* g, signed char* mq,          \
                                            float* ms, unsigned char* vq, float* vs,        \
                                            long long n,                                    \
                                            ADAM_CONST_PARAMS) {                            \
        adamw_m8<T>(p, g, mq, ms, vq, vs, n, AdamConsts ADAM_CONST_INIT);                    \
    }
MW_STORAGE_ENTRIES(ADAMW_M8)

template <typename T>
__device__ void adamw_m8_naive(float* p, const T* g, signed char* mq, float* ms,
                               unsigned char* vq, float* vs, long long n, AdamConsts k) {
    const long long nblocks = (n + QBLOCK - 1) / QBLOCK;
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const long long base = b * QBLOCK;
    const int cnt = (int)min((long long)QBLOCK, n - base);
    const float msc = ms[b], vsc = vs[b];
    // Pass 1: decode and update (nothing stored): the new blocks' maxima.
    float mmax = 0.0f, vmax = 0.0f;
    bool mnan = false, vnan = false;
    for (int j = 0; j < cnt; j++) {
        const long long i = base + j;
        float pi = p[i], mi = q8_decode_m(mq[i], msc), vi = q8_decode_v(vq[i], vsc);
        adam_elem(pi, to_f32(g[i]), mi, vi, k);
        mmax = fmaxf(mmax, fabsf(mi));
        vmax = fmaxf(vmax, fabsf(vi));
        mnan = mnan || mi != mi;
        vnan = vnan || vi != vi;
    }
    const float mscale = mnan ? q8_nan() : mmax;
    const float vscale = vnan ? q8_nan() : vmax;
    // Pass 2: the same update again (from the untouched old p, codes and scales), then the
    // stores: p, and the codes at the new scales.
    for (int j = 0; j < cnt; j++) {
        const long long i = base + j;
        float pi = p[i], mi = q8_decode_m(mq[i], msc), vi = q8_decode_v(vq[i], vsc);
        adam_elem(pi, to_f32(g[i]), mi, vi, k);
        p[i] = pi;
        mq[i] = mscale == 0.0f ? (signed char)0 : q8_encode_m(mi, mscale);
        vq[i] = vscale == 0.0f ? (unsigned char)0 : q8_encode_v(vi, vscale);
    }
    ms[b] = mscale;
    vs[b] = vscale;
}

// adamw_m8_naive_<S>: the naive twin of adamw_m8_<S> (same arguments, same bits): one thread
// per QBLOCK, serial; it runs the update twice per element (once for the block maxima, once
// to store) instead of keeping the new moments.
// Launch: grid = (ceil(ceil(n / 2048) / 64)), block = (64), dynamic smem 0. Scratch: none.
#define ADAMW_M8_NAIVE(T, S)                                                                 \
    extern "C" __global__ void adamw_m8_naive_##S(float* p, const T* g, signed char* mq,    \
                                                  float* ms, unsigned char* vq, float* vs,  \
                                                  long long n, ADAM_CONST_PARAMS) {         \
        adamw_m8_naive<T>(p, g, mq, ms, vq, vs, n, AdamConsts ADAM_CONST_INIT);              \
    }
MW_STORAGE_ENTRIES(ADAMW_M8_NAIVE)
