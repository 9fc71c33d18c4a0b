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
// min(ceil(N·OC / 8 / 256), 65535) (a thread takes 16 bytes of `out` at a time where it is
// 16-byte aligned, else one value). No shared memory, no scratch. No naive twin: both paths
// are the same arithmetic per element (k1_bias_test checks them against the CPU's bits).
template <typename T>
__device__ __forceinline__ T bias_value(T o, float b) {
    return from_f32<T>(__fadd_rn(to_f32(o), b));
}

template <typename T>
__device__ void add_bias(T* out, const float* b, int N, int OC) {
    constexpr int E = 16 / sizeof(T);
    const long long total = (long long)N * OC;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long packs = mw_aligned16(out) ? total / E : 0;
    for (long long p = t0; p < packs; p += stride) {
        MwPack<T> o = mw_load16(out + p * E);
        int j = (int)((p * E) % OC);  // the pack's first column; it may span rows
#pragma unroll
        for (int k = 0; k < E; k++) {
            o.v[k] = bias_value(o.v[k], b[j]);
            j = j + 1 == OC ? 0 : j + 1;
        }
        mw_store16(out + p * E, o);
    }
    for (long long i = packs * E + t0; i < total; i += stride)
        out[i] = bias_value(out[i], b[(int)(i % OC)]);
}

#define ADD_BIAS(T, S)                                                                       \
    extern "C" __global__ void add_bias_##S(T* out, const float* b, int N, int OC) {         \
        add_bias<T>(out, b, N, OC);                                                          \
    }
MW_STORAGE_ENTRIES(ADD_BIAS)
