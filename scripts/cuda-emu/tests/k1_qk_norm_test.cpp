// norm.cu: Qwen3's per-head q/k norm on fused q|k|v rows, forward and backward, for each
// storage type and shapes (HD below, at and past a warp; GQA and MHA; N odd):
//  - qk_norm_forward and its naive twin against an f64 reference (values copied bitwise);
//  - qk_norm_backward_partials + norm_reduce_partials and the naive twin (dw += onto nonzero
//    values) against the f64 reference, both computed from d BEFORE the input gradient;
//  - qk_norm_backward_input (in place) and its naive twin against the f64 reference, value
//    heads untouched bitwise;
//  - determinism: blocks of 8, 1 and 2 warps and a grid that grid-strides give the same bits;
//  - Qwen3's gain w (offset 0) and Gemma's 1 + w (offset 1, weights near 0), the forward's
//    outputs given the kernel's rstd bitwise the CPU's f32 arithmetic ((x·rstd)·(w + offset)).
//
//     python3 scripts/cuda-emu/run.py scripts/cuda-emu/tests/k1_qk_norm_test.cpp
#include "emu.h"
#include "../../../src/backend/cuda/kernels/norm.cu"
#include "k1_util.h"
#include <cstring>

template <class T>
struct QkK {
    void (*fwd)(T*, float*, const T*, const float*, float, int, int, int, int, float);
    void (*fwd_naive)(T*, float*, const T*, const float*, float, int, int, int, int, float);
    void (*bin)(T*, const T*, const float*, float, const float*, int, int, int, int);
    void (*bin_naive)(T*, const T*, const float*, float, const float*, int, int, int, int);
    void (*part)(float*, const T*, const T*, const float*, int, int, int, int, int);
    void (*params_naive)(T*, const T*, const T*, const float*, int, int, int, int);
    void (*reduce)(T*, const float*, int, int);
};

template <class T>
void near(const std::string& what, const std::vector<T>& got, const std::vector<double>& want,
          double atol32, double rtol32) {
    std::vector<float> g = k1::widened(got), w(want.size());
    for (size_t i = 0; i < want.size(); i++) w[i] = (float)want[i];
    double t = sizeof(T) == 4 ? 0.0 : k1::tol<T>();
    emu::expect_near(what.c_str(), g, w, atol32 + t, rtol32 + t);
}

// Bitwise equality of two stored elements.
template <class T>
bool same(const T& a, const T& b) { return memcmp(&a, &b, sizeof(T)) == 0; }

struct Launch { unsigned warps; unsigned grid; };  // grid 0: enough blocks for every unit
const Launch LAUNCHES[] = {{8, 0}, {1, 0}, {2, 3}};

// The CPU's f32 forward of the q/k heads given the rstd (rmsnorm.rs `forward_rows` per head,
// compiled without FP contraction), value heads copied.
template <class T>
std::vector<T> qk_cpu_out(const std::vector<T>& inp, const std::vector<float>& rstd,
                          const std::vector<float>& w, float offset, int N, int NH, int NKV,
                          int HD) {
    const int heads = NH + 2 * NKV, normed = NH + NKV, QKV = heads * HD;
    std::vector<T> o = inp;
    for (int r = 0; r < N; r++)
        for (int h = 0; h < normed; h++)
            for (int i = 0; i < HD; i++) {
                size_t at = (size_t)r * QKV + (size_t)h * HD + i;
                float wi = w[(h < NH ? 0 : HD) + i];
                o[at] = from_f32<T>(to_f32(inp[at]) * rstd[(size_t)r * normed + h] * (wi + offset));
            }
    return o;
}

