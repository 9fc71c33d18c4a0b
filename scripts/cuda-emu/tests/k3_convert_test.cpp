// convert.cu: f32_to_storage_<S> (an f32 operand rounded to T for a GEMM: bitwise the prelude's
// from_f32) and col_sum_partials_<S> + norm.cu's norm_reduce_partials_<S> (Op::MatmulBackward's
// bias gradient: db += Σ_rows dout, rows in chunks of R, chunks in order, one rounding), for
// each storage type, shapes not multiples of the block, grids that stride.
//
//     python3 scripts/cuda-emu/run.py scripts/cuda-emu/tests/k3_convert_test.cpp
#include "emu.h"
#include "../../../src/backend/cuda/kernels/convert.cu"
#include "../../../src/backend/cuda/kernels/norm.cu"
#include "k1_util.h"

// The kernel sees elements off .. n − 1 (off = 1: both pointers misaligned, one value at a
// time; off = 0: 16 bytes at a time, and a tail where n is not a multiple of 8).
template <class T>
void convert(long long n, dim3 grid, void (*kern)(const float*, T*, long long), long long off = 0) {
    auto x = k1::randn((size_t)n, 3.0f, 11 + n);
    if (n > 3) {
        x[0] = 0.0f;
        x[1] = -0.0f;
        x[2] = 1e30f;
        x[3] = __uint_as_float(0x7fc00001u);  // a NaN
    }
    std::vector<T> want = k1::stored<T>(x);
    std::vector<T> got(n);
    for (long long i = 0; i < off && i < n; i++) got[i] = want[i] = from_f32<T>(7.0f);
    emu_launch(kern, grid, dim3(64), 0, (const float*)x.data() + off, got.data() + off, n - off);
    char what[96];
    snprintf(what, sizeof what, "f32_to_storage %s n %lld grid %u offset %lld", k1::tname<T>(), n,
             grid.x, off);
    emu::expect_bits(what, got, want);
}

template <class T>
void colsum(int N, int C, int R, dim3 grid,
            void (*partials_k)(float*, const T*, int, int, int),
            void (*reduce_k)(T*, const float*, int, int)) {
    auto x = k1::stored<T>(k1::randn((size_t)N * C, 1.0f, 3 + N * 5 + C));
    auto db0 = k1::stored<T>(k1::randn(C, 1.0f, 7 + C));
    const int P = (N + R - 1) / R;
    // The reference: the same order (rows of a chunk in order; the chunks in 8 strands,
    // strand k summing chunks k, k + 8, ... in order, then the strands in order), in f32.
    std::vector<T> want = db0;
    for (int c = 0; c < C; c++) {
        float strand[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int p = 0; p < P; p++) {
            float s = 0.0f;
            for (int r = p * R; r < N && r < p * R + R; r++) s += to_f32(x[(size_t)r * C + c]);
            strand[p % 8] += s;
        }
        float total = strand[0];
        for (int k = 1; k < 8; k++) total += strand[k];
        want[c] = from_f32<T>(to_f32(want[c]) + total);
    }
    std::vector<float> partials((size_t)P * C);
    emu_launch(partials_k, grid, dim3(32), 0, partials.data(), (const T*)x.data(), N, C, R);
    std::vector<T> got = db0;
    emu_launch(reduce_k, dim3(k1::ceil_div(C, 32)), dim3(32), 0, got.data(),
               (const float*)partials.data(), P, C);
    char what[128];
    snprintf(what, sizeof what, "col_sum_partials %s %dx%d R %d grid %ux%u", k1::tname<T>(), N,
             C, R, grid.x, grid.y);
    emu::expect_bits(what, got, want);
}

template <class T>
void all(void (*conv)(const float*, T*, long long),
         void (*partials_k)(float*, const T*, int, int, int),
         void (*reduce_k)(T*, const float*, int, int)) {
    for (long long n : {1LL, 5LL, 64LL, 333LL}) {
        convert<T>(n, dim3(k1::ceil_div(n, 64)), conv);
        convert<T>(n, dim3(2), conv);  // grid-stride
        convert<T>(n, dim3(2), conv, 1);  // misaligned
    }
    const int shapes[][3] = {{1, 1, 64}, {7, 5, 2}, {65, 33, 64}, {130, 40, 7}, {200, 9, 3}};
    for (auto& s : shapes) {
        int P = (s[0] + s[2] - 1) / s[2];
        colsum<T>(s[0], s[1], s[2], dim3(k1::ceil_div(s[1], 32), P), partials_k, reduce_k);
        colsum<T>(s[0], s[1], s[2], dim3(1, 2), partials_k, reduce_k);  // grid-stride
    }
}

int main() {
    all<float>(f32_to_storage_f32, col_sum_partials_f32, norm_reduce_partials_f32);
    all<bf16>(f32_to_storage_bf16, col_sum_partials_bf16, norm_reduce_partials_bf16);
    all<f16>(f32_to_storage_f16, col_sum_partials_f16, norm_reduce_partials_f16);
    return emu::finish();
}
