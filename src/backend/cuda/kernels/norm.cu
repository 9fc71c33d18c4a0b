// The normalisation family: layer norm, RMS norm and Qwen3's per-head q/k norm, forward and
// backward.
//
//   Op::LayerNorm { inp, out, mean, rstd, w, b, rows, c, eps }
//     ->  layernorm_forward_<S>(out, mean, rstd, inp, w, b, N, C, eps)
//   Op::LayerNormBackward { dinp, dout, inp, mean, rstd, w, b, rows, c }
//     ->  layernorm_backward_input_<S>(dinp, dout, inp, w, mean, rstd, N, C)
//         and, unless the op is frozen (no parameter gradients):
//         layernorm_backward_partials_<S>(partials, dout, inp, mean, rstd, N, C, R)
//         norm_reduce_partials_<S>(dw, partials, P, C)
//         norm_reduce_partials_<S>(db, partials + P·C, P, C)
//   Op::RmsNorm { inp, out, residual, rstd, w, offset, rows, c, eps }
//     ->  rmsnorm_forward_<S>(out, rstd, inp, residual or NULL, w, offset, N, C, eps)
//   Op::RmsNormBackward { dinp, dout, inp, rstd, w, offset, rows, c }
//     ->  rmsnorm_backward_input_<S>(dinp, dout, inp, w, offset, rstd, N, C)
//         and, unless frozen:
//         rmsnorm_backward_partials_<S>(partials, dout, inp, rstd, N, C, R)
//         norm_reduce_partials_<S>(dw, partials, P, C)
//   Op::QkNorm { inp, out, rstd, w, offset, rows, nh, nkv, hd, eps }
//     ->  qk_norm_forward_<S>(out, rstd, inp, w, offset, N, NH, NKV, HD, eps)
//   Op::QkNormBackward { d, inp, rstd, w, offset, rows, nh, nkv, hd }
//     ->  unless frozen, FIRST (they read d before it is overwritten):
//         qk_norm_backward_partials_<S>(partials, d, inp, rstd, N, NH, NKV, HD, R)
//         norm_reduce_partials_<S>(dw, partials, P, 2·HD)
//         then qk_norm_backward_input_<S>(d, inp, w, offset, rstd, N, NH, NKV, HD)
//   Naive twins (plain loops, one thread per row or per column; for tests; each with the
//   arguments of the kernel it twins, offset and residual included):
//     layernorm_forward_naive_<S>, layernorm_backward_input_naive_<S>,
//     layernorm_backward_params_naive_<S> (dw, db += directly), rmsnorm_forward_naive_<S>,
//     rmsnorm_backward_input_naive_<S>, rmsnorm_backward_params_naive_<S> (dw += directly),
//     qk_norm_forward_naive_<S>, qk_norm_backward_input_naive_<S>,
//     qk_norm_backward_params_naive_<S> (dw += directly).
//
// Dtypes (the CPU's `ops/norm.rs`, `backend/cpu/layernorm.rs`, `rmsnorm.rs`): inp, out,
// residual, dout, dinp and the parameter gradients dw, db are the storage type T (entries
// `_f32`, `_bf16`, `_f16`); the weights w, b, the gain's offset, the statistics mean, rstd [N]
// and the partials scratch are f32. Weight and gradient pointers are offset to their ranges'
// first element.
//
// Mathematics, as the CPU (statistics in f32, the biased variance, two passes):
//   layer norm: mean = Σx / C, var = Σ(x − mean)² / C, rstd = 1 / sqrt(var + eps),
//     out = ((x − mean)·rstd)·w + b;
//     backward, with norm = (x − mean)·rstd, g = w·dout:
//     dinp += ((g − Σg/C) − norm·(Σ g·norm)/C)·rstd   (ACCUMULATES: the residual gradient),
//     dw += Σ_rows norm·dout, db += Σ_rows dout        (ACCUMULATE, rounded to T once).
//   RMS norm: rstd = 1 / sqrt(Σx² / C + eps), out = (residual +) (x·rstd)·gain, with the gain
//     gain = w + offset (Gemma's 1 + w; offset 0 elsewhere, still added, as the CPU adds it:
//     a −0 weight gives a +0 gain) and the residual (Gemma's post-norms) added last, when the
//     pointer is not NULL;
//     backward, with norm = x·rstd, g = gain·dout:
//     dinp += (g − norm·(Σ g·norm)/C)·rstd, dw += Σ_rows norm·dout (the offset is a constant:
//     the weight's gradient is the gain's, so the partials take no offset).
//   Qwen3's q/k norm: the RMS norm per head, its gain offset + w likewise (no residual).
// Elementwise steps are rounded as the CPU rounds them (`__fmul_rn` etc., never an FMA), so
// given the same statistics they are bitwise the CPU's; the sums differ from the CPU's only in
// their order (a row: 32 lanes and a butterfly; the parameter gradients: rows in chunks of R,
// then the chunks in 8 fixed strands; both fixed).
//
// Determinism and launch shapes: a row is one warp's (32 lanes, each striding over the row by
// 32, summed by `warp_sum`): no result depends on the block size or grid. The parameter
// gradients: `*_backward_partials` sums the rows in chunks of R (rows r·R … r·R + R − 1 of
// chunk r, in order) into P = ceil(N / R) partials per column; `norm_reduce_partials` sums a
// column's P partials in a fixed order (8 interleaved strands, then the strands in order),
// adds the sum to the stored gradient in f32 and rounds to T once. The result depends on R: the host must choose R from the shape alone (suggested:
// R = 64). Scratch: `partials` f32 [2, P, C] for layer norm (dw's, then db's), [P, C] for RMS
// norm. The host skips every kernel here when N = 0 or C = 0 (the CPU then changes nothing;
// norm_reduce_partials with P = 0 returns at once, but a forward with C = 0 would store NaN
// statistics).

