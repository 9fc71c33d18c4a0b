// Runs the xent / optimizer / lora / dequant kernels on the CPU against the CPU backend's
// arithmetic (k2_ref.rs's outputs, in the directory $K2_REF): bitwise where the kernels promise
// it, to a tolerance for the gradient norm. Built and run by run-k2.sh: under the shared
// emulator (scripts/cuda-emu/run.py, emu.h) where it exists, else under k2_emu.h
// (-DK2_OWN_EMU, which run-k2.sh passes with the prelude as -include files).
#ifdef K2_OWN_EMU
#define K2_LAUNCH(kernel, grid, block, ...) emu_launch((grid), (block), [&] { kernel(__VA_ARGS__); })
#else
#include "emu.h"
#define K2_LAUNCH(kernel, grid, block, ...) \
    emu_launch(kernel, dim3(grid), dim3(block), 0, __VA_ARGS__)
#endif
#include "src/backend/cuda/kernels/xent.cu"
#include "src/backend/cuda/kernels/optimizer.cu"
#include "src/backend/cuda/kernels/lora.cu"
#include "src/backend/cuda/kernels/dequant.cu"

#include <string>

static std::string DIR;
static int failures = 0;

template <typename V>
static std::vector<V> load(const std::string& name) {
    std::string path = DIR + "/" + name + ".bin";
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) {
        fprintf(stderr, "missing %s\n", path.c_str());
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    std::vector<V> v(n / sizeof(V));
    if (fread(v.data(), 1, n, f) != (size_t)n) exit(2);
    fclose(f);
    return v;
}

static bool same_f32(float a, float b) {
    return __float_as_uint(a) == __float_as_uint(b) || (a != a && b != b);
}

// Bitwise (NaN equals NaN) comparison of two f32 arrays.
static void check_f32(const char* what, const float* got, const float* want, size_t n) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (!same_f32(got[i], want[i]) && bad++ == 0) first = i;
    if (bad) {
        failures++;
        printf("FAIL %s: %zu of %zu differ; first [%zu]: %.9g (0x%08x) vs %.9g (0x%08x)\n", what,
               bad, n, first, got[first], __float_as_uint(got[first]), want[first],
               __float_as_uint(want[first]));
    }
}

static void check_bytes(const char* what, const void* got, const void* want, size_t n) {
    const unsigned char *g = (const unsigned char*)got, *w = (const unsigned char*)want;
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (g[i] != w[i] && bad++ == 0) first = i;
    if (bad) {
        failures++;
        printf("FAIL %s: %zu of %zu bytes differ; first [%zu]: %02x vs %02x\n", what, bad, n,
               first, g[first], w[first]);
    }
}

// ---------------------------------------------------------------- device helpers directly

static void test_helpers() {
    auto x = load<float>("exp_x"), y = load<float>("exp_y");
    std::vector<float> got(x.size());
    for (size_t i = 0; i < x.size(); i++) got[i] = mw_exp_f32(x[i]);
    check_f32("mw_exp_f32 vs exp_f32", got.data(), y.data(), x.size());

    auto lv = load<float>("levels");
    std::vector<float> gl;
    for (int k = 1; k <= 255; k++) gl.push_back(q8_level(k, 255));
    for (int k = 1; k <= 127; k++) gl.push_back(q8_level(k, 127));
    check_f32("q8_level vs level_from_bits", gl.data(), lv.data(), lv.size());

    auto ly = load<float>("logc_y");
    auto lc = load<unsigned>("logc_c");
    std::vector<unsigned> gc(ly.size());
    for (size_t i = 0; i < ly.size(); i++) gc[i] = (unsigned)q8_log_code(ly[i]);
    check_bytes("q8_log_code vs log_code", gc.data(), lc.data(), lc.size() * 4);

    // The literal constants the kernels hold as bits.
    auto c = load<unsigned>("consts");
    unsigned mine[] = {0x3fb8aa3bu, 0x3f318000u, 0xb95e8083u, 0x4b400000u, 0xc2ae999au, 0x42b00000u,
                       0x39506968u, 0x3ab743ceu, 0x3c088908u, 0x3d2aa9c1u, 0x3e2aaaaau,
                       __float_as_uint(1e-30f)};
    check_bytes("exp constants", mine, c.data(), sizeof mine);
    auto th = load<unsigned>("thresh"), oc = load<unsigned>("octave");
    unsigned oct[8];
    for (int r = 0; r < 8; r++) oct[r] = __float_as_uint(q8_octave(r));
    check_bytes("octave", oct, oc.data(), 32);
    unsigned ths[] = {0x3f85aac3u, 0x3f91c3d3u, 0x3f9ef532u, 0x3fad583fu,
                      0x3fbd08a4u, 0x3fce248cu, 0x3fe0ccdfu, 0x3ff5257du};
    check_bytes("thresholds", ths, th.data(), 32);
    printf("helpers done\n");
}

