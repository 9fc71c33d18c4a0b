// Causal self-attention with grouped-query attention (GQA): Op::Attention (forward) and
// Op::AttentionBackward, the CUDA port of src/backend/cpu/attention/mod.rs (the same
// mathematics, in f32; summation orders differ from the CPU's but are fixed: every entry gives
// the same bits on every run).
//
// Ops -> entries (S = f32 | bf16 | f16, the plan's storage type T; HD = 64 | 128 | 256 chosen
// by the head size hd: the smallest HD with hd <= HD; hd > 256 is not supported):
//   Op::Attention         -> attention_forward_hd<HD>_<S>                  (one launch)
//   Op::AttentionBackward -> attention_backward_dot_<S>                     (1: D, into ws)
//                            attention_backward_dkv_hd<HD>_<S>             (2: dK, dV)
//                            attention_backward_dq_hd<HD>_<S>              (3: dQ)
//                            launches 2 and 3 only read ws and write disjoint columns of dqkv:
//                            they may run in either order (or concurrently) after launch 1.
//   naive twins (for the GPU test suite; same arguments as the op, no workspace):
//                            attention_forward_naive_<S>, attention_backward_naive_<S>
// CPU-emulated tests (f64 reference, twins, determinism, packed rows, odd hd):
// python3 scripts/cuda-emu/tests/attention_run.py.
//
// Tensor cores: attention_mma.cu holds the same forward, dK/dV and dQ on mma.sync m16n8k16 for
// bf16 and f16 storage and hd ≤ 128 (attention_{forward,backward_dkv,backward_dq}_mma_hd<HD>_<S>,
// HD = 64 | 128; launch 1 of the backward is this file's dot). The host uses them only when
// MEMWALL_CUDA_ATTENTION=mma (ops/attention.rs); the default `fma` keeps this file's kernels
// for every plan until a GPU run has confirmed the mma ones.
//
// Shapes and notation (every dimension an `int`; element offsets are computed in 64 bits):
//   B rows of T tokens (N = B·T), NH query heads, NKV key/value heads (NKV divides NH,
//   g = NH/NKV), head size hd; ld = (NH + 2·NKV)·hd, co = NH·hd.
//   qkv  [N, ld] (T): for row n = b·T + t, query head h is channels h·hd .. h·hd+hd-1, key
//        head j channels NH·hd + j·hd .., value head j channels (NH+NKV)·hd + j·hd ..
//        KV head j serves query heads j·g … j·g+g−1 (repeat-interleave, as transformers'
//        repeat_kv).
//   out  [N, co] (T): query head h's output in channels h·hd ..
//   lse  [B, NH, T] f32: lse[(b·NH + h)·T + i] = ln Σ_{j attended} exp(S_ij), the NATURAL
//        log-sum-exp of the scaled scores S_ij = (q_i · k_j) / sqrt(sd) (sd, the last argument
//        of every entry but the dot: the head size hd, or Gemma 3's query_pre_attn_scalar).
//        As on the CPU it is computed in base 2: S'_ij = q_i·k_j · scale2 with scale2 = log2(e)/sqrt(sd) (f32:
//        1.44269504f / sqrtf(sd)), m = max_j S', l = Σ_j 2^(S'_ij − m), lse = (m + log2 l)·ln 2.
//   pos  [B, T] u32, or a NULL pointer for plain causal rows: positions of packed rows (each
//        token's position in its example: 0 where an example starts, else the previous plus
//        1; the CPU checks this). Query i of row b attends to keys lo(i) ..= i, lo(i) =
//        i − pos[b·T + i] (0 without pos; a position > i is clamped to i, i.e. lo = 0). The
//        kernels do not rely on the positions being valid: any positions give exactly these
//        key ranges (valid ones only make the skipping of masked tiles effective). Every query
//        attends at least to itself, so no softmax row is empty.
//   W    the sliding window (int, the last argument of every entry but the dot): query i sees
//        only keys j > i − W as well (Mistral's sliding_window, transformers'
//        sliding_window_overlay), so lo(i) = max(i − pos[b·T + i], i + 1 − W). W ≤ 0 or W ≥ T
//        is no window (the host passes T then). Key tiles outside every query's window are
//        never visited: the forward and dQ start at the CTA's smallest lo(i), the dK/dV
//        kernel stops at the last query block whose window reaches its keys (kend − 2 + W),
//        so the work is O(T·W), not O(T²).
//   dout [N, co] (T), dqkv [N, ld] (T): dqkv is OVERWRITTEN in full (as the CPU's
//        attention_backward): the Q part by launch 3, the K and V parts by launch 2 (a KV
//        head's gradient is the sum over the g query heads it serves, accumulated in f32 and
//        rounded to T once).
//
// Backward mathematics (as the CPU's): with P_ij = 2^min(S'_ij − lse_i·log2(e), 0) for
// attended (i, j), 0 otherwise (recomputed from lse, never stored),
//   D_i   = Σ_c dout[i, c] · out[i, c]          (f32, from the stored out and dout)
//   dP_ij = dout_i · v_j
//   dS_ij = P_ij · (dP_ij − D_i) · scale         (scale = 1/sqrtf(sd))
//   dV_j  = Σ_i P_ij dout_i,  dK_j = Σ_i dS_ij q_i,  dQ_i = Σ_j dS_ij k_j
// (dK, dV summed also over the g query heads of the KV head).
//
// Workspace `ws` (f32), as the CUDA planner must size it from (B, T, NH, NKV, hd):
//   Op::Attention:          0 elements (ws is not read; it may be NULL or any buffer).
//   Op::AttentionBackward:  B·NH·T elements: D [B, NH, T] at ws[0 ..], D[(b·NH + h)·T + i]
//                           = Σ_c dout·out of query i, head h (written by launch 1, read by 2
//                           and 3). Nothing else: there are no partial sums (the dK/dV launch
//                           loops over a KV head's query heads itself).
//
// Tiling (all flash entries): CTAs of ATT_THREADS = 256 threads (8 warps, exactly this many:
// the kernels return without writing when blockDim.x differs), tiles of ATT_BQ = 32 queries
// and ATT_BK = 32 keys; each warp owns ATT_RPW = 4 rows of a tile (queries, or keys in the
// dK/dV kernel); a lane owns one column of the 32-wide score tile, and, for the output
// accumulators, channels e = lane + 32·c (c < HD/32). Operand tiles are widened to f32 in
// shared memory; a row that lanes read one per lane has stride hd|1 (odd: no bank conflicts).
// Products are plain FMA loops (no tensor cores). All sums run in a fixed order (the dot
// products over e ascending, the key / query loops ascending, warp reductions by the
// prelude's fixed butterflies), and no kernel uses atomics, so results are bitwise
// reproducible, and do not depend on anything the host chooses (the launch shapes below are
// fixed). Dynamic shared memory (formulas at the entries, in runtime hd) above 48 KiB = 49,152
// bytes needs the opt-in CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES on the function before
// launch (the hd64 entries never do; the largest amount, dkv at hd 256, is 139,520 bytes:
// within sm_80's 163 KiB and sm_90's 227 KiB). The static shared memory of each entry is at
// most 384 bytes on top of the dynamic amount.
//
// Performance (this is the plain first version): scores and products are FMA loops over f32
// shared-memory tiles (about two shared loads per FMA), K/V tiles are loaded synchronously,
// each CTA serves one query head (a KV head's tiles are re-read, from L2, by its g query heads),
// and the backward recomputes P and dS twice (in the dK/dV and the dQ launch) to avoid atomics.
// A faster version would use bf16/f16 tensor cores (mma.sync m16n8k16 or wmma) for QKᵀ, PV,
// dSK, dSᵀQ and PᵀdO with P kept in registers, 64–128-query tiles, cp.async (sm_80) / TMA
// (sm_90) double-buffered K/V loads, 128-bit vector loads, and one CTA per KV head's g query
// heads for GQA; dQ could stay deterministic with per-key-block partials in ws reduced in order.

