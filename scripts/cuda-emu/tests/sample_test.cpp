// The sample kernels (sample_kernels.cu) against plain C++ references, for each storage type:
// a model for a kernel's test.
//
//     python3 scripts/cuda-emu/run.py scripts/cuda-emu/tests/sample_test.cpp
#include "emu.h"
#include "sample_kernels.cu"  // after the prelude, which run.py inlines first

// Host data of storage type T from floats (the prelude's own conversions run on the host too).
template <class T>
static std::vector<T> store(const std::vector<float>& v) {
    std::vector<T> r(v.size());
    for (size_t i = 0; i < v.size(); i++) r[i] = from_f32<T>(v[i]);
    return r;
}
template <class T>
static std::vector<float> load(const std::vector<T>& v) {
    std::vector<float> r(v.size());
    for (size_t i = 0; i < v.size(); i++) r[i] = to_f32(v[i]);
    return r;
}

template <class T>
static void check_transpose(void (*kernel)(const T*, T*, int, int), const char* name) {
    std::mt19937 rng(1);
    for (auto [rows, cols] : {std::pair{1, 1}, {33, 65}, {64, 32}, {100, 7}, {7, 100}}) {
        std::vector<float> xf(rows * cols);
        for (auto& v : xf) v = std::uniform_real_distribution<float>(-4, 4)(rng);
        std::vector<T> x = store<T>(xf), out(rows * cols), want(rows * cols);
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) want[c * rows + r] = x[r * cols + c];
        dim3 grid((cols + 31) / 32, (rows + 31) / 32);
        emu_launch(kernel, grid, dim3(32, 8), 0, x.data(), out.data(), rows, cols);
        char what[80];
        snprintf(what, sizeof what, "%s %dx%d", name, rows, cols);
        emu::expect_bits(what, out, want);
    }
}

template <class T>
static void check_softmax(void (*kernel)(const T*, T*, int), const char* name, double tol) {
    std::mt19937 rng(2);
    for (int cols : {1, 100, 1000}) {
        for (unsigned threads : {32u, 128u, 256u}) {
            const int rows = 5;
            std::vector<float> xf(rows * cols);
            for (auto& v : xf) v = std::uniform_real_distribution<float>(-8, 8)(rng);
            std::vector<T> x = store<T>(xf), y(rows * cols);
            size_t shared = (cols + 32) * sizeof(float);
            emu_launch(kernel, dim3(rows), dim3(threads), shared, x.data(), y.data(), cols);
            // Reference: in double, from the values as stored.
            std::vector<float> xs = load(x), want(rows * cols);
            for (int r = 0; r < rows; r++) {
                double m = -INFINITY, s = 0;
                for (int c = 0; c < cols; c++) m = std::max(m, (double)xs[r * cols + c]);
                for (int c = 0; c < cols; c++) s += exp(xs[r * cols + c] - m);
                for (int c = 0; c < cols; c++)
                    want[r * cols + c] = (float)(exp(xs[r * cols + c] - m) / s);
            }
            char what[80];
            snprintf(what, sizeof what, "%s cols %d, blockDim %u", name, cols, threads);
            emu::expect_near(what, load(y), want, 1e-7, tol);
        }
    }
}

int main() {
    check_transpose(transpose_f32, "transpose_f32");
    check_transpose(transpose_bf16, "transpose_bf16");
    check_transpose(transpose_f16, "transpose_f16");
    check_softmax(row_softmax_f32, "row_softmax_f32", 1e-5);
    check_softmax(row_softmax_bf16, "row_softmax_bf16", 1e-2);  // 8 significant bits
    check_softmax(row_softmax_f16, "row_softmax_f16", 1e-3);    // 11 significant bits
    return emu::finish();
}