// ---------------------------------------------------------------- xent

static void test_xent() {
    const unsigned cases = load<unsigned>("xent_cases")[0];
    for (unsigned ci = 0; ci < cases; ci++) {
        std::string p = "xent" + std::to_string(ci);
        auto shape = load<unsigned>(p + "_shape");
        const int n = shape[0], v = shape[1];
        const float scale = load<float>(p + "_scale")[0];
        auto logits = load<float>(p + "_logits");
        auto tg = load<unsigned>(p + "_targets");
        auto grad = load<float>(p + "_grad"), loss = load<float>(p + "_loss"),
             loss_fwd = load<float>(p + "_loss_fwd");
        struct Cfg {
            unsigned grid, block;
            bool naive;
        };
        Cfg cfgs[] = {{(unsigned)n, 1024, false},
                      {(unsigned)std::max(1, n / 2), 64, false},
                      {1, 32, false},
                      {(unsigned)((n + 63) / 64), 64, true}};
        // Rows `ld` floats apart: unpadded, and padded by 3 (the pad must stay untouched).
        for (int pad : {0, 3})
            for (const Cfg& c : cfgs)
                for (int g = 1; g >= 0; g--) {
                    const int ld = v + pad;
                    const float sentinel = 12345.0f;
                    std::vector<float> lg((size_t)n * ld, sentinel), ls(n, -7.0f);
                    for (int r = 0; r < n; r++)
                        for (int j = 0; j < v; j++) lg[(size_t)r * ld + j] = logits[(size_t)r * v + j];
                    if (c.naive)
                        K2_LAUNCH(xent_fused_naive, c.grid, c.block, lg.data(), tg.data(),
                                  ls.data(), n, v, ld, scale, g);
                    else
                        K2_LAUNCH(xent_fused, c.grid, c.block, lg.data(), tg.data(), ls.data(), n,
                                  v, ld, scale, g);
                    char what[160];
                    snprintf(what, sizeof what, "%s %dx%d ld %d grid %u block %u%s grad=%d",
                             p.c_str(), n, v, ld, c.grid, c.block, c.naive ? " naive" : "", g);
                    std::string w(what);
                    check_f32((w + " loss").c_str(), ls.data(), g ? loss.data() : loss_fwd.data(),
                              n);
                    std::vector<float> rows((size_t)n * v);
                    bool pad_kept = true;
                    for (int r = 0; r < n; r++) {
                        for (int j = 0; j < v; j++) rows[(size_t)r * v + j] = lg[(size_t)r * ld + j];
                        for (int j = v; j < ld; j++)
                            pad_kept = pad_kept && lg[(size_t)r * ld + j] == sentinel;
                    }
                    check_f32((w + " logits").c_str(), rows.data(),
                              g ? grad.data() : logits.data(), rows.size());
                    if (!pad_kept) {
                        failures++;
                        printf("FAIL %s: a column past V was written\n", what);
                    }
                }
    }
    printf("xent done\n");
}

// ---------------------------------------------------------------- optimizer

#define K9(k) k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7], k[8]
#define ADAM_K float, float, float, float, float, float, float, float, float

template <typename T>
struct AdamKernels {
    void (*m32)(float*, const T*, float*, float*, long long, ADAM_K);
    void (*mbf16)(float*, const T*, bf16*, bf16*, long long, ADAM_K);
    void (*m8)(float*, const T*, signed char*, float*, unsigned char*, float*, long long, ADAM_K);
    void (*m8_naive)(float*, const T*, signed char*, float*, unsigned char*, float*, long long,
                     ADAM_K);
};

