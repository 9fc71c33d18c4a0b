//! The GEMMs of the linear, LM head and adapter families on cuBLASLt (cudarc's `cublaslt`
//! `result`/`sys` layer: its safe `Matmul` wants one element type for A, B and C, and these
//! GEMMs mix them).
//!
//! A GEMM is stated as the CPU's `gemm_mixed` states it, on row-major buffers ([`Gemm`]):
//! `out[m, n] = alpha · op(a)[m, k] @ op(b)[k, n] + beta · c (+ bias[n])`, each operand with
//! its leading dimension (elements between rows: a column block of a wider output is a
//! pointer to its first column and the wide row's length, as LoRA's `col`/`ldo`) and a flag
//! saying it is stored transposed. cuBLAS is column-major: a row-major `X[r, c]` with leading
//! dimension `ld` is the column-major `Xᵀ [c, r]` with the same `ld`, so `out = op(a) @ op(b)`
//! is computed as `outᵀ = op(b)ᵀ @ op(a)ᵀ`: cuBLAS's A is our `b`, its B our `a`, its
//! `m, n` our `n, m` ([`col_major`], unit-tested against a column-major reference, as llm.c's
//! `matmul_cublaslt` computes `outᵀ = Wᵀ·inpᵀ` for its row-major activations).
//!
//! Arithmetic: compute type `CUBLAS_COMPUTE_32F` (f32 accumulation; TF32 OFF: never
//! `_FAST_TF32`), scale type f32. Element types: f32 × f32 → f32 (fp32 plans), and T × T → T
//! or T × T → f32 for bf16/f16 T (cuBLASLt's table for `CUBLAS_COMPUTE_32F`). A GEMM that
//! would mix f32 and T operands gets the f32 one rounded to T first (the callers:
//! [`GpuDevice::weight`], [`GpuDevice::narrow`]), as llm.c keeps its weights in bf16 and as
//! the CPU's AVX512_BF16 path rounds f32 operands while it packs them.
//!
//! A bias is cuBLASLt's `BIAS` epilogue on the f32 accumulator (its bias type set to f32,
//! the master weights' type), one rounding per output element as the CPU's; where cuBLASLt
//! finds no algorithm for that (or the bias is not 16-byte aligned, which Marian NMT found
//! the epilogue to need), the GEMM runs without it and `add_bias_<S>` (`kernels/bias.cu`)
//! adds the bias after (a second rounding in bf16/f16).
//!
//! Handles and algorithms: one cuBLASLt handle per device (a process-wide map from the
//! context's ordinal, created on first use, never destroyed: the GPU itself is opened once
//! per process; a follow-up moves it into `GpuDevice`), and per GEMM shape (types, dims,
//! transposes, leading dimensions, pointer alignments, bias, workspace) the descriptors and
//! the first algorithm of `cublasLtMatmulAlgoGetHeuristic`, cached. The workspace is the
//! backend scratch's `cublaslt` region (32 MiB, llm.c's size). Pointer alignments are told to
//! the heuristic (`MIN_ALIGNMENT_*`, the default assumes 256 bytes), so a column block or a
//! gradient range at any element offset gets an algorithm that reads it correctly.
//!
//! cuBLASLt is loaded on the first GEMM: a machine without `libcublasLt.so.13` gets an error
//! naming it, never a panic. cuBLASLt's results are deterministic for a given algorithm,
//! card and library (no atomics unless asked for), so a step's GEMMs are too.

use super::gpu::GpuDevice;
use super::launch::{grid_packs, grid_stride, launch_error, suffix};
use crate::dtype::DType;
use crate::ir::schedule::OpEntry;
use anyhow::{Result, anyhow, bail};
use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::PushKernelArg;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::{Mutex, OnceLock};

/// An element type of a GEMM operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    F32,
    Bf16,
    F16,
}

impl Ty {
    /// The type of plan buffers of dtype `d` (`None`: not a GEMM operand type).
    pub fn of(d: DType) -> Option<Ty> {
        match d {
            DType::F32 => Some(Ty::F32),
            DType::Bf16 => Some(Ty::Bf16),
            DType::F16 => Some(Ty::F16),
            _ => None,
        }
    }

    /// Bytes of one element.
    pub fn bytes(self) -> u64 {
        match self {
            Ty::F32 => 4,
            Ty::Bf16 | Ty::F16 => 2,
        }
    }

