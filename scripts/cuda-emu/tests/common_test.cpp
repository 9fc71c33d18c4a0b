// The prelude common.cuh under the emulator: its storage conversions bitwise against reference
// conversions written here another way (exact arithmetic in double), and its warp and block
// reductions against plain loops, blockDim 32..1024.
//
//     python3 scripts/cuda-emu/run.py scripts/cuda-emu/tests/common_test.cpp
//
// EMU_FULL=1 in the environment also checks every one of the 2^32 floats (a few minutes).
#include "emu.h"
#include "src/backend/cuda/kernels/common.cuh"

// --- References ----------------------------------------------------------------------------

// Rounds x to a binary format with `p` significand bits (the implicit one included), least
// normal exponent `emin` and largest finite `maxf`, to nearest even, by exact arithmetic in
// double (x / ulp is an integer plus a fraction that double holds exactly).
static double round_format(double x, int p, int emin, double maxf) {
    if (x == 0 || std::isinf(x)) return x;
    int e = std::max(std::ilogb(x), emin);
    double ulp = std::ldexp(1.0, e - (p - 1));
    double r = std::nearbyint(x / ulp) * ulp;  // the default rounding mode: ties to even
    if (std::fabs(r) > maxf) return std::copysign(INFINITY, x);
    return r;
}

static unsigned short ref_f16_from_f32(float x) {
    if (std::isnan(x)) return 0x7FFF;  // cvt.rn.f16.f32: the canonical NaN
    double r = round_format(x, 11, -14, 65504.0);
    unsigned short sign = std::signbit(x) ? 0x8000 : 0;
    double a = std::fabs(r);
    if (std::isinf(a)) return sign | 0x7C00;
    if (a == 0) return sign;
    int e = std::ilogb(a);
    if (e < -14) return sign | (unsigned short)(a / 0x1p-24);  // subnormal: mantissa · 2^-24
    unsigned m = (unsigned)(a / std::ldexp(1.0, e - 10)) - 1024;
    return sign | (unsigned short)(((e + 15) << 10) | m);
}

static float ref_f32_from_f16(unsigned short h) {
    int e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 31) {
        if (m) return __uint_as_float(0x7FFFFFFFu);  // cvt.f32.f16: the canonical NaN
        v = INFINITY;
    } else if (e == 0) {
        v = std::ldexp((double)m, -24);
    } else {
        v = std::ldexp(1024.0 + m, e - 25);
    }
    return (float)((h & 0x8000) ? -v : v);
}

static unsigned short ref_bf16_from_f32(float x) {
    uint32_t b = __float_as_uint(x);
    if (std::isnan(x)) return (unsigned short)((b | 0x00400000u) >> 16);  // quiet, truncated
    double r = round_format(x, 8, -126, 0x1.FEp127);
    if (std::isinf(r)) return (unsigned short)((b & 0x80000000u) >> 16 | 0x7F80);
    uint32_t rb = __float_as_uint((float)r);  // exact: r has 8 significant bits
    if (r == 0) rb = b & 0x80000000u;         // keep the sign of zero
    return (unsigned short)(rb >> 16);
}

static float ref_f32_from_bf16(unsigned short h) { return __uint_as_float((uint32_t)h << 16); }

// --- Conversion checks ---------------------------------------------------------------------

static void check_f16_to_f32() {
    std::vector<uint32_t> got(65536), want(65536);
    for (uint32_t h = 0; h < 65536; h++) {
        f16 v;
        v.bits = (unsigned short)h;
        got[h] = __float_as_uint(to_f32(v));
        want[h] = __float_as_uint(ref_f32_from_f16((unsigned short)h));
    }
    emu::expect_bits("to_f32(f16), every f16", got, want);
    std::vector<uint32_t> gb(65536), wb(65536);
    for (uint32_t h = 0; h < 65536; h++) {
        bf16 v;
        v.bits = (unsigned short)h;
        gb[h] = __float_as_uint(to_f32(v));
        wb[h] = __float_as_uint(ref_f32_from_bf16((unsigned short)h));
    }
    emu::expect_bits("to_f32(bf16), every bf16", gb, wb);
}