// offset: the gain is w + offset (Gemma's 1 + w, with weights near 0).
template <class T>
void qk(const QkK<T>& k, int N, int NH, int NKV, int HD, float offset) {
    char tagbuf[96];
    snprintf(tagbuf, sizeof tagbuf, " %s N%d %d/%d hd%d offset %g", k1::tname<T>(), N, NH, NKV,
             HD, offset);
    std::string tag(tagbuf);
    const float eps = 1e-6f;
    const int heads = NH + 2 * NKV, normed = NH + NKV, QKV = heads * HD;
    auto inp = k1::stored<T>(k1::randn((size_t)N * QKV, 2.0f, 90 + N + HD, 0.3f));
    auto w = offset == 0.0f ? k1::randn(2 * HD, 0.5f, 91 + HD, 1.0f)
                            : k1::randn(2 * HD, 0.1f, 91 + HD);
    if (offset != 0.0f) w[1] = -0.0f, w[HD + 1] = -offset;  // a −0 weight; a zero gain
    auto dy = k1::stored<T>(k1::randn((size_t)N * QKV, 1.0f, 92 + HD));
    auto dw0 = k1::stored<T>(k1::randn(2 * HD, 1.0f, 93 + HD));
    // f64 references on the widened inputs.
    std::vector<double> ref_out((size_t)N * QKV), ref_rstd((size_t)N * normed);
    std::vector<double> ref_d((size_t)N * QKV), ref_dw(2 * HD);
    for (int i = 0; i < 2 * HD; i++) ref_dw[i] = to_f32(dw0[i]);
    for (int r = 0; r < N; r++)
        for (int h = 0; h < heads; h++) {
            size_t at = (size_t)r * QKV + (size_t)h * HD;
            if (h >= normed) {
                for (int i = 0; i < HD; i++) {
                    ref_out[at + i] = to_f32(inp[at + i]);
                    ref_d[at + i] = to_f32(dy[at + i]);
                }
                continue;
            }
            std::vector<double> wh(HD);
            for (int i = 0; i < HD; i++) wh[i] = (double)w[(h < NH ? 0 : HD) + i] + offset;
            double ss = 0;
            for (int i = 0; i < HD; i++) ss += (double)to_f32(inp[at + i]) * to_f32(inp[at + i]);
            double s = 1.0 / sqrt(ss / HD + eps);
            ref_rstd[(size_t)r * normed + h] = s;
            double sgn = 0;
            for (int i = 0; i < HD; i++) {
                double x = to_f32(inp[at + i]);
                ref_out[at + i] = x * s * wh[i];
                sgn += wh[i] * (double)to_f32(dy[at + i]) * x * s;
                ref_dw[(h < NH ? 0 : HD) + i] += x * s * to_f32(dy[at + i]);
            }
            for (int i = 0; i < HD; i++) {
                double x = to_f32(inp[at + i]);
                ref_d[at + i] = (wh[i] * (double)to_f32(dy[at + i]) - x * s * sgn / HD) * s;
            }
        }
    // Forward.
    std::vector<T> out0;
    std::vector<float> rstd0;
    for (const Launch& l : LAUNCHES) {
        std::vector<T> out((size_t)N * QKV, from_f32<T>(9.0f));
        std::vector<float> rstd((size_t)N * normed, 9.0f);
        unsigned grid = l.grid ? l.grid : k1::ceil_div((long long)N * heads, l.warps);
        emu_launch(k.fwd, dim3(grid), dim3(32 * l.warps), 0, out.data(), rstd.data(),
                   inp.data(), w.data(), offset, N, NH, NKV, HD, eps);
        if (out0.empty()) {
            near("qk_norm_forward out" + tag, out, ref_out, 2e-5, 2e-5);
            near("qk_norm_forward rstd" + tag, rstd, ref_rstd, 0.0, 1e-5);
            emu::expect_bits(("qk_norm_forward out bitwise the CPU's, given rstd" + tag).c_str(),
                             out, qk_cpu_out(inp, rstd, w, offset, N, NH, NKV, HD));
            for (int r = 0; r < N; r++)
                for (int i = normed * HD; i < QKV; i++)
                    EMU_CHECK(same(out[(size_t)r * QKV + i], inp[(size_t)r * QKV + i]),
                              "value copied bitwise%s", tag.c_str());
            out0 = out;
            rstd0 = rstd;
        } else {
            emu::expect_bits(("qk_norm_forward same bits" + tag).c_str(), out, out0);
            emu::expect_bits(("qk_norm_forward rstd same bits" + tag).c_str(), rstd, rstd0);
        }
    }
    {
        std::vector<T> out((size_t)N * QKV, from_f32<T>(9.0f));
        std::vector<float> rstd((size_t)N * normed, 9.0f);
        emu_launch(k.fwd_naive, dim3(2), dim3(64), 0, out.data(), rstd.data(), inp.data(),
                   w.data(), offset, N, NH, NKV, HD, eps);
        near("qk_norm_forward_naive out" + tag, out, ref_out, 2e-5, 2e-5);
        emu::expect_bits(("qk_norm_forward_naive out bitwise the CPU's, given rstd" + tag).c_str(),
                         out, qk_cpu_out(inp, rstd, w, offset, N, NH, NKV, HD));
    }
    // Backward: the weight gradient from d first, then the input gradient in place.
    const int R = 4, P = (N + R - 1) / R;
    const double ptol = 1e-4 * sqrt((double)N * normed);
    std::vector<T> dw_first;
    for (int g : {1, 2}) {
        std::vector<float> partials((size_t)P * 2 * HD, 7.0f);
        std::vector<T> dw = dw0;
        emu_launch(k.part, dim3(k1::ceil_div(2 * HD, 256), g), dim3(256), 0, partials.data(),
                   dy.data(), inp.data(), rstd0.data(), N, NH, NKV, HD, R);
        emu_launch(k.reduce, dim3(1), dim3(256), 0, dw.data(), partials.data(), P, 2 * HD);
        if (dw_first.empty()) {
            near("qk_norm dw (partials)" + tag, dw, ref_dw, ptol, 1e-5);
            dw_first = dw;
        } else {
            emu::expect_bits(("qk_norm dw same bits" + tag).c_str(), dw, dw_first);
        }
    }
    {
        std::vector<T> dw = dw0;
        emu_launch(k.params_naive, dim3(1), dim3(64), 0, dw.data(), dy.data(), inp.data(),
                   rstd0.data(), N, NH, NKV, HD);
        near("qk_norm_backward_params_naive dw" + tag, dw, ref_dw, ptol, 1e-5);
    }
    std::vector<T> d_first;
    for (const Launch& l : LAUNCHES) {
        std::vector<T> d = dy;
        unsigned grid = l.grid ? l.grid : k1::ceil_div((long long)N * normed, l.warps);
        emu_launch(k.bin, dim3(grid), dim3(32 * l.warps), 0, d.data(), inp.data(), w.data(),
                   offset, rstd0.data(), N, NH, NKV, HD);
        if (d_first.empty()) {
            near("qk_norm_backward_input" + tag, d, ref_d, 1e-4, 1e-4);
            for (int r = 0; r < N; r++)
                for (int i = normed * HD; i < QKV; i++)
                    EMU_CHECK(same(d[(size_t)r * QKV + i], dy[(size_t)r * QKV + i]),
                              "value gradient untouched%s", tag.c_str());
            d_first = d;
        } else {
            emu::expect_bits(("qk_norm_backward_input same bits" + tag).c_str(), d, d_first);
        }
    }
    {
        std::vector<T> d = dy;
        emu_launch(k.bin_naive, dim3(3), dim3(32), 0, d.data(), inp.data(), w.data(),
                   offset, rstd0.data(), N, NH, NKV, HD);
        near("qk_norm_backward_input_naive" + tag, d, ref_d, 1e-4, 1e-4);
    }
}

