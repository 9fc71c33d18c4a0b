// xent.cu: the LM head's softmax cross-entropy (Op::LmHeadLoss), llm.c's fused classifier.
//
// Ops served:
// - Op::LmHeadLoss, per chunk of r rows: the host runs the GEMM `logits[r, V] (f32) = inp
//   rows @ wᵀ`, then ONE launch of `xent_fused` over the chunk: each row's loss into `losses`
//   and, when training, the logits overwritten IN PLACE by
//   d(loss·scale)/dlogits = scale·(softmax − onehot(target)), which the host's two GEMMs then
//   read (dinp = dlogits @ w, dw += dlogitsᵀ @ inp). Evaluation (not training, or no `dinp`)
//   launches the same entry with `grad = 0`: losses only, logits untouched.
// - Op::LmHeadLast needs no kernel: it is one GEMM, `logits[1, V] (f32) = inp[N−1, :] @ wᵀ`.
//
// Arithmetic: bitwise the CPU's (`backend/cpu/xent.rs`), not just to a tolerance:
// - max over the row (order-free; NaN skipped as by f32::max);
// - Σ e^(x − max) with the CPU's branch-free `exp_f32` (`reduce.rs`, ported op for op with
//   __fmul_rn/__fadd_rn so no FMA contraction changes a rounding), summed in the CPU's exact
//   order: the row cut into 1024-element blocks; in a block, 16 f32 lanes, lane l summing
//   elements l, l+16, l+32, ... in order; the 16 lanes combined pairwise as `combine16`
//   ((a[i] + a[i+8]), then (h[i] + h[i+4]), then (q0 + q2) + (q1 + q3)); the block sums
//   added in f64, block after block, from 0.0;
// - loss = (float)(log(sum) − (double)(x[target] − max)) (f64 log: CUDA's is within 1 ulp
//   of glibc's, so the f32 loss is the CPU's but in a ~2⁻²⁹ chance);
// - gradient: s = (float)((double)scale / sum); g = e·s (f32), flushed to 0 when g < 1e-30
//   (no denormals for the GEMMs); then g[target] −= scale.
// So the gradient and (but for the f64 log's last bit) the loss are bitwise the CPU's, for
// any launch configuration.
//
// A target of IGNORE_TARGET (0xFFFFFFFF) is not trained: loss 0, gradient row 0. A target
// >= V (the CPU panics on it) gives loss NaN and, when training, a gradient row of NaN, so
// the step's gradient norm is not finite and the step is skipped.

#define MW_IGNORE_TARGET 0xFFFFFFFFu
// Elements per block of the exp-sum (the CPU's SUM_BLOCK) and lanes per block.
#define XENT_SUM_BLOCK 1024
#define XENT_LANES 16

// `exp_f32` of backend/cpu/reduce.rs, op for op (no contraction): a Cephes polynomial;
// 0 below −87.3, saturated at e^88 above 88, NaN propagates.
__device__ __forceinline__ float mw_exp_f32(float x) {
    const float LOG2E = __uint_as_float(0x3fb8aa3bu);   // std::f32::consts::LOG2_E
    const float LN2_HI = __uint_as_float(0x3f318000u);  // 0.693_359_4
    const float LN2_LO = __uint_as_float(0xb95e8083u);  // -2.121_944_4e-4
    const float MAGIC = __uint_as_float(0x4b400000u);   // 12_582_912.0
    const float LO = __uint_as_float(0xc2ae999au);      // -87.3
    const float HI = __uint_as_float(0x42b00000u);      // 88.0
    bool underflow = x < LO;
    x = underflow ? LO : x;
    x = x > HI ? HI : x;
    float t = __fadd_rn(__fmul_rn(x, LOG2E), MAGIC);
    float k = __fsub_rn(t, MAGIC);
    int ki = (int)(__float_as_uint(t) - 0x4b400000u);
    float r = __fsub_rn(__fsub_rn(x, __fmul_rn(k, LN2_HI)), __fmul_rn(k, LN2_LO));
    float z = __fmul_rn(r, r);
    float p = __fadd_rn(__fmul_rn(__uint_as_float(0x39506968u), r), __uint_as_float(0x3ab743ceu));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3c088908u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3d2aa9c1u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3e2aaaaau));
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fadd_rn(__fmul_rn(p, z), r), 1.0f);
    float scale = __uint_as_float(((unsigned int)ki + 127u) << 23);
    float e = __fmul_rn(p, scale);
    return underflow ? 0.0f : e;
}

