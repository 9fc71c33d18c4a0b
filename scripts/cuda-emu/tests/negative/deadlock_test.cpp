// Negative test: half of each warp waits at __syncthreads while the other half waits in a
// full-mask shuffle for it: a deadlock (a hang, or worse, on the GPU).
// emu-expect-fail: deadlock
#include "emu.h"
#include "src/backend/cuda/kernels/common.cuh"

__global__ void halves(float* y) {
    float v = (float)threadIdx.x;
    if (threadIdx.x % 32 < 16)
        __syncthreads();
    else
        v = warp_sum(v);
    y[threadIdx.x] = v;
}

int main() {
    std::vector<float> y(64);
    emu_launch(halves, dim3(1), dim3(64), 0, y.data());
    return emu::finish();
}
