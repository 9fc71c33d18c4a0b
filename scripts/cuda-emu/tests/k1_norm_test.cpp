// norm.cu: layer norm and RMS norm, forward and backward. For each storage type and shapes
// (C below, at and past a warp; N not a multiple of anything):
//  - the warp-per-row kernels and their naive twins against an f64 reference (the CPU's
//    `naive` twins, on the same widened inputs and statistics) within the CPU tests'
//    tolerances; dinp, dw and db accumulate onto nonzero values;
//  - RMS norm with Gemma's gain (offset 1, weights near 0: out = x·rstd·(1 + w)) and with a
//    residual added to the output (Gemma's post-norms), as well as Llama's (offset 0, no
//    residual); given the kernel's rstd, every output element bitwise the CPU's f32 arithmetic
//    (rmsnorm.rs `forward_rows`: (residual +) ((x·rstd)·(w + offset)), rounded once);
//  - the parameter gradients by partials (R rows a chunk) + norm_reduce_partials, and by the
//    naive twin, against the f64 reference;
//  - determinism: every launch shape gives the same bits (blocks of 1, 2, 8 warps; grids
//    that grid-stride); only R changes the parameter gradients' order.
//
//     python3 scripts/cuda-emu/run.py scripts/cuda-emu/tests/k1_norm_test.cpp
#include "emu.h"
#include "../../../src/backend/cuda/kernels/norm.cu"
#include "k1_util.h"

template <class T>
struct LnK {
    void (*fwd)(T*, float*, float*, const T*, const float*, const float*, int, int, float);
    void (*fwd_naive)(T*, float*, float*, const T*, const float*, const float*, int, int, float);
    void (*bin)(T*, const T*, const T*, const float*, const float*, const float*, int, int);
    void (*bin_naive)(T*, const T*, const T*, const float*, const float*, const float*, int, int);
    void (*part)(float*, const T*, const T*, const float*, const float*, int, int, int);
    void (*params_naive)(T*, T*, const T*, const T*, const float*, const float*, int, int);
    void (*reduce)(T*, const float*, int, int);
};
template <class T>
struct RmsK {
    void (*fwd)(T*, float*, const T*, const T*, const float*, float, int, int, float);
    void (*fwd_naive)(T*, float*, const T*, const T*, const float*, float, int, int, float);
    void (*bin)(T*, const T*, const T*, const float*, float, const float*, int, int);
    void (*bin_naive)(T*, const T*, const T*, const float*, float, const float*, int, int);
    void (*part)(float*, const T*, const T*, const float*, int, int, int);
    void (*params_naive)(T*, const T*, const T*, const float*, int, int);
    void (*reduce)(T*, const float*, int, int);
};

// Tolerance on an output rounded to T (on top of the f32 one).
template <class T>
void near(const std::string& what, const std::vector<T>& got, const std::vector<double>& want,
          double atol32, double rtol32) {
    std::vector<float> g = k1::widened(got), w(want.size());
    for (size_t i = 0; i < want.size(); i++) w[i] = (float)want[i];
    double t = sizeof(T) == 4 ? 0.0 : k1::tol<T>();
    emu::expect_near(what.c_str(), g, w, atol32 + t, rtol32 + t);
}

struct Launch { unsigned warps; unsigned grid; };  // block = 32·warps; grid 0: ceil(N / warps)
const Launch LAUNCHES[] = {{8, 0}, {1, 0}, {2, 3}};

