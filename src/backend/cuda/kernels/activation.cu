// The activation family: GELU (GPT-2's tanh approximation, "gelu_new") and the gated linear
// units (SwiGLU: Llama's MLP; GeGLU: Gemma's, the gate through the same tanh GELU), forward
// and backward, elementwise.
//
//   Op::Gelu { inp, out, rows, width }            ->  gelu_forward_<S>(out, inp, N·width)
//   Op::GeluBackward { d, inp, rows, width }      ->  gelu_backward_<S>(d, inp, N·width)
//   Op::Glu { inp, out, rows, h, act }            ->  glu_forward_<S>(out, inp, N, H, act)
//   Op::GluBackward { dinp, dout, inp, rows, h, act }
//                                                 ->  glu_backward_<S>(dinp, dout, inp, N, H, act)
//   act (int): MW_GLU_SILU (0, GluAct::Silu: SwiGLU) or MW_GLU_GELU_TANH (1, GluAct::GeluTanh:
//   GeGLU); any other value writes nothing.
//
// Every operand is an activation (or its gradient) in the storage type T (entries `_f32`,
// `_bf16`, `_f16`). The arithmetic is the CPU's (`backend/cpu/gelu.rs`, `glu.rs`) operation by
// operation: the same `exp_f32` (a Cephes polynomial that saturates at e^88 and returns 0
// below -87.3), σ flushed to 0 below 1e-30, each product and sum rounded as the CPU rounds it
// (`__fmul_rn`/`__fadd_rn`: never contracted into an FMA, whatever --fmad says), so each
// element is bitwise the CPU's. Elementwise, no reduction: the result does not depend on the
// launch shape. GELU takes 16 bytes at a time where it can (MwPack), the gated units one
// element per thread (grid-stride): no naive twins.

// ---- The CPU's scalar helpers (backend/cpu/reduce.rs `exp_f32`, gelu.rs, glu.rs) ----

// e^x exactly as the CPU's `reduce::exp_f32`: below -87.3 exactly 0, above 88 saturates at
// e^88, NaN propagates (comparisons, not fminf/fmaxf, which would drop a NaN).
__device__ __forceinline__ float act_exp_f32(float x) {
    const float LOG2E = 1.44269504088896340736f;
    const float LN2_HI = 0.6933594f;
    const float LN2_LO = -2.1219444e-4f;
    const float MAGIC = 12582912.0f;  // 1.5·2^23
    bool underflow = x < -87.3f;
    x = underflow ? -87.3f : x;
    x = x > 88.0f ? 88.0f : x;
    float t = __fadd_rn(__fmul_rn(x, LOG2E), MAGIC);
    float k = __fsub_rn(t, MAGIC);
    int ki = __float_as_int(t) - __float_as_int(MAGIC);
    float r = __fsub_rn(__fsub_rn(x, __fmul_rn(k, LN2_HI)), __fmul_rn(k, LN2_LO));
    float z = __fmul_rn(r, r);
    float p = __fadd_rn(__fmul_rn(1.9875692e-4f, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fadd_rn(__fmul_rn(p, z), r), 1.0f);
    float scale = __int_as_float((int)((unsigned int)(ki + 127) << 23));
    float e = __fmul_rn(p, scale);
    return underflow ? 0.0f : e;
}

#define GELU_SQRT_2_OVER_PI 0.7978846f
#define GELU_K 0.044715f

// (σ(2u), 1 − σ(2u)) for the GELU argument x (gelu.rs `sig2u`).
__device__ __forceinline__ void gelu_sig2u(float x, float* sg_out, float* one_minus_out) {
    // u = sqrt(2/π)·(x + ((k·x)·x)·x)
    float cube = __fmul_rn(__fmul_rn(__fmul_rn(GELU_K, x), x), x);
    float u = __fmul_rn(GELU_SQRT_2_OVER_PI, __fadd_rn(x, cube));
    float e = act_exp_f32(__fmul_rn(-2.0f, u));
    float sg = __fdiv_rn(1.0f, __fadd_rn(1.0f, e));
    sg = sg < 1e-30f ? 0.0f : sg;  // NaN stays NaN
    *sg_out = sg;
    *one_minus_out = __fmul_rn(e, sg);
}

// gelu(x) = x·σ(2u) (gelu.rs `gelu`: GELU's and GeGLU's gate).
__device__ __forceinline__ float act_gelu(float x) {
    float sg, one_minus;
    gelu_sig2u(x, &sg, &one_minus);
    return __fmul_rn(x, sg);
}

// gelu'(x) = σ(2u) + (((2·xc)·σ(2u))·(1 − σ(2u)))·du, du = sqrt(2/π)·(1 + ((3·k)·xc)·xc), x
// clamped to [-12, 12] in the second term (there it is below 1e-30; keeps x³ finite; NaN stays
// NaN) (gelu.rs `gelu_grad`).
__device__ __forceinline__ float act_gelu_grad(float x) {
    float sg, one_minus;
    gelu_sig2u(x, &sg, &one_minus);
    float xc = x < -12.0f ? -12.0f : (x > 12.0f ? 12.0f : x);  // NaN stays NaN
    float du = __fmul_rn(GELU_SQRT_2_OVER_PI,
                         __fadd_rn(1.0f, __fmul_rn(__fmul_rn(__fmul_rn(3.0f, GELU_K), xc), xc)));
    float second = __fmul_rn(__fmul_rn(__fmul_rn(__fmul_rn(2.0f, xc), sg), one_minus), du);
    return __fadd_rn(sg, second);
}

// (σ(g), 1 − σ(g)) (glu.rs `sigmoid`).
__device__ __forceinline__ void act_sigmoid(float g, float* s_out, float* one_minus_out) {
    float e = act_exp_f32(-g);
    float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, e));
    s = s < 1e-30f ? 0.0f : s;  // NaN stays NaN
    *s_out = s;
    *one_minus_out = __fmul_rn(e, s);
}

