// Negative test: inline PTX the emulator has no C++ version of fails, with its text, when a
// thread reaches it (run.py also lists it when it compiles the test).
// emu-expect-fail: inline PTX not emulated: "mov.u32 %0, %%laneid;"
#include "emu.h"

__global__ void lanes(unsigned* out) {
    unsigned lane;
    asm("mov.u32 %0, %%laneid;" : "=r"(lane));
    out[threadIdx.x] = lane;
}

int main() {
    std::vector<unsigned> out(32);
    emu_launch(lanes, dim3(1), dim3(32), 0, out.data());
    return emu::finish();
}
