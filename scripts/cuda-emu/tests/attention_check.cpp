// Tests of src/backend/cuda/kernels/attention.cu on the CPU (attention_emu.h): the flash
// forward and the 3-launch backward, and their naive twins, against an f64 reference (a port of
// src/backend/cpu/attention/naive.rs) over shapes that exercise partial tiles, GQA, packed
// rows, sliding windows (W: query i sees keys j > i − W; alone and with packed rows; shorter and
// longer than a tile), head sizes below each entry's HD and odd ones; plus bitwise determinism
// (two runs; the same hd through a larger-HD entry) and the full overwrite of dqkv (prefilled
// with NaN).
// Build and run: python3 scripts/cuda-emu/tests/attention_run.py
#include <cstdio>
#include <random>
#include <string>
#include "attention_emu.h"
#include ATT_GEN  // the prelude and attention.cu, rewritten for g++

using std::vector;

static int failures = 0;

// f64 reference (naive.rs forward_f64 / backward_f64): the first key of query i, its example's
// (pos) and, with a window W > 0, no earlier than i + 1 − W (transformers' sliding window).
static int first_key(const vector<uint32_t>* pos, int W, int t, int b, int i) {
    int lo = pos ? i - (int)(*pos)[b * t + i] : 0;
    return W > 0 ? std::max(lo, i + 1 - W) : lo;
}
// What scores are divided by the square root of (the entries' last argument, `sd`): not the
// head size, as Gemma 3's query_pre_attn_scalar may not be, so the kernels must read it.
static float scale_dim(int hd) { return (float)hd + 3.0f; }

static void ref_forward(const vector<double>& qkv, int B, int T, int NH, int NKV, int hd,
                        const vector<uint32_t>* pos, int W, vector<double>& out,
                        vector<double>& lse, vector<double>& att) {
    int ld = (NH + 2 * NKV) * hd, co = NH * hd, g = NH / NKV;
    double scale = 1.0 / std::sqrt((double)scale_dim(hd));
    out.assign((size_t)B * T * co, 0.0);
    lse.assign((size_t)B * NH * T, 0.0);
    att.assign((size_t)B * NH * T * T, 0.0);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < NH; ++h)
            for (int i = 0; i < T; ++i) {
                int lo = first_key(pos, W, T, b, i), j = h / g;
                double* row = &att[(((size_t)b * NH + h) * T + i) * T];
                const double* q = &qkv[((size_t)b * T + i) * ld + h * hd];
                double mx = -INFINITY;
                for (int k = lo; k <= i; ++k) {
                    const double* kk = &qkv[((size_t)b * T + k) * ld + (NH + j) * hd];
                    double s = 0;
                    for (int e = 0; e < hd; ++e) s += q[e] * kk[e];
                    row[k] = s * scale;
                    mx = std::max(mx, row[k]);
                }
                double sum = 0;
                for (int k = lo; k <= i; ++k) sum += (row[k] = std::exp(row[k] - mx));
                for (int k = lo; k <= i; ++k) row[k] /= sum;
                lse[((size_t)b * NH + h) * T + i] = mx + std::log(sum);
                double* o = &out[((size_t)b * T + i) * co + h * hd];
                for (int k = lo; k <= i; ++k) {
                    const double* vv = &qkv[((size_t)b * T + k) * ld + (NH + NKV + j) * hd];
                    for (int e = 0; e < hd; ++e) o[e] += row[k] * vv[e];
                }
            }
}
static vector<double> ref_backward(const vector<double>& dout, const vector<double>& qkv, int B,
                                   int T, int NH, int NKV, int hd,
                                   const vector<uint32_t>* pos, int W) {
    int ld = (NH + 2 * NKV) * hd, co = NH * hd, g = NH / NKV;
    double scale = 1.0 / std::sqrt((double)scale_dim(hd));
    vector<double> out, lse, att;
    ref_forward(qkv, B, T, NH, NKV, hd, pos, W, out, lse, att);
    vector<double> dqkv((size_t)B * T * ld, 0.0), dp(T);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < NH; ++h)
            for (int i = 0; i < T; ++i) {
                int lo = first_key(pos, W, T, b, i), j = h / g;
                const double* p = &att[(((size_t)b * NH + h) * T + i) * T];
                const double* doi = &dout[((size_t)b * T + i) * co + h * hd];
                for (int k = lo; k <= i; ++k) {
                    size_t vrow = ((size_t)b * T + k) * ld + (NH + NKV + j) * hd;
                    dp[k] = 0;
                    for (int e = 0; e < hd; ++e) dp[k] += doi[e] * qkv[vrow + e];
                    for (int e = 0; e < hd; ++e) dqkv[vrow + e] += p[k] * doi[e];
                }
                double dot = 0;
                for (int k = lo; k <= i; ++k) dot += p[k] * dp[k];
                size_t qrow = ((size_t)b * T + i) * ld + h * hd;
                for (int k = lo; k <= i; ++k) {
                    double ds = p[k] * (dp[k] - dot) * scale;
                    size_t krow = ((size_t)b * T + k) * ld + (NH + j) * hd;
                    for (int e = 0; e < hd; ++e) {
                        dqkv[qrow + e] += ds * qkv[krow + e];
                        dqkv[krow + e] += ds * qkv[qrow + e];
                    }
                }
            }
    return dqkv;
}