// ---- GELU ----

// out = gelu(inp) elementwise (Op::Gelu): gelu(x) = x·σ(2u), u = sqrt(2/π)·(x + 0.044715·x³)
// (= 0.5·x·(1 + tanh u)).
//   out  T [len]
//   inp  T [len]
//   len  N·width (long long)
// Launch: grid-stride, any shape: block = 256, grid = min(ceil(len / 8 / 256), 65535) (a
// thread takes 16 bytes at a time where the pointers are 16-byte aligned). No shared memory,
// no scratch. No naive twin: the vector and scalar paths are the same arithmetic per element,
// and the conformance suite checks both (odd offsets take the scalar one).
// GELU of one value (the arithmetic of every path).
template <typename T>
__device__ __forceinline__ T gelu_value(T xin) {
    return from_f32<T>(act_gelu(to_f32(xin)));
}

template <typename T>
__device__ void gelu_forward(T* out, const T* inp, long long len) {
    constexpr int E = 16 / sizeof(T);
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long packs = mw_aligned16(out) && mw_aligned16(inp) ? len / E : 0;
    for (long long p = t0; p < packs; p += stride) {
        MwPack<T> x = mw_load16(inp + p * E);
#pragma unroll
        for (int k = 0; k < E; k++) x.v[k] = gelu_value(x.v[k]);
        mw_store16(out + p * E, x);
    }
    for (long long i = packs * E + t0; i < len; i += stride) out[i] = gelu_value(inp[i]);
}

// d ← d ⊙ gelu'(inp) in place (Op::GeluBackward), with (act_gelu_grad)
// gelu'(x) = σ(2u) + 2·x·σ(2u)·(1 − σ(2u))·sqrt(2/π)·(1 + 3·0.044715·x²), x clamped to
// [-12, 12] in the second term (there it is below 1e-30; keeps x³ finite; NaN stays NaN).
//   d    T [len] in: dL/dout, out: dL/dinp
//   inp  T [len] the forward's input
//   len  N·width (long long)
// Launch: as gelu_forward. No naive twin (as gelu_forward).
// d·gelu'(x) for one element (the arithmetic of every path).
template <typename T>
__device__ __forceinline__ T gelu_grad_value(T din, T xin) {
    return from_f32<T>(__fmul_rn(to_f32(din), act_gelu_grad(to_f32(xin))));
}

template <typename T>
__device__ void gelu_backward(T* d, const T* inp, long long len) {
    constexpr int E = 16 / sizeof(T);
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long packs = mw_aligned16(d) && mw_aligned16(inp) ? len / E : 0;
    for (long long p = t0; p < packs; p += stride) {
        MwPack<T> g = mw_load16(d + p * E);
        const MwPack<T> x = mw_load16(inp + p * E);
#pragma unroll
        for (int k = 0; k < E; k++) g.v[k] = gelu_grad_value(g.v[k], x.v[k]);
        mw_store16(d + p * E, g);
    }
    for (long long i = packs * E + t0; i < len; i += stride) d[i] = gelu_grad_value(d[i], inp[i]);
}

// ---- Gated linear units: SwiGLU and GeGLU ----

#define MW_GLU_SILU 0
#define MW_GLU_GELU_TANH 1