// ---- Layer norm ----

// out, mean, rstd = layernorm(inp; w, b) (Op::LayerNorm): one warp per row.
//   out   T [N, C];  mean, rstd  f32 [N] (written);  inp  T [N, C];  w, b  f32 [C]
//   N, C  (int);  eps  f32
// Launch: block = 32·W threads (a multiple of 32, e.g. 256), grid = ceil(N / W) (rows are
// also grid-strided, so fewer blocks are correct). No shared memory, no scratch. Naive twin:
// layernorm_forward_naive_<S>.
template <typename T>
__device__ void layernorm_forward(T* out, float* mean, float* rstd, const T* inp, const float* w,
                                  const float* b, int N, int C, float eps) {
    int lane = threadIdx.x & 31;
    long long warps = blockDim.x >> 5;
    for (long long row = blockIdx.x * warps + (threadIdx.x >> 5); row < N;
         row += (long long)gridDim.x * warps) {
        const T* x = inp + row * C;
        float s = 0.0f;
        for (int i = lane; i < C; i += 32) s += to_f32(x[i]);
        float mu = warp_sum(s) / (float)C;
        float v = 0.0f;
        for (int i = lane; i < C; i += 32) {
            float d = to_f32(x[i]) - mu;
            v += d * d;
        }
        float var = warp_sum(v) / (float)C;
        float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
        T* o = out + row * C;
        for (int i = lane; i < C; i += 32) {
            float n = __fmul_rn(__fsub_rn(to_f32(x[i]), mu), rs);
            o[i] = from_f32<T>(__fadd_rn(__fmul_rn(n, w[i]), b[i]));
        }
        if (lane == 0) {
            mean[row] = mu;
            rstd[row] = rs;
        }
    }
}

// The naive twin of layernorm_forward: one thread per row, sums in channel order.
//   Arguments as layernorm_forward.
// Launch: grid-stride over rows, any shape: block = 256, grid = ceil(N / 256).
template <typename T>
__device__ void layernorm_forward_naive(T* out, float* mean, float* rstd, const T* inp,
                                        const float* w, const float* b, int N, int C, float eps) {
    for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < N;
         row += (long long)gridDim.x * blockDim.x) {
        const T* x = inp + row * C;
        float s = 0.0f;
        for (int i = 0; i < C; i++) s = __fadd_rn(s, to_f32(x[i]));
        float mu = s / (float)C;
        float v = 0.0f;
        for (int i = 0; i < C; i++) {
            float d = __fsub_rn(to_f32(x[i]), mu);
            v = __fadd_rn(v, __fmul_rn(d, d));
        }
        float var = v / (float)C;
        float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
        T* o = out + row * C;
        for (int i = 0; i < C; i++) {
            float n = __fmul_rn(__fsub_rn(to_f32(x[i]), mu), rs);
            o[i] = from_f32<T>(__fadd_rn(__fmul_rn(n, w[i]), b[i]));
        }
        mean[row] = mu;
        rstd[row] = rs;
    }
}

// One element's terms of the row sums: g = w·dy, n = (x − mean)·rstd.
__device__ __forceinline__ void ln_bwd_terms(float wi, float dyi, float xi, float mu, float rs,
                                             float* g, float* n) {
    *g = __fmul_rn(wi, dyi);
    *n = __fmul_rn(__fsub_rn(xi, mu), rs);
}

// dinp += layernorm_backward_input(dout) (Op::LayerNormBackward's input gradient; all of a
// frozen layer norm's backward): one warp per row.
//   dinp  T [N, C] +=;  dout, inp  T [N, C];  w  f32 [C];  mean, rstd  f32 [N]
//   N, C  (int)
// Launch: as layernorm_forward (block = 32·W, grid = ceil(N / W)). No shared memory, no
// scratch. Naive twin: layernorm_backward_input_naive_<S>.
template <typename T>
__device__ void layernorm_backward_input(T* __restrict__ dinp, const T* __restrict__ dout,
                                         const T* __restrict__ inp, const float* __restrict__ w,
                                         const float* __restrict__ mean,
                                         const float* __restrict__ rstd, int N, int C) {
    // 16 bytes of each row a lane an access where the rows allow (lane l takes packs l, l + 32,
    // ...), else one value (lane l takes values l, l + 32, ...): a fixed order either way.
    constexpr int E = 16 / sizeof(T);
    const bool vec = C % E == 0 && mw_aligned16(dinp) && mw_aligned16(dout) &&
                     mw_aligned16(inp);
    int lane = threadIdx.x & 31;
    long long warps = blockDim.x >> 5;
    for (long long row = blockIdx.x * warps + (threadIdx.x >> 5); row < N;
         row += (long long)gridDim.x * warps) {
        const T* x = inp + row * C;
        const T* dy = dout + row * C;
        T* d = dinp + row * C;
        float mu = mean[row], rs = rstd[row];
        float sg = 0.0f, sgn = 0.0f, g, n;
        if (vec) {
            for (int i = lane * E; i < C; i += 32 * E) {
                const MwPack<T> yv = mw_load16(dy + i), xv = mw_load16(x + i);
#pragma unroll
                for (int k = 0; k < E; k++) {
                    ln_bwd_terms(w[i + k], to_f32(yv.v[k]), to_f32(xv.v[k]), mu, rs, &g, &n);
                    sg += g;
                    sgn += g * n;
                }
            }
        } else {
            for (int i = lane; i < C; i += 32) {
                ln_bwd_terms(w[i], to_f32(dy[i]), to_f32(x[i]), mu, rs, &g, &n);
                sg += g;
                sgn += g * n;
            }
        }
        float mean_g = warp_sum(sg) / (float)C;
        float mean_gn = warp_sum(sgn) / (float)C;
        if (vec) {
            for (int i = lane * E; i < C; i += 32 * E) {
                const MwPack<T> yv = mw_load16(dy + i), xv = mw_load16(x + i);
                MwPack<T> dv = mw_load16(d + i);
#pragma unroll
                for (int k = 0; k < E; k++) {
                    ln_bwd_terms(w[i + k], to_f32(yv.v[k]), to_f32(xv.v[k]), mu, rs, &g, &n);
                    float v = __fmul_rn(__fsub_rn(__fsub_rn(g, mean_g), __fmul_rn(n, mean_gn)), rs);
                    dv.v[k] = from_f32<T>(__fadd_rn(to_f32(dv.v[k]), v));
                }
                mw_store16(d + i, dv);
            }
        } else {
            for (int i = lane; i < C; i += 32) {
                ln_bwd_terms(w[i], to_f32(dy[i]), to_f32(x[i]), mu, rs, &g, &n);
                float v = __fmul_rn(__fsub_rn(__fsub_rn(g, mean_g), __fmul_rn(n, mean_gn)), rs);
                d[i] = from_f32<T>(__fadd_rn(to_f32(d[i]), v));
            }
        }
    }
}