    /// The kernels' suffix for this type (`add_bias_<S>`).
    pub fn suffix(self) -> &'static str {
        match self {
            Ty::F32 => "f32",
            Ty::Bf16 => "bf16",
            Ty::F16 => "f16",
        }
    }

    fn cuda(self) -> sys::cudaDataType {
        match self {
            Ty::F32 => sys::cudaDataType::CUDA_R_32F,
            Ty::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            Ty::F16 => sys::cudaDataType::CUDA_R_16F,
        }
    }
}

/// A row-major GEMM operand: its address, element type, leading dimension (elements from
/// one row to the next, at least the row's length) and whether it is stored transposed (an
/// `[k, m]` buffer used as `[m, k]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operand {
    pub ptr: u64,
    pub ty: Ty,
    pub ld: usize,
    pub trans: bool,
}

impl Operand {
    /// Stored as used, rows `ld` elements apart.
    pub fn new(ptr: u64, ty: Ty, ld: usize) -> Operand {
        Operand {
            ptr,
            ty,
            ld,
            trans: false,
        }
    }

    /// The same buffer, stored transposed.
    pub fn t(self) -> Operand {
        Operand {
            trans: true,
            ..self
        }
    }
}

/// `d[m, n] = alpha · op(a)[m, k] @ op(b)[k, n] + beta · c (+ bias[n] on every row)`, all
/// row-major. `d`'s `trans` is ignored; `c` (read when beta ≠ 0) has `d`'s type and leading
/// dimension, and is `d` itself unless given (a residual added out of place).
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: Operand,
    pub b: Operand,
    pub d: Operand,
    pub c: Option<u64>,
    pub alpha: f32,
    pub beta: f32,
    /// f32 `[n]` (an f32 master bias).
    pub bias: Option<u64>,
}

impl Gemm {
    /// `d = op(a) @ op(b)` (overwritten).
    pub fn new(m: usize, n: usize, k: usize, a: Operand, b: Operand, d: Operand) -> Gemm {
        Gemm {
            m,
            n,
            k,
            a,
            b,
            d,
            c: None,
            alpha: 1.0,
            beta: 0.0,
            bias: None,
        }
    }

    /// `d += op(a) @ op(b)` (beta = 1: a gradient accumulated, a column block added to).
    pub fn accumulate(self) -> Gemm {
        Gemm { beta: 1.0, ..self }
    }

    /// `d = c + op(a) @ op(b)`: `c` (a residual) read from elsewhere.
    pub fn plus(self, c: u64) -> Gemm {
        Gemm {
            c: Some(c),
            beta: 1.0,
            ..self
        }
    }

    /// Adds the f32 bias `[n]` at `bias` to every row.
    pub fn bias(self, bias: Option<u64>) -> Gemm {
        Gemm { bias, ..self }
    }
}

/// A matrix as cuBLASLt's layout describes it: column-major, `rows × cols` stored, columns
/// `ld` elements apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    pub ty: Ty,
    pub rows: u64,
    pub cols: u64,
    pub ld: i64,
}

/// A [`Gemm`] as cuBLASLt runs it: `D[m, n] = op(A)[m, k] · op(B)[k, n]`, column-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ColMajor {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub trans_a: bool,
    pub trans_b: bool,
    pub a: Layout,
    pub b: Layout,
    /// C's and D's layout.
    pub d: Layout,
}

/// The column-major GEMM computing `g` (the transposed problem, operands swapped), or why
/// `g` cannot run (an empty dimension, a leading dimension shorter than a row, element types
/// cuBLASLt does not multiply).
pub fn col_major(g: &Gemm) -> Result<ColMajor, String> {
    let (m, n, k) = (g.m as u64, g.n as u64, g.k as u64);
    if m == 0 || n == 0 || k == 0 {
        return Err(format!("an empty GEMM ({m}×{k} @ {k}×{n})"));
    }
    let types_ok = match (g.a.ty, g.b.ty, g.d.ty) {
        (Ty::F32, Ty::F32, Ty::F32) => true,
        (x, y, z) if x == y && x != Ty::F32 => z == x || z == Ty::F32,
        _ => false,
    };
    if !types_ok {
        return Err(format!(
            "cuBLASLt does not multiply {:?} × {:?} into {:?}",
            g.a.ty, g.b.ty, g.d.ty
        ));
    }
    // Row-major X (`rows × cols`, rows `ld` apart) is column-major Xᵀ (`cols × rows`).
    let stored = |o: &Operand, rows: u64, cols: u64, what: &str| {
        let (rows, cols) = if o.trans { (cols, rows) } else { (rows, cols) };
        if (o.ld as u64) < cols {
            return Err(format!(
                "{what}: leading dimension {} under its row of {cols}",
                o.ld
            ));
        }
        Ok(Layout {
            ty: o.ty,
            rows: cols,
            cols: rows,
            ld: o.ld as i64,
        })
    };
    // cuBLAS's A is op(b)ᵀ (`n × k`): b stored `[k, n]` is column-major `n × k` as is; stored
    // transposed (`[n, k]`, column-major `k × n`) it is read transposed. Likewise its B is
    // op(a)ᵀ (`k × m`).
    let a = stored(&g.b, k, n, "b")?;
    let b = stored(&g.a, m, k, "a")?;
    let d = stored(&g.d, m, n, "d")?;
    Ok(ColMajor {
        m: n,
        n: m,
        k,
        trans_a: g.b.trans,
        trans_b: g.a.trans,
        a,
        b,
        d,
    })
}

