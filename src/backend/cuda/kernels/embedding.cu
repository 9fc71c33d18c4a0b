// The embedding family: the token (and learned position) embedding's gather, `Op::Encoder`,
// and its scatter into the tables' gradients, `Op::EncoderBackward`.
//
//   Op::Encoder { tokens, positions, out, wte, wpe, rows, c, scale }
//     ->  encoder_forward_<S>(out, tokens, positions or NULL, wte, wpe or NULL, N, T, C, V,
//                             scale)
//   Op::EncoderBackward { dout, tokens, positions, wte, wpe, rows, c, scale }, in this order:
//     1. encoder_link_rows(link, tokens, N, T)                      rows linked by token
//     2. encoder_mark_rows(link, N)
//     3. encoder_backward_accumulate_<S>(dwte, dout, tokens, link, N, T, C, V, scale)
//     and with wpe (learned positions), the same three with the rows' positions as keys:
//     4. encoder_link_rows(link, positions or NULL, N, T)           rows linked by position
//     5. encoder_mark_rows(link, N)
//     6. encoder_backward_accumulate_<S>(dwpe, dout, positions or NULL, link, N, T, C, T, 1)
//   (`encoder_backward_naive_<S>(dtable, dout, keys, N, T, C, rows, scale)` is the plain twin
//   of steps 1-3 (or 4-6) together, for tests.)
//   (A table of ggml blocks, a quantized LoRA base, is gathered by dequant.cu's
//   `dequant_gather_<type>_<S>`, which takes the scale too.)
//
// `scale` multiplies the token rows only (Gemma's √C, `Gemma3TextScaledWordEmbedding`; 1
// elsewhere, where every product by it is exact): the forward's token row before the position
// is added, and each row's contribution to dwte in the backward (dwte += scale·dout; dwpe
// gets dout itself, scale 1).
//
// Dtypes (as the CPU's `ops/embedding.rs`, `backend/cpu/encoder.rs`): `out`, `dout` and the
// gradients `dwte`, `dwpe` are the storage type T (entries `_f32`, `_bf16`, `_f16`); the
// tables `wte` [V, C] and `wpe` [maxT, C] are the f32 parameters (pointers offset to their
// ranges' first element; the gradients' pointers likewise); token ids and positions are u32.
// N = B·T rows; a row's position is t = row % T, or positions[row] when the rows pack
// examples (each below T).
//
// "Keys". The backward adds row r of dout into row key(r) of a table's gradient: key = the
// token (dwte) or the position (dwpe). `keys` is a u32 [N] array, or NULL meaning
// key(r) = r % T (unpacked positions).
//
// The backward is deterministic without atomics and matches the CPU's order exactly: every
// gradient element gets its contributions in row order, accumulated in f32 starting from its
// stored value and rounded to T once: `g = T(((f32(g) + dout[r1]) + dout[r2]) + …)`,
// r1 < r2 < … the rows with that key (bitwise the CPU's result). To do so the rows with one
// key are linked in row order (a u32 scratch `link` [2·N]: link[r] = the next row after r
// with r's key, or 0xFFFFFFFF; link[N + r] = 1 when an earlier row has r's key), and one
// thread per (first row of a key, channel) walks that key's chain. The scratch is reused for
// the position gradient after the token gradient (steps 4-6 after 3).

#define EMB_NONE 0xFFFFFFFFu
#define EMB_LINK_TILE 256

// Row r's key: keys[r], or r % T when keys is NULL.
__device__ __forceinline__ unsigned int emb_key(const unsigned int* keys, long long r, int T) {
    return keys ? keys[r] : (unsigned int)(r % T);
}

// ---- Forward ----