template <typename T>
static void test_adam_t(int t, AdamKernels<T> kk) {
    const long long len = load<unsigned>("adam_len")[0];
    const std::string pre = "adam" + std::to_string(t);
    auto g = load<T>(pre + "_g");
    auto k = load<float>(pre + "_k");
    auto p0 = load<float>(pre + "_p0"), m0 = load<float>(pre + "_m0"), v0 = load<float>(pre + "_v0");
    {
        auto p = p0, m = m0, v = v0;
        const T* gp = g.data();
        K2_LAUNCH(kk.m32, 3, 256, p.data(), gp, m.data(), v.data(), len, K9(k));
        check_f32((pre + " m32 p").c_str(), p.data(), load<float>(pre + "_p32").data(), len);
        check_f32((pre + " m32 m").c_str(), m.data(), load<float>(pre + "_m32").data(), len);
        check_f32((pre + " m32 v").c_str(), v.data(), load<float>(pre + "_v32").data(), len);
    }
    {
        auto p = p0;
        auto m = load<bf16>(pre + "_mb0"), v = load<bf16>(pre + "_vb0");
        const T* gp = g.data();
        K2_LAUNCH(kk.mbf16, 2, 128, p.data(), gp, m.data(), v.data(), len, K9(k));
        check_f32((pre + " mbf16 p").c_str(), p.data(), load<float>(pre + "_pb").data(), len);
        check_bytes((pre + " mbf16 m").c_str(), m.data(), load<bf16>(pre + "_mb").data(), 2 * len);
        check_bytes((pre + " mbf16 v").c_str(), v.data(), load<bf16>(pre + "_vb").data(), 2 * len);
    }
    // 8-bit: 4 steps from a fresh state, the fast kernel (several launch shapes) and the twin.
    const long long blocks = (len + QBLOCK - 1) / QBLOCK;
    for (int variant = 0; variant < 4; variant++) {
        auto p = p0;
        std::vector<signed char> mq(len, 0);
        std::vector<unsigned char> vq(len, 0);
        std::vector<float> ms(blocks, 0.0f), vs(blocks, 0.0f);
        for (int step = 1; step <= 4; step++) {
            const std::string sp = pre + "_q" + std::to_string(step);
            auto gs = load<T>(sp + "_g");
            auto ks = load<float>(sp + "_k");
            const T* gp = gs.data();
            const unsigned grid = variant == 0 ? blocks : variant == 2 ? 2 : 1;
            const unsigned block = variant == 0 ? 256 : variant == 1 ? 1024 : variant == 2 ? 32 : 64;
            if (variant == 3)
                K2_LAUNCH(kk.m8_naive, grid, block, p.data(), gp, mq.data(), ms.data(), vq.data(),
                          vs.data(), len, K9(ks));
            else
                K2_LAUNCH(kk.m8, grid, block, p.data(), gp, mq.data(), ms.data(), vq.data(),
                          vs.data(), len, K9(ks));
            std::string w = sp + " variant " + std::to_string(variant);
            check_f32((w + " p").c_str(), p.data(), load<float>(sp + "_p").data(), len);
            check_bytes((w + " mq").c_str(), mq.data(), load<unsigned char>(sp + "_mq").data(), len);
            check_bytes((w + " vq").c_str(), vq.data(), load<unsigned char>(sp + "_vq").data(), len);
            // Scales bitwise, NaN bits included.
            check_bytes((w + " ms").c_str(), ms.data(), load<float>(sp + "_ms").data(), 4 * blocks);
            check_bytes((w + " vs").c_str(), vs.data(), load<float>(sp + "_vs").data(), 4 * blocks);
        }
    }
}

