// dequant.cu: decoding rows of a ggml-quantized weight into a dense tile, for a QLoRA frozen
// base (backend/cpu/gemm/quantized.rs: the weight `W [OC, IC]` stays in ggml blocks and
// TILE_ROWS rows at a time are decoded into the f32 workspace `quant_ws`, which a GEMM then
// reads), and for gathering an embedding's rows (one row per call, or the host's loop).
//
// Ops served: every op with a frozen, quantized weight (Matmul, MatmulBackward's input
// gradient, LmHeadLoss and LmHeadLast, Encoder with a quantized wte): the host decodes a tile
// with `dequant_<type>_<S>` and runs the GEMM on it (the LM head's a chunk of vocabulary rows
// at a time: r0, rows). <S> is the tile's element type: `_f32`
// is the CPU's (its tile is f32); `_bf16`/`_f16` round each decoded value once (for a GEMM on
// T operands).
//
// Types: exactly those the CPU decodes (`dtype::ggml::DEQUANTIZABLE`): F32, F16, BF16, Q8_0,
// Q4_0, Q4_1, Q5_0, Q4_K, Q6_K (Q5_1, Q8_1, Q2_K, Q3_K, Q5_K and the IQ types are refused by
// the CPU, so they are not here either). Values are bitwise `dtype::dequant`'s (llama.cpp's
// `dequantize_row_*`): f16 scales widened exactly, then the same f32 multiplies and adds in
// the same order, written with __fmul_rn/__fadd_rn/__fsub_rn so no FMA contraction changes a
// rounding.
//
// Layout of the weight: OC rows, each row IC/block_size blocks of type_size bytes, back to back
// (row_bytes = IC/block_size·type_size); all multi-byte fields little-endian and unaligned (a
// block is 18, 20, 22, 34, 144 or 210 bytes), so they are read byte by byte. Block layouts
// (bytes):
//   Q8_0 (32 values, 34 B): [0,2) f16 d; [2,34) i8 q[32].                 y[j] = q[j]·d
//   Q4_0 (32, 18 B): [0,2) f16 d; [2,18) qs[16]: value j < 16 in qs[j]'s low nibble, value
//        j + 16 in its high nibble.                                       y = (q − 8)·d
//   Q4_1 (32, 20 B): [0,2) f16 d; [2,4) f16 m; [4,20) qs[16] as Q4_0.    y = q·d + m
//   Q5_0 (32, 22 B): [0,2) f16 d; [2,6) u32 qh (bit j: value j's fifth bit); [6,22) qs[16]
//        as Q4_0.                                                         y = (q − 16)·d
//   Q4_K (256, 144 B): [0,2) f16 d; [2,4) f16 dmin; [4,16) 12 bytes of 6-bit scales and mins
//        (get_scale_min_k4); [16,144) qs[128]: 32-byte run k (0..4) holds sub-block 2k in its
//        low nibbles, 2k+1 in its high nibbles.        y = (d·sc)·q − (dmin·m)
//   Q6_K (256, 210 B): [0,128) ql; [128,192) qh; [192,208) i8 scales[16]; [208,210) f16 d.
//        Half h (values 128h..): l in 0..32: ql[64h+l] low/high nibble = values l / l+64,
//        ql[64h+l+32] low/high = values l+32 / l+96; qh[32h+l] bit pairs 0-1, 2-3, 4-5, 6-7 =
//        the top 2 bits of values l, l+32, l+64, l+96; scale sc[8h + l/16 + 2·(group)].
//                                                       y = (d·sc)·(q − 32)
//   F32 (4 B), F16 (2 B), BF16 (2 B) per value: widened exactly.
//
// Every entry: dequant_<type>_<S>(const u8* w, int cols, int r0, int rows, int c0, int width,
//                                 T* out)
//   w     u8  the whole weight's bytes [OC · row_bytes] (the tensor's first byte)
//   cols  int IC, the values per row (a whole number of blocks)
//   r0    int the first row to decode
//   rows  int rows to decode (r0 + rows <= OC)
//   c0    int the first column to decode (a whole number of blocks)
//   width int columns to decode (c0 + width <= cols; a whole number of blocks, or up to cols)
//   out   T   [rows, width] out, row-major (ld = width): out[i·width + j] = W[r0 + i, c0 + j]
// A linear layer's weight larger than the tile is decoded a chunk at a time: rows of output
// features for the forward, columns of input features for the backward's input gradient
// (backend/cuda/sizing.rs, `linear_tile`); a whole weight or the LM head's vocabulary rows
// are c0 = 0, width = cols.
// Launch: grid = (min(ceil(rows·width / 256), 65535)), block = (256) (any: one thread per
// output value in a grid-stride loop), dynamic smem 0. Scratch: none. The kernels are the
// plain version (one thread per value), so there are no naive twins.

