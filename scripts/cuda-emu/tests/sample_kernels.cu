// Two sample kernels written as memwall's kernels are (templates over the storage type T,
// entries by MW_STORAGE_ENTRIES, the prelude's conversions and reductions), to show and test
// the emulator: static shared memory with __syncthreads, and dynamic shared memory with the
// prelude's block reductions. They compile under NVRTC too (scripts/nvrtc-check.py FILE).

// out (cols x rows) = transpose of x (rows x cols), both row-major. Block (32, 8); grid
// (ceil(cols / 32), ceil(rows / 32)). A 32 x 33 tile: the padding column avoids bank conflicts.
template <typename T>
__device__ void transpose(const T* __restrict__ x, T* __restrict__ out, int rows, int cols) {
    __shared__ T tile[32][33];
    int c = blockIdx.x * 32 + threadIdx.x;
    for (int j = threadIdx.y; j < 32; j += 8) {
        int r = blockIdx.y * 32 + j;
        if (r < rows && c < cols) tile[j][threadIdx.x] = x[(size_t)r * cols + c];
    }
    __syncthreads();
    int r = blockIdx.y * 32 + threadIdx.x;
    for (int j = threadIdx.y; j < 32; j += 8) {
        int oc = blockIdx.x * 32 + j;  // a column of x: a row of out
        if (oc < cols && r < rows) out[(size_t)oc * rows + r] = tile[threadIdx.x][j];
    }
}

// y[row] = softmax(x[row]) over `cols`, one block per row (blockDim a multiple of 32); the row
// is kept in f32 in dynamic shared memory: cols * 4 bytes (+ 32 floats of scratch after it).
template <typename T>
__device__ void row_softmax(const T* __restrict__ x, T* __restrict__ y, int cols) {
    extern __shared__ float smem[];
    float* row = smem;
    float* scratch = smem + cols;
    const T* xr = x + (size_t)blockIdx.x * cols;
    float m = __int_as_float(0xff800000);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        row[i] = to_f32(xr[i]);
        m = fmaxf(m, row[i]);
    }
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        row[i] = expf(row[i] - m);
        s += row[i];
    }
    s = block_sum(s, scratch);
    float inv = 1.0f / s;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        y[(size_t)blockIdx.x * cols + i] = from_f32<T>(row[i] * inv);
}

#define SAMPLE_ENTRIES(T, S)                                                                \
    extern "C" __global__ void transpose_##S(const T* x, T* out, int rows, int cols) {      \
        transpose<T>(x, out, rows, cols);                                                   \
    }                                                                                       \
    extern "C" __global__ void row_softmax_##S(const T* x, T* y, int cols) {                \
        row_softmax<T>(x, y, cols);                                                         \
    }
MW_STORAGE_ENTRIES(SAMPLE_ENTRIES)