template <class T>
void layernorm(const LnK<T>& k, int N, int C) {
    char tagbuf[64];
    snprintf(tagbuf, sizeof tagbuf, " %s %dx%d", k1::tname<T>(), N, C);
    std::string tag(tagbuf);
    float eps = 1e-5f;
    auto inp = k1::stored<T>(k1::randn((size_t)N * C, 2.0f, 70 + N + C, 30.0f));
    auto w = k1::randn(C, 0.5f, 71 + C, 1.0f);
    auto b = k1::randn(C, 0.5f, 72 + C);
    // f64 reference forward (on the widened inputs).
    std::vector<double> ref_out((size_t)N * C), ref_mean(N), ref_rstd(N);
    for (int r = 0; r < N; r++) {
        double mu = 0, var = 0;
        for (int c = 0; c < C; c++) mu += to_f32(inp[(size_t)r * C + c]);
        mu /= C;
        for (int c = 0; c < C; c++) {
            double d = to_f32(inp[(size_t)r * C + c]) - mu;
            var += d * d;
        }
        var /= C;
        double s = 1.0 / sqrt(var + eps);
        for (int c = 0; c < C; c++)
            ref_out[(size_t)r * C + c] = (to_f32(inp[(size_t)r * C + c]) - mu) * s * w[c] + b[c];
        ref_mean[r] = mu;
        ref_rstd[r] = s;
    }
    std::vector<T> out0;
    std::vector<float> mean0, rstd0;
    for (const Launch& l : LAUNCHES) {
        std::vector<T> out((size_t)N * C, from_f32<T>(9.0f));
        std::vector<float> mean(N, 9.0f), rstd(N, 9.0f);
        unsigned grid = l.grid ? l.grid : k1::ceil_div(N, l.warps);
        emu_launch(k.fwd, dim3(grid), dim3(32 * l.warps), 0, out.data(), mean.data(), rstd.data(),
                   (const T*)inp.data(), (const float*)w.data(), (const float*)b.data(), N, C, eps);
        if (out0.empty()) {
            out0 = out, mean0 = mean, rstd0 = rstd;
            near("layernorm_forward out" + tag, out, ref_out, 2e-5, 2e-5);
            near("layernorm_forward mean" + tag, mean, ref_mean, 1e-6, 1e-5);
            near("layernorm_forward rstd" + tag, rstd, ref_rstd, 0.0, 1e-5);
        } else {
            emu::expect_bits(("layernorm_forward same bits, other launch" + tag).c_str(), out, out0);
            emu::expect_bits(("layernorm_forward mean same bits" + tag).c_str(), mean, mean0);
            emu::expect_bits(("layernorm_forward rstd same bits" + tag).c_str(), rstd, rstd0);
        }
    }
    {
        std::vector<T> out((size_t)N * C);
        std::vector<float> mean(N), rstd(N);
        emu_launch(k.fwd_naive, dim3(2), dim3(32), 0, out.data(), mean.data(), rstd.data(),
                   (const T*)inp.data(), (const float*)w.data(), (const float*)b.data(), N, C, eps);
        near("layernorm_forward_naive out" + tag, out, ref_out, 2e-5, 2e-5);
        near("layernorm_forward_naive mean" + tag, mean, ref_mean, 1e-6, 1e-5);
        near("layernorm_forward_naive rstd" + tag, rstd, ref_rstd, 0.0, 1e-5);
    }

    // Backward, from the kernel's own statistics (as the CPU test: f64 on given mean, rstd).
    auto dout = k1::stored<T>(k1::randn((size_t)N * C, 1.0f, 77 + N));
    auto di0 = k1::stored<T>(k1::randn((size_t)N * C, 1.0f, 78 + N));
    auto dw0 = k1::stored<T>(k1::randn(C, 1.0f, 79 + C));
    auto db0 = k1::stored<T>(k1::randn(C, 1.0f, 80 + C));
    const std::vector<float>& mean = mean0;
    const std::vector<float>& rstd = rstd0;
    std::vector<double> ref_di((size_t)N * C), ref_dw(C), ref_db(C);
    for (int r = 0; r < N; r++) {
        double mu = mean[r], s = rstd[r], mg = 0, mgn = 0;
        auto norm = [&](int c) { return (to_f32(inp[(size_t)r * C + c]) - mu) * s; };
        auto g = [&](int c) { return (double)w[c] * to_f32(dout[(size_t)r * C + c]); };
        for (int c = 0; c < C; c++) mg += g(c), mgn += g(c) * norm(c);
        mg /= C, mgn /= C;
        for (int c = 0; c < C; c++)
            ref_di[(size_t)r * C + c] = to_f32(di0[(size_t)r * C + c]) + (g(c) - mg - norm(c) * mgn) * s;
    }
    for (int c = 0; c < C; c++) {
        double sw = to_f32(dw0[c]), sb = to_f32(db0[c]);
        for (int r = 0; r < N; r++) {
            double dy = to_f32(dout[(size_t)r * C + c]);
            sw += (to_f32(inp[(size_t)r * C + c]) - (double)mean[r]) * rstd[r] * dy;
            sb += dy;
        }
        ref_dw[c] = sw, ref_db[c] = sb;
    }
    double ptol = 2e-5 * sqrt((double)N);
    std::vector<T> di_first;
    for (const Launch& l : LAUNCHES) {
        std::vector<T> di = di0;
        unsigned grid = l.grid ? l.grid : k1::ceil_div(N, l.warps);
        emu_launch(k.bin, dim3(grid), dim3(32 * l.warps), 0, di.data(), (const T*)dout.data(),
                   (const T*)inp.data(), (const float*)w.data(), (const float*)mean.data(),
                   (const float*)rstd.data(), N, C);
        if (di_first.empty()) {
            di_first = di;
            near("layernorm_backward_input" + tag, di, ref_di, 1e-4, 1e-4);
        } else {
            emu::expect_bits(("layernorm_backward_input same bits" + tag).c_str(), di, di_first);
        }
    }
    {
        std::vector<T> di = di0;
        emu_launch(k.bin_naive, dim3(1), dim3(64), 0, di.data(), (const T*)dout.data(),
                   (const T*)inp.data(), (const float*)w.data(), (const float*)mean.data(),
                   (const float*)rstd.data(), N, C);
        near("layernorm_backward_input_naive" + tag, di, ref_di, 1e-4, 1e-4);
    }
    for (int R : {1, 4, 64}) {
        int P = (N + R - 1) / R;
        std::vector<T> dw_first, db_first;
        const dim3 pgrids[][2] = {{dim3(k1::ceil_div(C, 256), P), dim3(256)},
                                  {dim3(1, 2), dim3(32)}};  // grid-stride both ways
        for (auto& pg : pgrids) {
            std::vector<float> partials(2 * (size_t)P * C, __int_as_float(0x7fc00000));
            std::vector<T> dw = dw0, db = db0;
            emu_launch(k.part, pg[0], pg[1], 0, partials.data(), (const T*)dout.data(),
                       (const T*)inp.data(), (const float*)mean.data(), (const float*)rstd.data(),
                       N, C, R);
            emu_launch(k.reduce, dim3(k1::ceil_div(C, 64)), dim3(64), 0, dw.data(),
                       (const float*)partials.data(), P, C);
            emu_launch(k.reduce, dim3(1), dim3(32), 0, db.data(),
                       (const float*)partials.data() + (size_t)P * C, P, C);
            std::string rt = tag + " R " + std::to_string(R);
            if (dw_first.empty()) {
                dw_first = dw, db_first = db;
                near("layernorm dw (partials)" + rt, dw, ref_dw, ptol, 1e-5);
                near("layernorm db (partials)" + rt, db, ref_db, ptol, 1e-5);
            } else {
                emu::expect_bits(("layernorm dw same bits" + rt).c_str(), dw, dw_first);
                emu::expect_bits(("layernorm db same bits" + rt).c_str(), db, db_first);
            }
        }
    }
    {
        std::vector<T> dw = dw0, db = db0;
        emu_launch(k.params_naive, dim3(1), dim3(32), 0, dw.data(), db.data(),
                   (const T*)dout.data(), (const T*)inp.data(), (const float*)mean.data(),
                   (const float*)rstd.data(), N, C);
        near("layernorm_backward_params_naive dw" + tag, dw, ref_dw, ptol, 1e-5);
        near("layernorm_backward_params_naive db" + tag, db, ref_db, ptol, 1e-5);
    }
    {
        // P = 0 (no rows): the gradient is untouched.
        std::vector<T> dw = dw0;
        emu_launch(k.reduce, dim3(1), dim3(32), 0, dw.data(), (const float*)nullptr, 0, C);
        emu::expect_bits(("norm_reduce_partials P = 0" + tag).c_str(), dw, dw0);
    }
}

