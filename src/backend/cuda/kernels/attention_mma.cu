// Causal self-attention on the tensor cores: FlashAttention-2-style forward and backward
// entries for the bf16 and f16 storage types, with
// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32` (inline PTX, f32
// accumulation). The same ops, arguments and results as attention.cu's
// `attention_forward_hd<HD>_<S>`, `attention_backward_dkv_hd<HD>_<S>` and
// `attention_backward_dq_hd<HD>_<S>` (read its header for the shapes, the notation, the
// base-2 lse, packed rows through `pos`, the sliding window W, the workspace D and the
// determinism rules); the backward's launch 1 (D) stays attention.cu's `attention_backward_dot_<S>`. The f32 storage
// type and head sizes above 128 stay on attention.cu's FMA kernels.
//
// STATUS: not yet run on a GPU. Checked by NVRTC (sm_80, sm_90) and by the CPU emulation
// (python3 scripts/cuda-emu/tests/attention_run.py, the mma emulated from the PTX fragment
// layout below) only. The host launches these entries only when MEMWALL_CUDA_ATTENTION=mma
// (ops/attention.rs); the default stays `fma` until a GPU run has confirmed them.
//
// Entries (S = bf16 | f16; HD = 64 | 128 the head tile, for 1 ≤ hd ≤ HD):
//   attention_forward_mma_hd<HD>_<S>(qkv, pos, out, lse, B, T, NH, NKV, hd, W, sd): Op::Attention,
//     writes out [N, NH·hd] and lse [B, NH, T] in full; no workspace.
//     grid (ceil(T/64), NH, B), block 128 (exactly: other blocks return without writing),
//     dynamic shared bytes 2·(64·(HD+8) + HD·72) (hd64: 18,432; hd128: 35,840: never above
//     the 48 KiB that needs an opt-in), static shared 256 bytes.
//   attention_backward_dkv_mma_hd<HD>_<S>(dqkv, pos, dout, qkv, lse, D, B, T, NH, NKV, hd, W, sd):
//     Op::AttentionBackward launch 2, writes the K and V parts of dqkv in full.
//     grid (ceil(T/64), NKV, B), block 128, dynamic shared bytes 2·(4·64·(HD+8) + 2·HD·72)
//     (hd64: 55,296; hd128: 106,496: both need the opt-in), static shared 768 bytes.
//   attention_backward_dq_mma_hd<HD>_<S>(dqkv, pos, dout, qkv, lse, D, B, T, NH, NKV, hd, W, sd):
//     Op::AttentionBackward launch 3, writes the Q part of dqkv in full (launches 2 and 3
//     write disjoint columns, read only ws: either order, after launch 1).
//     grid (ceil(T/64), NH, B), block 128, dynamic shared bytes 2·(4·64·(HD+8) + HD·72)
//     (hd64: 46,080; hd128: 88,064: opt-in), static shared 768 bytes.
//   Every entry needs sm_80 or newer (on an older card the mma traps; the host never selects
//   these entries there). Largest: 106,496 bytes, within sm_80's 163 KiB and sm_90's 227 KiB.
//
// Forward tiling: CTA (x, h, b) serves queries q0 = 64x .. qend−1 (qend = min(q0 + 64, T)) of query
// head h, row b: 4 warps, warp w owns the 16 queries q0 + 16w .. q0 + 16w + 15 (one mma
// M-tile). Keys are visited in blocks of 64 from kmin = min over the CTA's queries of lo(i)
// up to qend − 1 (as attention.cu). Shared memory holds 16-bit bits, rows padded by 8 halves
// (16 bytes) so that the fragment reads below hit 32 distinct banks:
//   Ks [64][HD+8]  keys kb .. kb+63 of the block (zero past qend and past hd); before the
//                  first block it holds the CTA's 64 queries, read once into registers
//   Vt [HD][72]    the block's values, TRANSPOSED (Vt[e][kk] = V[kb+kk][e]), so that PV's B
//                  fragments are single 32-bit reads
// Per key block, warp w computes S = Q Kᵀ (16 × 64, f32 accumulators, 8 n-tiles of 8 keys,
// HD/16 k-steps), masks it, updates the online softmax (base 2, as attention.cu), rounds
// P = 2^(S' − m) to the storage type (bf16/f16: the mma's operand type, as FlashAttention
// does) and accumulates O += P V (16 × HD, HD/8 n-tiles, 4 k-steps of 16 keys). The row sum
// l sums the ROUNDED p (the weights PV actually used), in a fixed order: a lane's 16 values
// (n-tile ascending, then the column pair), then the quad's 4 lanes by xor 1 then xor 2.
// No atomics, fixed loops: every run gives the same bits (the mma's own summation order is the
// hardware's, fixed; the CPU emulation's differs from it, so the emulator's bits are not the
// GPU's, only as close to the f64 reference).
//
// Fragment layout of mma.m16n8k16 (.row.col, 16-bit A and B, f32 C/D), lane l of the warp,
// g = l / 4 (groupID), t = l % 4 (threadID_in_group); each 32-bit A/B register holds two
// 16-bit values, the lower column (A) / k index (B) in the low half:
//   A (16 × 16, row-major)   a0: row g,   cols 2t, 2t+1     a1: row g+8, cols 2t, 2t+1
//                            a2: row g,   cols 2t+8, 2t+9   a3: row g+8, cols 2t+8, 2t+9
//   B (16 × 8, k × n, "col": stored n-major) b0: k 2t, 2t+1 of col g   b1: k 2t+8, 2t+9 of col g
//   C/D (16 × 8, f32)        c0, c1: row g, cols 2t, 2t+1   c2, c3: row g+8, cols 2t, 2t+1
// As NVIDIA's PTX ISA documents it ("Matrix Fragments for mma.m16n8k16 with floating point
// type", docs.nvidia.com/cuda/parallel-thread-execution/#mma-16816-a-f16, -16816-b-f16,
// -16816-c: row = groupID for a_i with 0 ≤ i < 2 || 4 ≤ i < 6, groupID + 8 otherwise; col =
// threadID_in_group·2 + (i & 1), + 8 for i ≥ 4; B row = threadID_in_group·2 + (i & 1), + 8 for
// i ≥ 2, col = groupID; C row = groupID for i < 2, + 8 otherwise, col = threadID_in_group·2 +
// (i & 1)), confirmed against ggml-cuda's mma.cuh (tile<16, 8, half2>::get_i/get_j: i =
// (l % 2)·8 + lane/4, j = (l / 2)·4 + lane%4 in half2 units; tile<16, 8, float>: i = (l / 2)·8
// + lane/4, j = (lane%4)·2 + l%2), the layout FlashAttention-2 and llm.c rely on. The C
// fragments of two adjacent n-tiles (keys 16kk .. 16kk+15) are exactly the A fragment of one
// k-step of PV: a0 = (c0, c1) of n-tile 2kk, a1 = (c2, c3) of 2kk, a2 = (c0, c1) of 2kk+1,
// a3 = (c2, c3) of 2kk+1, so P never leaves the registers.

