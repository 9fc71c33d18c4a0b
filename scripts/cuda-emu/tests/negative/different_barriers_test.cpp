// Negative test: threads of a block meet at two different __syncthreads (a divergent branch).
// emu-expect-fail: meet at different barriers
#include "emu.h"

__global__ void branches(float* y) {
    if (threadIdx.x & 1) {
        __syncthreads();
        y[threadIdx.x] = 1.0f;
    } else {
        __syncthreads();
        y[threadIdx.x] = 2.0f;
    }
}

int main() {
    std::vector<float> y(64);
    emu_launch(branches, dim3(1), dim3(64), 0, y.data());
    return emu::finish();
}
