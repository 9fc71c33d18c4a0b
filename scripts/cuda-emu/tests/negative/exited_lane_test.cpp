// Negative test: lanes return early, then the others call warp_sum (a full-mask xor butterfly)
// and read the exited lanes' values: undefined on the GPU, an error here.
// emu-expect-fail: which has exited
#include "emu.h"
#include "src/backend/cuda/kernels/common.cuh"

__global__ void partial_sum(const float* x, float* y, int n) {
    int i = threadIdx.x;
    if (i >= n) return;
    y[i] = warp_sum(x[i]);
}

int main() {
    std::vector<float> x(32, 1.0f), y(32);
    emu_launch(partial_sum, dim3(1), dim3(32), 0, x.data(), y.data(), 20);
    return emu::finish();
}
