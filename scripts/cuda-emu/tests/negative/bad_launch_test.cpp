// Negative test: a launch the GPU refuses (2048 threads a block) is an error here too.
// emu-expect-fail: invalid block (2048,1,1)
#include "emu.h"

__global__ void nothing() {}

int main() {
    emu_launch(nothing, dim3(1), dim3(2048), 0);
    return emu::finish();
}