template <class T>
void all(const QkK<T>& k) {
    const int shapes[][4] = {{3, 2, 1, 8}, {5, 4, 2, 32}, {7, 2, 2, 40}, {2, 1, 1, 130}};
    for (const auto& s : shapes) {
        qk<T>(k, s[0], s[1], s[2], s[3], 0.0f);  // Qwen3's gain w
        qk<T>(k, s[0], s[1], s[2], s[3], 1.0f);  // Gemma's 1 + w
    }
}

int main() {
    all<float>({qk_norm_forward_f32, qk_norm_forward_naive_f32, qk_norm_backward_input_f32,
                qk_norm_backward_input_naive_f32, qk_norm_backward_partials_f32,
                qk_norm_backward_params_naive_f32, norm_reduce_partials_f32});
    all<bf16>({qk_norm_forward_bf16, qk_norm_forward_naive_bf16, qk_norm_backward_input_bf16,
               qk_norm_backward_input_naive_bf16, qk_norm_backward_partials_bf16,
               qk_norm_backward_params_naive_bf16, norm_reduce_partials_bf16});
    all<f16>({qk_norm_forward_f16, qk_norm_forward_naive_f16, qk_norm_backward_input_f16,
              qk_norm_backward_input_naive_f16, qk_norm_backward_partials_f16,
              qk_norm_backward_params_naive_f16, norm_reduce_partials_f16});
    return emu::finish();
}
