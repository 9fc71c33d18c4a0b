// rope_<S> (rope.cu, Op::Rope): against a port of the CPU's rotate_rows (angle the f32
// product pos·inv_freq, cos/sin in f64 rounded to f32, the rotation in f32 without FMA),
// bitwise (the emulator's cos/sin are the host's libm, as the CPU's); against the f64
// rotation within 2e-6; values past `rotated` untouched; the inverse undoes the forward; with
// packed positions and pos0; with a scale (LongRoPE's) multiplying cos and sin; for each
// storage type and launch shapes that grid-stride.
//
//     python3 scripts/cuda-emu/run.py scripts/cuda-emu/tests/k1_rope_test.cpp
#include "emu.h"
#include "../../../src/backend/cuda/kernels/rope.cu"
#include "k1_util.h"

template <class T>
using RopeK = void (*)(T*, const unsigned int*, const float*, float, int, int, int, int, int, int,
                       int);

template <class T>
void run(int B, int Tq, int nh, int nkv, int hd, bool packed, int pos0, RopeK<T> kern,
         dim3 grid, dim3 block, float scale = 1.0f) {
    int N = B * Tq, width = (nh + 2 * nkv) * hd, rotated = (nh + nkv) * hd, half = hd / 2;
    std::vector<float> inv_freq(half);
    for (int i = 0; i < half; i++) inv_freq[i] = powf(10000.0f, -2.0f * i / hd);
    std::vector<unsigned int> positions(N);
    for (int r = 0; r < N; r++) positions[r] = packed ? (unsigned)((r * 7 + 3) % Tq) : 0u;
    const unsigned int* pos = packed ? positions.data() : nullptr;
    auto x0 = k1::stored<T>(k1::randn((size_t)N * width, 1.0f, 40 + N + hd));
    for (int inverse = 0; inverse < 2; inverse++) {
        std::vector<T> got = x0, want = x0;
        std::vector<float> got64, want64;
        emu_launch(kern, grid, block, 0, got.data(), pos, (const float*)inv_freq.data(), scale,
                   N, Tq, width, rotated, hd, pos0, inverse);
        for (int r = 0; r < N; r++) {
            long long within = packed ? positions[r] : r % Tq;
            float p = (float)(pos0 + within);
            for (int i = 0; i < half; i++) {
                double angle = (double)(p * inv_freq[i]);
                float c = (float)cos(angle) * scale, s = (float)sin(angle) * scale;
                if (inverse) s = -s;
                double s64 = (inverse ? -sin(angle) : sin(angle)) * scale;
                double c64 = cos(angle) * scale;
                for (int h = 0; h < rotated / hd; h++) {
                    size_t a = (size_t)r * width + h * hd + i, b = a + half;
                    float xa = to_f32(x0[a]), xb = to_f32(x0[b]);
                    want[a] = from_f32<T>(xa * c - xb * s);
                    want[b] = from_f32<T>(xb * c + xa * s);
                    got64.push_back(to_f32(got[a]));
                    want64.push_back((float)(xa * c64 - xb * s64));
                    got64.push_back(to_f32(got[b]));
                    want64.push_back((float)(xb * c64 + xa * s64));
                }
            }
        }
        char w[128];
        snprintf(w, sizeof w, "rope %s B%d T%d nh%d nkv%d hd%d packed %d pos0 %d inverse %d grid %u",
                 k1::tname<T>(), B, Tq, nh, nkv, hd, packed, pos0, inverse, grid.x);
        emu::expect_bits(w, got, want);
        if (sizeof(T) == 4) emu::expect_near(w, got64, want64, 2e-6, 2e-6);
        if (!inverse && scale == 1.0f) {
            // The inverse of the forward gives back the input (f32 only: one rounding each).
            std::vector<T> back = got;
            emu_launch(kern, grid, block, 0, back.data(), pos, (const float*)inv_freq.data(),
                       scale, N, Tq, width, rotated, hd, pos0, 1);
            if (sizeof(T) == 4)
                emu::expect_near("rope inverse(forward)", k1::widened(back), k1::widened(x0),
                                 1e-5, 1e-5);
        }
    }
}

template <class T>
void all(RopeK<T> kern) {
    // (B, T, nh, nkv, hd, packed, pos0)
    run<T>(1, 1, 1, 1, 2, false, 0, kern, dim3(1), dim3(32));
    run<T>(2, 5, 4, 2, 8, false, 0, kern, dim3(k1::ceil_div(10 * 4, 64)), dim3(64));
    run<T>(2, 5, 4, 2, 8, true, 0, kern, dim3(1), dim3(32));  // grid-stride
    run<T>(3, 7, 2, 1, 16, false, 3, kern, dim3(2), dim3(64));
    run<T>(2, 33, 3, 3, 6, true, 1, kern, dim3(k1::ceil_div(66 * 3, 256)), dim3(256));
    run<T>(1, 600, 1, 1, 4, false, 0, kern, dim3(4), dim3(128));  // larger angles
    run<T>(2, 9, 3, 1, 8, true, 2, kern, dim3(3), dim3(32), 1.1902381f);  // LongRoPE's scale
}

int main() {
    all<float>(rope_f32);
    all<bf16>(rope_bf16);
    all<f16>(rope_f16);
    return emu::finish();
}