#define ATTM_THREADS 128
#define ATTM_BQ 64
#define ATTM_BK 64
#define ATTM_PAD 8
#define ATTM_VS (ATTM_BK + ATTM_PAD)  // Vt's row stride (halves)
#define ATTM_LOG2E 1.4426950408889634f
#define ATTM_LN2 0.6931471805599453f
#define ATTM_NEG_INF __int_as_float(0xff800000)
#define ATTM_NO_KEY 0x7fffffff

// D = A·B + C for one m16n8k16 tile (fragments as in the header), in place on c. The CPU
// emulation (attention_run.py) replaces the asm with emu_mma_m16n8k16 (attention_emu.h).
template <typename T>
__device__ __forceinline__ void mw_mma_m16n8k16(float c[4], const unsigned a[4],
                                                const unsigned b[2]);
template <>
__device__ __forceinline__ void mw_mma_m16n8k16<bf16>(float c[4], const unsigned a[4],
                                                      const unsigned b[2]) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // sm_80 and newer only; the host never selects these entries below
#endif
}
template <>
__device__ __forceinline__ void mw_mma_m16n8k16<f16>(float c[4], const unsigned a[4],
                                                     const unsigned b[2]) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
}

// Two 16-bit values in one register: lo in the low half (the lower column / k index).
__device__ __forceinline__ unsigned attm_pack(unsigned short lo, unsigned short hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

// Rows row0 .. row0+63 of a [T, ld] operand (channels src + c, c < hd; rows ≥ rend and
// channels ≥ hd read as 0) into shared memory as 16-bit bits: row-major into dst[r·(HD+8) + c]
// and/or transposed into dstT[c·ATTM_VS + r] (either may be NULL). 16-byte global loads when
// `vec` (hd a multiple of 8 and the buffer 16-byte aligned: every row start then is), else one
// value at a time; the same bits either way.
template <typename T, int HD>
__device__ __forceinline__ void attm_load_tile(unsigned short* dst, unsigned short* dstT,
                                               const T* src, long long ld, int row0, int rend,
                                               int hd, bool vec) {
    constexpr int CH = HD / 8;  // 8-value chunks of a row
    for (int x = threadIdx.x; x < ATTM_BK * CH; x += ATTM_THREADS) {
        const int r = x / CH, c0 = (x - r * CH) * 8, row = row0 + r;
        unsigned short v[8];
        if (row < rend && vec && c0 < hd) {
            MwPack<T> p = mw_load16(src + (long long)row * ld + c0);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = p.v[j].bits;
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j)
                v[j] = row < rend && c0 + j < hd ? src[(long long)row * ld + c0 + j].bits : 0;
        }
        if (dstT != nullptr) {
#pragma unroll
            for (int j = 0; j < 8; ++j) dstT[(c0 + j) * ATTM_VS + r] = v[j];
        }
        if (dst != nullptr) {
#pragma unroll
            for (int j = 0; j < 8; ++j) dst[r * (HD + ATTM_PAD) + c0 + j] = v[j];
        }
    }
}