/// The alignment cuBLASLt may assume of an address (its largest power-of-two divisor, at
/// most the 256 bytes the heuristic assumes by default).
pub fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        1u32 << ptr.trailing_zeros().min(8)
    }
}

/// Whether the BIAS epilogue is tried for a bias at `ptr` (16-byte aligned).
pub fn bias_fusable(ptr: u64) -> bool {
    ptr.is_multiple_of(16)
}

/// What a cached algorithm was chosen for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    cm: ColMajor,
    /// A, B, C, D (cuBLAS's).
    align: [u32; 4],
    bias: bool,
    workspace: u64,
}

/// A GEMM shape's descriptors and algorithm (destroyed on drop).
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    /// The heuristic's algorithms, best first ([`ALGOS`] at most); `algos[chosen]` runs.
    algos: Vec<sys::cublasLtMatmulAlgo_t>,
    /// The first algorithm `cublasLtMatmul` accepted: one it refuses before running is
    /// passed over for the next (a safeguard: the one refusal seen on an H200 was a
    /// misaligned workspace, which every algorithm refused, now fixed by `SCRATCH_ALIGN`).
    /// The choice is fixed per shape, card and library, so results stay deterministic.
    chosen: usize,
    /// The bias epilogue is set (else the caller adds the bias).
    bias: bool,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each is null or created by cuBLASLt for this plan only.
        unsafe {
            for l in [self.a, self.b, self.d] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// A preference descriptor, destroyed on drop.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_pref`, used only here.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// # Safety
/// `buf` points to a value of `size_of::<V>()` bytes that the attribute takes.
unsafe fn desc_attr<V>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &V,
) -> Result<(), CublasError> {
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            v as *const V as *const c_void,
            std::mem::size_of::<V>(),
        )
    }
}

/// # Safety
/// As [`desc_attr`].
unsafe fn pref_attr<V>(
    pref: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    v: &V,
) -> Result<(), CublasError> {
    unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            attr,
            v as *const V as *const c_void,
            std::mem::size_of::<V>(),
        )
    }
}

impl Plan {
    /// Descriptors and the heuristic's first algorithm for `key`.
    ///
    /// # Safety
    /// `handle` is a live cuBLASLt handle.
    unsafe fn new(handle: sys::cublasLtHandle_t, key: &Key) -> Result<Plan, CublasError> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let cm = &key.cm;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )?;
        let mut plan = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algos: Vec::new(),
            chosen: 0,
            bias: key.bias,
        };
        // SAFETY: the descriptors are live; each value has the attribute's type (the
        // transposes a 32-bit `cublasOperation_t`, 1 = T, as cudarc's safe layer sets them).
        unsafe {
            desc_attr(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &(cm.trans_a as i32))?;
            desc_attr(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &(cm.trans_b as i32))?;
            if key.bias {
                let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                desc_attr(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
                desc_attr(
                    desc,
                    D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &sys::cudaDataType::CUDA_R_32F,
                )?;
            }
        }
        let layout = |l: &Layout| lt::create_matrix_layout(l.ty.cuda(), l.rows, l.cols, l.ld);
        plan.a = layout(&cm.a)?;
        plan.b = layout(&cm.b)?;
        plan.d = layout(&cm.d)?;
        let pref = Pref(lt::create_matmul_pref()?);
        // SAFETY: as above (the workspace a `uint64_t`, the alignments `uint32_t`).
        unsafe {
            pref_attr(
                pref.0,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &key.workspace,
            )?;
            let [a, b, c, d] = key.align;
            pref_attr(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a)?;
            pref_attr(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b)?;
            pref_attr(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &c)?;
            pref_attr(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &d)?;
            let mut found = [sys::cublasLtMatmulHeuristicResult_t {
                algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
                workspaceSize: 0,
                state: sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
                wavesCount: 0.0,
                reserved: [0; 4],
            }; ALGOS];
            let mut count = 0;
            sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc,
                plan.a,
                plan.b,
                plan.d,
                plan.d,
                pref.0,
                ALGOS as i32,
                found.as_mut_ptr(),
                &mut count,
            )
            .result()?;
            plan.algos = found[..count.clamp(0, ALGOS as i32) as usize]
                .iter()
                .filter(|h| h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|h| h.algo)
                .collect();
        }
        if plan.algos.is_empty() {
            return Err(CublasError(
                sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
            ));
        }
        Ok(plan)
    }
}