// The floats where rounding to a format with `drop` fewer significand bits than f32 changes:
// for every pattern of the high bits, low parts 0, 1, half - 1, half, half + 1, all ones, and a
// pseudo-random one; plus the midpoints between consecutive values of the smaller format
// (subnormals included) and their neighbours; plus the specials.
static std::vector<float> sweep(int drop, bool f16) {
    std::vector<uint32_t> bits;
    uint32_t low_mask = (1u << drop) - 1, half = 1u << (drop - 1);
    uint32_t seed = 12345;
    for (uint32_t hi = 0; hi < (1u << (32 - drop)); hi++) {
        seed = seed * 1664525u + 1013904223u;
        for (uint32_t lo : {0u, 1u, half - 1, half, half + 1, low_mask, seed & low_mask})
            bits.push_back((hi << drop) | lo);
    }
    if (f16) {
        // Between consecutive f16 values (as floats): the midpoint, one f32 ulp either side.
        for (uint32_t h = 0; h < 0x7C00; h++) {
            double a = ref_f32_from_f16((unsigned short)h), b = ref_f32_from_f16((unsigned short)(h + 1));
            if (h == 0x7BFF) b = 65536.0;  // the overflow threshold is the midpoint to 2^16
            float mid = (float)((a + b) / 2);  // exact: 12 significant bits
            for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY),
                            (float)a}) {
                bits.push_back(__float_as_uint(v));
                bits.push_back(__float_as_uint(v) | 0x80000000u);
            }
        }
        for (float v : {0x1p-25f, 0x1.000002p-25f, 0x1.fffffep-26f, 0x1p-24f, 0x1.8p-24f,
                        0x1p-14f, 0x1.ffcp-15f, 65504.0f, 65519.99f, 65520.0f, 1e10f})
            bits.push_back(__float_as_uint(v));
    }
    for (uint32_t v : {0u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00000u,
                       0x7F800001u, 0xFF800001u, 0x7FBFFFFFu, 0x7FFFFFFFu, 0xFFFFFFFFu,
                       0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F7F8000u, 0x7F7F7FFFu, 0x00000001u,
                       0x00008000u, 0x00018000u, 0x007FFFFFu, 0x00800000u})
        bits.push_back(v);
    std::vector<float> out(bits.size());
    for (size_t i = 0; i < bits.size(); i++) out[i] = __uint_as_float(bits[i]);
    return out;
}

template <class T>
static unsigned short bits_of(T v) {
    return v.bits;
}

static void check_from_f32(const std::vector<float>& xs, const char* what_f16,
                           const char* what_bf16) {
    std::vector<unsigned short> g16(xs.size()), w16(xs.size()), gb(xs.size()), wb(xs.size());
    for (size_t i = 0; i < xs.size(); i++) {
        g16[i] = bits_of(from_f32<f16>(xs[i]));
        w16[i] = ref_f16_from_f32(xs[i]);
        gb[i] = bits_of(from_f32<bf16>(xs[i]));
        wb[i] = ref_bf16_from_f32(xs[i]);
    }
    emu::expect_bits(what_f16, g16, w16);
    emu::expect_bits(what_bf16, gb, wb);
}