// The CPU's `combine16` of 16 lanes held by the 16 lanes of a half-warp (`a` = this lane's
// value); the result is valid in the half-warp's lane 0. Every lane of the warp must call it.
__device__ __forceinline__ float xent_combine16(float a) {
    float h = __fadd_rn(a, __shfl_down_sync(0xffffffffu, a, 8, 16));  // lanes 0..7: a[i] + a[i+8]
    float q = __fadd_rn(h, __shfl_down_sync(0xffffffffu, h, 4, 16));  // lanes 0..3: h[i] + h[i+4]
    // lanes 0, 1: q0 + q2, q1 + q3; then lane 0: (q0 + q2) + (q1 + q3)
    float s = __fadd_rn(q, __shfl_down_sync(0xffffffffu, q, 2, 16));
    return __fadd_rn(s, __shfl_down_sync(0xffffffffu, s, 1, 16));
}

// The gradient element of a trained row: e·s flushed below 1e-30, minus `scale` at the target.
__device__ __forceinline__ float xent_grad(float e, float s, float scale, bool is_target) {
    float g = __fmul_rn(e, s);
    g = g < 1e-30f ? 0.0f : g;
    return is_target ? __fsub_rn(g, scale) : g;
}

// xent_fused: Op::LmHeadLoss's softmax cross-entropy over one chunk of rows, fused.
//   logits  float [rows, ld] in: the chunk's logits (row r's V values at r·ld); out (grad != 0):
//                            d(loss·scale)/dlogits (the ld − V columns past V untouched)
//   targets u32   [rows]     the chunk's targets (the host offsets the pointer to the chunk's
//                            first row); IGNORE_TARGET = not trained
//   losses  float [rows]     out: each row's loss (pointer offset to the chunk's first row)
//   rows    int              rows of the chunk (r)
//   V       int              vocabulary (the values of a row)
//   ld      int              floats from one row to the next (>= V: the host pads rows to a
//                            multiple of 64 floats, so the GEMMs' rows are 256-byte aligned)
//   scale   float            loss_scale / max(loss_tokens, 1), computed by the host in f32 as
//                            the CPU does (`ctx.loss_scale / ctx.loss_tokens.max(1) as f32`)
//   grad    int              nonzero: write the gradient in place (training with dinp)
// Launch: grid = (rows) (a smaller grid also works: blocks stride over rows), block = (1024)
// (any multiple of 32 from 32 to 1024: the results are the same bits), dynamic smem 0.
// Scratch: none.
extern "C" __global__ void xent_fused(float* logits, const unsigned int* targets, float* losses,
                                      int rows, int V, int ld, float scale, int grad) {
    __shared__ float red[32];
    __shared__ float bsum[64];  // one f32 block sum per half-warp of the round
    __shared__ double total_sh;
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int hw = tid >> 4, nhw = nthreads >> 4, ln = tid & (XENT_LANES - 1);
    const int nblocks = (V + XENT_SUM_BLOCK - 1) / XENT_SUM_BLOCK;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        float* x = logits + (long long)row * ld;
        const unsigned int tgt = targets[row];
        if (tgt == MW_IGNORE_TARGET || tgt >= (unsigned int)V) {
            const float fill = tgt == MW_IGNORE_TARGET ? 0.0f : __uint_as_float(0x7fc00000u);
            if (tid == 0) losses[row] = fill;
            if (grad)
                for (int j = tid; j < V; j += nthreads) x[j] = fill;
            continue;  // block-uniform: no thread reaches a barrier the others skip
        }
        // Pass 1: the row's maximum (NaN skipped, as by f32::max).
        float mx = __uint_as_float(0xff800000u);
        for (int j = tid; j < V; j += nthreads) mx = fmaxf(mx, x[j]);
        mx = block_max(mx, red);
        const float x_t = x[tgt];
        // Pass 2: Σ e^(x − max) in the CPU's order. A round gives each half-warp one 1024-block;
        // thread 0 adds the round's block sums in block order, in f64.
        double total = 0.0;
        for (int base = 0; base < nblocks; base += nhw) {
            const int b = base + hw;
            float acc = 0.0f;
            if (b < nblocks) {
                const int start = b * XENT_SUM_BLOCK;
                for (int i = 0; i < XENT_SUM_BLOCK / XENT_LANES; i++) {
                    const int j = start + ln + XENT_LANES * i;
                    if (j < V) acc = __fadd_rn(acc, mw_exp_f32(__fsub_rn(x[j], mx)));
                }
            }
            const float bs = xent_combine16(acc);
            __syncthreads();  // the previous round's bsum has been read
            if (ln == 0 && b < nblocks) bsum[hw] = bs;
            __syncthreads();
            if (tid == 0) {
                const int in_round = min(nhw, nblocks - base);
                for (int k = 0; k < in_round; k++) total += (double)bsum[k];
            }
        }
        if (tid == 0) {
            total_sh = total;
            losses[row] = (float)(log(total) - (double)__fsub_rn(x_t, mx));
        }
        __syncthreads();
        total = total_sh;
        // Pass 3: the gradient, in place.
        if (grad) {
            const float s = (float)((double)scale / total);
            for (int j = tid; j < V; j += nthreads)
                x[j] = xent_grad(mw_exp_f32(__fsub_rn(x[j], mx)), s, scale, j == (int)tgt);
        }
        __syncthreads();  // total_sh and red are reused by the next row
    }
}