// The naive twin of layernorm_backward_input: one thread per row, sums in channel order.
//   Arguments as layernorm_backward_input.
// Launch: grid-stride over rows, any shape: block = 256, grid = ceil(N / 256).
template <typename T>
__device__ void layernorm_backward_input_naive(T* dinp, const T* dout, const T* inp,
                                               const float* w, const float* mean,
                                               const float* rstd, int N, int C) {
    for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < N;
         row += (long long)gridDim.x * blockDim.x) {
        const T* x = inp + row * C;
        const T* dy = dout + row * C;
        float mu = mean[row], rs = rstd[row];
        float sg = 0.0f, sgn = 0.0f;
        for (int i = 0; i < C; i++) {
            float g = __fmul_rn(w[i], to_f32(dy[i]));
            float n = __fmul_rn(__fsub_rn(to_f32(x[i]), mu), rs);
            sg = __fadd_rn(sg, g);
            sgn = __fadd_rn(sgn, __fmul_rn(g, n));
        }
        float mean_g = sg / (float)C;
        float mean_gn = sgn / (float)C;
        T* d = dinp + row * C;
        for (int i = 0; i < C; i++) {
            float g = __fmul_rn(w[i], to_f32(dy[i]));
            float n = __fmul_rn(__fsub_rn(to_f32(x[i]), mu), rs);
            float v = __fmul_rn(__fsub_rn(__fsub_rn(g, mean_g), __fmul_rn(n, mean_gn)), rs);
            d[i] = from_f32<T>(__fadd_rn(to_f32(d[i]), v));
        }
    }
}

// Per-chunk sums of layer norm's parameter gradients (Op::LayerNormBackward, not frozen):
// for chunk p (rows p·R … min(N, p·R + R) − 1, in order) and column c,
//   partials[p, c]        = Σ ((x − mean)·rstd)·dout     (dw's)
//   partials[P + p, c]    = Σ dout                       (db's),   P = ceil(N / R).
//   partials  f32 [2, P, C] scratch (written)
//   dout, inp  T [N, C];  mean, rstd  f32 [N];  N, C, R (rows per chunk, >= 1)  (int)
// One thread per (chunk, column). Launch (grid-stride both ways, any shape is correct):
// block = 256 (columns), grid = (ceil(C / 256), min(P, 65535)). No shared memory.
// Then norm_reduce_partials twice (dw, db). Naive twin (of the pair):
// layernorm_backward_params_naive_<S>.
template <typename T>
__device__ void layernorm_backward_partials(float* partials, const T* dout, const T* inp,
                                            const float* mean, const float* rstd, int N, int C,
                                            int R) {
    long long P = ((long long)N + R - 1) / R;
    for (long long p = blockIdx.y; p < P; p += gridDim.y) {
        long long r0 = p * R;
        long long r1 = r0 + R < N ? r0 + R : N;
        for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < C;
             c += (long long)gridDim.x * blockDim.x) {
            float aw = 0.0f, ab = 0.0f;
#pragma unroll 8
            for (long long r = r0; r < r1; r++) {
                float dy = to_f32(dout[r * C + c]);
                float n = __fmul_rn(__fsub_rn(to_f32(inp[r * C + c]), mean[r]), rstd[r]);
                aw = __fadd_rn(aw, __fmul_rn(n, dy));
                ab = __fadd_rn(ab, dy);
            }
            partials[p * C + c] = aw;
            partials[(P + p) * C + c] = ab;
        }
    }
}

// The naive twin of layernorm_backward_partials + norm_reduce_partials (dw and db): one
// thread per column, all rows in order, added to the stored gradients and rounded once (the
// CPU's own order).
//   dw, db  T [C] +=;  dout, inp  T [N, C];  mean, rstd  f32 [N];  N, C  (int)
// Launch: grid-stride over columns, any shape: block = 256, grid = ceil(C / 256). No scratch.
template <typename T>
__device__ void layernorm_backward_params_naive(T* dw, T* db, const T* dout, const T* inp,
                                                const float* mean, const float* rstd, int N,
                                                int C) {
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < C;
         c += (long long)gridDim.x * blockDim.x) {
        float aw = 0.0f, ab = 0.0f;
        for (long long r = 0; r < N; r++) {
            float dy = to_f32(dout[r * C + c]);
            float n = __fmul_rn(__fsub_rn(to_f32(inp[r * C + c]), mean[r]), rstd[r]);
            aw = __fadd_rn(aw, __fmul_rn(n, dy));
            ab = __fadd_rn(ab, dy);
        }
        dw[c] = from_f32<T>(__fadd_rn(to_f32(dw[c]), aw));
        db[c] = from_f32<T>(__fadd_rn(to_f32(db[c]), ab));
    }
}