// The CPU's f32 output of an RMS norm element given its row's rstd (rmsnorm.rs
// `forward_rows`, compiled without FP contraction): (y +) (x·rstd)·(w + offset), rounded once.
template <class T>
std::vector<T> rms_cpu_out(const std::vector<T>& inp, const std::vector<T>* res,
                           const std::vector<float>& rstd, const std::vector<float>& w,
                           float offset, int N, int C) {
    std::vector<T> o((size_t)N * C);
    for (int r = 0; r < N; r++)
        for (int c = 0; c < C; c++) {
            size_t i = (size_t)r * C + c;
            float v = to_f32(inp[i]) * rstd[r] * (w[c] + offset);
            o[i] = from_f32<T>(res ? to_f32((*res)[i]) + v : v);
        }
    return o;
}

// offset: the gain is w + offset (Gemma: 1, with weights near 0); residual: one is added to
// the output (Gemma's post-norms).
template <class T>
void rmsnorm(const RmsK<T>& k, int N, int C, float offset, bool residual) {
    char tagbuf[96];
    snprintf(tagbuf, sizeof tagbuf, " %s %dx%d offset %g%s", k1::tname<T>(), N, C, offset,
             residual ? " residual" : "");
    std::string tag(tagbuf);
    float eps = 1e-6f;
    auto inp = k1::stored<T>(k1::randn((size_t)N * C, 2.0f, 90 + N + C, 0.5f));
    // Llama's weights near 1; Gemma's near 0 (its gain 1 + w near 1).
    auto w = offset == 0.0f ? k1::randn(C, 0.5f, 91 + C, 1.0f) : k1::randn(C, 0.1f, 91 + C);
    if (offset != 0.0f && C > 2) w[1] = -0.0f, w[2] = -offset;  // a −0 weight; a zero gain
    auto res = k1::stored<T>(k1::randn((size_t)N * C, 3.0f, 89 + N + C));
    const T* resp = residual ? res.data() : nullptr;
    std::vector<double> ref_out((size_t)N * C), ref_rstd(N);
    for (int r = 0; r < N; r++) {
        double ss = 0;
        for (int c = 0; c < C; c++) {
            double v = to_f32(inp[(size_t)r * C + c]);
            ss += v * v;
        }
        double s = 1.0 / sqrt(ss / C + eps);
        for (int c = 0; c < C; c++) {
            size_t i = (size_t)r * C + c;
            ref_out[i] = to_f32(inp[i]) * s * ((double)w[c] + offset);
            if (residual) ref_out[i] += to_f32(res[i]);
        }
        ref_rstd[r] = s;
    }
    // The residual's magnitude (3) next to the norm's (about 1): the tolerance is of the sum.
    double atol = residual ? 2e-5 * 4 : 2e-5;
    std::vector<T> out0;
    std::vector<float> rstd0;
    for (const Launch& l : LAUNCHES) {
        std::vector<T> out((size_t)N * C, from_f32<T>(9.0f));
        std::vector<float> rstd(N, 9.0f);
        unsigned grid = l.grid ? l.grid : k1::ceil_div(N, l.warps);
        emu_launch(k.fwd, dim3(grid), dim3(32 * l.warps), 0, out.data(), rstd.data(),
                   (const T*)inp.data(), resp, (const float*)w.data(), offset, N, C, eps);
        if (out0.empty()) {
            out0 = out, rstd0 = rstd;
            near("rmsnorm_forward out" + tag, out, ref_out, atol, 2e-5);
            near("rmsnorm_forward rstd" + tag, rstd, ref_rstd, 0.0, 1e-5);
            auto want = rms_cpu_out(inp, residual ? &res : nullptr, rstd, w, offset, N, C);
            emu::expect_bits(("rmsnorm_forward out bitwise the CPU's, given rstd" + tag).c_str(),
                             out, want);
        } else {
            emu::expect_bits(("rmsnorm_forward same bits" + tag).c_str(), out, out0);
            emu::expect_bits(("rmsnorm_forward rstd same bits" + tag).c_str(), rstd, rstd0);
        }
    }
    {
        std::vector<T> out((size_t)N * C);
        std::vector<float> rstd(N);
        emu_launch(k.fwd_naive, dim3(1), dim3(32), 0, out.data(), rstd.data(), (const T*)inp.data(),
                   resp, (const float*)w.data(), offset, N, C, eps);
        near("rmsnorm_forward_naive out" + tag, out, ref_out, atol, 2e-5);
        near("rmsnorm_forward_naive rstd" + tag, rstd, ref_rstd, 0.0, 1e-5);
        auto want = rms_cpu_out(inp, residual ? &res : nullptr, rstd, w, offset, N, C);
        emu::expect_bits(("rmsnorm_forward_naive out bitwise the CPU's, given rstd" + tag).c_str(),
                         out, want);
    }
    auto dout = k1::stored<T>(k1::randn((size_t)N * C, 1.0f, 97 + N));
    auto di0 = k1::stored<T>(k1::randn((size_t)N * C, 1.0f, 98 + N));
    auto dw0 = k1::stored<T>(k1::randn(C, 1.0f, 99 + C));
    const std::vector<float>& rstd = rstd0;
    std::vector<double> ref_di((size_t)N * C), ref_dw(C);
    for (int r = 0; r < N; r++) {
        double s = rstd[r], mgn = 0;
        auto norm = [&](int c) { return to_f32(inp[(size_t)r * C + c]) * s; };
        auto g = [&](int c) { return ((double)w[c] + offset) * to_f32(dout[(size_t)r * C + c]); };
        for (int c = 0; c < C; c++) mgn += g(c) * norm(c);
        mgn /= C;
        for (int c = 0; c < C; c++)
            ref_di[(size_t)r * C + c] = to_f32(di0[(size_t)r * C + c]) + (g(c) - norm(c) * mgn) * s;
    }
    for (int c = 0; c < C; c++) {
        double sw = to_f32(dw0[c]);
        for (int r = 0; r < N; r++)
            sw += (double)to_f32(inp[(size_t)r * C + c]) * rstd[r] * to_f32(dout[(size_t)r * C + c]);
        ref_dw[c] = sw;
    }
    double ptol = 2e-5 * sqrt((double)N);
    std::vector<T> di_first;
    for (const Launch& l : LAUNCHES) {
        std::vector<T> di = di0;
        unsigned grid = l.grid ? l.grid : k1::ceil_div(N, l.warps);
        emu_launch(k.bin, dim3(grid), dim3(32 * l.warps), 0, di.data(), (const T*)dout.data(),
                   (const T*)inp.data(), (const float*)w.data(), offset, (const float*)rstd.data(),
                   N, C);
        if (di_first.empty()) {
            di_first = di;
            near("rmsnorm_backward_input" + tag, di, ref_di, 1e-4, 1e-4);
        } else {
            emu::expect_bits(("rmsnorm_backward_input same bits" + tag).c_str(), di, di_first);
        }
    }
    {
        std::vector<T> di = di0;
        emu_launch(k.bin_naive, dim3(2), dim3(32), 0, di.data(), (const T*)dout.data(),
                   (const T*)inp.data(), (const float*)w.data(), offset, (const float*)rstd.data(),
                   N, C);
        near("rmsnorm_backward_input_naive" + tag, di, ref_di, 1e-4, 1e-4);
    }
    for (int R : {1, 5, 64}) {
        int P = (N + R - 1) / R;
        std::vector<T> dw_first;
        const dim3 pgrids[][2] = {{dim3(k1::ceil_div(C, 128), P), dim3(128)},
                                  {dim3(2, 1), dim3(32)}};
        for (auto& pg : pgrids) {
            std::vector<float> partials((size_t)P * C, __int_as_float(0x7fc00000));
            std::vector<T> dw = dw0;
            emu_launch(k.part, pg[0], pg[1], 0, partials.data(), (const T*)dout.data(),
                       (const T*)inp.data(), (const float*)rstd.data(), N, C, R);
            emu_launch(k.reduce, dim3(k1::ceil_div(C, 32)), dim3(32), 0, dw.data(),
                       (const float*)partials.data(), P, C);
            std::string rt = tag + " R " + std::to_string(R);
            if (dw_first.empty()) {
                dw_first = dw;
                near("rmsnorm dw (partials)" + rt, dw, ref_dw, ptol, 1e-5);
            } else {
                emu::expect_bits(("rmsnorm dw same bits" + rt).c_str(), dw, dw_first);
            }
        }
    }
    {
        std::vector<T> dw = dw0;
        emu_launch(k.params_naive, dim3(3), dim3(32), 0, dw.data(), (const T*)dout.data(),
                   (const T*)inp.data(), (const float*)rstd.data(), N, C);
        near("rmsnorm_backward_params_naive dw" + tag, dw, ref_dw, ptol, 1e-5);
    }
}