template <class T> static vector<double> widen(const vector<T>& v) {
    vector<double> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = to_f32(v[i]);
    return r;
}
static vector<double> widen(const vector<float>& v) { return vector<double>(v.begin(), v.end()); }

// max |a − r| / max |r|; fails the test when above tol (or not finite).
static double check(const char* what, const std::string& tag, const vector<double>& a,
                    const vector<double>& r, double tol) {
    double err = 0, mag = 1e-30;
    bool finite = a.size() == r.size();
    for (size_t i = 0; i < a.size() && finite; ++i) {
        if (!std::isfinite(a[i])) finite = false;
        err = std::max(err, std::fabs(a[i] - r[i]));
        mag = std::max(mag, std::fabs(r[i]));
    }
    double rel = finite ? err / mag : INFINITY;
    bool ok = rel <= tol;
    if (!ok) ++failures;
    printf("  %-4s %-28s rel err %.3e (tol %.0e)\n", ok ? "ok" : "FAIL", what, rel, tol);
    (void)tag;
    return rel;
}
template <class T> static bool same_bits(const vector<T>& a, const vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
static void expect(bool c, const char* what) {
    if (!c) ++failures;
    printf("  %-4s %s\n", c ? "ok" : "FAIL", what);
}


template <class T> struct Entries {
    void (*fwd[3])(const T*, const unsigned*, T*, float*, int, int, int, int, int, int, float);
    void (*dkv[3])(T*, const unsigned*, const T*, const T*, const float*, const float*, int,
                   int, int, int, int, int, float);
    void (*dq[3])(T*, const unsigned*, const T*, const T*, const float*, const float*, int, int,
                  int, int, int, int, float);
    void (*dot)(float*, const T*, const T*, int, int, int, int);
    void (*fwd_naive)(const T*, const unsigned*, T*, float*, int, int, int, int, int, int, float);
    void (*bwd_naive)(T*, const unsigned*, const T*, const T*, const T*, const float*, int, int,
                      int, int, int, int, float);
};
#define ENTRIES(T, S)                                                                          \
    Entries<T>{{attention_forward_hd64_##S, attention_forward_hd128_##S,                       \
                attention_forward_hd256_##S},                                                   \
               {attention_backward_dkv_hd64_##S, attention_backward_dkv_hd128_##S,             \
                attention_backward_dkv_hd256_##S},                                              \
               {attention_backward_dq_hd64_##S, attention_backward_dq_hd128_##S,               \
                attention_backward_dq_hd256_##S},                                               \
               attention_backward_dot_##S,                                                      \
               attention_forward_naive_##S,                                                     \
               attention_backward_naive_##S}

static size_t fwd_smem(int hd) { return 4 * (32 * hd + 32 * (hd | 1) + 32 * hd + 1024); }
static size_t dkv_smem(int hd) { return 4 * (64 * hd + 64 * (hd | 1) + 2048); }
static size_t dq_smem(int hd) { return 4 * (64 * hd + 64 * (hd | 1) + 1024); }
static unsigned cdiv(long long a, long long b) { return (unsigned)((a + b - 1) / b); }

template <class T> struct Run {
    vector<T> out, dqkv;
    vector<float> lse, ws;
};

// Flash forward + backward through the entries of index `which` (0: hd64, 1: hd128, 2: hd256).
template <class T>
static Run<T> run_flash(const Entries<T>& en, int which, const vector<T>& qkv,
                        const vector<T>& dout, const vector<uint32_t>* pos, int B, int Tn,
                        int NH, int NKV, int hd, int W) {
    int ld = (NH + 2 * NKV) * hd, co = NH * hd;
    Run<T> r;
    T nanT = from_f32<T>(__int_as_float(0x7fc00000));
    r.out.assign((size_t)B * Tn * co, nanT);
    r.lse.assign((size_t)B * NH * Tn, NAN);
    r.dqkv.assign((size_t)B * Tn * ld, nanT);
    r.ws.assign((size_t)B * NH * Tn, NAN);
    const unsigned* pp = pos ? pos->data() : nullptr;
    emu_launch(dim3{cdiv(Tn, 32), (unsigned)NH, (unsigned)B}, dim3{256}, fwd_smem(hd),
               en.fwd[which], qkv.data(), pp, r.out.data(), r.lse.data(), B, Tn, NH, NKV, hd, W, scale_dim(hd));
    emu_launch(dim3{cdiv((long long)B * Tn * NH, 8)}, dim3{256}, 0, en.dot, r.ws.data(),
               dout.data(), (const T*)r.out.data(), B, Tn, NH, hd);
    emu_launch(dim3{cdiv(Tn, 32), (unsigned)NKV, (unsigned)B}, dim3{256}, dkv_smem(hd),
               en.dkv[which], r.dqkv.data(), pp, dout.data(), qkv.data(),
               (const float*)r.lse.data(), (const float*)r.ws.data(), B, Tn, NH, NKV, hd, W, scale_dim(hd));
    emu_launch(dim3{cdiv(Tn, 32), (unsigned)NH, (unsigned)B}, dim3{256}, dq_smem(hd),
               en.dq[which], r.dqkv.data(), pp, dout.data(), qkv.data(),
               (const float*)r.lse.data(), (const float*)r.ws.data(), B, Tn, NH, NKV, hd, W, scale_dim(hd));
    return r;
}

template <class T>
static void run_case(const char* tname, const Entries<T>& en, double tol, int B, int Tn, int NH,
                     int NKV, int hd, const vector<vector<int>>* examples, bool extra = false,
                     int W = 0) {
    int ld = (NH + 2 * NKV) * hd, co = NH * hd;
    int which = hd <= 64 ? 0 : hd <= 128 ? 1 : 2;
    std::string tag = std::string(tname) + " B" + std::to_string(B) + " T" + std::to_string(Tn) +
                      " NH" + std::to_string(NH) + " NKV" + std::to_string(NKV) + " hd" +
                      std::to_string(hd) + (examples ? " packed" : "") +
                      (W > 0 ? " W" + std::to_string(W) : "");
    printf("%s (entry hd%d)\n", tag.c_str(), 64 << which);
    std::mt19937 rng(1234 + B * 7 + Tn * 13 + NH * 17 + NKV * 19 + hd * 23);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    vector<T> qkv((size_t)B * Tn * ld), dout((size_t)B * Tn * co);
    for (auto& x : qkv) x = from_f32<T>(1.5f * nd(rng));
    for (auto& x : dout) x = from_f32<T>(nd(rng));
    vector<uint32_t> posv;
    if (examples) {
        for (int b = 0; b < B; ++b) {
            int n = 0;
            for (int len : (*examples)[b])
                for (int p = 0; p < len; ++p, ++n) posv.push_back(p);
            if (n != Tn) { printf("bad examples\n"); abort(); }
        }
    }
    const vector<uint32_t>* pos = examples ? &posv : nullptr;
    const unsigned* pp = pos ? pos->data() : nullptr;

    vector<double> rout, rlse, ratt;
    vector<double> q64 = widen(qkv), d64 = widen(dout);
    ref_forward(q64, B, Tn, NH, NKV, hd, pos, W, rout, rlse, ratt);
    vector<double> rdqkv = ref_backward(d64, q64, B, Tn, NH, NKV, hd, pos, W);

    Run<T> f = run_flash(en, which, qkv, dout, pos, B, Tn, NH, NKV, hd, W);
    check("flash out vs f64", tag, widen(f.out), rout, tol);
    check("flash lse vs f64", tag, widen(f.lse), rlse, tol);
    check("flash dqkv vs f64", tag, widen(f.dqkv), rdqkv, 4 * tol);

    // Naive twins: forward, then the backward from the flash forward's out and lse.
    T nanT = from_f32<T>(__int_as_float(0x7fc00000));
    vector<T> nout((size_t)B * Tn * co, nanT), ndqkv((size_t)B * Tn * ld, nanT);
    vector<float> nlse((size_t)B * NH * Tn, NAN);
    emu_launch(dim3{cdiv((long long)B * Tn * NH * hd, 256)}, dim3{256}, 0, en.fwd_naive,
               qkv.data(), pp, nout.data(), nlse.data(), B, Tn, NH, NKV, hd, W, scale_dim(hd));
    emu_launch(dim3{cdiv((long long)B * Tn * ld, 256)}, dim3{256}, 0, en.bwd_naive,
               ndqkv.data(), pp, dout.data(), qkv.data(), (const T*)f.out.data(),
               (const float*)f.lse.data(), B, Tn, NH, NKV, hd, W, scale_dim(hd));
    check("naive out vs f64", tag, widen(nout), rout, tol);
    check("naive lse vs f64", tag, widen(nlse), rlse, tol);
    check("naive dqkv vs f64", tag, widen(ndqkv), rdqkv, 4 * tol);
    check("flash out vs naive", tag, widen(f.out), widen(nout), tol);
    check("flash dqkv vs naive", tag, widen(f.dqkv), widen(ndqkv), 4 * tol);

    if (extra) {
        Run<T> f2 = run_flash(en, which, qkv, dout, pos, B, Tn, NH, NKV, hd, W);
        expect(same_bits(f.out, f2.out) && same_bits(f.lse, f2.lse) &&
                   same_bits(f.dqkv, f2.dqkv),
               "second run bitwise equal");
        if (which < 2) {
            Run<T> f3 = run_flash(en, which + 1, qkv, dout, pos, B, Tn, NH, NKV, hd, W);
            expect(same_bits(f.out, f3.out) && same_bits(f.lse, f3.lse) &&
                       same_bits(f.dqkv, f3.dqkv),
                   "larger-HD entry bitwise equal");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// attention_mma.cu: the tensor-core entries (bf16, f16; hd64, hd128), block 128:
//   forward  grid (ceil(T/64), NH, B),  dynamic shared 2·(64·(HD+8) + HD·72) bytes
//   dkv      grid (ceil(T/64), NKV, B), dynamic shared 2·(4·64·(HD+8) + 2·HD·72) bytes
//   dq       grid (ceil(T/64), NH, B),  dynamic shared 2·(4·64·(HD+8) + HD·72) bytes
// (the backward's D from attention.cu's attention_backward_dot_<S>, as the host launches it).

template <class T> struct MmaEntries {
    void (*fwd[2])(const T*, const unsigned*, T*, float*, int, int, int, int, int, int, float);
    void (*dkv[2])(T*, const unsigned*, const T*, const T*, const float*, const float*, int,
                   int, int, int, int, int, float);
    void (*dq[2])(T*, const unsigned*, const T*, const T*, const float*, const float*, int, int,
                  int, int, int, int, float);
};
#define MMA_ENTRIES(S)                                                                         \
    {{attention_forward_mma_hd64_##S, attention_forward_mma_hd128_##S},                        \
     {attention_backward_dkv_mma_hd64_##S, attention_backward_dkv_mma_hd128_##S},              \
     {attention_backward_dq_mma_hd64_##S, attention_backward_dq_mma_hd128_##S}}

static size_t mma_fwd_smem(int HD) { return 2 * (64 * (HD + 8) + HD * 72); }
static size_t mma_dkv_smem(int HD) { return 2 * (4 * 64 * (HD + 8) + 2 * HD * 72); }
static size_t mma_dq_smem(int HD) { return 2 * (4 * 64 * (HD + 8) + HD * 72); }

// The mma forward, then the backward (D by attention.cu's dot entry from the mma forward's
// out), through the entries of index `which` (0: hd64, 1: hd128).
template <class T>
static Run<T> run_mma(const MmaEntries<T>& en, const Entries<T>& fma, int which,
                      const vector<T>& qkv, const vector<T>& dout, const vector<uint32_t>* pos,
                      int B, int Tn, int NH, int NKV, int hd, int W) {
    int ld = (NH + 2 * NKV) * hd, co = NH * hd, HD = 64 << which;
    Run<T> r;
    T nanT = from_f32<T>(__int_as_float(0x7fc00000));
    r.out.assign((size_t)B * Tn * co, nanT);
    r.lse.assign((size_t)B * NH * Tn, NAN);
    r.dqkv.assign((size_t)B * Tn * ld, nanT);
    r.ws.assign((size_t)B * NH * Tn, NAN);
    const unsigned* pp = pos ? pos->data() : nullptr;
    emu_launch(dim3{cdiv(Tn, 64), (unsigned)NH, (unsigned)B}, dim3{128}, mma_fwd_smem(HD),
               en.fwd[which], qkv.data(), pp, r.out.data(), r.lse.data(), B, Tn, NH, NKV, hd, W, scale_dim(hd));
    emu_launch(dim3{cdiv((long long)B * Tn * NH, 8)}, dim3{256}, 0, fma.dot, r.ws.data(),
               dout.data(), (const T*)r.out.data(), B, Tn, NH, hd);
    emu_launch(dim3{cdiv(Tn, 64), (unsigned)NKV, (unsigned)B}, dim3{128}, mma_dkv_smem(HD),
               en.dkv[which], r.dqkv.data(), pp, dout.data(), qkv.data(),
               (const float*)r.lse.data(), (const float*)r.ws.data(), B, Tn, NH, NKV, hd, W, scale_dim(hd));
    emu_launch(dim3{cdiv(Tn, 64), (unsigned)NH, (unsigned)B}, dim3{128}, mma_dq_smem(HD),
               en.dq[which], r.dqkv.data(), pp, dout.data(), qkv.data(),
               (const float*)r.lse.data(), (const float*)r.ws.data(), B, Tn, NH, NKV, hd, W, scale_dim(hd));
    return r;
}

// The mma forward and backward against the f64 reference and attention.cu's FMA flash entries
// (same inputs); with `extra`, twice (bitwise equal) and, for hd ≤ 64, through the hd128
// entries too (bitwise equal: the extra k-steps and n-tiles only meet zeros).
template <class T>
static void run_mma_case(const char* tname, const MmaEntries<T>& en, const Entries<T>& fma,
                         double tol, int B, int Tn, int NH, int NKV, int hd,
                         const vector<vector<int>>* examples, bool extra = false, int W = 0) {
    int ld = (NH + 2 * NKV) * hd, co = NH * hd;
    int which = hd <= 64 ? 0 : 1;
    std::string tag = std::string(tname) + " B" + std::to_string(B) + " T" + std::to_string(Tn) +
                      " NH" + std::to_string(NH) + " NKV" + std::to_string(NKV) + " hd" +
                      std::to_string(hd) + (examples ? " packed" : "") +
                      (W > 0 ? " W" + std::to_string(W) : "");
    printf("mma %s (entries *_mma_hd%d)\n", tag.c_str(), 64 << which);
    std::mt19937 rng(4321 + B * 7 + Tn * 13 + NH * 17 + NKV * 19 + hd * 23);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    vector<T> qkv((size_t)B * Tn * ld), dout((size_t)B * Tn * co);
    for (auto& x : qkv) x = from_f32<T>(1.5f * nd(rng));
    for (auto& x : dout) x = from_f32<T>(nd(rng));
    vector<uint32_t> posv;
    if (examples) {
        for (int b = 0; b < B; ++b) {
            int n = 0;
            for (int len : (*examples)[b])
                for (int p = 0; p < len; ++p, ++n) posv.push_back(p);
            if (n != Tn) { printf("bad examples\n"); abort(); }
        }
    }
    const vector<uint32_t>* pos = examples ? &posv : nullptr;
    vector<double> rout, rlse, ratt, q64 = widen(qkv), d64 = widen(dout);
    ref_forward(q64, B, Tn, NH, NKV, hd, pos, W, rout, rlse, ratt);
    vector<double> rdqkv = ref_backward(d64, q64, B, Tn, NH, NKV, hd, pos, W);

    Run<T> f = run_mma(en, fma, which, qkv, dout, pos, B, Tn, NH, NKV, hd, W);
    check("mma out vs f64", tag, widen(f.out), rout, tol);
    check("mma lse vs f64", tag, widen(f.lse), rlse, tol);
    check("mma dqkv vs f64", tag, widen(f.dqkv), rdqkv, 4 * tol);

    int fw = hd <= 64 ? 0 : hd <= 128 ? 1 : 2;
    Run<T> ff = run_flash(fma, fw, qkv, dout, pos, B, Tn, NH, NKV, hd, W);
    check("mma out vs fma flash", tag, widen(f.out), widen(ff.out), tol);
    check("mma lse vs fma flash", tag, widen(f.lse), widen(ff.lse), tol);
    check("mma dqkv vs fma flash", tag, widen(f.dqkv), widen(ff.dqkv), 4 * tol);

    if (extra) {
        Run<T> f2 = run_mma(en, fma, which, qkv, dout, pos, B, Tn, NH, NKV, hd, W);
        expect(same_bits(f.out, f2.out) && same_bits(f.lse, f2.lse) &&
                   same_bits(f.dqkv, f2.dqkv),
               "mma second run bitwise equal");
        if (which == 0) {
            Run<T> f3 = run_mma(en, fma, 1, qkv, dout, pos, B, Tn, NH, NKV, hd, W);
            expect(same_bits(f.out, f3.out) && same_bits(f.lse, f3.lse) &&
                       same_bits(f.dqkv, f3.dqkv),
                   "mma hd128 entries bitwise equal");
        }
    }
}

// One m16n8k16 through the emulated mma against a plain product (the fragment layout of
// attention_mma.cu's header), for both operand types: catches a layout error of the emulator
// independently of the kernels.
template <class T> static void mma_unit(const char* tname, bool bf) {
    static float A[16][16], Bm[16][8], D[16][8];
    std::mt19937 rng(99);
    std::uniform_int_distribution<int> ud(-8, 8);
    for (auto& r : A) for (auto& x : r) x = to_f32(from_f32<T>(ud(rng) / 4.0f));
    for (auto& r : Bm) for (auto& x : r) x = to_f32(from_f32<T>(ud(rng) / 4.0f));
    auto bits = [](float x) { return (unsigned)from_f32<T>(x).bits; };
    auto kernel = [&](int bfl) {
        const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        unsigned a[4] = {bits(A[g][2 * t]) | bits(A[g][2 * t + 1]) << 16,
                         bits(A[g + 8][2 * t]) | bits(A[g + 8][2 * t + 1]) << 16,
                         bits(A[g][2 * t + 8]) | bits(A[g][2 * t + 9]) << 16,
                         bits(A[g + 8][2 * t + 8]) | bits(A[g + 8][2 * t + 9]) << 16};
        unsigned b[2] = {bits(Bm[2 * t][g]) | bits(Bm[2 * t + 1][g]) << 16,
                         bits(Bm[2 * t + 8][g]) | bits(Bm[2 * t + 9][g]) << 16};
        float c[4] = {1.0f, 2.0f, 3.0f, 4.0f};
        emu_mma_m16n8k16(c, a, b, bfl != 0);
        D[g][2 * t] = c[0];
        D[g][2 * t + 1] = c[1];
        D[g + 8][2 * t] = c[2];
        D[g + 8][2 * t + 1] = c[3];
    };
    emu_launch(dim3{1}, dim3{32}, 0, kernel, bf ? 1 : 0);
    bool ok = true;
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 8; ++j) {
            double want = 1.0 + (i >= 8 ? 2 : 0) + (j & 1);
            for (int k = 0; k < 16; ++k) want += (double)A[i][k] * Bm[k][j];
            ok &= D[i][j] == (float)want;
        }
    printf("mma unit (%s)\n", tname);
    expect(ok, "emulated mma.m16n8k16 == plain product (exact small values)");
}

// Sliding windows (FMA entries): shorter than a tile (5, 20), longer (40), with packed rows, a
// window of 1, and W = T and W > T (no window: bitwise the unwindowed run).
static void windowed(const Entries<float>& e32, const Entries<bf16>& eb,
                     const vector<vector<int>>& ex70, const vector<vector<int>>& ex100) {
    // Sliding windows: shorter than a tile (5, 20), longer (40), with packed rows, a
    // window of 1, and one of T (no window: bitwise the unwindowed run, checked below).
    run_case("f32", e32, 2e-5, 2, 100, 4, 2, 64, nullptr, true, 20);
    run_case("f32", e32, 2e-5, 1, 130, 2, 1, 33, nullptr, true, 40);
    run_case("f32", e32, 2e-5, 3, 100, 2, 1, 33, &ex100, true, 40);
    run_case("f32", e32, 2e-5, 2, 70, 4, 2, 64, &ex70, false, 5);
    run_case("f32", e32, 2e-5, 1, 45, 3, 3, 16, nullptr, false, 1);
    run_case("bf16", eb, 3e-2, 2, 70, 4, 2, 64, &ex70, true, 24);
    {
        int Tn = 70, ld = 8 * 64;
        std::mt19937 rng(5);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        vector<float> qkv((size_t)Tn * ld), dout((size_t)Tn * 4 * 64);
        for (auto& x : qkv) x = nd(rng);
        for (auto& x : dout) x = nd(rng);
        Run<float> a = run_flash(e32, 0, qkv, dout, nullptr, 1, Tn, 4, 2, 64, 0);
        Run<float> b = run_flash(e32, 0, qkv, dout, nullptr, 1, Tn, 4, 2, 64, Tn);
        Run<float> c = run_flash(e32, 0, qkv, dout, nullptr, 1, Tn, 4, 2, 64, 1000);
        printf("window of T or more\n");
        expect(same_bits(a.out, b.out) && same_bits(a.lse, b.lse) &&
                   same_bits(a.dqkv, b.dqkv) && same_bits(a.out, c.out) &&
                   same_bits(a.dqkv, c.dqkv),
               "W = T and W = 1000 bitwise W = 0 (no window)");
    }
}

// Sliding windows on the mma entries: longer than a 64-query tile (70), shorter (20, 3),
// packed rows.
static void windowed_mma(const MmaEntries<bf16>& mb, const Entries<bf16>& eb,
                         const MmaEntries<f16>& mh, const Entries<f16>& eh,
                         const vector<vector<int>>& ex70) {
    run_mma_case("bf16", mb, eb, 3e-2, 1, 200, 2, 1, 64, nullptr, true, 70);
    run_mma_case("f16", mh, eh, 4e-3, 2, 70, 4, 2, 64, &ex70, false, 20);
    run_mma_case("f16", mh, eh, 4e-3, 1, 130, 2, 2, 128, nullptr, false, 3);
}

int main(int argc, char** argv) {
    auto e32 = ENTRIES(float, f32);
    auto eb = ENTRIES(bf16, bf16);
    auto eh = ENTRIES(f16, f16);
    vector<vector<int>> ex70 = {{30, 1, 39}, {5, 65}};
    vector<vector<int>> ex40 = {{1, 1, 38}};
    vector<vector<int>> ex100 = {{33, 32, 35}, {100}, {1, 64, 3, 32}};
    std::string mode = argc > 1 ? argv[1] : "";
    MmaEntries<bf16> mb = MMA_ENTRIES(bf16);
    MmaEntries<f16> mh = MMA_ENTRIES(f16);
    if (mode == "window") {  // the sliding-window cases alone
        windowed(e32, eb, ex70, ex100);
        windowed_mma(mb, eb, mh, eh, ex70);
        printf(failures ? "FAILED: %d checks\n" : "all passed\n", failures);
        return failures ? 1 : 0;
    }
    if (mode == "quick") {  // a packed GQA case with partial tiles, and an odd hd
        run_case("f32", e32, 2e-5, 2, 70, 4, 2, 64, &ex70);
        run_case("f32", e32, 2e-5, 1, 45, 2, 1, 33, nullptr);
        run_case("f32", e32, 2e-5, 2, 100, 4, 2, 64, &ex100, false, 20);
    } else {
        run_case("f32", e32, 2e-5, 2, 70, 4, 2, 64, nullptr, true);
        run_case("f32", e32, 2e-5, 2, 70, 4, 2, 64, &ex70, true);
        run_case("f32", e32, 2e-5, 1, 33, 3, 1, 40, nullptr, true);
        run_case("f32", e32, 2e-5, 3, 100, 2, 1, 33, &ex100, true);
        run_case("f32", e32, 2e-5, 1, 40, 2, 2, 128, &ex40, true);
        run_case("f32", e32, 2e-5, 1, 37, 6, 2, 96, nullptr);
        run_case("f32", e32, 2e-5, 1, 1, 2, 1, 64, nullptr);
        run_case("f32", e32, 2e-5, 1, 35, 2, 1, 200, nullptr, true);
        run_case("bf16", eb, 3e-2, 2, 70, 4, 2, 64, &ex70, true);
        run_case("f16", eh, 4e-3, 1, 45, 4, 4, 128, nullptr, true);
        if (mode == "long") run_case("f32", e32, 2e-5, 1, 200, 4, 1, 64, nullptr, true);
        windowed(e32, eb, ex70, ex100);
    }
    // attention_mma.cu (bf16 and f16 only).
    mma_unit<bf16>("bf16", true);
    mma_unit<f16>("f16", false);
    vector<vector<int>> ex130 = {{64, 1, 65}};
    if (mode == "quick") {
        run_mma_case("bf16", mb, eb, 3e-2, 2, 70, 4, 2, 64, &ex70, true);
        run_mma_case("f16", mh, eh, 4e-3, 1, 45, 2, 1, 128, nullptr, true);
    } else {
        run_mma_case("bf16", mb, eb, 3e-2, 2, 70, 4, 2, 64, nullptr, true);
        run_mma_case("bf16", mb, eb, 3e-2, 2, 70, 4, 2, 64, &ex70, true);
        run_mma_case("bf16", mb, eb, 3e-2, 1, 130, 2, 1, 64, &ex130);
        run_mma_case("bf16", mb, eb, 3e-2, 3, 100, 2, 1, 128, &ex100, true);
        run_mma_case("bf16", mb, eb, 3e-2, 1, 33, 3, 1, 40, nullptr);
        run_mma_case("bf16", mb, eb, 3e-2, 1, 1, 2, 1, 64, nullptr);
        run_mma_case("f16", mh, eh, 4e-3, 1, 45, 4, 4, 128, nullptr, true);
        run_mma_case("f16", mh, eh, 4e-3, 2, 70, 4, 2, 64, &ex70, true);
        run_mma_case("f16", mh, eh, 4e-3, 1, 64, 6, 2, 72, nullptr);
        run_mma_case("f16", mh, eh, 4e-3, 1, 129, 2, 2, 64, nullptr);
        run_mma_case("f16", mh, eh, 4e-3, 1, 40, 2, 2, 33, &ex40);
        windowed_mma(mb, eb, mh, eh, ex70);
    }
    printf(failures ? "FAILED: %d checks\n" : "all passed\n", failures);
    return failures ? 1 : 0;
}