// A little-endian f16 at b[0..2], widened exactly.
__device__ __forceinline__ float dq_f16(const unsigned char* b) {
    f16 h;
    h.bits = (unsigned short)(b[0] | (b[1] << 8));
    return to_f32(h);
}

// `scale_min_k4(j, q)`: Q4_K's 6-bit scale and min of sub-block j (0..8).
__device__ __forceinline__ void dq_scale_min_k4(int j, const unsigned char* q, int& sc,
                                                int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Value v (0 <= v < block size) of the block at b, per type.
__device__ __forceinline__ float dq_q8_0(const unsigned char* b, int v) {
    return __fmul_rn((float)(signed char)b[2 + v], dq_f16(b));
}

__device__ __forceinline__ float dq_q4_0(const unsigned char* b, int v) {
    const unsigned char byte = b[2 + (v & 15)];
    const int x = (v < 16 ? (byte & 0x0F) : (byte >> 4)) - 8;
    return __fmul_rn((float)x, dq_f16(b));
}

__device__ __forceinline__ float dq_q4_1(const unsigned char* b, int v) {
    const unsigned char byte = b[4 + (v & 15)];
    const int x = v < 16 ? (byte & 0x0F) : (byte >> 4);
    return __fadd_rn(__fmul_rn((float)x, dq_f16(b)), dq_f16(b + 2));
}

__device__ __forceinline__ float dq_q5_0(const unsigned char* b, int v) {
    const unsigned int qh = (unsigned int)b[2] | ((unsigned int)b[3] << 8) |
                            ((unsigned int)b[4] << 16) | ((unsigned int)b[5] << 24);
    const int j = v & 15;
    const unsigned char byte = b[6 + j];
    int x;
    if (v < 16) {
        const unsigned int h0 = ((qh >> j) << 4) & 0x10u;
        x = (int)((byte & 0x0Fu) | h0) - 16;
    } else {
        const unsigned int h1 = (qh >> (j + 12)) & 0x10u;
        x = (int)((byte >> 4) | h1) - 16;
    }
    return __fmul_rn((float)x, dq_f16(b));
}

__device__ __forceinline__ float dq_q4_k(const unsigned char* b, int v) {
    const float d = dq_f16(b), dmin = dq_f16(b + 2);
    const unsigned char* scales = b + 4;
    const unsigned char* qs = b + 16;
    const int k = v >> 6, w = v & 63, l = w & 31, hi = w >> 5;  // value l of sub-block 2k+hi
    int sc, m;
    dq_scale_min_k4(2 * k + hi, scales, sc, m);
    const float d1 = __fmul_rn(d, (float)sc), m1 = __fmul_rn(dmin, (float)m);
    const unsigned char byte = qs[32 * k + l];
    const int q = hi ? (byte >> 4) : (byte & 0x0F);
    return __fsub_rn(__fmul_rn(d1, (float)q), m1);
}

__device__ __forceinline__ float dq_q6_k(const unsigned char* b, int v) {
    const float d = dq_f16(b + 208);
    const int h = v >> 7, w = v & 127, grp = w >> 5, l = w & 31, is = l >> 4;
    const unsigned char* ql = b + 64 * h;
    const unsigned char* qh = b + 128 + 32 * h;
    const unsigned char* sc = b + 192 + 8 * h;
    const unsigned char lo = grp & 1 ? ql[l + 32] : ql[l];  // groups 1, 3 read ql[l + 32]
    const int low = grp < 2 ? (lo & 0x0F) : (lo >> 4);      // groups 2, 3 the high nibble
    const int top = (qh[l] >> (2 * grp)) & 3;
    const int q = (low | (top << 4)) - 32;
    const int s = (int)(signed char)sc[is + 2 * grp];
    return __fmul_rn(__fmul_rn(d, (float)s), (float)q);
}

__device__ __forceinline__ float dq_f32v(const unsigned char* b, int) {
    return __uint_as_float((unsigned int)b[0] | ((unsigned int)b[1] << 8) |
                           ((unsigned int)b[2] << 16) | ((unsigned int)b[3] << 24));
}

__device__ __forceinline__ float dq_f16v(const unsigned char* b, int) { return dq_f16(b); }

__device__ __forceinline__ float dq_bf16v(const unsigned char* b, int) {
    bf16 x;
    x.bits = (unsigned short)(b[0] | (b[1] << 8));
    return to_f32(x);
}

// Rows [r0, r0 + rows) and columns [c0, c0 + width) of the weight into out [rows, width];
// BS values per block of TS bytes, value v of a block decoded by DECODE(block, v).
template <typename T, int BS, int TS, float (*DECODE)(const unsigned char*, int)>
__device__ void dequant_rows(const unsigned char* w, int cols, int r0, int rows, int c0,
                             int width, T* out) {
    const long long row_bytes = (long long)(cols / BS) * TS;
    const long long n = (long long)rows * width;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const long long i = e / width;
        const int c = c0 + (int)(e - i * width);
        const unsigned char* blk = w + (r0 + i) * row_bytes + (long long)(c / BS) * TS;
        out[e] = from_f32<T>(DECODE(blk, c % BS));
    }
}

