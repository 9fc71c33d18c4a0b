// activation.cu: gelu_forward/backward_<S>, glu_forward/backward_<S> (SwiGLU and GeGLU, the
// act flag) against
//  (1) a line-by-line C++ port of the CPU's f32 code (gelu.rs, glu.rs, reduce.rs exp_f32):
//      bitwise equal (the kernels round each operation as the CPU does), and
//  (2) the textbook formulas in f64 (the CPU's `naive` twins): within the CPU tests' tolerance,
// on a grid of -20..20, extremes (±50, ±1e6, ±3e30), random values and NaN, for each storage
// type, with launch shapes that grid-stride. An unknown act writes nothing.
//
//     python3 scripts/cuda-emu/run.py scripts/cuda-emu/tests/k1_activation_test.cpp
#include "emu.h"
#include "../../../src/backend/cuda/kernels/activation.cu"
#include "k1_util.h"

namespace ref {
// reduce.rs exp_f32, statement by statement (compiled without FP contraction).
float exp_f32(float x) {
    const float LOG2E = 1.44269504088896340736f, LN2_HI = 0.6933594f, LN2_LO = -2.1219444e-4f;
    const float MAGIC = 12582912.0f;
    bool underflow = x < -87.3f;
    x = underflow ? -87.3f : x;
    x = x > 88.0f ? 88.0f : x;
    float t = x * LOG2E + MAGIC;
    float k = t - MAGIC;
    int32_t ki = (int32_t)((uint32_t)__float_as_int(t) - (uint32_t)__float_as_int(MAGIC));
    float r = x - k * LN2_HI - k * LN2_LO;
    float z = r * r;
    float p = (((((1.9875692e-4f * r + 1.3981999e-3f) * r + 8.333452e-3f) * r + 4.1665796e-2f) *
                    r +
                1.6666665e-1f) *
                   r +
               0.5f) *
                  z +
              r + 1.0f;
    float scale = __uint_as_float((uint32_t)(ki + 127) << 23);
    float e = p * scale;
    return underflow ? 0.0f : e;
}
const float S2P = 0.7978846f, K = 0.044715f;
void sig2u(float x, float& sg, float& om) {
    float u = S2P * (x + K * x * x * x);
    float e = exp_f32(-2.0f * u);
    sg = 1.0f / (1.0f + e);
    sg = sg < 1e-30f ? 0.0f : sg;
    om = e * sg;
}
float gelu(float x) {
    float sg, om;
    sig2u(x, sg, om);
    return x * sg;
}
float gelu_bwd(float d, float x) {
    float sg, om;
    sig2u(x, sg, om);
    float xc = x < -12.0f ? -12.0f : (x > 12.0f ? 12.0f : x);
    float du = S2P * (1.0f + 3.0f * K * xc * xc);
    return d * (sg + 2.0f * xc * sg * om * du);
}
void sigmoid(float g, float& s, float& om) {
    float e = exp_f32(-g);
    s = 1.0f / (1.0f + e);
    s = s < 1e-30f ? 0.0f : s;
    om = e * s;
}
// Textbook f64 (the CPU's naive twins).
double u64(double x) { return sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x); }
double gelu64(double x) { return 0.5 * x * (1.0 + tanh(u64(x))); }
double gelu_grad64(double x) {
    double t = tanh(u64(x));
    double du = sqrt(2.0 / M_PI) * (1.0 + 3.0 * 0.044715 * x * x);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
}
double sig64(double g) { return 1.0 / (1.0 + exp(-g)); }
}  // namespace ref

std::vector<float> grid_values() {
    std::vector<float> x;
    for (int i = 0; i <= 4000; i++) x.push_back(-20.0f + i * 0.01f);
    for (float v : {0.0f, -0.0f, 1e-8f, -1e-8f, 50.0f, -50.0f, 1e6f, -1e6f, 3e30f, -3e30f})
        x.push_back(v);
    auto r = k1::randn(1000, 3.0f, 11);
    x.insert(x.end(), r.begin(), r.end());
    return x;
}