#define ATT_THREADS 256
#define ATT_WARPS 8
#define ATT_RPW 4
#define ATT_BQ 32
#define ATT_BK 32
#define ATT_LOG2E 1.4426950408889634f
#define ATT_LN2 0.6931471805599453f
#define ATT_NEG_INF __int_as_float(0xff800000)
#define ATT_NO_KEY 0x7fffffff

// Whether the arguments are ones the flash kernels handle (checked by every CTA; a CTA of an
// invalid launch returns without writing anything).
__device__ __forceinline__ bool att_args_ok(int Tn, int NH, int NKV, int hd, int hd_max) {
    return blockDim.x == ATT_THREADS && Tn > 0 && NKV > 0 && NH > 0 && NH % NKV == 0 &&
           hd > 0 && hd <= hd_max;
}

// ---------------------------------------------------------------------------------------------
// Forward (FlashAttention-2: a block of queries per CTA, online softmax over key blocks)

// CTA (x, h, b): queries q0 = x·BQ .. qend−1 (qend = min(q0 + BQ, T)) of head h, row b.
// Keys kmin .. qend−1 in blocks of BK from kmin = min over the CTA's queries of lo(i) (keys
// below kmin and above qend−1 are masked for every query of the CTA: those blocks are never
// visited; every visited block holds at least one attended key of some query). Warp w owns
// queries q0 + 4w .. q0 + 4w + 3; in the score phase lane = key of the block, in the output
// phase lane owns channels lane + 32c.
template <typename T, int HDC>
__device__ __forceinline__ void att_forward(const T* __restrict__ qkv,
                                            const unsigned int* __restrict__ pos,
                                            T* __restrict__ out, float* __restrict__ lse, int B,
                                            int Tn, int NH, int NKV, int hd, int W, float sd) {
    extern __shared__ float att_sm[];
    __shared__ int los[ATT_BQ];
    if (!att_args_ok(Tn, NH, NKV, hd, 32 * HDC)) return;
    const int q0 = blockIdx.x * ATT_BQ, h = blockIdx.y, b = blockIdx.z;
    if (q0 >= Tn || h >= NH || b >= B) return;  // uniform over the CTA
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int ks = hd | 1;
    float* Qs = att_sm;              // [BQ][hd]   queries (broadcast reads)
    float* Ks = Qs + ATT_BQ * hd;    // [BK][ks]   keys (lane reads row lane)
    float* Vs = Ks + ATT_BK * ks;    // [BK][hd]   values (lane reads channels)
    float* Ps = Vs + ATT_BK * hd;    // [BQ][BK]   probabilities of the block (per warp rows)
    const int g = NH / NKV, kvh = h / g;
    const long long ld = (long long)(NH + 2 * NKV) * hd, co = (long long)NH * hd;
    const int qend = min(q0 + ATT_BQ, Tn);
    const float scale2 = ATT_LOG2E / sqrtf(sd);
    const T* base = qkv + (long long)b * Tn * ld;
    const T* qp = base + (long long)h * hd;
    const T* kp = base + (long long)(NH + kvh) * hd;
    const T* vp = base + (long long)(NH + NKV + kvh) * hd;

    if (tid < ATT_BQ) {
        int i = q0 + tid;
        los[tid] = i < qend ? mw_first_key(pos, b, Tn, i, W) : ATT_NO_KEY;
    }
    for (int x = tid; x < ATT_BQ * hd; x += ATT_THREADS) {
        int r = x / hd, e = x - r * hd, i = q0 + r;
        Qs[x] = i < qend ? to_f32(qp[i * ld + e]) : 0.0f;
    }
    __syncthreads();
    int kmin = los[0];
    for (int r = 1; r < ATT_BQ; ++r) kmin = min(kmin, los[r]);

    float m[ATT_RPW], l[ATT_RPW], o[ATT_RPW][HDC];
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; ++rr) {
        m[rr] = ATT_NEG_INF;
        l[rr] = 0.0f;
#pragma unroll
        for (int c = 0; c < HDC; ++c) o[rr][c] = 0.0f;
    }
    const float* qr = Qs + w * ATT_RPW * hd;
    for (int kb = kmin; kb < qend; kb += ATT_BK) {
        __syncthreads();  // every warp is done with the previous block's Ks, Vs
        for (int x = tid; x < ATT_BK * hd; x += ATT_THREADS) {
            int kk = x / hd, e = x - kk * hd, k = kb + kk;
            bool in = k < qend;
            Ks[kk * ks + e] = in ? to_f32(kp[k * ld + e]) : 0.0f;
            Vs[x] = in ? to_f32(vp[k * ld + e]) : 0.0f;
        }
        __syncthreads();
        // Scores of the warp's 4 queries against key kb + lane.
        float s[ATT_RPW];
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; ++rr) s[rr] = 0.0f;
        const float* kr = Ks + lane * ks;
        for (int e = 0; e < hd; ++e) {
            float kv = kr[e];
#pragma unroll
            for (int rr = 0; rr < ATT_RPW; ++rr) s[rr] += qr[rr * hd + e] * kv;
        }
        // Online softmax (base 2). Masked entries get p = 0 exactly, never through exp2.
        const int k = kb + lane;
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; ++rr) {
            const int r = w * ATT_RPW + rr, i = q0 + r;
            const bool ok = i < qend && k >= los[r] && k <= i;
            const float sv = ok ? s[rr] * scale2 : ATT_NEG_INF;
            const float mn = fmaxf(m[rr], warp_max(sv));  // the same in every lane
            float p = 0.0f, alpha = 1.0f;
            if (mn != ATT_NEG_INF) {          // warp-uniform: some key seen so far
                alpha = exp2f(m[rr] - mn);    // 0 when m was −inf (o and l are 0 then)
                p = ok ? exp2f(sv - mn) : 0.0f;
            }
            l[rr] = l[rr] * alpha + warp_sum(p);
            m[rr] = mn;
            Ps[r * ATT_BK + lane] = p;
#pragma unroll
            for (int c = 0; c < HDC; ++c) o[rr][c] *= alpha;
        }
        __syncwarp();
        // o += P V over the block's keys (keys past qend have p = 0 and are not visited).
        const int nk = min(ATT_BK, qend - kb);
        for (int jj = 0; jj < nk; ++jj) {
            float vv[HDC];
#pragma unroll
            for (int c = 0; c < HDC; ++c) {
                int e = lane + 32 * c;
                vv[c] = e < hd ? Vs[jj * hd + e] : 0.0f;
            }
#pragma unroll
            for (int rr = 0; rr < ATT_RPW; ++rr) {
                float p = Ps[(w * ATT_RPW + rr) * ATT_BK + jj];
#pragma unroll
                for (int c = 0; c < HDC; ++c) o[rr][c] += p * vv[c];
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; ++rr) {
        const int i = q0 + w * ATT_RPW + rr;
        if (i >= qend) continue;
        const float inv = 1.0f / l[rr];
        T* orow = out + ((long long)b * Tn + i) * co + (long long)h * hd;
#pragma unroll
        for (int c = 0; c < HDC; ++c) {
            int e = lane + 32 * c;
            if (e < hd) orow[e] = from_f32<T>(o[rr][c] * inv);
        }
        if (lane == 0) lse[((long long)b * NH + h) * Tn + i] = (m[rr] + log2f(l[rr])) * ATT_LN2;
    }
}

