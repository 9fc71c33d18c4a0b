// zero_bytes (fill.cu, Op::Zero): every byte count 0..67 from a 4-byte-aligned start, launch
// shapes from one thread to more blocks than words: exactly the first nbytes bytes become 0,
// the bytes after them are untouched.
//
//     python3 scripts/cuda-emu/run.py scripts/cuda-emu/tests/k1_fill_test.cpp
#include "emu.h"
#include "../../../src/backend/cuda/kernels/fill.cu"
#include "k1_util.h"

int main() {
    const dim3 shapes[][2] = {{dim3(1), dim3(32)}, {dim3(1), dim3(256)}, {dim3(3), dim3(64)},
                              {dim3(40), dim3(32)}};
    for (long long nbytes = 0; nbytes < 68; nbytes++) {
        for (auto& s : shapes) {
            std::vector<unsigned int> words(24, 0xABABABABu);  // 96 bytes, 4-byte aligned
            unsigned char* p = (unsigned char*)words.data();
            emu_launch(zero_bytes, s[0], s[1], 0, p, nbytes);
            bool ok = true;
            for (int i = 0; i < 96; i++) ok &= p[i] == (i < nbytes ? 0 : 0xAB);
            EMU_CHECK(ok, "zero_bytes nbytes %lld grid %u block %u", nbytes, s[0].x, s[1].x);
        }
    }
    return emu::finish();
}