// ---- The parameter gradients' second pass (layer norm and RMS norm) ----

// grad[c] = T(f32(grad[c]) + Σ_{p < P} partials[p, c]) (the parameter gradient ACCUMULATES,
// rounded to T once). The sum in a fixed order: NORM_STRANDS strands, strand k summing
// partials k, k + 8, k + 16, ... in order, then the strands added 0 to 7, so a thread has 8
// loads in flight a round (one strand in index order left a few hundred threads waiting on
// one load at a time: 40 µs for GPT-2's 768 columns on an H200, Nsight Compute).
//   grad      T [C] +=
//   partials  f32 [P, C] (from *_backward_partials; layer norm's db: its partials + P·C)
//   P, C      (int; P = 0 leaves grad untouched)
// One thread per column. Launch: grid-stride over columns, any shape: block = 256, grid =
// ceil(C / 256). No shared memory.
#define NORM_STRANDS 8
template <typename T>
__device__ void norm_reduce_partials(T* grad, const float* partials, int P, int C) {
    if (P <= 0) return;
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < C;
         c += (long long)gridDim.x * blockDim.x) {
        float a[NORM_STRANDS];
#pragma unroll
        for (int k = 0; k < NORM_STRANDS; k++) a[k] = 0.0f;
        for (long long p = 0; p < P; p += NORM_STRANDS) {
#pragma unroll
            for (int k = 0; k < NORM_STRANDS; k++)
                if (p + k < P) a[k] = __fadd_rn(a[k], partials[(p + k) * C + c]);
        }
        float s = a[0];
#pragma unroll
        for (int k = 1; k < NORM_STRANDS; k++) s = __fadd_rn(s, a[k]);
        grad[c] = from_f32<T>(__fadd_rn(to_f32(grad[c]), s));
    }
}

// ---- RMS norm ----

// One output element of an RMS norm (or a q/k norm's head): (residual +) (x·rstd)·(w + offset),
// rounded as the CPU rounds it (rmsnorm.rs `forward_rows`). res is ignored without a residual.
template <typename T>
__device__ __forceinline__ T rms_out(float x, float rs, float wi, float offset, bool has_res,
                                     float res) {
    float v = __fmul_rn(__fmul_rn(x, rs), __fadd_rn(wi, offset));
    return from_f32<T>(has_res ? __fadd_rn(res, v) : v);
}

// out, rstd = (residual +) rmsnorm(inp; w + offset) (Op::RmsNorm): one warp per row.
//   out  T [N, C];  rstd  f32 [N] (written);  inp  T [N, C];
//   residual  T [N, C] or NULL (added to the output: Gemma's post-norms);  w  f32 [C];
//   offset  f32 (the gain is w + offset);  N, C (int);  eps f32
// out must not overlap inp or residual (the plan's buffers never do). Launch: as
// layernorm_forward (block = 32·W, grid = ceil(N / W)). No shared memory. Naive twin:
// rmsnorm_forward_naive_<S>.
template <typename T>
__device__ void rmsnorm_forward(T* out, float* rstd, const T* inp, const T* residual,
                                const float* w, float offset, int N, int C, float eps) {
    int lane = threadIdx.x & 31;
    long long warps = blockDim.x >> 5;
    for (long long row = blockIdx.x * warps + (threadIdx.x >> 5); row < N;
         row += (long long)gridDim.x * warps) {
        const T* x = inp + row * C;
        float s = 0.0f;
        for (int i = lane; i < C; i += 32) {
            float v = to_f32(x[i]);
            s += v * v;
        }
        float ms = warp_sum(s) / (float)C;
        float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
        T* o = out + row * C;
        const T* y = residual ? residual + row * C : nullptr;
        for (int i = lane; i < C; i += 32)
            o[i] = rms_out<T>(to_f32(x[i]), rs, w[i], offset, y != nullptr,
                              y ? to_f32(y[i]) : 0.0f);
        if (lane == 0) rstd[row] = rs;
    }
}

// The naive twin of rmsnorm_forward: one thread per row, the sum in channel order.
// Launch: grid-stride over rows, any shape: block = 256, grid = ceil(N / 256).
template <typename T>
__device__ void rmsnorm_forward_naive(T* out, float* rstd, const T* inp, const T* residual,
                                      const float* w, float offset, int N, int C, float eps) {
    for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < N;
         row += (long long)gridDim.x * blockDim.x) {
        const T* x = inp + row * C;
        float s = 0.0f;
        for (int i = 0; i < C; i++) {
            float v = to_f32(x[i]);
            s = __fadd_rn(s, __fmul_rn(v, v));
        }
        float ms = s / (float)C;
        float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
        T* o = out + row * C;
        for (int i = 0; i < C; i++) {
            float v = __fmul_rn(__fmul_rn(to_f32(x[i]), rs), __fadd_rn(w[i], offset));
            if (residual) v = __fadd_rn(to_f32(residual[row * C + i]), v);
            o[i] = from_f32<T>(v);
        }
        rstd[row] = rs;
    }
}