template <typename T>
static void test_gradnorm_t(void (*partials)(const T*, long long, double*),
                            void (*naive)(const T*, long long, double*, int), const char* name) {
    for (long long len : {1LL, 1000LL, 16384LL, 3 * 16384LL + 5}) {
        std::vector<T> g(len);
        double want = 0.0;
        uint64_t s = 12345 + len;
        for (long long i = 0; i < len; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            float x = ((float)(s >> 40) / 16777216.0f - 0.5f) * 3.0f;
            g[i] = from_f32<T>(x);
            double d = (double)to_f32(g[i]);
            want += d * d;
        }
        const long long np = (len + GN_CHUNK - 1) / GN_CHUNK;
        double res[3][4];
        for (int c = 0; c < 3; c++) {
            std::vector<double> part(np, -1.0), out(4, -1.0);
            unsigned grid = c == 0 ? np : c == 1 ? 1 : 2;
            K2_LAUNCH(partials, grid, 256, g.data(), len, part.data());
            K2_LAUNCH(gradnorm_finish, 1, 256, part.data(), np, out.data(), 2);
            memcpy(res[c], out.data(), sizeof res[c]);
        }
        std::vector<double> out(4, -1.0);
        K2_LAUNCH(naive, 1, 1, g.data(), len, out.data(), 1);
        bool ok = memcmp(res[0], res[1], 32) == 0 && memcmp(res[0], res[2], 32) == 0 &&
                  res[0][0] == -1.0 && res[0][1] == -1.0 && res[0][3] == -1.0 &&
                  std::fabs(res[0][2] - want) <= 1e-12 * want &&
                  std::fabs(out[1] - want) <= 1e-12 * want;
        if (!ok) {
            failures++;
            printf("FAIL gradnorm %s len %lld: %.17g %.17g %.17g naive %.17g want %.17g\n", name,
                   len, res[0][2], res[1][2], res[2][2], out[1], want);
        }
    }
    // len 0: only the finish, which writes 0.
    std::vector<double> out(1, -1.0);
    const double* none = nullptr;
    K2_LAUNCH(gradnorm_finish, 1, 256, none, 0LL, out.data(), 0);
    if (out[0] != 0.0) {
        failures++;
        printf("FAIL gradnorm_finish with no partials: %g\n", out[0]);
    }
}

static void test_optimizer() {
    test_adam_t<float>(0, {adamw_m32_f32, adamw_mbf16_f32, adamw_m8_f32, adamw_m8_naive_f32});
    test_adam_t<bf16>(1, {adamw_m32_bf16, adamw_mbf16_bf16, adamw_m8_bf16, adamw_m8_naive_bf16});
    test_adam_t<f16>(2, {adamw_m32_f16, adamw_mbf16_f16, adamw_m8_f16, adamw_m8_naive_f16});
    test_gradnorm_t<float>(gradnorm_partials_f32, gradnorm_naive_f32, "f32");
    test_gradnorm_t<bf16>(gradnorm_partials_bf16, gradnorm_naive_bf16, "bf16");
    test_gradnorm_t<f16>(gradnorm_partials_f16, gradnorm_naive_f16, "f16");
    printf("optimizer done\n");
}

// ---------------------------------------------------------------- lora