// The A fragment of k-step ks of rows r0 .. r0+15 of a row-major tile of W-word rows (16-bit
// pairs), and the B fragment of k-step ks of the n-tile whose 8 columns are the tile's rows
// n0 .. n0+7 (the header's layout).
__device__ __forceinline__ void attm_frag_a(unsigned a[4], const unsigned int* tile, int W,
                                            int r0, int ks, int g, int t) {
    a[0] = tile[(r0 + g) * W + ks * 8 + t];
    a[1] = tile[(r0 + g + 8) * W + ks * 8 + t];
    a[2] = tile[(r0 + g) * W + ks * 8 + 4 + t];
    a[3] = tile[(r0 + g + 8) * W + ks * 8 + 4 + t];
}
__device__ __forceinline__ void attm_frag_b(unsigned b[2], const unsigned int* tile, int W,
                                            int n0, int ks, int g, int t) {
    b[0] = tile[(n0 + g) * W + ks * 8 + t];
    b[1] = tile[(n0 + g) * W + ks * 8 + 4 + t];
}

template <typename T, int HD>
__device__ __forceinline__ void attm_forward(const T* __restrict__ qkv,
                                             const unsigned int* __restrict__ pos,
                                             T* __restrict__ out, float* __restrict__ lse, int B,
                                             int Tn, int NH, int NKV, int hd, int W, float sd) {
    extern __shared__ unsigned int attm_sm[];
    __shared__ int los[ATTM_BQ];
    constexpr int KS = HD / 16;  // k-steps of QKᵀ
    constexpr int NO = HD / 8;   // n-tiles of O
    constexpr int NS = ATTM_BK / 8;  // n-tiles of S
    constexpr int KW = (HD + ATTM_PAD) / 2, VW = ATTM_VS / 2;  // row strides in 32-bit words
    if (blockDim.x != ATTM_THREADS || Tn <= 0 || NKV <= 0 || NH <= 0 || NH % NKV != 0 ||
        hd <= 0 || hd > HD)
        return;
    const int q0 = blockIdx.x * ATTM_BQ, h = blockIdx.y, b = blockIdx.z;
    if (q0 >= Tn || h >= NH || b >= B) return;  // uniform over the CTA
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    unsigned short* Ks = (unsigned short*)attm_sm;   // [64][HD+8]
    unsigned short* Vt = Ks + ATTM_BK * (HD + ATTM_PAD);  // [HD][72]
    const unsigned int* K32 = attm_sm;
    const unsigned int* V32 = attm_sm + ATTM_BK * KW;
    const int grp = NH / NKV, kvh = h / grp;
    const long long ld = (long long)(NH + 2 * NKV) * hd, co = (long long)NH * hd;
    const int qend = min(q0 + ATTM_BQ, Tn);
    const float scale2 = ATTM_LOG2E / sqrtf(sd);
    const T* base = qkv + (long long)b * Tn * ld;
    const bool vec = hd % 8 == 0 && mw_aligned16(qkv);

    if (tid < ATTM_BQ) {
        int i = q0 + tid;
        los[tid] = i < qend ? mw_first_key(pos, b, Tn, i, W) : ATTM_NO_KEY;
    }
    // The queries through Ks into registers: qf[ks] is the A fragment of k-step ks of the
    // warp's 16 rows.
    attm_load_tile<T, HD>(Ks, nullptr, base + (long long)h * hd, ld, q0, qend, hd, vec);
    __syncthreads();
    int kmin = los[0];
    for (int r = 1; r < ATTM_BQ; ++r) kmin = min(kmin, los[r]);
    const int ra = w * 16 + g, rb = ra + 8;  // the lane's two rows of the tile (c0,c1 / c2,c3)
    const int ia = q0 + ra, ib = q0 + rb, loa = los[ra], lob = los[rb];
    unsigned qf[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) attm_frag_a(qf[ks], K32, KW, w * 16, ks, g, t);

    float o[NO][4], m[2] = {ATTM_NEG_INF, ATTM_NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    const T* kp = base + (long long)(NH + kvh) * hd;
    const T* vp = base + (long long)(NH + NKV + kvh) * hd;
    for (int kb = kmin; kb < qend; kb += ATTM_BK) {
        __syncthreads();  // every warp is done with Ks (the queries, or the previous block), Vt
        attm_load_tile<T, HD>(Ks, nullptr, kp, ld, kb, qend, hd, vec);
        attm_load_tile<T, HD>(nullptr, Vt, vp, ld, kb, qend, hd, vec);
        __syncthreads();
        // S = Q Kᵀ: s[n] is the C fragment of keys kb + 8n .. kb + 8n + 7.
        float s[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
            for (int n = 0; n < NS; ++n) {
                unsigned kf[2];
                attm_frag_b(kf, K32, KW, n * 8, ks, g, t);
                mw_mma_m16n8k16<T>(s[n], qf[ks], kf);
            }
        }
        // Mask, scale (base 2), the rows' maxima over the block (the quad's 4 lanes hold a
        // row's 64 keys).
        float mx[2] = {ATTM_NEG_INF, ATTM_NEG_INF};
#pragma unroll
        for (int n = 0; n < NS; ++n) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int k = kb + n * 8 + 2 * t + (j & 1);
                const int i = j < 2 ? ia : ib, lo = j < 2 ? loa : lob;
                const bool ok = i < qend && k >= lo && k <= i;
                s[n][j] = ok ? s[n][j] * scale2 : ATTM_NEG_INF;
                mx[j >> 1] = fmaxf(mx[j >> 1], s[n][j]);
            }
        }
        float alpha[2], mn[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            mn[r] = fmaxf(m[r], mx[r]);  // the same in the quad's 4 lanes
            // m = −inf: nothing seen yet (o, l are 0); mn = −inf: nothing seen still.
            alpha[r] = mn[r] == ATTM_NEG_INF ? 1.0f : exp2f(m[r] - mn[r]);
        }
        // P = 2^(S' − m), rounded to T (masked: exactly 0, never through exp2), packed as PV's
        // A fragments; the row sums of the rounded values.
        unsigned pf[ATTM_BK / 16][4];
        float ps[2] = {0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            unsigned short hb[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float sv = s[n][j];
                const T p = from_f32<T>(sv == ATTM_NEG_INF ? 0.0f : exp2f(sv - mn[j >> 1]));
                hb[j] = p.bits;
                ps[j >> 1] += to_f32(p);
            }
            pf[n >> 1][(n & 1) * 2 + 0] = attm_pack(hb[0], hb[1]);  // row g: a0 / a2
            pf[n >> 1][(n & 1) * 2 + 1] = attm_pack(hb[2], hb[3]);  // row g+8: a1 / a3
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            ps[r] += __shfl_xor_sync(0xffffffffu, ps[r], 1);
            ps[r] += __shfl_xor_sync(0xffffffffu, ps[r], 2);
            l[r] = l[r] * alpha[r] + ps[r];
            m[r] = mn[r];
        }
        // O = O·alpha + P V: k-step kk covers keys kb + 16kk .. (A: pf[kk]; B: Vt rows = the
        // n-tile's channels, words kk·8 + t and kk·8 + 4 + t = keys 16kk + 2t, + 8).
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
#pragma unroll
        for (int kk = 0; kk < ATTM_BK / 16; ++kk) {
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                unsigned vf[2];
                attm_frag_b(vf, V32, VW, n * 8, kk, g, t);
                mw_mma_m16n8k16<T>(o[n], pf[kk], vf);
            }
        }
    }
    // out = O / l (channels < hd of the valid rows); lse = (m + log2 l)·ln 2 by the quad's
    // first lane.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = r == 0 ? ia : ib;
        if (i >= qend) continue;
        const float inv = 1.0f / l[r];
        T* orow = out + ((long long)b * Tn + i) * co + (long long)h * hd;