// dinp += rmsnorm_backward_input(dout) (Op::RmsNormBackward's input gradient; all of a frozen
// RMS norm's backward): one warp per row.
//   dinp  T [N, C] +=;  dout, inp  T [N, C];  w  f32 [C];  offset  f32 (the gain w + offset,
//   as the forward's);  rstd  f32 [N];  N, C  (int)
// A residual the forward added is the caller's: its gradient is dout itself.
// Launch: as layernorm_forward (block = 32·W, grid = ceil(N / W)). No shared memory. Naive
// twin: rmsnorm_backward_input_naive_<S>.
template <typename T>
__device__ void rmsnorm_backward_input(T* dinp, const T* dout, const T* inp, const float* w,
                                       float offset, const float* rstd, int N, int C) {
    int lane = threadIdx.x & 31;
    long long warps = blockDim.x >> 5;
    for (long long row = blockIdx.x * warps + (threadIdx.x >> 5); row < N;
         row += (long long)gridDim.x * warps) {
        const T* x = inp + row * C;
        const T* dy = dout + row * C;
        float rs = rstd[row];
        float sgn = 0.0f;
        for (int i = lane; i < C; i += 32) {
            float g = __fmul_rn(__fadd_rn(w[i], offset), to_f32(dy[i]));
            float n = __fmul_rn(to_f32(x[i]), rs);
            sgn += g * n;
        }
        float mean_gn = warp_sum(sgn) / (float)C;
        T* d = dinp + row * C;
        for (int i = lane; i < C; i += 32) {
            float g = __fmul_rn(__fadd_rn(w[i], offset), to_f32(dy[i]));
            float n = __fmul_rn(to_f32(x[i]), rs);
            float v = __fmul_rn(__fsub_rn(g, __fmul_rn(n, mean_gn)), rs);
            d[i] = from_f32<T>(__fadd_rn(to_f32(d[i]), v));
        }
    }
}

// The naive twin of rmsnorm_backward_input: one thread per row, the sum in channel order.
// Launch: grid-stride over rows, any shape: block = 256, grid = ceil(N / 256).
template <typename T>
__device__ void rmsnorm_backward_input_naive(T* dinp, const T* dout, const T* inp,
                                             const float* w, float offset, const float* rstd,
                                             int N, int C) {
    for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < N;
         row += (long long)gridDim.x * blockDim.x) {
        const T* x = inp + row * C;
        const T* dy = dout + row * C;
        float rs = rstd[row];
        float sgn = 0.0f;
        for (int i = 0; i < C; i++) {
            float g = __fmul_rn(__fadd_rn(w[i], offset), to_f32(dy[i]));
            float n = __fmul_rn(to_f32(x[i]), rs);
            sgn = __fadd_rn(sgn, __fmul_rn(g, n));
        }
        float mean_gn = sgn / (float)C;
        T* d = dinp + row * C;
        for (int i = 0; i < C; i++) {
            float g = __fmul_rn(__fadd_rn(w[i], offset), to_f32(dy[i]));
            float n = __fmul_rn(to_f32(x[i]), rs);
            float v = __fmul_rn(__fsub_rn(g, __fmul_rn(n, mean_gn)), rs);
            d[i] = from_f32<T>(__fadd_rn(to_f32(d[i]), v));
        }
    }
}

// Per-chunk sums of RMS norm's weight gradient (Op::RmsNormBackward, not frozen): for chunk p
// (rows p·R … min(N, p·R + R) − 1, in order) and column c,
//   partials[p, c] = Σ (x·rstd)·dout,   P = ceil(N / R) chunks.
//   partials  f32 [P, C] scratch (written)
//   dout, inp  T [N, C];  rstd  f32 [N];  N, C, R (>= 1)  (int)
// Launch: as layernorm_backward_partials: block = 256, grid = (ceil(C / 256), min(P, 65535)).
// Then norm_reduce_partials(dw, partials, P, C). Naive twin (of the pair):
// rmsnorm_backward_params_naive_<S>.
template <typename T>
__device__ void rmsnorm_backward_partials(float* partials, const T* dout, const T* inp,
                                          const float* rstd, int N, int C, int R) {
    long long P = ((long long)N + R - 1) / R;
    for (long long p = blockIdx.y; p < P; p += gridDim.y) {
        long long r0 = p * R;
        long long r1 = r0 + R < N ? r0 + R : N;
        for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < C;
             c += (long long)gridDim.x * blockDim.x) {
            float a = 0.0f;
#pragma unroll 8
            for (long long r = r0; r < r1; r++) {
                float n = __fmul_rn(to_f32(inp[r * C + c]), rstd[r]);
                a = __fadd_rn(a, __fmul_rn(n, to_f32(dout[r * C + c])));
            }
            partials[p * C + c] = a;
        }
    }
}

// The naive twin of rmsnorm_backward_partials + norm_reduce_partials: one thread per column,
// all rows in order, added to the stored gradient and rounded once (the CPU's own order).
//   dw  T [C] +=;  dout, inp  T [N, C];  rstd  f32 [N];  N, C  (int)
// Launch: grid-stride over columns, any shape: block = 256, grid = ceil(C / 256).
template <typename T>
__device__ void rmsnorm_backward_params_naive(T* dw, const T* dout, const T* inp,
                                              const float* rstd, int N, int C) {
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < C;
         c += (long long)gridDim.x * blockDim.x) {
        float a = 0.0f;
        for (long long r = 0; r < N; r++) {
            float n = __fmul_rn(to_f32(inp[r * C + c]), rstd[r]);
            a = __fadd_rn(a, __fmul_rn(n, to_f32(dout[r * C + c])));
        }
        dw[c] = from_f32<T>(__fadd_rn(to_f32(dw[c]), a));
    }
}

