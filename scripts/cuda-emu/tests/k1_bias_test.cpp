// add_bias_<S> (bias.cu, Op::AddBias): out = T(f32(out) + b), bitwise the CPU's
// `matmul::add_bias`, for each storage type, shapes not multiples of the block, launch shapes
// that grid-stride.
//
//     python3 scripts/cuda-emu/run.py scripts/cuda-emu/tests/k1_bias_test.cpp
#include "emu.h"
#include "../../../src/backend/cuda/kernels/bias.cu"
#include "k1_util.h"

// `off` = 1: `out` one value past a 16-byte boundary (one value at a time); 0: 16 bytes at a
// time, packs spanning rows where OC is not a multiple of 8.
template <class T>
void run(int N, int OC, dim3 grid, dim3 block, void (*kern)(T*, const float*, int, int),
         size_t off = 0) {
    auto out0 = k1::stored<T>(k1::randn((size_t)N * OC + off, 2.0f, 1 + N * 7 + OC));
    auto b = k1::randn(OC, 1.0f, 2 + OC);
    std::vector<T> want = out0;
    for (int n = 0; n < N; n++)
        for (int j = 0; j < OC; j++) {
            T& o = want[off + (size_t)n * OC + j];
            o = from_f32<T>(to_f32(o) + b[j]);
        }
    std::vector<T> got = out0;
    emu_launch(kern, grid, block, 0, got.data() + off, (const float*)b.data(), N, OC);
    char what[96];
    snprintf(what, sizeof what, "add_bias %s %dx%d grid %u offset %zu", k1::tname<T>(), N, OC,
             grid.x, off);
    emu::expect_bits(what, got, want);
}

template <class T>
void all(void (*kern)(T*, const float*, int, int)) {
    const int shapes[][2] = {{1, 1}, {3, 7}, {5, 33}, {17, 100}, {9, 16}};
    for (auto& s : shapes) {
        run<T>(s[0], s[1], dim3(k1::ceil_div((long long)s[0] * s[1], 64)), dim3(64), kern);
        run<T>(s[0], s[1], dim3(2), dim3(32), kern);  // grid-stride
        run<T>(s[0], s[1], dim3(2), dim3(32), kern, 1);  // misaligned
    }
}

int main() {
    all<float>(add_bias_f32);
    all<bf16>(add_bias_bf16);
    all<f16>(add_bias_f16);
    return emu::finish();
}