/// One device's cuBLASLt handle and cached plans.
struct Lt {
    ordinal: usize,
    handle: sys::cublasLtHandle_t,
    plans: HashMap<Key, Plan>,
}

// SAFETY: the handle and descriptors are host objects used under `HANDLES`'s lock only.
unsafe impl Send for Lt {}

/// Every device's cuBLASLt state, by context ordinal.
static HANDLES: Mutex<Vec<Lt>> = Mutex::new(Vec::new());

/// Algorithms asked of the heuristic per shape: the best, and those tried after it where
/// `cublasLtMatmul` refuses it.
const ALGOS: usize = 8;

/// Plans kept per device before the cache is emptied (generation's growing sequence makes a
/// shape per length).
const MAX_PLANS: usize = 4096;

/// Whether libcublasLt could be loaded (probed once: cudarc panics on a missing library).
fn library() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only loads the library (dlopen) and drops it.
    if *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() }) {
        Ok(())
    } else {
        bail!(
            "--device cuda: cuBLASLt (libcublasLt.so.13, CUDA 13's cuBLAS) could not be loaded; \
             install CUDA 13's cuBLAS libraries (or put their folder on LD_LIBRARY_PATH) to run \
             GEMMs on the GPU"
        )
    }
}

impl GpuDevice {
    /// The plan's storage type as a GEMM element type.
    pub(super) fn storage_ty(&self) -> Ty {
        Ty::of(self.storage).unwrap_or(Ty::F32)
    }

    /// The address of `bytes` at byte `offset` of the scratch's weight tile (an internal
    /// error where the sizing gave it less).
    pub(super) fn tile(&self, e: &OpEntry, offset: u64, bytes: u64) -> Result<u64> {
        let (ptr, size) = self.scratch().weight_tile;
        if offset + bytes > size || ptr == 0 {
            bail!(
                "internal error: {}: the GEMM weight tile holds {size} bytes, {} needed",
                e.name,
                offset + bytes
            );
        }
        Ok(ptr + offset)
    }

    /// Weight `[rows, cols]` (parameter range `w` of `e`) as a GEMM reads it: the f32 master
    /// in place in an fp32 plan; rounded to the storage type T into the weight tile at byte
    /// `at` in a bf16/f16 plan (`f32_to_storage_<S>`); a quantized base decoded into the
    /// tile as T (`dequant_<type>_<S>`: its rows are `rows`).
    pub(super) fn weight(
        &self,
        e: &OpEntry,
        w: &Range<usize>,
        (rows, cols): (usize, usize),
        at: u64,
    ) -> Result<(u64, Ty)> {
        self.weight_rows(e, w, (rows, cols), 0..rows, at)
    }

    /// Whether [`GpuDevice::weight`] reads `e`'s weight where it is (an f32 master in an fp32
    /// plan), writing nothing to the weight tile.
    pub(super) fn weight_in_place(&self, e: &OpEntry) -> bool {
        self.storage_ty() == Ty::F32 && self.param_dtype(e) == Some(DType::F32)
    }

    /// Rows `part` of weight `[rows, cols]` (parameter range `w` of `e`) as a GEMM reads them,
    /// `[part.len(), cols]` from the returned address, as [`GpuDevice::weight`] makes the
    /// whole: the f32 master in place, or those rows alone converted or decoded into the
    /// weight tile at byte `at` (the LM head's vocabulary chunks, a linear layer's chunks of
    /// output features).
    pub(super) fn weight_rows(
        &self,
        e: &OpEntry,
        w: &Range<usize>,
        (rows, cols): (usize, usize),
        part: Range<usize>,
        at: u64,
    ) -> Result<(u64, Ty)> {
        self.weight_block(e, w, (rows, cols), (part, 0..cols), at)
    }