template <class T>
void gelu_case(void (*fwd)(T*, const T*, long long), void (*bwd)(T*, const T*, long long),
               dim3 grid, dim3 block, size_t off = 0) {
    // The kernels see elements off .. n − 1: off = 1 makes every pointer 16-byte misaligned
    // (the one-value path); off = 0 takes 16 bytes at a time, n not a multiple of 8 (a tail).
    auto xv = grid_values();
    size_t n = xv.size();
    auto x = k1::stored<T>(xv);
    auto g = k1::stored<T>(k1::randn(n, 1.0f, 12));
    std::vector<T> out(n, from_f32<T>(12345.0f)), d = g;
    emu_launch(fwd, grid, block, 0, out.data() + off, (const T*)x.data() + off, (long long)(n - off));
    emu_launch(bwd, grid, block, 0, d.data() + off, (const T*)x.data() + off, (long long)(n - off));
    std::vector<T> want_o(n), want_d(n);
    std::vector<float> f64_o(n), f64_d(n);
    for (size_t i = 0; i < n; i++) {
        float xi = to_f32(x[i]), gi = to_f32(g[i]);
        want_o[i] = i < off ? from_f32<T>(12345.0f) : from_f32<T>(ref::gelu(xi));
        want_d[i] = i < off ? g[i] : from_f32<T>(ref::gelu_bwd(gi, xi));
        f64_o[i] = (float)ref::gelu64(xi);
        f64_d[i] = (float)(gi * ref::gelu_grad64(xi));
    }
    char w[96];
    snprintf(w, sizeof w, "gelu_forward %s grid %u offset %zu (n %zu)", k1::tname<T>(), grid.x, off, n);
    emu::expect_bits(w, out, want_o);
    snprintf(w, sizeof w, "gelu_backward %s grid %u offset %zu", k1::tname<T>(), grid.x, off);
    emu::expect_bits(w, d, want_d);
    if (sizeof(T) == 4) {
        // Against f64 (the CPU tests' tolerance), where x is moderate (the f64 tanh formula
        // and the flushed f32 one differ far out in the tails only by denormal amounts).
        std::vector<float> a, b, c, e;
        for (size_t i = off; i < n; i++)
            if (fabsf(to_f32(x[i])) < 1e3f) {
                a.push_back(to_f32(out[i]));
                b.push_back(f64_o[i]);
                c.push_back(to_f32(d[i]));
                e.push_back(f64_d[i]);
            }
        emu::expect_near("gelu_forward f32 vs f64", a, b, 1e-6, 2e-6);
        emu::expect_near("gelu_backward f32 vs f64", c, e, 2e-6, 4e-6);
    }
}

// The CPU's gate activation and its derivative (glu.rs: SwiGLU's silu(g) = g·σ(g),
// σ(g)·(1 + g·(1 − σ(g))); GeGLU's gelu.rs `gelu`, `gelu_grad`), f32, and in f64.
struct Act {
    float a, da;
};
Act cpu_act(int act, float g) {
    if (act == MW_GLU_SILU) {
        float s, om;
        ref::sigmoid(g, s, om);
        return {g * s, s * (1.0f + g * om)};
    }
    return {ref::gelu(g), ref::gelu_bwd(1.0f, g)};
}
void act64(int act, double g, double& a, double& da) {
    if (act == MW_GLU_SILU) {
        double s = ref::sig64(g);
        a = g * s, da = s * (1.0 + g * (1.0 - s));
    } else {
        a = ref::gelu64(g), da = ref::gelu_grad64(g);
    }
}

template <class T>
void glu_case(int N, int H, int act, void (*fwd)(T*, const T*, int, int, int),
              void (*bwd)(T*, const T*, const T*, int, int, int), dim3 grid, dim3 block) {
    auto iv = k1::randn((size_t)N * 2 * H, 3.0f, 20 + N + H);
    if (N * 2 * H > 6) {
        iv[0] = -100.0f;
        iv[1] = 100.0f;
        iv[2] = -70.0f;
        iv[3] = 0.0f;
    }
    if (H > 12) {  // the GELU's clamp at ±12 and its flush below 1e-30, in gates
        iv[4] = -12.5f;
        iv[5] = 12.5f;
        iv[6] = -9.5f;
        iv[7] = -1.2785f;
    }
    auto inp = k1::stored<T>(iv);
    auto dout = k1::stored<T>(k1::randn((size_t)N * H, 1.0f, 30 + N + H));
    std::vector<T> out((size_t)N * H, from_f32<T>(7.0f)), dinp((size_t)N * 2 * H, from_f32<T>(7.0f));
    emu_launch(fwd, grid, block, 0, out.data(), (const T*)inp.data(), N, H, act);
    emu_launch(bwd, grid, block, 0, dinp.data(), (const T*)dout.data(), (const T*)inp.data(), N, H, act);
    std::vector<T> want_o(out.size()), want_d(dinp.size());
    std::vector<float> got_o64, want_o64, got_d64, want_d64;
    for (int n = 0; n < N; n++)
        for (int j = 0; j < H; j++) {
            size_t b = (size_t)n * 2 * H;
            float gv = to_f32(inp[b + j]), uv = to_f32(inp[b + H + j]), dy = to_f32(dout[(size_t)n * H + j]);
            // glu.rs: act(g)·u; (dy·u)·act'(g), dy·act(g).
            Act c = cpu_act(act, gv);
            want_o[(size_t)n * H + j] = from_f32<T>(c.a * uv);
            want_d[b + j] = from_f32<T>(dy * uv * c.da);
            want_d[b + H + j] = from_f32<T>(dy * c.a);
            if (fabsf(gv) >= 1e3f) continue;  // f64 against the flushed f32 tails: see gelu_case
            double a, da;
            act64(act, gv, a, da);
            got_o64.push_back(to_f32(out[(size_t)n * H + j]));
            want_o64.push_back((float)(a * uv));
            got_d64.push_back(to_f32(dinp[b + j]));
            want_d64.push_back((float)(dy * uv * da));
            got_d64.push_back(to_f32(dinp[b + H + j]));
            want_d64.push_back((float)(dy * a));
        }
    const char* name = act == MW_GLU_SILU ? "swiglu" : "geglu";
    char w[96];
    snprintf(w, sizeof w, "glu_forward %s %s %dx%d grid %u", name, k1::tname<T>(), N, H, grid.x);
    emu::expect_bits(w, out, want_o);
    snprintf(w, sizeof w, "glu_backward %s %s %dx%d grid %u", name, k1::tname<T>(), N, H, grid.x);
    emu::expect_bits(w, dinp, want_d);
    if (sizeof(T) == 4) {
        snprintf(w, sizeof w, "glu_forward %s f32 vs f64", name);
        emu::expect_near(w, got_o64, want_o64, 1e-6, 2e-6);
        snprintf(w, sizeof w, "glu_backward %s f32 vs f64", name);
        emu::expect_near(w, got_d64, want_d64, 2e-6, 4e-6);
    }
}