// ---- Qwen3's q/k norm (per head of a fused q|k|v row) ----
//
// Rows of QKV = (NH + 2·NKV)·HD: NH query heads, NKV key heads, NKV value heads of HD channels
// (transformers' Qwen3Attention: q_norm(q_proj(x).view(.., HD)), k_norm likewise, before RoPE).
// Each query and key head is one RMS norm "row" of HD (its statistic in rstd [N, NH + NKV],
// heads in row order), scaled by offset + w[0..HD) (q_norm) or offset + w[HD..2·HD) (k_norm);
// value heads are copied forward and passed through backward. Per head the arithmetic is
// rmsnorm's (without a residual).

// out, rstd = qk_norm(inp; w + offset) (Op::QkNorm): one warp per (row, head) of all
// NH + 2·NKV heads.
//   out  T [N, QKV];  rstd  f32 [N, NH + NKV] (written);  inp  T [N, QKV];  w  f32 [2, HD]
//   offset  f32 (the gain is w + offset);  N, NH, NKV, HD (int);  eps f32
// Launch: block = 32·W, grid = ceil(N·(NH + 2·NKV) / W) (grid-strided). No shared memory.
// Naive twin: qk_norm_forward_naive_<S>.
template <typename T>
__device__ void qk_norm_forward(T* out, float* rstd, const T* inp, const float* w, float offset,
                                int N, int NH, int NKV, int HD, float eps) {
    int lane = threadIdx.x & 31;
    long long warps = blockDim.x >> 5;
    long long heads = NH + 2LL * NKV, normed = NH + NKV;
    for (long long u = blockIdx.x * warps + (threadIdx.x >> 5); u < (long long)N * heads;
         u += (long long)gridDim.x * warps) {
        long long row = u / heads, h = u % heads;
        const T* x = inp + row * heads * HD + h * HD;
        T* o = out + row * heads * HD + h * HD;
        if (h >= normed) {
            for (int i = lane; i < HD; i += 32) o[i] = x[i];
            continue;
        }
        const float* wh = w + (h < NH ? 0 : HD);
        float s = 0.0f;
        for (int i = lane; i < HD; i += 32) {
            float v = to_f32(x[i]);
            s += v * v;
        }
        float ms = warp_sum(s) / (float)HD;
        float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
        for (int i = lane; i < HD; i += 32)
            o[i] = rms_out<T>(to_f32(x[i]), rs, wh[i], offset, false, 0.0f);
        if (lane == 0) rstd[row * normed + h] = rs;
    }
}

// The naive twin of qk_norm_forward: one thread per (row, head), the sum in channel order.
// Launch: grid-stride over N·(NH + 2·NKV), any shape.
template <typename T>
__device__ void qk_norm_forward_naive(T* out, float* rstd, const T* inp, const float* w,
                                      float offset, int N, int NH, int NKV, int HD, float eps) {
    long long heads = NH + 2LL * NKV, normed = NH + NKV;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < (long long)N * heads;
         u += (long long)gridDim.x * blockDim.x) {
        long long row = u / heads, h = u % heads;
        const T* x = inp + row * heads * HD + h * HD;
        T* o = out + row * heads * HD + h * HD;
        if (h >= normed) {
            for (int i = 0; i < HD; i++) o[i] = x[i];
            continue;
        }
        const float* wh = w + (h < NH ? 0 : HD);
        float s = 0.0f;
        for (int i = 0; i < HD; i++) {
            float v = to_f32(x[i]);
            s = __fadd_rn(s, __fmul_rn(v, v));
        }
        float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(s / (float)HD, eps)));
        for (int i = 0; i < HD; i++)
            o[i] = from_f32<T>(__fmul_rn(__fmul_rn(to_f32(x[i]), rs), __fadd_rn(wh[i], offset)));
        rstd[row * normed + h] = rs;
    }
}

// d = qk_norm_backward_input(d) in place (Op::QkNormBackward's input gradient): the gradient
// of each query and key head's output replaced by its input's, (g − norm·mean(g·norm))·rstd
// with g = (w + offset)·dout, norm = x·rstd; value heads untouched. One warp per (row, q/k
// head): each lane reads and then overwrites only its own channels, after the warp's sum.
//   d  T [N, QKV] (in: dout, out: dinp);  inp  T [N, QKV];  w  f32 [2, HD];  offset  f32;
//   rstd  f32 [N, NH + NKV];  N, NH, NKV, HD (int)
// Launch: block = 32·W, grid = ceil(N·(NH + NKV) / W) (grid-strided). Run after the
// partials. Naive twin: qk_norm_backward_input_naive_<S>.
template <typename T>
__device__ void qk_norm_backward_input(T* d, const T* inp, const float* w, float offset,
                                       const float* rstd, int N, int NH, int NKV, int HD) {
    int lane = threadIdx.x & 31;
    long long warps = blockDim.x >> 5;
    long long heads = NH + 2LL * NKV, normed = NH + NKV;
    for (long long u = blockIdx.x * warps + (threadIdx.x >> 5); u < (long long)N * normed;
         u += (long long)gridDim.x * warps) {
        long long row = u / normed, h = u % normed;
        const T* x = inp + row * heads * HD + h * HD;
        T* dy = d + row * heads * HD + h * HD;
        const float* wh = w + (h < NH ? 0 : HD);
        float rs = rstd[u];
        float sgn = 0.0f;
        for (int i = lane; i < HD; i += 32) {
            float g = __fmul_rn(__fadd_rn(wh[i], offset), to_f32(dy[i]));
            float n = __fmul_rn(to_f32(x[i]), rs);
            sgn += g * n;
        }
        float mean_gn = warp_sum(sgn) / (float)HD;
        for (int i = lane; i < HD; i += 32) {
            float g = __fmul_rn(__fadd_rn(wh[i], offset), to_f32(dy[i]));
            float n = __fmul_rn(to_f32(x[i]), rs);
            dy[i] = from_f32<T>(__fmul_rn(__fsub_rn(g, __fmul_rn(n, mean_gn)), rs));
        }
    }
}