    /// The block `rows_part × cols_part` of weight `[rows, cols]` (parameter range `w` of `e`)
    /// as a GEMM reads it. With every column: as [`GpuDevice::weight_rows`] (rows `ld` = cols
    /// apart when the f32 master is read in place). With fewer (a linear layer's chunk of input
    /// features, for its backward): converted or decoded into the weight tile at byte `at`,
    /// `[rows_part.len(), cols_part.len()]` row-major (`dequant_<type>_<S>`; an f32 master
    /// through `dequant_f32_<S>`); a quantized weight's columns must be whole blocks.
    pub(super) fn weight_block(
        &self,
        e: &OpEntry,
        w: &Range<usize>,
        (rows, cols): (usize, usize),
        (part, cpart): (Range<usize>, Range<usize>),
        at: u64,
    ) -> Result<(u64, Ty)> {
        if part.start > part.end || part.end > rows || cpart.start > cpart.end || cpart.end > cols {
            bail!(
                "internal error: {}: rows {part:?}, columns {cpart:?} of a weight of {rows} × \
                 {cols}",
                e.name
            );
        }
        let whole_rows = cpart.len() == cols;
        let t = self.storage_ty();
        let n = (part.len() * cpart.len()) as u64;
        let src = self.param_ptr(e, w)?;
        let q = match self.param_dtype(e) {
            Some(DType::F32) if t == Ty::F32 && whole_rows => {
                return Ok((src + (part.start * cols) as u64 * 4, Ty::F32));
            }
            Some(DType::F32) if whole_rows => {
                let dst = self.tile(e, at, n * t.bytes())?;
                self.narrow(e, src + (part.start * cols) as u64 * 4, dst, n)?;
                return Ok((dst, t));
            }
            Some(DType::F32) => crate::dtype::GgmlType::F32,
            Some(DType::Ggml(q)) => q,
            d => bail!(
                "internal error: {}: parameters stored as {d:?} are not a GEMM weight",
                e.name
            ),
        };
        if !q.dequantizable() {
            bail!(
                "{}: a {q} weight cannot be decoded (on the GPU as on the CPU)",
                e.name
            );
        }
        let bs = q.block_size as usize;
        if !cpart.start.is_multiple_of(bs) || !(cpart.len().is_multiple_of(bs) || whole_rows) {
            bail!(
                "internal error: {}: columns {cpart:?} are not whole {q} blocks of {bs}",
                e.name
            );
        }
        let dst = self.tile(e, at, n * t.bytes())?;
        let name = format!("dequant_{}_{}", q.name.to_ascii_lowercase(), t.suffix());
        let f = self.plain_kernel(&name)?;
        let (cols_i, r0, rows_i) = (int(e, cols)?, int(e, part.start)?, int(e, part.len())?);
        let (c0, width) = (int(e, cpart.start)?, int(e, cpart.len())?);
        // SAFETY: `dequant_<type>_<S>(const u8* w, int cols, int r0, int rows, int c0, int
        // width, T* out)`: `src` is the weight's first block (rows r0 .. r0 + rows, columns c0
        // .. c0 + width of its `rows × cols` are read: checked above), `dst` holds rows·width
        // T (checked by `tile`).
        unsafe {
            self.launch(f)
                .arg(&src)
                .arg(&cols_i)
                .arg(&r0)
                .arg(&rows_i)
                .arg(&c0)
                .arg(&width)
                .arg(&dst)
                .launch(grid_stride(n))
        }
        .map_err(|err| launch_error(e, &name, err))?;
        Ok((dst, t))
    }