// out[n, j] = act(g)·u, g = inp[n, j], u = inp[n, H + j] (Op::Glu): SwiGLU's
// silu(g) = g·σ(g) (glu.rs `swiglu_rows`), GeGLU's gelu(g) = g·σ(2u) (`geglu_rows`).
//   out  T [N, H]
//   inp  T [N, 2H] gate | up
//   N, H  (int; N·2H may exceed 2^31: indices are long long)
//   act  MW_GLU_SILU or MW_GLU_GELU_TANH (int; another value writes nothing)
// Launch: grid-stride over the N·H outputs, any shape: block = 256, grid =
// min(ceil(N·H / 256), 65535). No shared memory, no scratch. Plain version: no naive twin.
template <typename T, int ACT>
__device__ void glu_forward_act(T* out, const T* inp, int N, int H) {
    long long total = (long long)N * H;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        long long n = i / H;
        long long j = i - n * H;
        long long base = n * 2 * (long long)H;
        float g = to_f32(inp[base + j]);
        float u = to_f32(inp[base + H + j]);
        float a;
        if (ACT == MW_GLU_SILU) {
            float s, one_minus;
            act_sigmoid(g, &s, &one_minus);
            a = __fmul_rn(g, s);
        } else {
            a = act_gelu(g);
        }
        out[i] = from_f32<T>(__fmul_rn(a, u));
    }
}

template <typename T>
__device__ void glu_forward(T* out, const T* inp, int N, int H, int act) {
    if (act == MW_GLU_SILU) glu_forward_act<T, MW_GLU_SILU>(out, inp, N, H);
    if (act == MW_GLU_GELU_TANH) glu_forward_act<T, MW_GLU_GELU_TANH>(out, inp, N, H);
}

// The gradient of the gate|up input, OVERWRITING dinp (Op::GluBackward):
// dinp[n, j] = (dout·u)·act'(g)  (d gate),  dinp[n, H + j] = dout·act(g)  (d up), with
// SwiGLU's silu'(g) = σ(g)·(1 + g·(1 − σ(g))), silu(g) = g·σ(g) (glu.rs
// `swiglu_backward_rows`), GeGLU's gelu'(g) (act_gelu_grad) and gelu(g) (act_gelu)
// (`geglu_backward_rows`).
//   dinp  T [N, 2H] written (not read)
//   dout  T [N, H]
//   inp   T [N, 2H] gate | up
//   N, H  (int)
//   act   as glu_forward's
// Launch: as glu_forward (one thread per (n, j), grid-stride over N·H). Plain version: no
// naive twin.
template <typename T, int ACT>
__device__ void glu_backward_act(T* dinp, const T* dout, const T* inp, int N, int H) {
    long long total = (long long)N * H;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        long long n = i / H;
        long long j = i - n * H;
        long long base = n * 2 * (long long)H;
        float dy = to_f32(dout[i]);
        float g = to_f32(inp[base + j]);
        float u = to_f32(inp[base + H + j]);
        float a, da;
        if (ACT == MW_GLU_SILU) {
            float s, one_minus;
            act_sigmoid(g, &s, &one_minus);
            da = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(g, one_minus)));
            a = __fmul_rn(g, s);
        } else {
            da = act_gelu_grad(g);
            a = act_gelu(g);
        }
        dinp[base + j] = from_f32<T>(__fmul_rn(__fmul_rn(dy, u), da));
        dinp[base + H + j] = from_f32<T>(__fmul_rn(dy, a));
    }
}

template <typename T>
__device__ void glu_backward(T* dinp, const T* dout, const T* inp, int N, int H, int act) {
    if (act == MW_GLU_SILU) glu_backward_act<T, MW_GLU_SILU>(dinp, dout, inp, N, H);
    if (act == MW_GLU_GELU_TANH) glu_backward_act<T, MW_GLU_GELU_TANH>(dinp, dout, inp, N, H);
}

#define ACTIVATION_ENTRIES(T, S)                                                             \
    extern "C" __global__ void gelu_forward_##S(T* out, const T* inp, long long len) {       \
        gelu_forward<T>(out, inp, len);                                                      \
    }                                                                                        \
    extern "C" __global__ void gelu_backward_##S(T* d, const T* inp, long long len) {        \
        gelu_backward<T>(d, inp, len);                                                       \
    }                                                                                        \
    extern "C" __global__ void glu_forward_##S(T* out, const T* inp, int N, int H, int act) { \
        glu_forward<T>(out, inp, N, H, act);                                                 \
    }                                                                                        \
    extern "C" __global__ void glu_backward_##S(T* dinp, const T* dout, const T* inp, int N, \
                                                int H, int act) {                            \
        glu_backward<T>(dinp, dout, inp, N, H, act);                                         \
    }
MW_STORAGE_ENTRIES(ACTIVATION_ENTRIES)