#pragma unroll
        for (int n = 0; n < NO; ++n) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int e = n * 8 + 2 * t + j;
                if (e < hd) orow[e] = from_f32<T>(o[n][2 * r + j] * inv);
            }
        }
        if (t == 0) lse[((long long)b * NH + h) * Tn + i] = (m[r] + log2f(l[r])) * ATTM_LN2;
    }
}

// ---------------------------------------------------------------------------------------------
// Backward (launches 2 and 3 of Op::AttentionBackward; launch 1, D = rowsum(dout ⊙ out) into
// ws, stays attention.cu's attention_backward_dot_<S>). With lse2 = lse·log2(e), as attention.cu:
//   P_ij = 2^min(S'_ij − lse2_i, 0) (attended; else 0), dS_ij = P_ij (dP_ij − D_i) · scale,
//   dP = dO Vᵀ, dV = Pᵀ dO, dK = dSᵀ Q, dQ = dS K (scale = 1/sqrtf(sd)),
// S and dP accumulated in f32 by the mma; P and dS rounded to T (bf16/f16) as the operands of
// the dV, dK and dQ products (as FlashAttention-2 does), accumulated in f32, rounded to T once.

// The 16 × 64 tile of P and dS (C fragments s = scores q·k, dp = dO·v) as PV-style A
// fragments: pf[kk] / df[kk] cover columns 16kk .. 16kk+15 (see the header's C → A identity).
// Element (r, c) of the tile (the lane's rows r = g, g+8; columns c = 8n + 2t, +1) belongs to
// query i and key k that `terms` names; masked elements are exactly 0.
template <typename T>
__device__ __forceinline__ void attm_pack_p_ds(const float s[8][4], const float dp[8][4],
                                               const bool ok[8][4], const float lse2[8][4],
                                               const float dd[8][4], float scale2, float scale,
                                               unsigned pf[4][4], unsigned df[4][4]) {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        unsigned short pb[4], db[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float p = 0.0f, ds = 0.0f;
            if (ok[n][j]) {
                p = exp2f(fminf(s[n][j] * scale2 - lse2[n][j], 0.0f));
                ds = p * (dp[n][j] - dd[n][j]) * scale;
            }
            pb[j] = from_f32<T>(p).bits;
            db[j] = from_f32<T>(ds).bits;
        }
        pf[n >> 1][(n & 1) * 2 + 0] = attm_pack(pb[0], pb[1]);
        pf[n >> 1][(n & 1) * 2 + 1] = attm_pack(pb[2], pb[3]);
        df[n >> 1][(n & 1) * 2 + 0] = attm_pack(db[0], db[1]);
        df[n >> 1][(n & 1) * 2 + 1] = attm_pack(db[2], db[3]);
    }
}