static void check_conversions() {
    check_f16_to_f32();
    check_from_f32(sweep(13, true), "from_f32<f16>, f16 sweep", "from_f32<bf16>, f16 sweep");
    check_from_f32(sweep(16, false), "from_f32<f16>, bf16 sweep", "from_f32<bf16>, bf16 sweep");
    // Named cases, so that a failure reads plainly.
    struct Case {
        float x;
        unsigned short f16, bf16;
    } cases[] = {
        {1.0f, 0x3C00, 0x3F80},
        {-2.0f, 0xC000, 0xC000},
        {65504.0f, 0x7BFF, 0x4780},          // the f16 max; 65536 in bf16
        {65520.0f, 0x7C00, 0x4780},          // f16 overflow: the tie rounds to infinity
        {0x1p-24f, 0x0001, 0x3380},          // the least f16 subnormal
        {0x1p-25f, 0x0000, 0x3300},          // a tie to zero
        {0x1.7FFFFEp0f, 0x3E00, 0x3FC0},     // 1.4999999: rounds up to 1.5 in both
        {3.4028235e38f, 0x7C00, 0x7F80},     // f32 max: infinity in both
        {-INFINITY, 0xFC00, 0xFF80},
        {__uint_as_float(0x7F800001u), 0x7FFF, 0x7FC0},  // signalling NaN: made quiet
        {__uint_as_float(0xFFC12345u), 0x7FFF, 0xFFC1},  // negative NaN, payload kept in bf16
    };
    for (auto& c : cases) {
        EMU_CHECK(bits_of(from_f32<f16>(c.x)) == c.f16, "from_f32<f16>(%a) = 0x%04x, want 0x%04x",
                  c.x, bits_of(from_f32<f16>(c.x)), c.f16);
        EMU_CHECK(bits_of(from_f32<bf16>(c.x)) == c.bf16,
                  "from_f32<bf16>(%a) = 0x%04x, want 0x%04x", c.x, bits_of(from_f32<bf16>(c.x)),
                  c.bf16);
    }
    // f32 is the identity.
    float z = -0.0f;
    EMU_CHECK(__float_as_uint(to_f32(from_f32<float>(z))) == 0x80000000u, "f32 identity");
    // Round trips: f16 -> f32 -> f16 and bf16 -> f32 -> bf16 keep every non-NaN value.
    size_t bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        f16 a;
        a.bits = (unsigned short)h;
        bf16 b;
        b.bits = (unsigned short)h;
        bool nan16 = ((h >> 10) & 31) == 31 && (h & 1023);
        bool nanb = ((h >> 7) & 255) == 255 && (h & 127);
        if (!nan16 && bits_of(from_f32<f16>(to_f32(a))) != h) bad++;
        if (!nanb && bits_of(from_f32<bf16>(to_f32(b))) != h) bad++;
    }
    EMU_CHECK(bad == 0, "%zu f16/bf16 values do not survive a round trip through f32", bad);

    if (getenv("EMU_FULL")) {
        size_t bad16 = 0, badb = 0;
        for (uint64_t u = 0; u < (1ull << 32); u++) {
            float x = __uint_as_float((uint32_t)u);
            bad16 += bits_of(from_f32<f16>(x)) != ref_f16_from_f32(x);
            badb += bits_of(from_f32<bf16>(x)) != ref_bf16_from_f32(x);
        }
        EMU_CHECK(bad16 == 0 && badb == 0, "every float: %zu f16 and %zu bf16 differ", bad16,
                  badb);
        printf("every float checked\n");
    }
}

// --- Reductions ----------------------------------------------------------------------------

__global__ void reductions(const float* x, float* bsum, float* bmax, float* wsum, float* wmax,
                           double* wsumd) {
    __shared__ float scratch[32];
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    bsum[i] = block_sum(v, scratch);
    bmax[i] = block_max(v, scratch);
    wsum[i] = warp_sum(v);
    wmax[i] = warp_max(v);
    wsumd[i] = warp_sum((double)v);
}

// The xor butterfly over 32 lanes, as warp_sum does it (lane l adds lane l ^ o).
template <class T>
static T butterfly(const T* v, bool max_) {
    T a[32], b[32];
    std::copy(v, v + 32, a);
    for (int o = 16; o > 0; o >>= 1) {
        for (int l = 0; l < 32; l++) b[l] = max_ ? fmaxf(a[l], a[l ^ o]) : a[l] + a[l ^ o];
        std::copy(b, b + 32, a);
    }
    for (int l = 1; l < 32; l++)
        if (memcmp(&a[l], &a[0], sizeof(T))) return (T)NAN;  // every lane must agree
    return a[0];
}