template <typename T>
static void test_lora_t(int t, void (*dropout)(const T*, float*, long long, unsigned long long,
                                               unsigned long long, float, unsigned long long),
                        void (*add_masked)(T*, const float*, long long, unsigned long long,
                                           unsigned long long, float, unsigned long long),
                        void (*scale_k)(T*, long long, float),
                        void (*narrow)(const float*, T*, long long, float),
                        void (*add_cols)(T*, int, const float*, int, int, int),
                        void (*widen)(const T*, float*, long long)) {
    auto shape = load<unsigned>("lora_shape");
    const long long n = (long long)shape[0] * shape[1];
    auto dp = load<unsigned long long>("lora_dparams");
    const float ks = load<float>("lora_dscale")[0];
    const std::string p = "lora" + std::to_string(t);
    auto x = load<T>(p + "_x");
    auto tt = load<float>(p + "_t");
    const float s = load<float>(p + "_s")[0];
    std::vector<float> xd(n, -1.0f);
    K2_LAUNCH(dropout, 2, 64, x.data(), xd.data(), n, dp[0], dp[1], ks, dp[2]);
    check_f32((p + " dropout").c_str(), xd.data(), load<float>(p + "_xd").data(), n);
    auto dx = load<T>(p + "_dx0");
    K2_LAUNCH(add_masked, 3, 32, dx.data(), tt.data(), n, dp[0], dp[1], ks, dp[2]);
    check_bytes((p + " add_masked").c_str(), dx.data(), load<T>(p + "_dx1").data(), n * sizeof(T));
    auto h = x;
    K2_LAUNCH(scale_k, 1, 256, h.data(), n, s);
    check_bytes((p + " scale").c_str(), h.data(), load<T>(p + "_hsc").data(), n * sizeof(T));
    std::vector<T> hn(n);
    K2_LAUNCH(narrow, 4, 64, tt.data(), hn.data(), n, s);
    check_bytes((p + " narrow_scale").c_str(), hn.data(), load<T>(p + "_nsc").data(), n * sizeof(T));
    // add_cols: src [rows, ld_src] into columns col.. of dst [rows, ld_dst].
    const int rows = 5, cols = 7, ld_dst = 13, col = 4, ld_src = 9;
    std::vector<T> dst(rows * ld_dst), want(rows * ld_dst);
    std::vector<float> src(rows * ld_src);
    for (int i = 0; i < rows * ld_dst; i++) dst[i] = want[i] = from_f32<T>(0.37f * i - 3.0f);
    for (int i = 0; i < rows * ld_src; i++) src[i] = 0.011f * i * i - 1.3f;
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++)
            want[i * ld_dst + col + j] =
                from_f32<T>(to_f32(want[i * ld_dst + col + j]) + src[i * ld_src + j]);
    K2_LAUNCH(add_cols, 1, 32, dst.data() + col, ld_dst, src.data(), ld_src, rows, cols);
    check_bytes((p + " add_cols").c_str(), dst.data(), want.data(), dst.size() * sizeof(T));
    std::vector<float> wd(n), ww(n);
    for (long long i = 0; i < n; i++) ww[i] = to_f32(x[i]);
    K2_LAUNCH(widen, 2, 32, x.data(), wd.data(), n);
    check_f32((p + " widen").c_str(), wd.data(), ww.data(), n);
}

static void test_lora() {
    test_lora_t<float>(0, lora_dropout_f32, lora_add_masked_f32, lora_scale_f32,
                       lora_narrow_scale_f32, lora_add_cols_f32, lora_widen_f32);
    test_lora_t<bf16>(1, lora_dropout_bf16, lora_add_masked_bf16, lora_scale_bf16,
                      lora_narrow_scale_bf16, lora_add_cols_bf16, lora_widen_bf16);
    test_lora_t<f16>(2, lora_dropout_f16, lora_add_masked_f16, lora_scale_f16,
                     lora_narrow_scale_f16, lora_add_cols_f16, lora_widen_f16);
    printf("lora done\n");
}

// ---------------------------------------------------------------- dequant

typedef void (*DqF32)(const unsigned char*, int, int, int, int, int, float*);
typedef void (*DqBf16)(const unsigned char*, int, int, int, int, int, bf16*);
typedef void (*GaF32)(const unsigned char*, int, const unsigned int*, int, int, float, float*);