// Backward 2: dK, dV. CTA (x, j, b): keys k0 = 64x .. kend−1 of KV head j, row b; warp w owns
// keys k0 + 16w .. k0 + 16w + 15 and accumulates their dK, dV (16 × HD each, f32 C fragments)
// over the query heads h = j·g … j·g+g−1 in order and, per head, the query blocks q0 = k0,
// k0 + 64, … < T in order (a block none of whose queries attends a key of the CTA is skipped,
// by __syncthreads_or, as attention.cu). Per block: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (16 keys × 64
// queries), Pᵀ, dSᵀ, then dV += Pᵀ dO and dK += dSᵀ Q (B fragments from the transposed tiles).
// Shared (16-bit, rows padded by 8 halves): Ks, Vs [64][HD+8] (the CTA's keys, values),
// Qs, dOs [64][HD+8] (the query block), Qt, dOt [HD][72] (the same, transposed).
template <typename T, int HD>
__device__ __forceinline__ void attm_backward_dkv(T* __restrict__ dqkv,
                                                  const unsigned int* __restrict__ pos,
                                                  const T* __restrict__ dout,
                                                  const T* __restrict__ qkv,
                                                  const float* __restrict__ lse,
                                                  const float* __restrict__ D, int B, int Tn,
                                                  int NH, int NKV, int hd, int W, float sd) {
    extern __shared__ unsigned int attm_sm[];
    __shared__ int los[ATTM_BQ];
    __shared__ float lse2s[ATTM_BQ], Ds[ATTM_BQ];
    constexpr int KS = HD / 16, NO = HD / 8;
    constexpr int KW = (HD + ATTM_PAD) / 2, VW = ATTM_VS / 2;
    if (blockDim.x != ATTM_THREADS || Tn <= 0 || NKV <= 0 || NH <= 0 || NH % NKV != 0 ||
        hd <= 0 || hd > HD)
        return;
    const int k0 = blockIdx.x * ATTM_BK, j = blockIdx.y, b = blockIdx.z;
    if (k0 >= Tn || j >= NKV || b >= B) return;  // uniform over the CTA
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    const unsigned int* K32 = attm_sm;
    const unsigned int* V32 = K32 + ATTM_BK * KW;
    const unsigned int* Q32 = V32 + ATTM_BK * KW;
    const unsigned int* dO32 = Q32 + ATTM_BQ * KW;
    const unsigned int* Qt32 = dO32 + ATTM_BQ * KW;
    const unsigned int* dOt32 = Qt32 + HD * VW;
    unsigned short* Ks = (unsigned short*)K32;
    unsigned short* Vs = (unsigned short*)V32;
    unsigned short* Qs = (unsigned short*)Q32;
    unsigned short* dOs = (unsigned short*)dO32;
    unsigned short* Qt = (unsigned short*)Qt32;
    unsigned short* dOt = (unsigned short*)dOt32;
    const int grp = NH / NKV;
    const long long ld = (long long)(NH + 2 * NKV) * hd, co = (long long)NH * hd;
    const int kend = min(k0 + ATTM_BK, Tn);
    const float scale = 1.0f / sqrtf(sd);
    const float scale2 = ATTM_LOG2E / sqrtf(sd);
    const T* base = qkv + (long long)b * Tn * ld;
    const bool vq = hd % 8 == 0 && mw_aligned16(qkv), vd = hd % 8 == 0 && mw_aligned16(dout);

    attm_load_tile<T, HD>(Ks, nullptr, base + (long long)(NH + j) * hd, ld, k0, kend, hd, vq);
    attm_load_tile<T, HD>(Vs, nullptr, base + (long long)(NH + NKV + j) * hd, ld, k0, kend, hd,
                          vq);
    float dk[NO][4], dv[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
        for (int q = 0; q < 4; ++q) dk[n][q] = dv[n][q] = 0.0f;
    const int ka = k0 + w * 16 + g, kb8 = ka + 8;  // the lane's two keys (rows g, g+8)

    for (int h = j * grp; h < (j + 1) * grp; ++h) {
        const T* qp = base + (long long)h * hd;
        const T* dop = dout + (long long)b * Tn * co + (long long)h * hd;
        const float* lsep = lse + ((long long)b * NH + h) * Tn;
        const float* Dp = D + ((long long)b * NH + h) * Tn;
        // Queries past kend − 2 + W see no key of the CTA (their windows start after it).
        const int qlim = W > 0 ? (int)min((long long)Tn, (long long)kend - 1 + W) : Tn;
        for (int q0 = k0; q0 < qlim; q0 += ATTM_BQ) {
            // Does any query of the block attend a key of the CTA (queries i ≥ q0 ≥ k0 reach
            // a key below kend iff lo(i) < kend)? The barrier also ends every warp's use of
            // the previous block's tiles (and orders the K, V loads before the first use).
            bool att = false;
            if (tid < ATTM_BQ && q0 + tid < Tn)
                att = mw_first_key(pos, b, Tn, q0 + tid, W) < kend;
            if (!__syncthreads_or(att)) continue;
            const int qend = min(q0 + ATTM_BQ, Tn);
            if (tid < ATTM_BQ) {
                const int i = q0 + tid;
                const bool in = i < qend;
                los[tid] = in ? mw_first_key(pos, b, Tn, i, W) : ATTM_NO_KEY;
                lse2s[tid] = in ? lsep[i] * ATTM_LOG2E : 0.0f;
                Ds[tid] = in ? Dp[i] : 0.0f;
            }
            attm_load_tile<T, HD>(Qs, Qt, qp, ld, q0, qend, hd, vq);
            attm_load_tile<T, HD>(dOs, dOt, dop, co, q0, qend, hd, vd);
            __syncthreads();
            // Sᵀ, dPᵀ: rows = the warp's keys, columns = the block's queries (n-tile n:
            // queries q0 + 8n ..).
            float s[8][4], dp[8][4];
#pragma unroll
            for (int n = 0; n < 8; ++n)
#pragma unroll
                for (int q = 0; q < 4; ++q) s[n][q] = dp[n][q] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                unsigned ka4[4], va4[4];
                attm_frag_a(ka4, K32, KW, w * 16, ks, g, t);
                attm_frag_a(va4, V32, KW, w * 16, ks, g, t);
#pragma unroll
                for (int n = 0; n < 8; ++n) {
                    unsigned qb[2], gb[2];
                    attm_frag_b(qb, Q32, KW, n * 8, ks, g, t);
                    attm_frag_b(gb, dO32, KW, n * 8, ks, g, t);
                    mw_mma_m16n8k16<T>(s[n], ka4, qb);
                    mw_mma_m16n8k16<T>(dp[n], va4, gb);
                }
            }
            bool ok[8][4];
            float l2[8][4], dd[8][4];
#pragma unroll
            for (int n = 0; n < 8; ++n)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int c = n * 8 + 2 * t + (q & 1), i = q0 + c, k = q < 2 ? ka : kb8;
                    ok[n][q] = k < kend && i < qend && k >= los[c] && k <= i;
                    l2[n][q] = lse2s[c];
                    dd[n][q] = Ds[c];
                }
            unsigned pf[4][4], df[4][4];
            attm_pack_p_ds<T>(s, dp, ok, l2, dd, scale2, scale, pf, df);
            // dV += Pᵀ dO, dK += dSᵀ Q: k-step kk = queries q0 + 16kk ..; B from dOt, Qt.
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                for (int n = 0; n < NO; ++n) {
                    unsigned gb[2], qb[2];
                    attm_frag_b(gb, dOt32, VW, n * 8, kk, g, t);
                    attm_frag_b(qb, Qt32, VW, n * 8, kk, g, t);
                    mw_mma_m16n8k16<T>(dv[n], pf[kk], gb);
                    mw_mma_m16n8k16<T>(dk[n], df[kk], qb);
                }
            }
        }
    }
    T* dbase = dqkv + (long long)b * Tn * ld;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int k = r == 0 ? ka : kb8;
        if (k >= kend) continue;
        T* dkrow = dbase + (long long)k * ld + (long long)(NH + j) * hd;
        T* dvrow = dbase + (long long)k * ld + (long long)(NH + NKV + j) * hd;