// The naive twin of qk_norm_backward_input: one thread per (row, q/k head), channel order.
// Launch: grid-stride over N·(NH + NKV), any shape.
template <typename T>
__device__ void qk_norm_backward_input_naive(T* d, const T* inp, const float* w, float offset,
                                             const float* rstd, int N, int NH, int NKV, int HD) {
    long long heads = NH + 2LL * NKV, normed = NH + NKV;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < (long long)N * normed;
         u += (long long)gridDim.x * blockDim.x) {
        long long row = u / normed, h = u % normed;
        const T* x = inp + row * heads * HD + h * HD;
        T* dy = d + row * heads * HD + h * HD;
        const float* wh = w + (h < NH ? 0 : HD);
        float rs = rstd[u];
        float sgn = 0.0f;
        for (int i = 0; i < HD; i++) {
            float g = __fmul_rn(__fadd_rn(wh[i], offset), to_f32(dy[i]));
            sgn = __fadd_rn(sgn, __fmul_rn(g, __fmul_rn(to_f32(x[i]), rs)));
        }
        float mean_gn = sgn / (float)HD;
        for (int i = 0; i < HD; i++) {
            float g = __fmul_rn(__fadd_rn(wh[i], offset), to_f32(dy[i]));
            float n = __fmul_rn(to_f32(x[i]), rs);
            dy[i] = from_f32<T>(__fmul_rn(__fsub_rn(g, __fmul_rn(n, mean_gn)), rs));
        }
    }
}

// Per-chunk sums of the q/k norms' weight gradient (Op::QkNormBackward, not frozen): for chunk
// p (rows p·R … min(N, p·R + R) − 1, in order, and in each row the heads in order) and column
// c of [2, HD] (c < HD: q_norm's channel c over the query heads; else k_norm's channel c − HD
// over the key heads),
//   partials[p, c] = Σ (x·rstd)·dout,   P = ceil(N / R) chunks.
//   partials  f32 [P, 2·HD] scratch (written);  d (dout, before the input gradient overwrites
//   it), inp  T [N, QKV];  rstd  f32 [N, NH + NKV];  N, NH, NKV, HD, R (>= 1) (int)
// Launch: block = 256, grid = (ceil(2·HD / 256), min(P, 65535)). Then
// norm_reduce_partials(dw, partials, P, 2·HD). Naive twin: qk_norm_backward_params_naive_<S>.
template <typename T>
__device__ void qk_norm_backward_partials(float* partials, const T* d, const T* inp,
                                          const float* rstd, int N, int NH, int NKV, int HD,
                                          int R) {
    long long P = ((long long)N + R - 1) / R;
    long long heads = NH + 2LL * NKV, normed = NH + NKV, C = 2LL * HD;
    for (long long p = blockIdx.y; p < P; p += gridDim.y) {
        long long r0 = p * R;
        long long r1 = r0 + R < N ? r0 + R : N;
        for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < C;
             c += (long long)gridDim.x * blockDim.x) {
            long long j = c % HD, h0 = c < HD ? 0 : NH, h1 = c < HD ? NH : normed;
            float a = 0.0f;
            for (long long r = r0; r < r1; r++)
                for (long long h = h0; h < h1; h++) {
                    long long at = r * heads * HD + h * HD + j;
                    float n = __fmul_rn(to_f32(inp[at]), rstd[r * normed + h]);
                    a = __fadd_rn(a, __fmul_rn(n, to_f32(d[at])));
                }
            partials[p * C + c] = a;
        }
    }
}

// The naive twin of qk_norm_backward_partials + norm_reduce_partials: one thread per column of
// [2, HD], all rows and heads in order, added to the stored gradient and rounded once.
//   dw  T [2, HD] +=;  d, inp  T [N, QKV];  rstd  f32 [N, NH + NKV]
// Launch: grid-stride over 2·HD columns, any shape.
template <typename T>
__device__ void qk_norm_backward_params_naive(T* dw, const T* d, const T* inp, const float* rstd,
                                              int N, int NH, int NKV, int HD) {
    long long heads = NH + 2LL * NKV, normed = NH + NKV;
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < 2LL * HD;
         c += (long long)gridDim.x * blockDim.x) {
        long long j = c % HD, h0 = c < HD ? 0 : NH, h1 = c < HD ? NH : normed;
        float a = 0.0f;
        for (long long r = 0; r < N; r++)
            for (long long h = h0; h < h1; h++) {
                long long at = r * heads * HD + h * HD + j;
                float n = __fmul_rn(to_f32(inp[at]), rstd[r * normed + h]);
                a = __fadd_rn(a, __fmul_rn(n, to_f32(d[at])));
            }
        dw[c] = from_f32<T>(__fadd_rn(to_f32(dw[c]), a));
    }
}