    /// `dst[i] = T(src[i])` for `n` f32 values (`f32_to_storage_<S>`, T the storage type).
    pub(super) fn narrow(&self, e: &OpEntry, src: u64, dst: u64, n: u64) -> Result<()> {
        let name = format!("f32_to_storage_{}", suffix(self.storage));
        let f = self.kernel("f32_to_storage")?;
        let count = n as i64;
        // SAFETY: `f32_to_storage_<S>(const float* x, T* y, long long n)`, both holding n.
        unsafe {
            self.launch(f)
                .arg(&src)
                .arg(&dst)
                .arg(&count)
                .launch(grid_packs(n))
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, &name, err))
    }

    /// Runs `g` on the device's stream (for `e`, named in errors). A bias cuBLASLt cannot fuse
    /// is added after by `add_bias_<S>`.
    pub(super) fn gemm(&self, e: &OpEntry, g: &Gemm) -> Result<()> {
        let cm = col_major(g).map_err(|why| anyhow!("internal error: {}: {why}", e.name))?;
        library()?;
        let c = g.c.unwrap_or(g.d.ptr);
        let (ws, ws_bytes) = self.scratch().cublaslt;
        let ws_bytes = if ws == 0 { 0 } else { ws_bytes };
        let bias = g.bias.filter(|&b| bias_fusable(b));
        let key = Key {
            cm,
            align: [
                alignment(g.b.ptr),
                alignment(g.a.ptr),
                alignment(c),
                alignment(g.d.ptr),
            ],
            bias: bias.is_some(),
            workspace: ws_bytes,
        };
        let fail = |what: &str, err: CublasError| {
            anyhow!(
                "{}: cuBLASLt {what} failed ({err:?}) for a {:?} {}×{} @ {}×{} GEMM into {:?}",
                e.name,
                g.a.ty,
                g.m,
                g.k,
                g.k,
                g.n,
                g.d.ty
            )
        };
        let fused = {
            let mut handles = HANDLES.lock().unwrap_or_else(|p| p.into_inner());
            let ordinal = self.ctx.ordinal();
            let i = match handles.iter().position(|l| l.ordinal == ordinal) {
                Some(i) => i,
                None => {
                    self.ctx
                        .bind_to_thread()
                        .map_err(|err| anyhow!("{}: the GPU's context: {err:?}", e.name))?;
                    let handle = lt::create_handle().map_err(|err| fail("cublasLtCreate", err))?;
                    handles.push(Lt {
                        ordinal,
                        handle,
                        plans: HashMap::new(),
                    });
                    handles.len() - 1
                }
            };
            let lt_state = &mut handles[i];
            if lt_state.plans.len() >= MAX_PLANS {
                lt_state.plans.clear();
            }
            let handle = lt_state.handle;
            let plan = match lt_state.plans.entry(key) {
                Entry::Occupied(o) => o.into_mut(),
                Entry::Vacant(v) => {
                    // SAFETY: `handle` is live.
                    let plan = match unsafe { Plan::new(handle, &key) } {
                        Ok(p) => p,
                        // No algorithm with the bias epilogue: without it (the bias added
                        // after).
                        Err(_) if key.bias => {
                            let plain = Key { bias: false, ..key };
                            // SAFETY: as above.
                            unsafe { Plan::new(handle, &plain) }
                                .map_err(|err| fail("cublasLtMatmulAlgoGetHeuristic", err))?
                        }
                        Err(err) => return Err(fail("cublasLtMatmulAlgoGetHeuristic", err)),
                    };
                    v.insert(plan)
                }
            };
            let (alpha, beta) = (g.alpha, g.beta);
            // SAFETY: the plan's descriptors describe the operands' device buffers (the
            // callers' shapes are the plan's buffers'); alpha and beta are host f32 (the
            // default pointer mode) read during the call; the workspace is the scratch's
            // cuBLASLt region; the stream is the device's.
            unsafe {
                if plan.bias {
                    let b: u64 = bias.unwrap_or(0);
                    desc_attr(
                        plan.desc,
                        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                        &b,
                    )
                    .map_err(|err| fail("setting the bias", err))?;
                }
                let mut first_err = None;
                for i in plan.chosen..plan.algos.len() {
                    let run = lt::matmul(
                        handle,
                        plan.desc,
                        &alpha as *const f32 as *const c_void,
                        &beta as *const f32 as *const c_void,
                        g.b.ptr as *const c_void,
                        plan.a,
                        g.a.ptr as *const c_void,
                        plan.b,
                        c as *const c_void,
                        plan.d,
                        g.d.ptr as *mut c_void,
                        plan.d,
                        &plan.algos[i],
                        ws as *mut c_void,
                        ws_bytes as usize,
                        self.stream.cu_stream() as sys::cudaStream_t,
                    );
                    match run {
                        Ok(()) => {
                            plan.chosen = i;
                            first_err = None;
                            break;
                        }
                        // Refused before it ran (its arguments checked against that
                        // algorithm): the next one.
                        Err(err) if refused_before_running(err) => {
                            first_err.get_or_insert(err);
                        }
                        Err(err) => return Err(fail("cublasLtMatmul", err)),
                    }
                }
                if let Some(err) = first_err {
                    let tried = plan.algos.len() - plan.chosen;
                    return Err(fail(
                        &format!("cublasLtMatmul (each of the heuristic's {tried} algorithms)"),
                        err,
                    ));
                }
            }
            plan.bias
        };
        match g.bias {
            Some(b) if !fused => self.add_bias(e, g.d.ptr, g.d.ty, b, (g.m, g.n, g.d.ld)),
            _ => Ok(()),
        }
    }

    /// `out[r, :] += b` for `rows` rows of `cols` (`add_bias_<S>`, out of type `ty`).
    pub(super) fn add_bias(
        &self,
        e: &OpEntry,
        out: u64,
        ty: Ty,
        b: u64,
        (rows, cols, ld): (usize, usize, usize),
    ) -> Result<()> {
        if ld != cols {
            bail!(
                "internal error: {}: a bias added to a column block ({cols} of {ld})",
                e.name
            );
        }
        let name = format!("add_bias_{}", ty.suffix());
        let f = self.plain_kernel(&name)?;
        let (n, oc) = (int(e, rows)?, int(e, cols)?);
        // SAFETY: `add_bias_<S>(T* out, const float* b, int N, int OC)`: out holds N·OC T, b
        // OC f32.
        unsafe {
            self.launch(f)
                .arg(&out)
                .arg(&b)
                .arg(&n)
                .arg(&oc)
                .launch(grid_packs((rows * cols) as u64))
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, &name, err))
    }
}