// Rows ids[0..n) of the weight into out [n, cols] (an embedding's gather, Op::Encoder on a
// quantized table): row i is scale·W[ids[i], :], each value decoded as dequant_rows decodes it,
// times scale in f32 (Gemma's √C; 1 elsewhere, exact), rounded to T once (the CPU's
// `ops/embedding.rs`: `T::from_f32(x * scale)`); an id >= vocab (a bad token; the CPU refuses
// it) gives a row of NaN rather than a read out of bounds, as encoder_forward does.
template <typename T, int BS, int TS, float (*DECODE)(const unsigned char*, int)>
__device__ void dequant_gather(const unsigned char* w, int cols, const unsigned int* ids, int n,
                               int vocab, float scale, T* out) {
    const long long row_bytes = (long long)(cols / BS) * TS;
    const long long total = (long long)n * cols;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long i = e / cols;
        const int c = (int)(e - i * cols);
        const unsigned int id = ids[i];
        float v = __int_as_float(0x7fc00000);  // NaN
        if (id < (unsigned int)vocab) {
            const unsigned char* blk = w + (long long)id * row_bytes + (long long)(c / BS) * TS;
            v = __fmul_rn(DECODE(blk, c % BS), scale);
        }
        out[e] = from_f32<T>(v);
    }
}

// dequant_q8_0_<S>, dequant_q4_0_<S>, dequant_q4_1_<S>, dequant_q5_0_<S>, dequant_q4_k_<S>,
// dequant_q6_k_<S>, dequant_f32_<S>, dequant_f16_<S>, dequant_bf16_<S>: see the header; each
// with its gather, dequant_gather_<type>_<S>(const u8* w, int cols, const u32* ids, int n,
// int vocab, float scale, T* out): out [n, cols] = scale · rows ids of the weight (vocab
// rows), launched as the others (one thread per output value, grid-stride).
#define DEQUANT_Q8_0(T, S)                                                                   \
    extern "C" __global__ void dequant_q8_0_##S(const unsigned char* w, int cols, int r0,    \
                                                  int rows, int c0, int width, T* out) {     \
        dequant_rows<T, 32, 34, dq_q8_0>(w, cols, r0, rows, c0, width, out);                 \
    }                                                                                       \
    extern "C" __global__ void dequant_gather_q8_0_##S(const unsigned char* w, int cols,     \
                                                    const unsigned int* ids, int n,          \
                                                    int vocab, float scale, T* out) {        \
        dequant_gather<T, 32, 34, dq_q8_0>(w, cols, ids, n, vocab, scale, out);              \
    }
#define DEQUANT_Q4_0(T, S)                                                                   \
    extern "C" __global__ void dequant_q4_0_##S(const unsigned char* w, int cols, int r0,    \
                                                  int rows, int c0, int width, T* out) {     \
        dequant_rows<T, 32, 18, dq_q4_0>(w, cols, r0, rows, c0, width, out);                 \
    }                                                                                       \
    extern "C" __global__ void dequant_gather_q4_0_##S(const unsigned char* w, int cols,     \
                                                    const unsigned int* ids, int n,          \
                                                    int vocab, float scale, T* out) {        \
        dequant_gather<T, 32, 18, dq_q4_0>(w, cols, ids, n, vocab, scale, out);              \
    }
#define DEQUANT_Q4_1(T, S)                                                                   \
    extern "C" __global__ void dequant_q4_1_##S(const unsigned char* w, int cols, int r0,    \
                                                  int rows, int c0, int width, T* out) {     \
        dequant_rows<T, 32, 20, dq_q4_1>(w, cols, r0, rows, c0, width, out);                 \
    }                                                                                       \
    extern "C" __global__ void dequant_gather_q4_1_##S(const unsigned char* w, int cols,     \
                                                    const unsigned int* ids, int n,          \
                                                    int vocab, float scale, T* out) {        \
        dequant_gather<T, 32, 20, dq_q4_1>(w, cols, ids, n, vocab, scale, out);              \
    }
