// Rotary position embedding, of the attention family: `Op::Rope` (forward, and its inverse
// in the backward), in place.
//
//   Op::Rope { x, positions, rows, width, rotated, hd, inv_freq, scale, inverse }
//     ->  rope_<S>(x, positions or NULL, inv_freq (a device copy, [hd/2] f32), scale,
//                  N = B·T, T, width, rotated, hd, pos0 = 0, inverse)
//
// As the CPU's `backend/cpu/rope.rs` (transformers' rotate-half convention): in each row the
// first `rotated` channels, head by head (hd channels each), element i < hd/2 paired with
// i + hd/2, at angle θ = pos · inv_freq[i] with pos = pos0 + (t = row % T, or positions[row]
// for rows that pack examples):
//   x'[i] = x[i]·cos θ − x[i + hd/2]·sin θ,   x'[i + hd/2] = x[i + hd/2]·cos θ + x[i]·sin θ,
// and with `inverse` the angle −θ (sin negated exactly). The angle is the f32 product
// `(float)pos · inv_freq[i]` (as transformers and the CPU); its cosine and sine are computed
// in f64 from that f32 angle and rounded to f32, as the CPU does (so they agree with it
// except at a rare f64 near-tie or an f64 libm ulp difference), then multiplied by `scale`
// in f32 (LongRoPE's attention factor, as transformers scales cos and sin; 1 otherwise). The rotation is in f32, each
// product and difference rounded separately (`__fmul_rn`/`__fadd_rn`, no FMA, as the CPU),
// rounded to T once. No reduction: the result does not depend on the launch shape.

// x rotated in place (Op::Rope; forward, or the inverse rotation when `inverse` != 0).
//   x          T [N, width] in place; channels rotated..width untouched
//   positions  u32 [N] each row's place in its example (packed rows), or NULL: t = row % T
//   inv_freq   f32 [hd/2] (device memory)
//   scale      f32: cos and sin are multiplied by it
//   N          rows B·T (int)
//   T          the sequence length (int, > 0), used when positions is NULL
//   width      row length (int)
//   rotated    channels rotated (int): a multiple of hd, <= width
//   hd         head size (int): even, >= 2
//   pos0       added to every position (int; the ops use 0)
//   inverse    0: angle θ (forward); 1: angle −θ (backward)
// One thread per (row, pair i < hd/2): it computes cos/sin once and rotates pair i of every
// head of the row. Launch: grid-stride over N·hd/2, any shape: block = 256, grid =
// min(ceil(N·(hd/2) / 256), 65535). No shared memory, no scratch. Plain version: no naive
// twin.
template <typename T>
__device__ void rope(T* x, const unsigned int* positions, const float* inv_freq, float scale,
                     int N, int T_, int width, int rotated, int hd, int pos0, int inverse) {
    int half = hd / 2;
    if (half <= 0) return;
    int heads = rotated / hd;
    long long total = (long long)N * half;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += stride) {
        long long row = k / half;
        int i = (int)(k - row * half);
        long long within = positions ? (long long)positions[row] : row % T_;
        float pos = (float)(pos0 + within);  // round to nearest, as Rust's `as f32`
        double angle = (double)__fmul_rn(pos, inv_freq[i]);
        float c = __fmul_rn((float)cos(angle), scale);
        float s = __fmul_rn((float)sin(angle), scale);
        if (inverse) s = -s;
        T* xr = x + row * (long long)width;
        for (int h = 0; h < heads; h++) {
            T* a = xr + (long long)h * hd + i;
            T* b = a + half;
            float xa = to_f32(*a), xb = to_f32(*b);
            *a = from_f32<T>(__fsub_rn(__fmul_rn(xa, c), __fmul_rn(xb, s)));
            *b = from_f32<T>(__fadd_rn(__fmul_rn(xb, c), __fmul_rn(xa, s)));
        }
    }
}

#define ROPE_ENTRIES(T, S)                                                                   \
    extern "C" __global__ void rope_##S(T* x, const unsigned int* positions,                  \
                                        const float* inv_freq, float scale, int N, int T_,   \
                                        int width, int rotated, int hd, int pos0,            \
                                        int inverse) {                                       \
        rope<T>(x, positions, inv_freq, scale, N, T_, width, rotated, hd, pos0, inverse);    \
    }
MW_STORAGE_ENTRIES(ROPE_ENTRIES)