static void check_reductions(bool integers) {
    std::mt19937 rng(integers ? 7 : 8);
    for (unsigned threads = 32; threads <= 1024; threads += 32) {
        const unsigned blocks = 3, n = threads * blocks;
        std::vector<float> x(n), bsum(n), bmax(n), wsum(n), wmax(n);
        std::vector<double> wsumd(n);
        double abs_sum = 0;  // the largest sum of |x| of a block: the scale of rounding errors
        for (auto& v : x) {
            v = integers ? (float)((int)(rng() % 201) - 100)
                         : std::uniform_real_distribution<float>(-1, 1)(rng) *
                               std::ldexp(1.0f, (int)(rng() % 20) - 10);
        }
        emu_launch(reductions, dim3(blocks), dim3(threads), 0, x.data(), bsum.data(),
                   bmax.data(), wsum.data(), wmax.data(), wsumd.data());
        std::vector<float> rs(n), rm(n), rws(n), rwm(n), plain(n);
        std::vector<double> rwd(n);
        for (unsigned b = 0; b < blocks; b++) {
            const float* xb = &x[b * threads];
            unsigned warps = threads / 32;
            float ws[32] = {}, wm[32];
            double loop = 0;
            float mx = -INFINITY;
            for (unsigned w = 0; w < warps; w++) {
                ws[w] = butterfly(xb + 32 * w, false);
                wm[w] = butterfly(xb + 32 * w, true);
                double d[32];
                for (int l = 0; l < 32; l++) d[l] = xb[32 * w + l];
                double wd = butterfly(d, false);
                for (int l = 0; l < 32; l++) {
                    rws[b * threads + 32 * w + l] = ws[w];
                    rwm[b * threads + 32 * w + l] = wm[w];
                    rwd[b * threads + 32 * w + l] = wd;
                }
            }
            for (unsigned w = warps; w < 32; w++) wm[w] = -INFINITY;
            float s = butterfly(ws, false), m = butterfly(wm, true);
            double a = 0;
            for (unsigned t = 0; t < threads; t++) a += fabs(xb[t]);
            abs_sum = std::max(abs_sum, a);
            for (unsigned t = 0; t < threads; t++) {
                loop += xb[t];
                mx = std::max(mx, xb[t]);
            }
            for (unsigned t = 0; t < threads; t++) {
                rs[b * threads + t] = s;
                rm[b * threads + t] = m;
                plain[b * threads + t] = (float)loop;
            }
            EMU_CHECK(m == mx, "block_max, blockDim %u: butterfly %g, plain loop %g", threads, m,
                      mx);
        }
        char what[64];
        snprintf(what, sizeof what, "block_sum, blockDim %u", threads);
        emu::expect_bits(what, bsum, rs);  // bitwise: the butterfly order, replayed
        // Against a plain loop in double: equal for integers, else within rounding.
        emu::expect_near(what, bsum, plain, integers ? 0 : 2e-6 * abs_sum, 0);
        snprintf(what, sizeof what, "block_max, blockDim %u", threads);
        emu::expect_bits(what, bmax, rm);
        snprintf(what, sizeof what, "warp_sum, blockDim %u", threads);
        emu::expect_bits(what, wsum, rws);
        snprintf(what, sizeof what, "warp_max, blockDim %u", threads);
        emu::expect_bits(what, wmax, rwm);
        snprintf(what, sizeof what, "warp_sum(double), blockDim %u", threads);
        emu::expect_bits(what, wsumd, rwd);
    }
}

int main() {
    check_conversions();
    check_reductions(true);
    check_reductions(false);
    return emu::finish();
}