// out[n, :] = scale·wte[tokens[n], :] (+ wpe[pos(n), :] when wpe is given), in f32 (the
// product, then the sum, each rounded as the CPU's `encoder_forward`) and rounded to T once
// (Op::Encoder); pos(n) = positions[n], or n % T when positions is NULL. A token >= V (a bad
// id; the CPU panics) gives a row of NaN rather than a read out of bounds.
//   out        T [N, C]
//   tokens     u32 [N]
//   positions  u32 [N] or NULL
//   wte        f32 [V, C]
//   wpe        f32 [maxT, C] or NULL (no learned positions)
//   N, T, C, V  rows, sequence length (> 0), channels, vocabulary rows (int)
//   scale      f32, the token rows' factor (1: the rows themselves)
// Launch: grid-stride over the N·C elements, any shape: block = 256, grid =
// min(ceil(N·C / 256), 65535). No shared memory, no scratch. Plain version: no naive twin.
template <typename T>
__device__ void encoder_forward(T* out, const unsigned int* tokens, const unsigned int* positions,
                                const float* wte, const float* wpe, int N, int T_, int C, int V,
                                float scale) {
    long long total = (long long)N * C;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        long long n = i / C;
        long long c = i - n * C;
        unsigned int tok = tokens[n];
        float v;
        if (tok >= (unsigned int)V) {
            v = __int_as_float(0x7fc00000);  // NaN
        } else {
            v = __fmul_rn(wte[(long long)tok * C + c], scale);
            if (wpe) {
                long long pos = emb_key(positions, n, T_);
                v = __fadd_rn(v, wpe[pos * C + c]);
            }
        }
        out[i] = from_f32<T>(v);
    }
}

// ---- Backward ----

// Step 1 (and 4) of EncoderBackward: links each row to the next row with its key.
// Writes link[r] = min { j > r : key(j) == key(r) }, or 0xFFFFFFFF when there is none, and
// link[N + r] = 0 (encoder_mark_rows sets it next).
//   link  u32 [2·N] scratch (written)
//   keys  u32 [N] (tokens or positions), or NULL: key(r) = r % T
//   N, T  rows, sequence length (> 0 when keys is NULL) (int)
// One thread per row; a block scans the keys after its rows in tiles of 256 (shared memory),
// stopping once each of its rows has found its next. The result is the same for any launch
// shape. Launch: block = 256 (any multiple of 32 up to 1024), grid = ceil(N / block). Static
// shared memory 1 KiB, no dynamic. Cost: up to N²/2 key comparisons (keys that occur once
// scan to the end): about N = 65536 → 2·10⁹ shared-memory compares, a fraction of a ms.
extern "C" __global__ void encoder_link_rows(unsigned int* link, const unsigned int* keys, int N,
                                             int T) {
    __shared__ unsigned int tile[EMB_LINK_TILE];
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    bool valid = r < N;
    unsigned int key = valid ? emb_key(keys, r, T) : 0u;
    unsigned int best = EMB_NONE;
    // The first candidate of the block's lowest row; the block's other rows skip j <= r.
    long long j0 = (long long)blockIdx.x * blockDim.x + 1;
    for (; j0 < N; j0 += EMB_LINK_TILE) {
        for (int k = threadIdx.x; k < EMB_LINK_TILE; k += blockDim.x) {
            long long j = j0 + k;
            tile[k] = j < N ? emb_key(keys, j, T) : 0u;
        }
        __syncthreads();
        if (valid && best == EMB_NONE) {
            long long left = (long long)N - j0;
            int kmax = left < EMB_LINK_TILE ? (int)left : EMB_LINK_TILE;
            for (int k = 0; k < kmax; k++) {
                long long j = j0 + k;
                if (j > r && tile[k] == key) {
                    best = (unsigned int)j;
                    break;
                }
            }
        }
        // A barrier (the tile is reloaded after it) and the block's uniform stop condition.
        if (!__syncthreads_or(valid && best == EMB_NONE)) break;
    }
    if (valid) {
        link[r] = best;
        link[(long long)N + r] = 0u;
    }
}

// Step 2 (and 5) of EncoderBackward: link[N + j] = 1 for every row j that some earlier row
// links to (j has an earlier row with its key). Each j is linked to by at most one row, so
// the stores never collide.
//   link  u32 [2·N] scratch, from encoder_link_rows
//   N     rows (int)
// Launch: grid-stride over N, any shape: block = 256, grid = min(ceil(N / 256), 65535).
// No shared memory. Plain version: no naive twin.
extern "C" __global__ void encoder_mark_rows(unsigned int* link, int N) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < N; r += stride) {
        unsigned int nx = link[r];
        if (nx != EMB_NONE) link[(long long)N + nx] = 1u;
    }
}

