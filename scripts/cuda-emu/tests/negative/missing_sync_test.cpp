// Negative test: a missing __syncthreads. The thread that reads s[t + 1] may run before the
// thread that writes it: the emulator's schedule orders make that happen (and the 0xFF fill
// makes the unwritten value a NaN), so the check fails.
// emu-expect-fail: FAIL shift
#include "emu.h"

__global__ void shift(const float* x, float* y) {
    __shared__ float s[256];
    s[threadIdx.x] = x[threadIdx.x];
    // __syncthreads(); is missing here
    y[threadIdx.x] = s[(threadIdx.x + 1) % 256];
}

int main() {
    std::vector<float> x(256), y(256), want(256);
    for (int i = 0; i < 256; i++) x[i] = (float)i;
    for (int i = 0; i < 256; i++) want[i] = x[(i + 1) % 256];
    emu_launch(shift, dim3(1), dim3(256), 0, x.data(), y.data());
    emu::expect_near("shift", y, want, 0, 0);
    return emu::finish();
}