template <class T>
void all(const LnK<T>& ln, const RmsK<T>& rms) {
    const int shapes[][2] = {{1, 1}, {1, 7}, {3, 16}, {5, 17}, {2, 64}, {13, 100}, {9, 300}, {70, 33}};
    for (auto& s : shapes) {
        layernorm<T>(ln, s[0], s[1]);
        rmsnorm<T>(rms, s[0], s[1], 0.0f, false);  // Llama's
        rmsnorm<T>(rms, s[0], s[1], 1.0f, true);   // Gemma's post-norm: 1 + w, a residual
    }
    rmsnorm<T>(rms, 5, 17, 1.0f, false);  // Gemma's pre-norm: 1 + w alone
    rmsnorm<T>(rms, 5, 17, 0.0f, true);   // a residual alone
}

int main() {
    all<float>({layernorm_forward_f32, layernorm_forward_naive_f32, layernorm_backward_input_f32,
                layernorm_backward_input_naive_f32, layernorm_backward_partials_f32,
                layernorm_backward_params_naive_f32, norm_reduce_partials_f32},
               {rmsnorm_forward_f32, rmsnorm_forward_naive_f32, rmsnorm_backward_input_f32,
                rmsnorm_backward_input_naive_f32, rmsnorm_backward_partials_f32,
                rmsnorm_backward_params_naive_f32, norm_reduce_partials_f32});
    all<bf16>({layernorm_forward_bf16, layernorm_forward_naive_bf16, layernorm_backward_input_bf16,
               layernorm_backward_input_naive_bf16, layernorm_backward_partials_bf16,
               layernorm_backward_params_naive_bf16, norm_reduce_partials_bf16},
              {rmsnorm_forward_bf16, rmsnorm_forward_naive_bf16, rmsnorm_backward_input_bf16,
               rmsnorm_backward_input_naive_bf16, rmsnorm_backward_partials_bf16,
               rmsnorm_backward_params_naive_bf16, norm_reduce_partials_bf16});
    all<f16>({layernorm_forward_f16, layernorm_forward_naive_f16, layernorm_backward_input_f16,
              layernorm_backward_input_naive_f16, layernorm_backward_partials_f16,
              layernorm_backward_params_naive_f16, norm_reduce_partials_f16},
             {rmsnorm_forward_f16, rmsnorm_forward_naive_f16, rmsnorm_backward_input_f16,
              rmsnorm_backward_input_naive_f16, rmsnorm_backward_partials_f16,
              rmsnorm_backward_params_naive_f16, norm_reduce_partials_f16});
    return emu::finish();
}
