// Negative test: an off-by-one bound (i <= n) reads and writes one past the buffers; the
// AddressSanitizer build (run.py's default) reports it at the kernel's line.
// emu-expect-fail: heap-buffer-overflow
// emu-needs-san
#include "emu.h"

__global__ void copy(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) y[i] = x[i];
}

int main() {
    const int n = 100;
    std::vector<float> x(n, 1.0f), y(n);
    emu_launch(copy, dim3(1), dim3(128), 0, x.data(), y.data(), n);
    return emu::finish();
}