// ---------------------------------------------------------------------------------------------
// Backward 1: D = rowsum(dout ⊙ out), one warp per (token, query head).

template <typename T>
__device__ __forceinline__ void att_backward_dot(float* __restrict__ D,
                                                 const T* __restrict__ dout,
                                                 const T* __restrict__ out, int B, int Tn,
                                                 int NH, int hd) {
    const long long pairs = (long long)B * Tn * NH;
    const long long idx = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (idx >= pairs) return;  // warp-uniform
    const long long n = idx / NH;
    const int h = (int)(idx - n * NH);
    const long long b = n / Tn, i = n - b * Tn;
    const long long at = n * NH * (long long)hd + (long long)h * hd;
    float acc = 0.0f;
    for (int e = lane; e < hd; e += 32) acc += to_f32(dout[at + e]) * to_f32(out[at + e]);
    acc = warp_sum(acc);
    if (lane == 0) D[(b * NH + h) * Tn + i] = acc;
}

// ---------------------------------------------------------------------------------------------
// Backward 2: dK, dV. CTA (x, j, b): keys k0 = x·BK .. kend−1 (kend = min(k0 + BK, T)) of KV
// head j, row b; registers accumulate their dK, dV over the query heads h = j·g … j·g+g−1 in
// order and, per head, the query blocks q0 = k0, k0 + BQ, … < T in order (a block none of whose
// queries attends a key of the CTA is skipped: __syncthreads_or over the CTA). Warp w owns keys
// k0 + 4w .. k0 + 4w + 3; in the score phase lane = query of the block, in the accumulation
// phase lane owns channels lane + 32c.
template <typename T, int HDC>
__device__ __forceinline__ void att_backward_dkv(T* __restrict__ dqkv,
                                                 const unsigned int* __restrict__ pos,
                                                 const T* __restrict__ dout,
                                                 const T* __restrict__ qkv,
                                                 const float* __restrict__ lse,
                                                 const float* __restrict__ D, int B, int Tn,
                                                 int NH, int NKV, int hd, int W, float sd) {
    extern __shared__ float att_sm[];
    __shared__ int los[ATT_BQ];
    __shared__ float lse2s[ATT_BQ], Ds[ATT_BQ];
    if (!att_args_ok(Tn, NH, NKV, hd, 32 * HDC)) return;
    const int k0 = blockIdx.x * ATT_BK, j = blockIdx.y, b = blockIdx.z;
    if (k0 >= Tn || j >= NKV || b >= B) return;  // uniform over the CTA
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int qs = hd | 1;
    float* Ks = att_sm;              // [BK][hd]  the CTA's keys (broadcast reads)
    float* Vs = Ks + ATT_BK * hd;    // [BK][hd]  the CTA's values (broadcast reads)
    float* Qs = Vs + ATT_BK * hd;    // [BQ][qs]  query block (lane reads row lane)
    float* dOs = Qs + ATT_BQ * qs;   // [BQ][qs]  its dout rows
    float* Ps = dOs + ATT_BQ * qs;   // [BK][BQ]  P transposed (per warp key rows)
    float* dSs = Ps + ATT_BK * ATT_BQ;  // [BK][BQ] dS transposed
    const int g = NH / NKV;
    const long long ld = (long long)(NH + 2 * NKV) * hd, co = (long long)NH * hd;
    const int kend = min(k0 + ATT_BK, Tn);
    const float scale = 1.0f / sqrtf(sd);
    const float scale2 = ATT_LOG2E / sqrtf(sd);
    const T* base = qkv + (long long)b * Tn * ld;
    const T* kp = base + (long long)(NH + j) * hd;
    const T* vp = base + (long long)(NH + NKV + j) * hd;

    for (int x = tid; x < ATT_BK * hd; x += ATT_THREADS) {
        int kk = x / hd, e = x - kk * hd, k = k0 + kk;
        bool in = k < kend;
        Ks[x] = in ? to_f32(kp[k * ld + e]) : 0.0f;
        Vs[x] = in ? to_f32(vp[k * ld + e]) : 0.0f;
    }
    __syncthreads();

    float dk[ATT_RPW][HDC], dv[ATT_RPW][HDC];
#pragma unroll
    for (int kk = 0; kk < ATT_RPW; ++kk)
#pragma unroll
        for (int c = 0; c < HDC; ++c) dk[kk][c] = dv[kk][c] = 0.0f;
    const float* kr = Ks + w * ATT_RPW * hd;
    const float* vr = Vs + w * ATT_RPW * hd;
    const float* qr = Qs + lane * qs;
    const float* gr = dOs + lane * qs;

    for (int h = j * g; h < (j + 1) * g; ++h) {
        const T* qp = base + (long long)h * hd;
        const T* dop = dout + (long long)b * Tn * co + (long long)h * hd;
        const float* lsep = lse + ((long long)b * NH + h) * Tn;
        const float* Dp = D + ((long long)b * NH + h) * Tn;
        // Queries past kend − 2 + W see no key of the CTA (their windows start after it).
        const int qlim = W > 0 ? (int)min((long long)Tn, (long long)kend - 1 + W) : Tn;
        for (int q0 = k0; q0 < qlim; q0 += ATT_BQ) {
            // Does any query of this block attend a key of the CTA? (queries i ≥ q0 ≥ k0 see
            // key k0 causally; they reach a key below kend iff lo(i) ≤ kend − 1.) The barrier
            // also ends every warp's use of the previous block's tiles.
            bool att = false;
            if (tid < ATT_BQ && q0 + tid < Tn)
                att = mw_first_key(pos, b, Tn, q0 + tid, W) < kend;
            if (!__syncthreads_or(att)) continue;
            const int qend = min(q0 + ATT_BQ, Tn);
            if (tid < ATT_BQ) {
                int i = q0 + tid;
                bool in = i < qend;
                los[tid] = in ? mw_first_key(pos, b, Tn, i, W) : ATT_NO_KEY;
                lse2s[tid] = in ? lsep[i] * ATT_LOG2E : 0.0f;
                Ds[tid] = in ? Dp[i] : 0.0f;
            }
            for (int x = tid; x < ATT_BQ * hd; x += ATT_THREADS) {
                int r = x / hd, e = x - r * hd, i = q0 + r;
                bool in = i < qend;
                Qs[r * qs + e] = in ? to_f32(qp[i * ld + e]) : 0.0f;
                dOs[r * qs + e] = in ? to_f32(dop[i * co + e]) : 0.0f;
            }
            __syncthreads();
            // S' and dP of the warp's 4 keys against query q0 + lane.
            float s[ATT_RPW], dp[ATT_RPW];
#pragma unroll
            for (int kk = 0; kk < ATT_RPW; ++kk) s[kk] = dp[kk] = 0.0f;
            for (int e = 0; e < hd; ++e) {
                float qv = qr[e], gv = gr[e];
#pragma unroll
                for (int kk = 0; kk < ATT_RPW; ++kk) {
                    s[kk] += qv * kr[kk * hd + e];
                    dp[kk] += gv * vr[kk * hd + e];
                }
            }
            const int i = q0 + lane;
#pragma unroll
            for (int kk = 0; kk < ATT_RPW; ++kk) {
                const int kr_ = w * ATT_RPW + kk, k = k0 + kr_;
                const bool ok = k < kend && k >= los[lane] && k <= i;
                float p = 0.0f, ds = 0.0f;
                if (ok) {
                    p = exp2f(fminf(s[kk] * scale2 - lse2s[lane], 0.0f));
                    ds = p * (dp[kk] - Ds[lane]) * scale;
                }
                Ps[kr_ * ATT_BQ + lane] = p;
                dSs[kr_ * ATT_BQ + lane] = ds;
            }
            __syncwarp();
            // dV += P dO, dK += dS Q over the block's queries in order.
            const int nq = qend - q0;
            for (int r = 0; r < nq; ++r) {
                float qv[HDC], gv[HDC];
#pragma unroll
                for (int c = 0; c < HDC; ++c) {
                    int e = lane + 32 * c;
                    qv[c] = e < hd ? Qs[r * qs + e] : 0.0f;
                    gv[c] = e < hd ? dOs[r * qs + e] : 0.0f;
                }
#pragma unroll
                for (int kk = 0; kk < ATT_RPW; ++kk) {
                    float p = Ps[(w * ATT_RPW + kk) * ATT_BQ + r];
                    float ds = dSs[(w * ATT_RPW + kk) * ATT_BQ + r];
#pragma unroll
                    for (int c = 0; c < HDC; ++c) {
                        dv[kk][c] += p * gv[c];
                        dk[kk][c] += ds * qv[c];
                    }
                }
            }
        }
    }
    T* dbase = dqkv + (long long)b * Tn * ld;
#pragma unroll
    for (int kk = 0; kk < ATT_RPW; ++kk) {
        const int k = k0 + w * ATT_RPW + kk;
        if (k >= kend) continue;
        T* dkrow = dbase + k * ld + (long long)(NH + j) * hd;
        T* dvrow = dbase + k * ld + (long long)(NH + NKV + j) * hd;
#pragma unroll
        for (int c = 0; c < HDC; ++c) {
            int e = lane + 32 * c;
            if (e < hd) {
                dkrow[e] = from_f32<T>(dk[kk][c]);
                dvrow[e] = from_f32<T>(dv[kk][c]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Backward 3: dQ. CTA (x, h, b): queries q0 = x·BQ .. qend−1 of head h, row b, over the key
// blocks of the forward (kmin .. qend−1 in blocks of BK, in order). Warp w owns queries
// q0 + 4w .. q0 + 4w + 3; in the score phase lane = key, in the accumulation phase lane owns
// channels lane + 32c.
template <typename T, int HDC>
__device__ __forceinline__ void att_backward_dq(T* __restrict__ dqkv,
                                                const unsigned int* __restrict__ pos,
                                                const T* __restrict__ dout,
                                                const T* __restrict__ qkv,
                                                const float* __restrict__ lse,
                                                const float* __restrict__ D, int B, int Tn,
                                                int NH, int NKV, int hd, int W, float sd) {
    extern __shared__ float att_sm[];
    __shared__ int los[ATT_BQ];
    __shared__ float lse2s[ATT_BQ], Ds[ATT_BQ];
    if (!att_args_ok(Tn, NH, NKV, hd, 32 * HDC)) return;
    const int q0 = blockIdx.x * ATT_BQ, h = blockIdx.y, b = blockIdx.z;
    if (q0 >= Tn || h >= NH || b >= B) return;  // uniform over the CTA
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int ks = hd | 1;
    float* Qs = att_sm;              // [BQ][hd]  queries (broadcast reads)
    float* dOs = Qs + ATT_BQ * hd;   // [BQ][hd]  their dout rows (broadcast reads)
    float* Ks = dOs + ATT_BQ * hd;   // [BK][ks]  key block (lane reads row lane / channels)
    float* Vs = Ks + ATT_BK * ks;    // [BK][ks]  value block (lane reads row lane)
    float* dSs = Vs + ATT_BK * ks;   // [BQ][BK]  dS of the block (per warp rows)
    const int g = NH / NKV, kvh = h / g;
    const long long ld = (long long)(NH + 2 * NKV) * hd, co = (long long)NH * hd;
    const int qend = min(q0 + ATT_BQ, Tn);
    const float scale = 1.0f / sqrtf(sd);
    const float scale2 = ATT_LOG2E / sqrtf(sd);
    const T* base = qkv + (long long)b * Tn * ld;
    const T* qp = base + (long long)h * hd;
    const T* kp = base + (long long)(NH + kvh) * hd;
    const T* vp = base + (long long)(NH + NKV + kvh) * hd;
    const T* dop = dout + (long long)b * Tn * co + (long long)h * hd;
    const float* lsep = lse + ((long long)b * NH + h) * Tn;
    const float* Dp = D + ((long long)b * NH + h) * Tn;

    if (tid < ATT_BQ) {
        int i = q0 + tid;
        bool in = i < qend;
        los[tid] = in ? mw_first_key(pos, b, Tn, i, W) : ATT_NO_KEY;
        lse2s[tid] = in ? lsep[i] * ATT_LOG2E : 0.0f;
        Ds[tid] = in ? Dp[i] : 0.0f;
    }
    for (int x = tid; x < ATT_BQ * hd; x += ATT_THREADS) {
        int r = x / hd, e = x - r * hd, i = q0 + r;
        bool in = i < qend;
        Qs[x] = in ? to_f32(qp[i * ld + e]) : 0.0f;
        dOs[x] = in ? to_f32(dop[i * co + e]) : 0.0f;
    }
    __syncthreads();
    int kmin = los[0];
    for (int r = 1; r < ATT_BQ; ++r) kmin = min(kmin, los[r]);

    float dq[ATT_RPW][HDC];
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; ++rr)
#pragma unroll
        for (int c = 0; c < HDC; ++c) dq[rr][c] = 0.0f;
    const float* qr = Qs + w * ATT_RPW * hd;
    const float* gr = dOs + w * ATT_RPW * hd;
    for (int kb = kmin; kb < qend; kb += ATT_BK) {
        __syncthreads();  // every warp is done with the previous block's Ks, Vs
        for (int x = tid; x < ATT_BK * hd; x += ATT_THREADS) {
            int kk = x / hd, e = x - kk * hd, k = kb + kk;
            bool in = k < qend;
            Ks[kk * ks + e] = in ? to_f32(kp[k * ld + e]) : 0.0f;
            Vs[kk * ks + e] = in ? to_f32(vp[k * ld + e]) : 0.0f;
        }
        __syncthreads();
        float s[ATT_RPW], dp[ATT_RPW];
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; ++rr) s[rr] = dp[rr] = 0.0f;
        const float* kr = Ks + lane * ks;
        const float* vr = Vs + lane * ks;
        for (int e = 0; e < hd; ++e) {
            float kv = kr[e], vv = vr[e];
#pragma unroll
            for (int rr = 0; rr < ATT_RPW; ++rr) {
                s[rr] += qr[rr * hd + e] * kv;
                dp[rr] += gr[rr * hd + e] * vv;
            }
        }
        const int k = kb + lane;
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; ++rr) {
            const int r = w * ATT_RPW + rr, i = q0 + r;
            const bool ok = i < qend && k >= los[r] && k <= i;
            float ds = 0.0f;
            if (ok) {
                float p = exp2f(fminf(s[rr] * scale2 - lse2s[r], 0.0f));
                ds = p * (dp[rr] - Ds[r]) * scale;
            }
            dSs[r * ATT_BK + lane] = ds;
        }
        __syncwarp();
        const int nk = min(ATT_BK, qend - kb);
        for (int jj = 0; jj < nk; ++jj) {
            float kv[HDC];
#pragma unroll
            for (int c = 0; c < HDC; ++c) {
                int e = lane + 32 * c;
                kv[c] = e < hd ? Ks[jj * ks + e] : 0.0f;
            }
#pragma unroll
            for (int rr = 0; rr < ATT_RPW; ++rr) {
                float ds = dSs[(w * ATT_RPW + rr) * ATT_BK + jj];
#pragma unroll
                for (int c = 0; c < HDC; ++c) dq[rr][c] += ds * kv[c];
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; ++rr) {
        const int i = q0 + w * ATT_RPW + rr;
        if (i >= qend) continue;
        T* dqrow = dqkv + ((long long)b * Tn + i) * ld + (long long)h * hd;
#pragma unroll
        for (int c = 0; c < HDC; ++c) {
            int e = lane + 32 * c;
            if (e < hd) dqrow[e] = from_f32<T>(dq[rr][c]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Naive twins: one thread per output element, plain loops in f32, no shared memory.

// Forward, thread (b, i, h, e): two passes over keys lo(i) ..= i (scores recomputed): m =
// max S', then l = Σ 2^(S' − m) and o = Σ 2^(S' − m) v[e]; out = o · (1/l); the e = 0 thread
// writes lse = (m + log2 l)·ln 2.
template <typename T>
__device__ __forceinline__ void att_forward_naive(const T* __restrict__ qkv,
                                                  const unsigned int* __restrict__ pos,
                                                  T* __restrict__ out, float* __restrict__ lse,
                                                  int B, int Tn, int NH, int NKV, int hd, int W, float sd) {
    if (NKV <= 0 || NH % NKV != 0 || hd <= 0) return;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * Tn * NH * hd) return;
    const int e = (int)(idx % hd);
    const int h = (int)((idx / hd) % NH);
    const long long n = idx / ((long long)hd * NH);
    const int b = (int)(n / Tn), i = (int)(n % Tn);
    const int g = NH / NKV, kvh = h / g;
    const long long ld = (long long)(NH + 2 * NKV) * hd, co = (long long)NH * hd;
    const float scale2 = ATT_LOG2E / sqrtf(sd);
    const T* base = qkv + (long long)b * Tn * ld;
    const T* q = base + (long long)i * ld + (long long)h * hd;
    const int lo = mw_first_key(pos, b, Tn, i, W);
    float m = ATT_NEG_INF;
    for (int k = lo; k <= i; ++k) {
        const T* kk = base + (long long)k * ld + (long long)(NH + kvh) * hd;
        float s = 0.0f;
        for (int c = 0; c < hd; ++c) s += to_f32(q[c]) * to_f32(kk[c]);
        m = fmaxf(m, s * scale2);
    }
    float l = 0.0f, o = 0.0f;
    for (int k = lo; k <= i; ++k) {
        const T* kk = base + (long long)k * ld + (long long)(NH + kvh) * hd;
        const T* vv = base + (long long)k * ld + (long long)(NH + NKV + kvh) * hd;
        float s = 0.0f;
        for (int c = 0; c < hd; ++c) s += to_f32(q[c]) * to_f32(kk[c]);
        float p = exp2f(s * scale2 - m);
        l += p;
        o += p * to_f32(vv[e]);
    }
    out[n * co + (long long)h * hd + e] = from_f32<T>(o * (1.0f / l));
    if (e == 0) lse[((long long)b * NH + h) * Tn + i] = (m + log2f(l)) * ATT_LN2;
}

// The backward terms of query i, query head h against key k (all attended): P, dS.
template <typename T>
__device__ __forceinline__ void att_naive_terms(const T* base, const T* dorow, float lse2,
                                                float Di, int i, int k, int h, int kvh, int NH,
                                                int NKV, int hd, long long ld, float scale,
                                                float scale2, float* p, float* ds) {
    const T* q = base + (long long)i * ld + (long long)h * hd;
    const T* kk = base + (long long)k * ld + (long long)(NH + kvh) * hd;
    const T* vv = base + (long long)k * ld + (long long)(NH + NKV + kvh) * hd;
    float s = 0.0f, dp = 0.0f;
    for (int c = 0; c < hd; ++c) {
        s += to_f32(q[c]) * to_f32(kk[c]);
        dp += to_f32(dorow[c]) * to_f32(vv[c]);
    }
    *p = exp2f(fminf(s * scale2 - lse2, 0.0f));
    *ds = *p * (dp - Di) * scale;
}

// D_i of query i, head h: Σ_c dout · out (sequential).
template <typename T>
__device__ __forceinline__ float att_naive_d(const T* dorow, const T* orow, int hd) {
    float d = 0.0f;
    for (int c = 0; c < hd; ++c) d += to_f32(dorow[c]) * to_f32(orow[c]);
    return d;
}

// Backward, thread (n, c) of dqkv [N, ld]: the dQ, dK or dV element c of token n (whichever
// part of the row c is in), summing over the attended keys / the queries attending it (and, for
// dK, dV, over the KV head's g query heads in order), probabilities recomputed from lse and D
// recomputed from out and dout.
template <typename T>
__device__ __forceinline__ void att_backward_naive(T* __restrict__ dqkv,
                                                   const unsigned int* __restrict__ pos,
                                                   const T* __restrict__ dout,
                                                   const T* __restrict__ qkv,
                                                   const T* __restrict__ out,
                                                   const float* __restrict__ lse, int B, int Tn,
                                                   int NH, int NKV, int hd, int W, float sd) {
    if (NKV <= 0 || NH % NKV != 0 || hd <= 0) return;
    const long long ld = (long long)(NH + 2 * NKV) * hd, co = (long long)NH * hd;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * Tn * ld) return;
    const int c = (int)(idx % ld);
    const long long n = idx / ld;
    const int b = (int)(n / Tn), t = (int)(n % Tn);
    const int g = NH / NKV;
    const float scale = 1.0f / sqrtf(sd);
    const float scale2 = ATT_LOG2E / sqrtf(sd);
    const T* base = qkv + (long long)b * Tn * ld;
    const T* dbase = dout + (long long)b * Tn * co;
    const T* obase = out + (long long)b * Tn * co;
    const float* lseb = lse + (long long)b * NH * Tn;
    float acc = 0.0f;
    if (c < NH * hd) {  // dQ[t, h, e] = Σ_k dS_tk K[k, e]
        const int h = c / hd, e = c % hd, kvh = h / g, i = t;
        const T* dorow = dbase + (long long)i * co + (long long)h * hd;
        const float Di = att_naive_d(dorow, obase + (long long)i * co + (long long)h * hd, hd);
        const float lse2 = lseb[(long long)h * Tn + i] * ATT_LOG2E;
        for (int k = mw_first_key(pos, b, Tn, i, W); k <= i; ++k) {
            float p, ds;
            att_naive_terms(base, dorow, lse2, Di, i, k, h, kvh, NH, NKV, hd, ld, scale, scale2,
                            &p, &ds);
            acc += ds * to_f32(base[(long long)k * ld + (long long)(NH + kvh) * hd + e]);
        }
    } else {  // dK[t, j, e] = Σ_h Σ_i dS_it Q[i, h, e];  dV[t, j, e] = Σ_h Σ_i P_it dO[i, h, e]
        const bool is_v = c >= (NH + NKV) * hd;
        const int cc = c - (is_v ? (NH + NKV) * hd : NH * hd);
        const int kvh = cc / hd, e = cc % hd, k = t;
        for (int h = kvh * g; h < (kvh + 1) * g; ++h) {
            for (int i = k; i < Tn; ++i) {
                if (mw_first_key(pos, b, Tn, i, W) > k) continue;
                const T* dorow = dbase + (long long)i * co + (long long)h * hd;
                const float Di =
                    att_naive_d(dorow, obase + (long long)i * co + (long long)h * hd, hd);
                const float lse2 = lseb[(long long)h * Tn + i] * ATT_LOG2E;
                float p, ds;
                att_naive_terms(base, dorow, lse2, Di, i, k, h, kvh, NH, NKV, hd, ld, scale,
                                scale2, &p, &ds);
                acc += is_v ? p * to_f32(dorow[e])
                            : ds * to_f32(base[(long long)i * ld + (long long)h * hd + e]);
            }
        }
    }
    dqkv[idx] = from_f32<T>(acc);
}

// ---------------------------------------------------------------------------------------------
// Entries. Common arguments (see the header for shapes): qkv [N, ld] T; pos [B, T] u32 or
// NULL; out [N, co] T; lse [B, NH, T] f32; dout [N, co] T; dqkv [N, ld] T (overwritten);
// D = the backward's ws [B·NH·T] f32; then the ints B, T, NH, NKV, hd (and W, the window, but
// for the dot).
//
// attention_forward_hd<HD>_<S>(qkv, pos, out, lse, B, T, NH, NKV, hd, W, sd), for 1 ≤ hd ≤ HD
// (HD = 64, 128, 256): Op::Attention; writes out and lse in full; needs no workspace.
//   grid (ceil(T/32), NH, B), block 256, dynamic shared bytes
//   4·(32·hd + 32·(hd|1) + 32·hd + 1024)   (hd 64: 28,800; hd 128: 53,376; hd 256: 102,528).
//
// attention_backward_dot_<S>(D, dout, out, B, T, NH, hd): Op::AttentionBackward, launch 1:
//   D[(b·NH + h)·T + i] = Σ_c dout[b·T+i, h·hd + c] · out[b·T+i, h·hd + c] (f32), D = ws.
//   grid ceil(B·T·NH / 8), block 256 (one warp per (token, head); any multiple of 32 works,
//   with grid ceil(B·T·NH / (block/32))), no dynamic shared memory. Any hd ≥ 1.
//
// attention_backward_dkv_hd<HD>_<S>(dqkv, pos, dout, qkv, lse, D, B, T, NH, NKV, hd, W, sd), for
// 1 ≤ hd ≤ HD: Op::AttentionBackward, launch 2: writes the K and V parts of dqkv (columns
// NH·hd .. ld) in full.
//   grid (ceil(T/32), NKV, B), block 256, dynamic shared bytes
//   4·(64·hd + 64·(hd|1) + 2048)   (hd 64: 41,216; hd 128: 73,984; hd 256: 139,520).
//
// attention_backward_dq_hd<HD>_<S>(dqkv, pos, dout, qkv, lse, D, B, T, NH, NKV, hd, W, sd), for
// 1 ≤ hd ≤ HD: Op::AttentionBackward, launch 3: writes the Q part of dqkv (columns 0 .. NH·hd)
// in full.
//   grid (ceil(T/32), NH, B), block 256, dynamic shared bytes
//   4·(64·hd + 64·(hd|1) + 1024)   (hd 64: 37,120; hd 128: 69,888; hd 256: 135,424).
//
// attention_forward_naive_<S>(qkv, pos, out, lse, B, T, NH, NKV, hd, W, sd): the naive twin of the
// forward (any hd ≥ 1): one thread per out element (b, i, h, e).
//   grid ceil(B·T·NH·hd / 256), block 256 (any block size works), no shared memory.
//
// attention_backward_naive_<S>(dqkv, pos, dout, qkv, out, lse, B, T, NH, NKV, hd, W, sd): the naive
// twin of the whole backward (any hd ≥ 1; no workspace: D is recomputed per term): one thread
// per dqkv element, overwriting dqkv in full.
//   grid ceil(B·T·(NH + 2·NKV)·hd / 256), block 256 (any block size works), no shared memory.

#define ATT_FWD_PARAMS(T)                                                                      \
    const T *qkv, const unsigned int *pos, T *out, float *lse, int B, int Tn, int NH, int NKV,  \
        int hd, int W, float sd
#define ATT_BWD_PARAMS(T)                                                                      \
    T *dqkv, const unsigned int *pos, const T *dout, const T *qkv, const float *lse,            \
        const float *D, int B, int Tn, int NH, int NKV, int hd, int W, float sd
#define ATT_FWD_ARGS qkv, pos, out, lse, B, Tn, NH, NKV, hd, W, sd
#define ATT_BWD_ARGS dqkv, pos, dout, qkv, lse, D, B, Tn, NH, NKV, hd, W, sd

#define ATTENTION_ENTRIES(T, S)                                                                 \
    extern "C" __global__ __launch_bounds__(ATT_THREADS) void attention_forward_hd64_##S(       \
        ATT_FWD_PARAMS(T)) {                                                                    \
        att_forward<T, 2>(ATT_FWD_ARGS);                                                        \
    }                                                                                           \
    extern "C" __global__ __launch_bounds__(ATT_THREADS) void attention_forward_hd128_##S(      \
        ATT_FWD_PARAMS(T)) {                                                                    \
        att_forward<T, 4>(ATT_FWD_ARGS);                                                        \
    }                                                                                           \
    extern "C" __global__ __launch_bounds__(ATT_THREADS) void attention_forward_hd256_##S(      \
        ATT_FWD_PARAMS(T)) {                                                                    \
        att_forward<T, 8>(ATT_FWD_ARGS);                                                        \
    }                                                                                           \
    extern "C" __global__ void attention_backward_dot_##S(float* D, const T* dout, const T* out, \
                                                          int B, int Tn, int NH, int hd) {     \
        att_backward_dot<T>(D, dout, out, B, Tn, NH, hd);                                      \
    }                                                                                           \
    extern "C" __global__ __launch_bounds__(ATT_THREADS) void attention_backward_dkv_hd64_##S(  \
        ATT_BWD_PARAMS(T)) {                                                                    \
        att_backward_dkv<T, 2>(ATT_BWD_ARGS);                                                   \
    }                                                                                           \
    extern "C" __global__ __launch_bounds__(ATT_THREADS) void attention_backward_dkv_hd128_##S( \
        ATT_BWD_PARAMS(T)) {                                                                    \
        att_backward_dkv<T, 4>(ATT_BWD_ARGS);                                                   \
    }                                                                                           \
    extern "C" __global__ __launch_bounds__(ATT_THREADS) void attention_backward_dkv_hd256_##S( \
        ATT_BWD_PARAMS(T)) {                                                                    \
        att_backward_dkv<T, 8>(ATT_BWD_ARGS);                                                   \
    }                                                                                           \
    extern "C" __global__ __launch_bounds__(ATT_THREADS) void attention_backward_dq_hd64_##S(   \
        ATT_BWD_PARAMS(T)) {                                                                    \
        att_backward_dq<T, 2>(ATT_BWD_ARGS);                                                    \
    }                                                                                           \
    extern "C" __global__ __launch_bounds__(ATT_THREADS) void attention_backward_dq_hd128_##S(  \
        ATT_BWD_PARAMS(T)) {                                                                    \
        att_backward_dq<T, 4>(ATT_BWD_ARGS);                                                    \
    }                                                                                           \
    extern "C" __global__ __launch_bounds__(ATT_THREADS) void attention_backward_dq_hd256_##S(  \
        ATT_BWD_PARAMS(T)) {                                                                    \
        att_backward_dq<T, 8>(ATT_BWD_ARGS);                                                    \
    }                                                                                           \
    extern "C" __global__ void attention_forward_naive_##S(ATT_FWD_PARAMS(T)) {                 \
        att_forward_naive<T>(ATT_FWD_ARGS);                                                     \
    }                                                                                           \
    extern "C" __global__ void attention_backward_naive_##S(                                    \
        T* dqkv, const unsigned int* pos, const T* dout, const T* qkv, const T* out,            \
        const float* lse, int B, int Tn, int NH, int NKV, int hd, int W, float sd) {            \
        att_backward_naive<T>(dqkv, pos, dout, qkv, out, lse, B, Tn, NH, NKV, hd, W, sd);       \
    }

MW_STORAGE_ENTRIES(ATTENTION_ENTRIES)