// xent_fused_naive: the naive twin of xent_fused (same arguments and semantics): one thread per
// row, the CPU's loops written out serially (16 lane accumulators, combine16, f64 block
// sums), so its results are bitwise xent_fused's.
// Launch: grid = (ceil(rows / 64)), block = (64), dynamic smem 0. Scratch: none.
extern "C" __global__ void xent_fused_naive(float* logits, const unsigned int* targets,
                                            float* losses, int rows, int V, int ld, float scale,
                                            int grad) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    float* x = logits + (long long)row * ld;
    const unsigned int tgt = targets[row];
    if (tgt == MW_IGNORE_TARGET || tgt >= (unsigned int)V) {
        const float fill = tgt == MW_IGNORE_TARGET ? 0.0f : __uint_as_float(0x7fc00000u);
        losses[row] = fill;
        if (grad)
            for (int j = 0; j < V; j++) x[j] = fill;
        return;
    }
    float mx = __uint_as_float(0xff800000u);
    for (int j = 0; j < V; j++) mx = fmaxf(mx, x[j]);
    double total = 0.0;
    for (int start = 0; start < V; start += XENT_SUM_BLOCK) {
        float a[XENT_LANES];
        for (int l = 0; l < XENT_LANES; l++) a[l] = 0.0f;
        for (int j = start; j < V && j < start + XENT_SUM_BLOCK; j++)
            a[(j - start) % XENT_LANES] =
                __fadd_rn(a[(j - start) % XENT_LANES], mw_exp_f32(__fsub_rn(x[j], mx)));
        float h[8];
        for (int i = 0; i < 8; i++) h[i] = __fadd_rn(a[i], a[i + 8]);
        float q0 = __fadd_rn(h[0], h[4]), q1 = __fadd_rn(h[1], h[5]);
        float q2 = __fadd_rn(h[2], h[6]), q3 = __fadd_rn(h[3], h[7]);
        total += (double)__fadd_rn(__fadd_rn(q0, q2), __fadd_rn(q1, q3));
    }
    losses[row] = (float)(log(total) - (double)__fsub_rn(x[tgt], mx));
    if (grad) {
        const float s = (float)((double)scale / total);
        for (int j = 0; j < V; j++)
            x[j] = xent_grad(mw_exp_f32(__fsub_rn(x[j], mx)), s, scale, j == (int)tgt);
    }
}