#define DEQUANT_Q5_0(T, S)                                                                   \
    extern "C" __global__ void dequant_q5_0_##S(const unsigned char* w, int cols, int r0,    \
                                                  int rows, int c0, int width, T* out) {     \
        dequant_rows<T, 32, 22, dq_q5_0>(w, cols, r0, rows, c0, width, out);                 \
    }                                                                                       \
    extern "C" __global__ void dequant_gather_q5_0_##S(const unsigned char* w, int cols,     \
                                                    const unsigned int* ids, int n,          \
                                                    int vocab, float scale, T* out) {        \
        dequant_gather<T, 32, 22, dq_q5_0>(w, cols, ids, n, vocab, scale, out);              \
    }
#define DEQUANT_Q4_K(T, S)                                                                   \
    extern "C" __global__ void dequant_q4_k_##S(const unsigned char* w, int cols, int r0,    \
                                                  int rows, int c0, int width, T* out) {     \
        dequant_rows<T, 256, 144, dq_q4_k>(w, cols, r0, rows, c0, width, out);               \
    }                                                                                       \
    extern "C" __global__ void dequant_gather_q4_k_##S(const unsigned char* w, int cols,     \
                                                    const unsigned int* ids, int n,          \
                                                    int vocab, float scale, T* out) {        \
        dequant_gather<T, 256, 144, dq_q4_k>(w, cols, ids, n, vocab, scale, out);            \
    }
#define DEQUANT_Q6_K(T, S)                                                                   \
    extern "C" __global__ void dequant_q6_k_##S(const unsigned char* w, int cols, int r0,    \
                                                  int rows, int c0, int width, T* out) {     \
        dequant_rows<T, 256, 210, dq_q6_k>(w, cols, r0, rows, c0, width, out);               \
    }                                                                                       \
    extern "C" __global__ void dequant_gather_q6_k_##S(const unsigned char* w, int cols,     \
                                                    const unsigned int* ids, int n,          \
                                                    int vocab, float scale, T* out) {        \
        dequant_gather<T, 256, 210, dq_q6_k>(w, cols, ids, n, vocab, scale, out);            \
    }
#define DEQUANT_F32(T, S)                                                                    \
    extern "C" __global__ void dequant_f32_##S(const unsigned char* w, int cols, int r0,     \
                                                  int rows, int c0, int width, T* out) {     \
        dequant_rows<T, 1, 4, dq_f32v>(w, cols, r0, rows, c0, width, out);                   \
    }                                                                                       \
    extern "C" __global__ void dequant_gather_f32_##S(const unsigned char* w, int cols,      \
                                                    const unsigned int* ids, int n,          \
                                                    int vocab, float scale, T* out) {        \
        dequant_gather<T, 1, 4, dq_f32v>(w, cols, ids, n, vocab, scale, out);                \
    }
#define DEQUANT_F16(T, S)                                                                    \
    extern "C" __global__ void dequant_f16_##S(const unsigned char* w, int cols, int r0,     \
                                                  int rows, int c0, int width, T* out) {     \
        dequant_rows<T, 1, 2, dq_f16v>(w, cols, r0, rows, c0, width, out);                   \
    }                                                                                       \
    extern "C" __global__ void dequant_gather_f16_##S(const unsigned char* w, int cols,      \
                                                    const unsigned int* ids, int n,          \
                                                    int vocab, float scale, T* out) {        \
        dequant_gather<T, 1, 2, dq_f16v>(w, cols, ids, n, vocab, scale, out);                \
    }
#define DEQUANT_BF16(T, S)                                                                   \
    extern "C" __global__ void dequant_bf16_##S(const unsigned char* w, int cols, int r0,    \
                                                  int rows, int c0, int width, T* out) {     \
        dequant_rows<T, 1, 2, dq_bf16v>(w, cols, r0, rows, c0, width, out);                  \
    }                                                                                       \
    extern "C" __global__ void dequant_gather_bf16_##S(const unsigned char* w, int cols,     \
                                                    const unsigned int* ids, int n,          \
                                                    int vocab, float scale, T* out) {        \
        dequant_gather<T, 1, 2, dq_bf16v>(w, cols, ids, n, vocab, scale, out);               \
    }
MW_STORAGE_ENTRIES(DEQUANT_Q8_0)
MW_STORAGE_ENTRIES(DEQUANT_Q4_0)
MW_STORAGE_ENTRIES(DEQUANT_Q4_1)
MW_STORAGE_ENTRIES(DEQUANT_Q5_0)
MW_STORAGE_ENTRIES(DEQUANT_Q4_K)
MW_STORAGE_ENTRIES(DEQUANT_Q6_K)
MW_STORAGE_ENTRIES(DEQUANT_F32)
MW_STORAGE_ENTRIES(DEQUANT_F16)
MW_STORAGE_ENTRIES(DEQUANT_BF16)