// Step 3 (and 6) of EncoderBackward: dtable[key(r), :] += Σ scale·dout[r', :] over the rows
// r' with that key, for each key's first row r: in f32 from the stored value, in row order
// (each term scale·dout rounded, then added, as the CPU's), rounded to T once (the CPU's
// order exactly). Rows whose key is >= table_rows are skipped (a bad id; the CPU panics).
//   dtable      T [table_rows, C] += (dwte: table_rows = V; dwpe: table_rows = T)
//   dout        T [N, C]
//   keys        u32 [N] (tokens or positions) or NULL: key(r) = r % T, as given to step 1
//   link        u32 [2·N] scratch, from encoder_link_rows then encoder_mark_rows
//   N, T, C, table_rows  (int)
//   scale       f32: the forward's for dwte, 1 for dwpe
// One thread per (row, channel); only a key's first row does work (it walks the key's chain
// of rows). Grid-stride in both directions, any shape: block = 256 (channels), grid =
// (min(N, 2^31 - 1) rows, min(ceil(C / 256), 65535) channel blocks). No shared memory.
// Naive twin: encoder_backward_naive_<S>. Cost: a key with k rows is a chain of k dependent
// loads per channel (a token repeated 10⁴ times: some ms).
template <typename T>
__device__ void encoder_backward_accumulate(T* dtable, const T* dout, const unsigned int* keys,
                                            const unsigned int* link, int N, int T_, int C,
                                            int table_rows, float scale) {
    for (long long r = blockIdx.x; r < N; r += gridDim.x) {
        if (link[(long long)N + r] != 0u) continue;  // not its key's first row
        unsigned int key = emb_key(keys, r, T_);
        if (key >= (unsigned int)table_rows) continue;
        T* d = dtable + (long long)key * C;
        for (long long c = (long long)blockIdx.y * blockDim.x + threadIdx.x; c < C;
             c += (long long)gridDim.y * blockDim.x) {
            float acc = to_f32(d[c]);
            for (unsigned int q = (unsigned int)r; q != EMB_NONE; q = link[q])
                acc = __fadd_rn(acc, __fmul_rn(scale, to_f32(dout[(long long)q * C + c])));
            d[c] = from_f32<T>(acc);
        }
    }
}

// The naive twin of steps 1-3 (or 4-6) together: one thread per (row r, channel c); if no
// row before r has r's key, it adds, in f32 from the stored value, dout[j, c] for every row
// j >= r with that key in order, and rounds once. Same result, bitwise, as the linked
// version; O(N²·C): for tests only.
//   dtable, dout, keys, N, T, C, table_rows, scale  as encoder_backward_accumulate (no link)
// Launch: grid-stride over the N·C elements, any shape: block = 256, grid =
// min(ceil(N·C / 256), 65535). No shared memory, no scratch.
template <typename T>
__device__ void encoder_backward_naive(T* dtable, const T* dout, const unsigned int* keys, int N,
                                       int T_, int C, int table_rows, float scale) {
    long long total = (long long)N * C;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        long long r = i / C;
        long long c = i - r * C;
        unsigned int key = emb_key(keys, r, T_);
        if (key >= (unsigned int)table_rows) continue;
        bool first = true;
        for (long long j = 0; j < r; j++)
            if (emb_key(keys, j, T_) == key) {
                first = false;
                break;
            }
        if (!first) continue;
        T* d = dtable + (long long)key * C + c;
        float acc = to_f32(*d);
        for (long long j = r; j < N; j++)
            if (emb_key(keys, j, T_) == key)
                acc = __fadd_rn(acc, __fmul_rn(scale, to_f32(dout[j * C + c])));
        *d = from_f32<T>(acc);
    }
}

#define EMBEDDING_ENTRIES(T, S)                                                              \
    extern "C" __global__ void encoder_forward_##S(                                          \
        T* out, const unsigned int* tokens, const unsigned int* positions, const float* wte, \
        const float* wpe, int N, int T_, int C, int V, float scale) {                        \
        encoder_forward<T>(out, tokens, positions, wte, wpe, N, T_, C, V, scale);            \
    }                                                                                        \
    extern "C" __global__ void encoder_backward_accumulate_##S(                              \
        T* dtable, const T* dout, const unsigned int* keys, const unsigned int* link, int N, \
        int T_, int C, int table_rows, float scale) {                                        \
        encoder_backward_accumulate<T>(dtable, dout, keys, link, N, T_, C, table_rows,       \
                                       scale);                                               \
    }                                                                                        \
    extern "C" __global__ void encoder_backward_naive_##S(                                   \
        T* dtable, const T* dout, const unsigned int* keys, int N, int T_, int C,            \
        int table_rows, float scale) {                                                       \
        encoder_backward_naive<T>(dtable, dout, keys, N, T_, C, table_rows, scale);          \
    }
MW_STORAGE_ENTRIES(EMBEDDING_ENTRIES)
