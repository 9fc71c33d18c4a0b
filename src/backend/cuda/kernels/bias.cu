// A linear layer's bias added on its own: `Op::AddBias` (a frozen layer whose weight is
// stored apart from its bias: a quantized LoRA base), of the linear family.
//
//   Op::AddBias { out, b, rows, oc }  ->  add_bias_<S>(out, b + 0, N, OC)
//
// `out` is an activation (storage type T: entries `_f32`, `_bf16`, `_f16`); `b` the f32
// (master) bias, the pointer offset to the range's first element. As the CPU's
// `matmul::add_bias`: `out = T(f32(out) + b)`, one rounding per element; bitwise the CPU's.
// No reduction: the result does not depend on the launch shape.

// out[n, j] += b[j] for every row n (Op::AddBias).
//   out  T [N, OC] in place
//   b    f32 [OC]
//   N, OC  rows and columns (int; N·OC may exceed 2^31: indices are long long)
// Launch: grid-stride over the N·OC elements, any shape is correct: block = 256, grid =
// min(ceil(N·OC / 256), 65535). No shared memory, no scratch. The plain version: no naive
// twin.
template <typename T>
__device__ void add_bias(T* out, const float* b, int N, int OC) {
    long long total = (long long)N * OC;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int j = (int)(i % OC);
        out[i] = from_f32<T>(__fadd_rn(to_f32(out[i]), b[j]));
    }
}

#define ADD_BIAS(T, S)                                                                       \
    extern "C" __global__ void add_bias_##S(T* out, const float* b, int N, int OC) {         \
        add_bias<T>(out, b, N, OC);                                                          \
    }
MW_STORAGE_ENTRIES(ADD_BIAS)