#pragma unroll
        for (int n = 0; n < NO; ++n)
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int e = n * 8 + 2 * t + q;
                if (e < hd) {
                    dkrow[e] = from_f32<T>(dk[n][2 * r + q]);
                    dvrow[e] = from_f32<T>(dv[n][2 * r + q]);
                }
            }
    }
}

// Backward 3: dQ. CTA (x, h, b): queries q0 = 64x .. qend−1 of head h, row b, over the key
// blocks of the forward (kmin .. qend−1 in blocks of 64, in order); warp w owns queries
// q0 + 16w .. + 15 and accumulates their dQ (16 × HD, f32). Per block: S = Q Kᵀ, dP = dO Vᵀ
// (16 queries × 64 keys), P, dS, dQ += dS K (B fragments from Kt). Shared (16-bit, padded):
// Qs, dOs [64][HD+8] (the CTA's queries), Ks, Vs [64][HD+8] (the key block), Kt [HD][72].
template <typename T, int HD>
__device__ __forceinline__ void attm_backward_dq(T* __restrict__ dqkv,
                                                 const unsigned int* __restrict__ pos,
                                                 const T* __restrict__ dout,
                                                 const T* __restrict__ qkv,
                                                 const float* __restrict__ lse,
                                                 const float* __restrict__ D, int B, int Tn,
                                                 int NH, int NKV, int hd, int W, float sd) {
    extern __shared__ unsigned int attm_sm[];
    __shared__ int los[ATTM_BQ];
    __shared__ float lse2s[ATTM_BQ], Ds[ATTM_BQ];
    constexpr int KS = HD / 16, NO = HD / 8;
    constexpr int KW = (HD + ATTM_PAD) / 2, VW = ATTM_VS / 2;
    if (blockDim.x != ATTM_THREADS || Tn <= 0 || NKV <= 0 || NH <= 0 || NH % NKV != 0 ||
        hd <= 0 || hd > HD)
        return;
    const int q0 = blockIdx.x * ATTM_BQ, h = blockIdx.y, b = blockIdx.z;
    if (q0 >= Tn || h >= NH || b >= B) return;  // uniform over the CTA
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    const unsigned int* Q32 = attm_sm;
    const unsigned int* dO32 = Q32 + ATTM_BQ * KW;
    const unsigned int* K32 = dO32 + ATTM_BQ * KW;
    const unsigned int* V32 = K32 + ATTM_BK * KW;
    const unsigned int* Kt32 = V32 + ATTM_BK * KW;
    const int grp = NH / NKV, kvh = h / grp;
    const long long ld = (long long)(NH + 2 * NKV) * hd, co = (long long)NH * hd;
    const int qend = min(q0 + ATTM_BQ, Tn);
    const float scale = 1.0f / sqrtf(sd);
    const float scale2 = ATTM_LOG2E / sqrtf(sd);
    const T* base = qkv + (long long)b * Tn * ld;
    const bool vq = hd % 8 == 0 && mw_aligned16(qkv), vd = hd % 8 == 0 && mw_aligned16(dout);

    if (tid < ATTM_BQ) {
        const int i = q0 + tid;
        const bool in = i < qend;
        los[tid] = in ? mw_first_key(pos, b, Tn, i, W) : ATTM_NO_KEY;
        lse2s[tid] = in ? lse[((long long)b * NH + h) * Tn + i] * ATTM_LOG2E : 0.0f;
        Ds[tid] = in ? D[((long long)b * NH + h) * Tn + i] : 0.0f;
    }
    attm_load_tile<T, HD>((unsigned short*)Q32, nullptr, base + (long long)h * hd, ld, q0, qend,
                          hd, vq);
    attm_load_tile<T, HD>((unsigned short*)dO32, nullptr,
                          dout + (long long)b * Tn * co + (long long)h * hd, co, q0, qend, hd,
                          vd);
    __syncthreads();
    int kmin = los[0];
    for (int r = 1; r < ATTM_BQ; ++r) kmin = min(kmin, los[r]);
    const int ra = w * 16 + g, rb = ra + 8;  // the lane's two rows (c0, c1 / c2, c3)
    float dq[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
    const T* kp = base + (long long)(NH + kvh) * hd;
    const T* vp = base + (long long)(NH + NKV + kvh) * hd;
    for (int kb = kmin; kb < qend; kb += ATTM_BK) {
        __syncthreads();  // every warp is done with the previous block's Ks, Vs, Kt
        attm_load_tile<T, HD>((unsigned short*)K32, (unsigned short*)Kt32, kp, ld, kb, qend, hd,
                              vq);
        attm_load_tile<T, HD>((unsigned short*)V32, nullptr, vp, ld, kb, qend, hd, vq);
        __syncthreads();
        float s[8][4], dp[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) s[n][q] = dp[n][q] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            unsigned qa[4], ga[4];
            attm_frag_a(qa, Q32, KW, w * 16, ks, g, t);
            attm_frag_a(ga, dO32, KW, w * 16, ks, g, t);
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                unsigned kf[2], vf[2];
                attm_frag_b(kf, K32, KW, n * 8, ks, g, t);
                attm_frag_b(vf, V32, KW, n * 8, ks, g, t);
                mw_mma_m16n8k16<T>(s[n], qa, kf);
                mw_mma_m16n8k16<T>(dp[n], ga, vf);
            }
        }
        bool ok[8][4];
        float l2[8][4], dd[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int r = q < 2 ? ra : rb, i = q0 + r, k = kb + n * 8 + 2 * t + (q & 1);
                ok[n][q] = i < qend && k >= los[r] && k <= i;
                l2[n][q] = lse2s[r];
                dd[n][q] = Ds[r];
            }
        unsigned pf[4][4], df[4][4];
        attm_pack_p_ds<T>(s, dp, ok, l2, dd, scale2, scale, pf, df);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                unsigned kf[2];
                attm_frag_b(kf, Kt32, VW, n * 8, kk, g, t);
                mw_mma_m16n8k16<T>(dq[n], df[kk], kf);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = q0 + (r == 0 ? ra : rb);
        if (i >= qend) continue;
        T* dqrow = dqkv + ((long long)b * Tn + i) * ld + (long long)h * hd;
#pragma unroll
        for (int n = 0; n < NO; ++n)
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int e = n * 8 + 2 * t + q;
                if (e < hd) dqrow[e] = from_f32<T>(dq[n][2 * r + q]);
            }
    }
}