template <class T>
void all(void (*gf)(T*, const T*, long long), void (*gb)(T*, const T*, long long),
         void (*sf)(T*, const T*, int, int, int), void (*sb)(T*, const T*, const T*, int, int, int)) {
    gelu_case<T>(gf, gb, dim3(k1::ceil_div(5011, 256)), dim3(256));
    gelu_case<T>(gf, gb, dim3(3), dim3(64));  // grid-stride
    gelu_case<T>(gf, gb, dim3(3), dim3(64), 1);  // misaligned: one value at a time
    const int shapes[][2] = {{1, 1}, {3, 5}, {7, 33}, {16, 64}};
    for (int act : {MW_GLU_SILU, MW_GLU_GELU_TANH})
        for (auto& s : shapes) {
            glu_case<T>(s[0], s[1], act, sf, sb, dim3(k1::ceil_div((long long)s[0] * s[1], 128)),
                        dim3(128));
            glu_case<T>(s[0], s[1], act, sf, sb, dim3(2), dim3(32));
        }
    // An unknown act writes nothing.
    std::vector<T> x = k1::stored<T>(k1::randn(2 * 2 * 3, 1.0f, 40)), dy = k1::stored<T>(k1::randn(2 * 3, 1.0f, 41));
    std::vector<T> o(2 * 3, from_f32<T>(7.0f)), d(2 * 2 * 3, from_f32<T>(7.0f));
    auto o0 = o, d0 = d;
    emu_launch(sf, dim3(1), dim3(32), 0, o.data(), (const T*)x.data(), 2, 3, 2);
    emu_launch(sb, dim3(1), dim3(32), 0, d.data(), (const T*)dy.data(), (const T*)x.data(), 2, 3, 2);
    emu::expect_bits("glu_forward act 2: untouched", o, o0);
    emu::expect_bits("glu_backward act 2: untouched", d, d0);
}

int main() {
    all<float>(gelu_forward_f32, gelu_backward_f32, glu_forward_f32, glu_backward_f32);
    all<bf16>(gelu_forward_bf16, gelu_backward_bf16, glu_forward_bf16, glu_backward_bf16);
    all<f16>(gelu_forward_f16, gelu_backward_f16, glu_forward_f16, glu_backward_f16);
    // NaN propagates to its own element only.
    std::vector<float> x = {1.0f, __int_as_float(0x7fc00000), -1.0f}, o(3, 0.0f), d(3, 1.0f);
    emu_launch(gelu_forward_f32, dim3(1), dim3(32), 0, o.data(), (const float*)x.data(), 3LL);
    emu_launch(gelu_backward_f32, dim3(1), dim3(32), 0, d.data(), (const float*)x.data(), 3LL);
    EMU_CHECK(std::isnan(o[1]) && std::isfinite(o[0]) && std::isfinite(o[2]), "gelu NaN forward");
    EMU_CHECK(std::isnan(d[1]) && std::isfinite(d[0]) && std::isfinite(d[2]), "gelu NaN backward");
    return emu::finish();
}