#define NORM_ENTRIES(T, S)                                                                   \
    extern "C" __global__ void layernorm_forward_##S(T* out, float* mean, float* rstd,        \
                                                     const T* inp, const float* w,           \
                                                     const float* b, int N, int C,           \
                                                     float eps) {                            \
        layernorm_forward<T>(out, mean, rstd, inp, w, b, N, C, eps);                         \
    }                                                                                        \
    extern "C" __global__ void layernorm_forward_naive_##S(T* out, float* mean, float* rstd,  \
                                                           const T* inp, const float* w,     \
                                                           const float* b, int N, int C,     \
                                                           float eps) {                      \
        layernorm_forward_naive<T>(out, mean, rstd, inp, w, b, N, C, eps);                   \
    }                                                                                        \
    extern "C" __global__ void layernorm_backward_input_##S(                                 \
        T* dinp, const T* dout, const T* inp, const float* w, const float* mean,             \
        const float* rstd, int N, int C) {                                                   \
        layernorm_backward_input<T>(dinp, dout, inp, w, mean, rstd, N, C);                   \
    }                                                                                        \
    extern "C" __global__ void layernorm_backward_input_naive_##S(                           \
        T* dinp, const T* dout, const T* inp, const float* w, const float* mean,             \
        const float* rstd, int N, int C) {                                                   \
        layernorm_backward_input_naive<T>(dinp, dout, inp, w, mean, rstd, N, C);             \
    }                                                                                        \
    extern "C" __global__ void layernorm_backward_partials_##S(                              \
        float* partials, const T* dout, const T* inp, const float* mean, const float* rstd,  \
        int N, int C, int R) {                                                               \
        layernorm_backward_partials<T>(partials, dout, inp, mean, rstd, N, C, R);            \
    }                                                                                        \
    extern "C" __global__ void layernorm_backward_params_naive_##S(                          \
        T* dw, T* db, const T* dout, const T* inp, const float* mean, const float* rstd,     \
        int N, int C) {                                                                      \
        layernorm_backward_params_naive<T>(dw, db, dout, inp, mean, rstd, N, C);             \
    }                                                                                        \
    extern "C" __global__ void norm_reduce_partials_##S(T* grad, const float* partials,       \
                                                        int P, int C) {                      \
        norm_reduce_partials<T>(grad, partials, P, C);                                       \
    }                                                                                        \
    extern "C" __global__ void qk_norm_forward_##S(T* out, float* rstd, const T* inp,        \
                                                   const float* w, float offset, int N,      \
                                                   int NH, int NKV, int HD, float eps) {     \
        qk_norm_forward<T>(out, rstd, inp, w, offset, N, NH, NKV, HD, eps);                  \
    }                                                                                        \
    extern "C" __global__ void qk_norm_forward_naive_##S(T* out, float* rstd, const T* inp,  \
                                                         const float* w, float offset,       \
                                                         int N, int NH, int NKV, int HD,     \
                                                         float eps) {                        \
        qk_norm_forward_naive<T>(out, rstd, inp, w, offset, N, NH, NKV, HD, eps);            \
    }                                                                                        \
    extern "C" __global__ void qk_norm_backward_input_##S(T* d, const T* inp, const float* w, \
                                                          float offset, const float* rstd,   \
                                                          int N, int NH, int NKV, int HD) {  \
        qk_norm_backward_input<T>(d, inp, w, offset, rstd, N, NH, NKV, HD);                  \
    }                                                                                        \
    extern "C" __global__ void qk_norm_backward_input_naive_##S(                             \
        T* d, const T* inp, const float* w, float offset, const float* rstd, int N, int NH,  \
        int NKV, int HD) {                                                                   \
        qk_norm_backward_input_naive<T>(d, inp, w, offset, rstd, N, NH, NKV, HD);            \
    }                                                                                        \
    extern "C" __global__ void qk_norm_backward_partials_##S(                                \
        float* partials, const T* d, const T* inp, const float* rstd, int N, int NH,         \
        int NKV, int HD, int R) {                                                            \
        qk_norm_backward_partials<T>(partials, d, inp, rstd, N, NH, NKV, HD, R);             \
    }                                                                                        \
    extern "C" __global__ void qk_norm_backward_params_naive_##S(                            \
        T* dw, const T* d, const T* inp, const float* rstd, int N, int NH, int NKV,          \
        int HD) {                                                                            \
        qk_norm_backward_params_naive<T>(dw, d, inp, rstd, N, NH, NKV, HD);                  \
    }                                                                                        \
    extern "C" __global__ void rmsnorm_forward_##S(T* out, float* rstd, const T* inp,        \
                                                   const T* residual, const float* w,        \
                                                   float offset, int N, int C, float eps) {  \
        rmsnorm_forward<T>(out, rstd, inp, residual, w, offset, N, C, eps);                  \
    }                                                                                        \
    extern "C" __global__ void rmsnorm_forward_naive_##S(T* out, float* rstd, const T* inp,  \
                                                         const T* residual, const float* w,  \
                                                         float offset, int N, int C,         \
                                                         float eps) {                        \
        rmsnorm_forward_naive<T>(out, rstd, inp, residual, w, offset, N, C, eps);            \
    }                                                                                        \
    extern "C" __global__ void rmsnorm_backward_input_##S(T* dinp, const T* dout,            \
                                                          const T* inp, const float* w,      \
                                                          float offset, const float* rstd,   \
                                                          int N, int C) {                    \
        rmsnorm_backward_input<T>(dinp, dout, inp, w, offset, rstd, N, C);                   \
    }                                                                                        \
    extern "C" __global__ void rmsnorm_backward_input_naive_##S(                             \
        T* dinp, const T* dout, const T* inp, const float* w, float offset,                  \
        const float* rstd, int N, int C) {                                                   \
        rmsnorm_backward_input_naive<T>(dinp, dout, inp, w, offset, rstd, N, C);             \
    }                                                                                        \
    extern "C" __global__ void rmsnorm_backward_partials_##S(                                \
        float* partials, const T* dout, const T* inp, const float* rstd, int N, int C,       \
        int R) {                                                                             \
        rmsnorm_backward_partials<T>(partials, dout, inp, rstd, N, C, R);                    \
    }                                                                                        \
    extern "C" __global__ void rmsnorm_backward_params_naive_##S(                            \
        T* dw, const T* dout, const T* inp, const float* rstd, int N, int C) {               \
        rmsnorm_backward_params_naive<T>(dw, dout, inp, rstd, N, C);                         \
    }
MW_STORAGE_ENTRIES(NORM_ENTRIES)