static void test_dequant() {
    struct {
        const char* name;
        DqF32 f;
        DqBf16 b;
        GaF32 g;
    } types[] = {
        {"q8_0", dequant_q8_0_f32, dequant_q8_0_bf16, dequant_gather_q8_0_f32},
        {"q4_0", dequant_q4_0_f32, dequant_q4_0_bf16, dequant_gather_q4_0_f32},
        {"q4_1", dequant_q4_1_f32, dequant_q4_1_bf16, dequant_gather_q4_1_f32},
        {"q5_0", dequant_q5_0_f32, dequant_q5_0_bf16, dequant_gather_q5_0_f32},
        {"q4_k", dequant_q4_k_f32, dequant_q4_k_bf16, dequant_gather_q4_k_f32},
        {"q6_k", dequant_q6_k_f32, dequant_q6_k_bf16, dequant_gather_q6_k_f32},
        {"f32", dequant_f32_f32, dequant_f32_bf16, dequant_gather_f32_f32},
        {"f16", dequant_f16_f32, dequant_f16_bf16, dequant_gather_f16_f32},
        {"bf16", dequant_bf16_f32, dequant_bf16_bf16, dequant_gather_bf16_f32},
    };
    auto shape = load<unsigned>("dq_shape");
    const int oc = shape[0], ic = shape[1];
    for (auto& ty : types) {
        std::string p = std::string("dq_") + ty.name;
        auto w = load<unsigned char>(p + "_w");
        auto y = load<float>(p + "_y");
        std::vector<float> all(oc * ic, -1.0f);
        K2_LAUNCH(ty.f, 3, 256, w.data(), ic, 0, oc, 0, ic, all.data());
        check_f32((p + " all rows").c_str(), all.data(), y.data(), all.size());
        std::vector<float> part(4 * ic, -1.0f);
        K2_LAUNCH(ty.f, 1, 64, w.data(), ic, 2, 4, 0, ic, part.data());
        check_f32((p + " rows 2..6").c_str(), part.data(), y.data() + 2 * ic, part.size());
        std::vector<bf16> pb(3 * ic), wb(3 * ic);
        for (int i = 0; i < 3 * ic; i++) wb[i] = from_f32<bf16>(y[4 * ic + i]);
        K2_LAUNCH(ty.b, 2, 128, w.data(), ic, 4, 3, 0, ic, pb.data());
        check_bytes((p + " bf16 rows 4..7").c_str(), pb.data(), wb.data(), pb.size() * 2);
        // A column chunk (the backward's input features): columns [256, ic) of rows 1..6, a
        // whole number of blocks of every type (ic is 512).
        const int c0 = 256, width = ic - 256;
        std::vector<float> cols(5 * width, -1.0f), want(5 * width);
        for (int i = 0; i < 5; i++)
            for (int j = 0; j < width; j++) want[i * width + j] = y[(1 + i) * ic + c0 + j];
        K2_LAUNCH(ty.f, 2, 64, w.data(), ic, 1, 5, c0, width, cols.data());
        check_f32((p + " rows 1..6, columns 256..").c_str(), cols.data(), want.data(),
                  cols.size());
        std::vector<bf16> cb(5 * width), cw(5 * width);
        for (int i = 0; i < 5 * width; i++) cw[i] = from_f32<bf16>(want[i]);
        K2_LAUNCH(ty.b, 3, 32, w.data(), ic, 1, 5, c0, width, cb.data());
        check_bytes((p + " bf16 rows 1..6, columns 256..").c_str(), cb.data(), cw.data(),
                    cb.size() * 2);
        // The gather: rows 6, 0, 3, 0, then an id past the 7 rows (a NaN row).
        const unsigned int ids[5] = {6, 0, 3, 0, 7};
        std::vector<float> gat(5 * ic, -1.0f), gw(4 * ic);
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < ic; j++) gw[i * ic + j] = y[ids[i] * ic + j];
        K2_LAUNCH(ty.g, 2, 128, w.data(), ic, ids, 5, oc, 1.0f, gat.data());
        check_f32((p + " gather rows 6, 0, 3, 0").c_str(), gat.data(), gw.data(), 4 * ic);
        // Scaled (Gemma's √C: the CPU's `T::from_f32(x * scale)`, here f32): each decoded
        // value times the scale, rounded once.
        const float scale = sqrtf(640.0f);
        std::vector<float> gs(5 * ic, -1.0f), gsw(4 * ic);
        for (int i = 0; i < 4 * ic; i++) gsw[i] = gw[i] * scale;
        K2_LAUNCH(ty.g, 3, 64, w.data(), ic, ids, 5, oc, scale, gs.data());
        check_f32((p + " gather rows 6, 0, 3, 0 scaled").c_str(), gs.data(), gsw.data(), 4 * ic);
        int nan = 0;
        for (int j = 0; j < ic; j++) nan += gat[4 * ic + j] != gat[4 * ic + j];
        if (nan != ic) {
            printf("FAIL %s gather: id 7 of 7 rows gave %d NaN of %d\n", p.c_str(), nan, ic);
            failures++;
        }
    }
    printf("dequant done\n");
}

int main() {
    const char* dir = getenv("K2_REF");
    if (!dir) {
        fprintf(stderr, "k2_check: set K2_REF to k2_ref's output directory\n");
        return 2;
    }
    DIR = dir;
    test_helpers();
    test_dequant();
    test_lora();
    test_optimizer();
    test_xent();
    printf(failures ? "k2 tests: %d FAILED\n" : "k2 tests: all passed\n", failures);
    return failures ? 1 : 0;
}