/// Whether `cublasLtMatmul` refused an algorithm without running it (its checks of the
/// arguments against that algorithm), so another may run.
fn refused_before_running(err: CublasError) -> bool {
    use sys::cublasStatus_t as S;
    matches!(
        err.0,
        S::CUBLAS_STATUS_INVALID_VALUE
            | S::CUBLAS_STATUS_NOT_SUPPORTED
            | S::CUBLAS_STATUS_ARCH_MISMATCH
    )
}

/// `x` as a kernel's `int` argument (an error naming the op where it does not fit).
pub fn int(e: &OpEntry, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| anyhow!("{}: {x} does not fit a CUDA kernel's int", e.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row-major reference: `d[i, j] = Σ op(a)[i, l] · op(b)[l, j]`, reading operands
    /// through their leading dimensions and transposes.
    fn row_major(g: &Gemm, a: &[f64], b: &[f64], d: &mut [f64]) {
        let at = |o: &Operand, x: &[f64], i: usize, j: usize| {
            if o.trans {
                x[j * o.ld + i]
            } else {
                x[i * o.ld + j]
            }
        };
        for i in 0..g.m {
            for j in 0..g.n {
                let s: f64 = (0..g.k)
                    .map(|l| at(&g.a, a, i, l) * at(&g.b, b, l, j))
                    .sum();
                d[i * g.d.ld + j] = s;
            }
        }
    }

    /// Column-major reference of what cuBLASLt computes for `cm` with A at `a`, B at `b`
    /// (indices checked against the layouts: nothing outside a stored matrix is read).
    fn col_major_ref(cm: &ColMajor, a: &[f64], b: &[f64], d: &mut [f64]) {
        let at = |l: &Layout, trans: bool, x: &[f64], i: u64, j: u64| {
            let (r, c) = if trans { (j, i) } else { (i, j) };
            assert!(r < l.rows && c < l.cols, "({r}, {c}) outside {l:?}");
            x[(r + c * l.ld as u64) as usize]
        };
        for i in 0..cm.m {
            for j in 0..cm.n {
                let s: f64 = (0..cm.k)
                    .map(|l| at(&cm.a, cm.trans_a, a, i, l) * at(&cm.b, cm.trans_b, b, l, j))
                    .sum();
                assert!(i < cm.d.rows && j < cm.d.cols);
                d[(i + j * cm.d.ld as u64) as usize] = s;
            }
        }
    }

    fn fill(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 1000) as f64 / 100.0 - 5.0
            })
            .collect()
    }

    /// Every transpose combination, with padded leading dimensions and the tight ones: the
    /// column-major problem reads the same elements and writes the same result.
    #[test]
    fn row_major_gemms_map_to_cublas_column_major() {
        for &(m, n, k) in &[(1, 1, 1), (3, 5, 7), (4, 1, 6), (1, 9, 2), (6, 6, 3)] {
            for ta in [false, true] {
                for tb in [false, true] {
                    for pad in [0, 3] {
                        let (ar, ac) = if ta { (k, m) } else { (m, k) };
                        let (br, bc) = if tb { (n, k) } else { (k, n) };
                        let a = Operand {
                            ptr: 0,
                            ty: Ty::F32,
                            ld: ac + pad,
                            trans: ta,
                        };
                        let b = Operand {
                            ptr: 0,
                            ty: Ty::F32,
                            ld: bc + pad,
                            trans: tb,
                        };
                        let d = Operand::new(0, Ty::F32, n + pad);
                        let g = Gemm::new(m, n, k, a, b, d);
                        let av = fill(ar * a.ld, 1 + m as u64);
                        let bv = fill(br * b.ld, 2 + n as u64);
                        let mut want = vec![0.0; m * d.ld];
                        let mut got = vec![0.0; m * d.ld];
                        row_major(&g, &av, &bv, &mut want);
                        let cm = col_major(&g).unwrap();
                        assert_eq!((cm.m, cm.n, cm.k), (n as u64, m as u64, k as u64));
                        // cuBLAS's A is our b, its B our a.
                        col_major_ref(&cm, &bv, &av, &mut got);
                        assert_eq!(got, want, "{m}×{n}×{k} ta {ta} tb {tb} pad {pad}");
                    }
                }
            }
        }
    }

    /// The layouts the linear layer's three GEMMs get (GPT-2's Conv1D `[IC, OC]` weight):
    /// forward `out = inp @ W`, `dinp = dout @ Wᵀ`, `dW += inpᵀ @ dout`.
    #[test]
    fn linear_layouts_are_cublas_layouts() {
        let (n, ic, oc) = (8, 3, 5);
        let t = Ty::Bf16;
        let fwd = Gemm::new(
            n,
            oc,
            ic,
            Operand::new(0, t, ic),
            Operand::new(0, t, oc),
            Operand::new(0, t, oc),
        );
        let cm = col_major(&fwd).unwrap();
        // outᵀ[OC, N] = Wᵀ[OC, IC] · inpᵀ[IC, N]: W as stored (column-major OC × IC).
        assert_eq!((cm.m, cm.n, cm.k), (5, 8, 3));
        assert!(!cm.trans_a && !cm.trans_b);
        assert_eq!((cm.a.rows, cm.a.cols, cm.a.ld), (5, 3, 5));
        assert_eq!((cm.b.rows, cm.b.cols, cm.b.ld), (3, 8, 3));
        assert_eq!((cm.d.rows, cm.d.cols, cm.d.ld), (5, 8, 5));
        // dW[IC, OC] += inpᵀ @ dout: inp read transposed.
        let dw = Gemm::new(
            ic,
            oc,
            n,
            Operand::new(0, t, ic).t(),
            Operand::new(0, t, oc),
            Operand::new(0, t, oc),
        )
        .accumulate();
        let cm = col_major(&dw).unwrap();
        assert!(!cm.trans_a && cm.trans_b);
        assert_eq!((cm.b.rows, cm.b.cols, cm.b.ld), (3, 8, 3));
        assert_eq!(dw.beta, 1.0);
    }

    #[test]
    fn a_column_block_keeps_the_wide_leading_dimension() {
        // LoRA: out[:, col..col + OC] += h[N, r] @ bᵀ, out rows ldo wide.
        let (n, r, oc, ldo) = (4, 2, 3, 10);
        let g = Gemm::new(
            n,
            oc,
            r,
            Operand::new(0, Ty::F16, r),
            Operand::new(0, Ty::F16, r).t(),
            Operand::new(2 * 7, Ty::F16, ldo),
        )
        .accumulate();
        let cm = col_major(&g).unwrap();
        assert_eq!((cm.d.rows, cm.d.cols, cm.d.ld), (3, 4, 10));
        assert!(cm.trans_a);
        assert_eq!((cm.a.rows, cm.a.cols, cm.a.ld), (2, 3, 2));
        assert_eq!(alignment(14), 2);
    }

    #[test]
    fn refused_gemms_say_why() {
        let o = |ty, ld| Operand::new(0, ty, ld);
        let mixed = Gemm::new(2, 2, 2, o(Ty::F32, 2), o(Ty::Bf16, 2), o(Ty::Bf16, 2));
        assert!(col_major(&mixed).unwrap_err().contains("does not multiply"));
        let narrow_out = Gemm::new(2, 2, 2, o(Ty::F32, 2), o(Ty::F32, 2), o(Ty::Bf16, 2));
        assert!(col_major(&narrow_out).is_err());
        let wide = Gemm::new(2, 2, 2, o(Ty::Bf16, 2), o(Ty::Bf16, 2), o(Ty::F32, 2));
        assert!(col_major(&wide).is_ok());
        let short = Gemm::new(2, 3, 2, o(Ty::F32, 2), o(Ty::F32, 2), o(Ty::F32, 3));
        assert!(
            col_major(&short)
                .unwrap_err()
                .contains("b: leading dimension 2")
        );
        let empty = Gemm::new(0, 3, 2, o(Ty::F32, 2), o(Ty::F32, 3), o(Ty::F32, 3));
        assert!(col_major(&empty).unwrap_err().contains("empty"));
    }

    #[test]
    fn alignments_are_capped_at_256_bytes() {
        assert_eq!(alignment(0), 256);
        assert_eq!(alignment(1 << 20), 256);
        assert_eq!(alignment(256 + 64), 64);
        assert_eq!(alignment(6), 2);
        assert!(bias_fusable(1 << 12) && !bias_fusable(1028));
    }
}