#define ATTM_FWD_PARAMS(T)                                                                     \
    const T *qkv, const unsigned int *pos, T *out, float *lse, int B, int Tn, int NH, int NKV, \
        int hd, int W, float sd
#define ATTM_FWD_ARGS qkv, pos, out, lse, B, Tn, NH, NKV, hd, W, sd

extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_forward_mma_hd64_bf16(
    ATTM_FWD_PARAMS(bf16)) {
    attm_forward<bf16, 64>(ATTM_FWD_ARGS);
}
extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_forward_mma_hd128_bf16(
    ATTM_FWD_PARAMS(bf16)) {
    attm_forward<bf16, 128>(ATTM_FWD_ARGS);
}
extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_forward_mma_hd64_f16(
    ATTM_FWD_PARAMS(f16)) {
    attm_forward<f16, 64>(ATTM_FWD_ARGS);
}
extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_forward_mma_hd128_f16(
    ATTM_FWD_PARAMS(f16)) {
    attm_forward<f16, 128>(ATTM_FWD_ARGS);
}

#define ATTM_BWD_PARAMS(T)                                                                     \
    T *dqkv, const unsigned int *pos, const T *dout, const T *qkv, const float *lse,            \
        const float *D, int B, int Tn, int NH, int NKV, int hd, int W, float sd
