// The fill family: `Op::Zero` (a buffer set to zeros: a parameter group's gradients before
// their first write, the residual gradient before the backward).
//
//   Op::Zero { buf }  ->  zero_bytes(buf, its size in bytes)
//
// One entry, not templated (a buffer's bytes are zeroed whatever its dtype). No reduction:
// the result does not depend on the launch shape.

// Zeroes `nbytes` bytes from `p` (Op::Zero). Whole 32-bit words first, then the 0..3 tail
// bytes after them (one byte per thread).
//   p       u8 [nbytes], its start 4-byte aligned (a device allocation or a buffer offset
//           that is a multiple of 4); any nbytes >= 0 (not necessarily a multiple of 4).
//   nbytes  the byte count (long long).
// Launch: grid-stride over the words, so any shape is correct: block = 256, grid =
// min(ceil(ceil(nbytes / 4) / 256), 65535) (more blocks than words is harmless). No dynamic
// shared memory, no scratch. The plain version: no naive twin.
extern "C" __global__ void zero_bytes(unsigned char* p, long long nbytes) {
    long long words = nbytes >> 2;
    unsigned int* w = (unsigned int*)p;
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = i0; i < words; i += stride) w[i] = 0u;
    long long tail = nbytes - (words << 2);  // 0..3
    if (i0 < tail) p[(words << 2) + i0] = 0;
}