#define ATTM_BWD_ARGS dqkv, pos, dout, qkv, lse, D, B, Tn, NH, NKV, hd, W, sd

extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_backward_dkv_mma_hd64_bf16(
    ATTM_BWD_PARAMS(bf16)) {
    attm_backward_dkv<bf16, 64>(ATTM_BWD_ARGS);
}
extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_backward_dkv_mma_hd128_bf16(
    ATTM_BWD_PARAMS(bf16)) {
    attm_backward_dkv<bf16, 128>(ATTM_BWD_ARGS);
}
extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_backward_dkv_mma_hd64_f16(
    ATTM_BWD_PARAMS(f16)) {
    attm_backward_dkv<f16, 64>(ATTM_BWD_ARGS);
}
extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_backward_dkv_mma_hd128_f16(
    ATTM_BWD_PARAMS(f16)) {
    attm_backward_dkv<f16, 128>(ATTM_BWD_ARGS);
}
extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_backward_dq_mma_hd64_bf16(
    ATTM_BWD_PARAMS(bf16)) {
    attm_backward_dq<bf16, 64>(ATTM_BWD_ARGS);
}
extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_backward_dq_mma_hd128_bf16(
    ATTM_BWD_PARAMS(bf16)) {
    attm_backward_dq<bf16, 128>(ATTM_BWD_ARGS);
}
extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_backward_dq_mma_hd64_f16(
    ATTM_BWD_PARAMS(f16)) {
    attm_backward_dq<f16, 64>(ATTM_BWD_ARGS);
}
extern "C" __global__ __launch_bounds__(ATTM_THREADS) void attention_backward_dq_mma_hd128_f16(
    ATTM_BWD_PARAMS(f16)) {
    attm_backward_dq<f16, 128>(ATTM_BWD_ARGS);
}
