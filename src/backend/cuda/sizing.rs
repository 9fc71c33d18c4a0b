//! What the planner asks of the CUDA backend ([`CudaSizing`]), answered without a GPU: the
//! plan for `--device cuda` is made on any machine, by any build.
//!
//! The GPU's one tier is its memory ([`Tier::Device`]): every plan buffer is packed there,
//! the backend's own scratch among them ([`Scratch`], the plan's persistent
//! `backend.scratch`, sized from the ops): cuBLASLt's workspace, the weight tile a GEMM reads
//! in the storage type (an f32 master weight converted, or a quantized base's blocks
//! decoded, a chunk of at most [`WEIGHT_CHUNK_BYTES`] at a time: a linear layer's output or
//! input features, [`linear_tile`], the LM head's vocabulary rows, [`lm_head_tile`]), the partial sums
//! of the deterministic reductions, attention's backward row statistics and the embedding
//! backward's row links. The kernels' plan workspaces (`attention_workspace_elems` and the
//! two GEMM tiles) are therefore empty on the GPU. The CUDA context's own device memory is
//! the baseline ([`CONTEXT_BYTES`]).

use crate::dtype::DType;
use crate::ir::schedule::{Op, OpEntry};
use crate::ir::{Sizing, Tier};

/// The planner's view of a CUDA GPU.
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaSizing;

/// cuBLASLt's workspace (llm.c's 32 MiB: enough for its split-K and stream-K algorithms on
/// Hopper).
pub const CUBLASLT_WORKSPACE_BYTES: u64 = 32 << 20;

/// Device memory the CUDA context, cuBLASLt's handle and the loaded kernels hold outside the
/// plan: the baseline of a GPU's peak, as the process's resident memory is the CPU's.
/// Measured: 552402944 bytes (527 MiB) in use when memwall had opened an H200 (driver
/// 580.159.04, CUDA 13.0; docs/gpu-runs/2026-11-28.md), where the whole bench then peaked
/// 7 MiB above plan + context. Another card or driver differs by some MiB: `bench` reports
/// the device's own figure.
pub const CONTEXT_BYTES: u64 = 527 << 20;

/// Blocks a column reduction over rows (a bias gradient) is cut into: each writes one f32
/// partial row, summed in block order by a second kernel.
pub const REDUCE_BLOCKS: u64 = 256;

/// Rows per chunk of a norm's parameter gradients (`kernels/norm.cu`, R): the
/// `*_backward_partials` kernels sum rows in chunks of this many, one f32 partial row per
/// chunk, and `norm_reduce_partials` sums the chunks in order. Fixed, so the bits depend on
/// the shape alone.
pub const NORM_CHUNK_ROWS: u64 = 64;

/// Gradient elements per f64 partial of the gradient norm (`kernels/optimizer.cu`,
/// `GN_CHUNK`).
pub const GRADNORM_CHUNK: u64 = 16384;

/// The most bytes of a weight that the weight tile holds at once (in the type its GEMMs
/// read): a weight larger than this is converted or decoded a chunk at a time
/// ([`weight_chunk`]), each chunk's GEMM writing its block of the output. For the LM head
/// `[V, C]` the chunks are of vocabulary rows ([`lm_head_vocab_rows`]), so Llama 3's 128256 ×
/// 4096 (1002 MiB in bf16) costs the tile 128 MiB; a linear layer's are of its output
/// features in the forward and of its input features in the backward ([`linear_tile`]), so
/// a 70B's gate|up (57344 × 8192: 896 MiB in bf16) costs it the same. A head that fits is
/// decoded once per op; one that does not is decoded 2K − 1 times per row chunk (K chunks),
/// which is why the bound holds GPT-2's whole head (74 MiB in bf16): at 64 MiB its two chunks
/// were converted 150 times a step on an H200 (docs/gpu-runs/2026-11-28.md). A linear
/// layer's chunks are each decoded once per GEMM, as its whole was.
pub const WEIGHT_CHUNK_BYTES: u64 = 128 << 20;

/// Rows (or columns) the chunks of [`WEIGHT_CHUNK_BYTES`] are counted in: a chunk's first row
/// or column is a multiple of it, so its block of the GEMM's output (f32 or T) starts 512-byte
/// aligned, as cuBLASLt's fastest algorithms want, and a column chunk of a quantized weight is
/// whole blocks (of 32 or 256 values).
pub const CHUNK_QUANTUM: usize = 256;

/// Of a weight's dimension of `len` (the one cut), the length a chunk takes when each of its
/// elements brings `width · elem` bytes to the tile: as many whole [`CHUNK_QUANTUM`]s as fit
/// in [`WEIGHT_CHUNK_BYTES`] (at least one quantum: a width over 256 KiB overshoots the bound),
/// all of `len` when that is fewer (the last chunk may be shorter). A function of the shape
/// alone, so the chunks, and the order of any sums over them, are the same on every run.
pub fn weight_chunk(len: usize, width: usize, elem: u64) -> usize {
    let row = (width as u64 * elem).max(1);
    let fit = (WEIGHT_CHUNK_BYTES / row) as usize / CHUNK_QUANTUM * CHUNK_QUANTUM;
    fit.max(CHUNK_QUANTUM).min(len.max(1))
}

/// Vocabulary rows of the LM head's weight (`[V, C]`, `elem` bytes a value in the tile)
/// decoded at a time ([`weight_chunk`] over V).
pub fn lm_head_vocab_rows(c: usize, v: usize, elem: u64) -> usize {
    weight_chunk(v, c, elem)
}

/// How a linear op's GEMM reads its weight (logically `[IC, OC]`) through the tile, `elem`
/// bytes a value there: the forward (`backward` false) by chunks of its OC output features
/// (each `[chunk, IC]` of the weight, writing a column block of `out[N, OC]`), the backward's
/// input gradient by chunks of its IC input features (`[OC, chunk]`, writing a column block of
/// `dinp[N, IC]`). Returns (the chunk's length, the tile's bytes). One chunk when the weight
/// fits [`WEIGHT_CHUNK_BYTES`].
pub fn linear_tile(ic: usize, oc: usize, elem: u64, backward: bool) -> (usize, u64) {
    let (len, width) = if backward { (ic, oc) } else { (oc, ic) };
    let chunk = weight_chunk(len, width, elem);
    (chunk, chunk as u64 * width as u64 * elem)
}

/// Chunks of [`NORM_CHUNK_ROWS`] rows over `n` rows: the partial rows a norm's backward
/// writes per parameter vector (P).
pub fn norm_chunks(n: u64) -> u64 {
    n.div_ceil(NORM_CHUNK_ROWS)
}

/// The f64 partials of the gradient norm over `len` gradient elements.
pub fn gradnorm_parts(len: u64) -> u64 {
    len.div_ceil(GRADNORM_CHUNK)
}

/// The backend's own device scratch for a schedule, region by region (bytes; each region
/// starts at a 256-byte boundary of the one allocation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scratch {
    /// cuBLASLt's workspace.
    pub cublaslt: u64,
    /// The largest chunk of a weight a GEMM reads, in the type the GEMM reads it: the storage
    /// type's copy of an f32 master weight under mixed precision, or a quantized base's weight
    /// decoded (to the storage type, f32 in fp32 plans); of a linear layer, a chunk of its
    /// output or input features ([`linear_tile`]); of the LM head, one of its vocabulary rows
    /// ([`lm_head_tile`]). Empty for an fp32 plan with no quantized base
    /// (its GEMMs read the f32 weights where they are). Under mixed precision it also holds
    /// the other f32 operands rounded to the storage type beside the weight: the LM head's
    /// dlogits chunk and f32 input-gradient sum ([`lm_head_tile`]) and a LoRA adapter's `dh`
    /// and f32 products ([`lora_tile`]).
    pub weight_tile: u64,
    /// f32 partial rows of the column reductions over rows, for the largest: a norm's
    /// backward, P = ceil(N / [`NORM_CHUNK_ROWS`]) rows of C (× 2 for a LayerNorm: its weight
    /// and bias); a bias gradient, [`REDUCE_BLOCKS`] × OC × 2.
    pub partials: u64,
    /// f64 partials of the gradient norm: ceil(len / [`GRADNORM_CHUNK`]) of the largest
    /// range.
    pub norm_partials: u64,
    /// Attention's backward: `D = rowsum(dout ⊙ out)` `[B, NH, T]` f32 of the largest.
    pub attention_rows: u64,
    /// The embedding backward's row links (`kernels/embedding.cu`): u32 `[2·N]` of the
    /// largest.
    pub link: u64,
}

/// The alignment of the scratch's start and of each of its regions (cuBLASLt's workspace
/// must be 256-byte aligned: an H200 refused one 64 bytes off).
pub const SCRATCH_ALIGN: u64 = 256;

fn align(b: u64) -> u64 {
    b.next_multiple_of(SCRATCH_ALIGN)
}

impl Scratch {
    /// The scratch `ops` need, activations stored as `storage`.
    pub fn for_ops(ops: &[OpEntry], storage: DType) -> Scratch {
        let mut s = Scratch {
            cublaslt: CUBLASLT_WORKSPACE_BYTES,
            ..Scratch::default()
        };
        let tile_elem = storage.size().unwrap_or(4) as u64;
        let mixed = storage != DType::F32;
        for e in ops {
            // A GEMM's weight, when the GEMM cannot read it where it is: a chunk at a time.
            let weight = match &e.op {
                Op::Matmul { ic, oc, .. } => linear_tile(*ic, *oc, tile_elem, false).1,
                Op::MatmulBackward { ic, oc, .. } => linear_tile(*ic, *oc, tile_elem, true).1,
                _ => 0,
            };
            if mixed || e.frozen {
                s.weight_tile = s.weight_tile.max(weight);
            }
            match &e.op {
                Op::LmHeadLoss {
                    c,
                    v,
                    rows_per_chunk,
                    dinp,
                    ..
                } if mixed || e.frozen => {
                    let dlogits = mixed && dinp.is_some();
                    let tile = lm_head_tile(*c, *v, *rows_per_chunk, storage, dlogits);
                    s.weight_tile = s.weight_tile.max(tile.bytes);
                }
                Op::LmHeadLast { c, v, .. } if mixed || e.frozen => {
                    let tile = lm_head_tile(*c, *v, 1, storage, false);
                    s.weight_tile = s.weight_tile.max(tile.bytes);
                }
                Op::LoraForward {
                    rows, ic, oc, r, ..
                }
                | Op::LoraBackward {
                    rows, ic, oc, r, ..
                } if mixed => {
                    let (_, bytes) = lora_tile(rows.n(), *ic, *oc, *r);
                    s.weight_tile = s.weight_tile.max(bytes);
                }
                _ => {}
            }
            let partials = match &e.op {
                // A frozen norm computes no parameter gradient: no partials.
                Op::LayerNormBackward { rows, c, .. } if !e.frozen => {
                    2 * norm_chunks(rows.n() as u64) * *c as u64 * 4
                }
                Op::RmsNormBackward { rows, c, .. } if !e.frozen => {
                    norm_chunks(rows.n() as u64) * *c as u64 * 4
                }
                // `[P, 2·hd]`: q_norm's and k_norm's columns.
                Op::QkNormBackward { rows, hd, .. } if !e.frozen => {
                    norm_chunks(rows.n() as u64) * 2 * *hd as u64 * 4
                }
                Op::MatmulBackward { oc, b: Some(_), .. } => REDUCE_BLOCKS * *oc as u64 * 2 * 4,
                _ => 0,
            };
            s.partials = s.partials.max(partials);
            if let Op::GradNorm { range, .. } = &e.op {
                s.norm_partials = s.norm_partials.max(gradnorm_parts(range.len() as u64) * 8);
            }
            if let Op::AttentionBackward { rows, nh, .. } = &e.op {
                s.attention_rows = s.attention_rows.max((rows.n() * nh * 4) as u64);
            }
            if let Op::EncoderBackward { rows, .. } = &e.op
                && !e.frozen
            {
                s.link = s.link.max(2 * rows.n() as u64 * 4);
            }
        }
        s
    }

    /// Byte offsets of the regions, in field order, and the total.
    pub fn offsets(&self) -> ([u64; 6], u64) {
        let sizes = [
            self.cublaslt,
            self.weight_tile,
            self.partials,
            self.norm_partials,
            self.attention_rows,
            self.link,
        ];
        let mut at = 0;
        let mut offsets = [0; 6];
        for (o, size) in offsets.iter_mut().zip(sizes) {
            *o = at;
            at += align(size);
        }
        (offsets, at)
    }

    /// Bytes of the one scratch allocation.
    pub fn total(&self) -> u64 {
        match self.offsets().1 {
            0 => 0,
            // What aligning the start to SCRATCH_ALIGN may skip (a plan buffer starts ALIGNed).
            at => at + SCRATCH_ALIGN - crate::ir::buffer::ALIGN,
        }
    }

    /// Byte offset of the [`Scratch::link`] region.
    pub fn link_offset(&self) -> u64 {
        self.offsets().0[5]
    }
}

/// The LM head's share of [`Scratch::weight_tile`]: where each part lies (byte offsets from
/// the tile's start) and how the vocabulary is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LmHeadTile {
    /// Vocabulary rows per chunk of the weight ([`lm_head_vocab_rows`]; the last chunk may
    /// be shorter).
    pub vocab_rows: usize,
    /// Chunks over the vocabulary (1: the weight is decoded once per op).
    pub chunks: usize,
    /// The storage type's copy of one row chunk's f32 dlogits `[rows_per_chunk, V]`, in a
    /// bf16/f16 training plan (its two backward GEMMs multiply it with T operands).
    pub dlogits: Option<u64>,
    /// `dinp`'s f32 sum over the vocabulary chunks, `[rows_per_chunk, C]`, rounded to T once
    /// at the end: in a bf16/f16 training plan whose vocabulary is cut (`chunks > 1`).
    pub dinp_sum: Option<u64>,
    /// Bytes of all the parts.
    pub bytes: u64,
}

/// The LM head's [`LmHeadTile`]: at 0, one chunk of the weight `[vocab_rows, C]` in the type
/// its GEMMs read (the storage type's copy, or a quantized head decoded; f32 in fp32 plans);
/// then, with `dlogits` (a bf16/f16 training plan), the storage type's copy of one row chunk's
/// f32 dlogits `[rows_per_chunk, V]`, and when the vocabulary is cut, the f32 sum of `dinp`
/// `[rows_per_chunk, C]` over the chunks. Generation's `LmHeadLast` is `rows_per_chunk` 1
/// without `dlogits`: the weight chunk alone.
pub fn lm_head_tile(
    c: usize,
    v: usize,
    rows_per_chunk: usize,
    storage: DType,
    dlogits: bool,
) -> LmHeadTile {
    let elem = storage.size().unwrap_or(4) as u64;
    let vocab_rows = lm_head_vocab_rows(c, v, elem);
    let chunks = v.div_ceil(vocab_rows).max(1);
    // Each part at a 256-byte boundary after the one before; `end` is the last one's end.
    let mut end = vocab_rows as u64 * c as u64 * elem;
    let mut part = |bytes: u64| {
        let offset = align(end);
        end = offset + bytes;
        offset
    };
    let rows = rows_per_chunk as u64;
    let dlogits_at = dlogits.then(|| part(rows * v as u64 * elem));
    let dinp_sum = (dlogits && chunks > 1).then(|| part(rows * c as u64 * 4));
    LmHeadTile {
        vocab_rows,
        chunks,
        dlogits: dlogits_at,
        dinp_sum,
        bytes: end,
    }
}

/// A LoRA adapter's share of [`Scratch::weight_tile`] in a bf16/f16 plan (bytes; f32 plans
/// need none): at 0, `[N, r]` of f32 or T (the forward's f32 `xd @ aᵀ` with dropout; the
/// backward's T copy of `dh`); then the adapter weight `a` `[r, IC]` or `b` `[OC, r]` as T, or
/// the backward's f32 `dhᵀ @ xd` `[r, IC]` with dropout (one at a time). Returns (the second
/// part's offset, the bytes of both); `n` is the plan's N.
pub fn lora_tile(n: usize, ic: usize, oc: usize, r: usize) -> (u64, u64) {
    let at = align(n as u64 * r as u64 * 4);
    (at, at + (r as u64 * ic.max(oc) as u64 * 4))
}

impl Sizing for CudaSizing {
    /// Attention keeps no plan workspace on the GPU: the forward's tiles are in shared
    /// memory, the backward's row statistics in the backend's scratch ([`Scratch`]).
    fn attention_workspace_elems(
        &self,
        _storage: DType,
        _t: usize,
        _hs: usize,
        _window: Option<usize>,
        _threads: usize,
    ) -> usize {
        0
    }

    /// The storage-type weight tile is in the backend's scratch ([`Scratch::weight_tile`]).
    fn mixed_gemm_workspace_elems(&self) -> usize {
        0
    }

    /// A quantized base's weight is decoded into the backend's scratch
    /// ([`Scratch::weight_tile`]).
    fn quantized_gemm_workspace_elems(&self, _cols: usize) -> usize {
        0
    }

    /// cuBLASLt and the kernels allocate nothing for themselves: their scratch is a plan
    /// buffer ([`Sizing::scratch_bytes`]).
    fn library_scratch_bytes(&self, _ops: &[OpEntry], _storage: DType, _threads: usize) -> u64 {
        0
    }

    fn scratch_bytes(&self, ops: &[OpEntry], storage: DType) -> u64 {
        Scratch::for_ops(ops, storage).total()
    }

    fn compute_note(&self, storage: DType) -> Option<String> {
        Some(match storage {
            DType::F32 => "GEMMs on cuBLASLt in f32 (TF32 off)".to_string(),
            s => format!("GEMMs on cuBLASLt with {s:?} inputs and f32 accumulation"),
        })
    }

    fn tiers(&self) -> &'static [Tier] {
        &[Tier::Device, Tier::Host]
    }

    fn baseline_bytes(&self) -> Option<u64> {
        Some(CONTEXT_BYTES)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::BufId;
    use crate::ir::schedule::{Phase, Rows};

    fn entry(op: Op, frozen: bool) -> OpEntry {
        OpEntry {
            name: "op".into(),
            phase: Phase::Backward,
            op,
            flops: 0,
            params: None,
            grads: None,
            micro: 0,
            frozen,
        }
    }

    const ROWS: Rows = Rows { b: 4, t: 1000 }; // N = 4000: 63 chunks of 64 rows

    fn layer_norm_backward(c: usize) -> Op {
        Op::LayerNormBackward {
            dinp: BufId(0),
            dout: BufId(1),
            inp: BufId(2),
            mean: BufId(3),
            rstd: BufId(4),
            w: 0..c,
            b: c..2 * c,
            rows: ROWS,
            c,
        }
    }

    #[test]
    fn partials_hold_the_largest_norm_backward() {
        let rms = Op::RmsNormBackward {
            dinp: BufId(0),
            dout: BufId(1),
            inp: BufId(2),
            rstd: BufId(4),
            w: 0..4096,
            offset: 0.0,
            rows: ROWS,
            c: 4096,
        };
        let s = Scratch::for_ops(&[entry(rms.clone(), false)], DType::Bf16);
        assert_eq!(s.partials, 63 * 4096 * 4);
        let s = Scratch::for_ops(
            &[entry(rms, false), entry(layer_norm_backward(768), false)],
            DType::Bf16,
        );
        assert_eq!(s.partials, 63 * 4096 * 4);
        let s = Scratch::for_ops(&[entry(layer_norm_backward(4096), false)], DType::F32);
        assert_eq!(s.partials, 2 * 63 * 4096 * 4);
        // A frozen norm computes no parameter gradient.
        let s = Scratch::for_ops(&[entry(layer_norm_backward(4096), true)], DType::F32);
        assert_eq!(s.partials, 0);
        // Qwen3's q/k norms: [P, 2·hd].
        let qk = Op::QkNormBackward {
            d: BufId(0),
            inp: BufId(1),
            rstd: BufId(2),
            w: 0..256,
            offset: 0.0,
            rows: ROWS,
            nh: 16,
            nkv: 8,
            hd: 128,
        };
        let s = Scratch::for_ops(&[entry(qk.clone(), false)], DType::Bf16);
        assert_eq!(s.partials, 63 * 256 * 4);
        assert_eq!(
            Scratch::for_ops(&[entry(qk, true)], DType::Bf16).partials,
            0
        );
    }

    #[test]
    fn gradient_norm_partials_hold_the_largest_range() {
        let norm = |len: usize| {
            entry(
                Op::GradNorm {
                    range: 10..10 + len,
                    out: BufId(0),
                    slot: 0,
                    parts: false,
                },
                false,
            )
        };
        let s = Scratch::for_ops(&[norm(16384 * 3 + 1), norm(5)], DType::F32);
        assert_eq!(s.norm_partials, 4 * 8);
        assert_eq!(Scratch::for_ops(&[norm(0)], DType::F32).norm_partials, 0);
    }

    #[test]
    fn the_row_links_are_the_last_region() {
        let op = Op::EncoderBackward {
            dout: BufId(0),
            tokens: BufId(1),
            positions: None,
            wte: 0..768 * 50257,
            wpe: None,
            first_token: 0,
            rows: ROWS,
            c: 768,
            scale: 1.0,
        };
        let s = Scratch::for_ops(&[entry(op, false)], DType::Bf16);
        assert_eq!(s.link, 2 * 4000 * 4);
        let (o, total) = s.offsets();
        assert_eq!(s.link_offset(), o[5]);
        assert_eq!(o[5] % 256, 0);
        assert!(o[5] >= o[4] + s.attention_rows);
        assert_eq!(total, o[5] + align(s.link));
    }

    /// The scratch's regions start at its first 256-byte boundary (cuBLASLt's workspace
    /// alignment), wherever the plan put the buffer: its bytes hold them from there.
    #[test]
    fn the_scratch_holds_its_regions_from_any_aligned_start() {
        let s = Scratch::for_ops(&[], DType::Bf16);
        let (_, regions) = s.offsets();
        assert!(regions > 0);
        for k in 0..SCRATCH_ALIGN / crate::ir::buffer::ALIGN {
            let ptr = (1 << 20) + k * crate::ir::buffer::ALIGN;
            let at = ptr.next_multiple_of(SCRATCH_ALIGN);
            assert!(at + regions <= ptr + s.total(), "start {ptr}");
        }
        assert_eq!(Scratch::default().total(), 0);
    }

    fn lm_head(dinp: Option<BufId>) -> OpEntry {
        entry(
            Op::LmHeadLoss {
                inp: BufId(0),
                targets: BufId(1),
                losses: BufId(2),
                logits: BufId(3),
                dinp,
                w: 0..7 * 100,
                rows: Rows { b: 2, t: 8 },
                c: 7,
                v: 100,
                rows_per_chunk: 4,
                vocab: None,
                teacher: None,
                row_stats: None,
            },
            false,
        )
    }

    #[test]
    fn the_lm_head_tile_holds_the_weight_then_a_dlogits_chunk() {
        // bf16 training, one vocabulary chunk: the weight (1400 bytes), then at 1536 the
        // 4 × 100 bf16 dlogits; no f32 sum of dinp (one chunk: one GEMM).
        let tile = lm_head_tile(7, 100, 4, DType::Bf16, true);
        assert_eq!(
            tile,
            LmHeadTile {
                vocab_rows: 100,
                chunks: 1,
                dlogits: Some(1536),
                dinp_sum: None,
                bytes: 1536 + 800,
            }
        );
        let eval = lm_head_tile(7, 100, 4, DType::Bf16, false);
        assert_eq!((eval.dlogits, eval.bytes), (None, 1400));
        let s = Scratch::for_ops(&[lm_head(Some(BufId(4)))], DType::Bf16);
        assert_eq!(s.weight_tile, 1536 + 800);
        let s = Scratch::for_ops(&[lm_head(None)], DType::Bf16);
        assert_eq!(s.weight_tile, 1400);
        // fp32: the GEMMs read the f32 weight and logits in place.
        assert_eq!(
            Scratch::for_ops(&[lm_head(Some(BufId(4)))], DType::F32).weight_tile,
            0
        );
    }

    #[test]
    fn a_large_linear_weight_is_decoded_a_bounded_chunk_at_a_time() {
        // Llama 3 8B's gate|up (IC 4096, OC 28672) in bf16: 224 MiB whole; the forward's
        // chunks of 16384 output features, the backward's of 2304 input features.
        assert_eq!(
            linear_tile(4096, 28672, 2, false),
            (16384, WEIGHT_CHUNK_BYTES)
        );
        assert_eq!(linear_tile(4096, 28672, 2, true), (2304, 2304 * 28672 * 2));
        // A 70B's (IC 8192, OC 57344): 896 MiB whole, 128 and 112 MiB a chunk.
        assert_eq!(
            linear_tile(8192, 57344, 2, false),
            (8192, WEIGHT_CHUNK_BYTES)
        );
        assert_eq!(linear_tile(8192, 57344, 2, true), (1024, 1024 * 57344 * 2));
        // A weight within the bound is one chunk, the whole (GPT-2's c_fc).
        assert_eq!(linear_tile(768, 3072, 2, false), (3072, 768 * 3072 * 2));
        assert_eq!(linear_tile(768, 3072, 2, true), (768, 768 * 3072 * 2));
        let mut s = Scratch::default();
        for (ic, oc) in [(4096, 28672), (14336, 4096), (8192, 57344), (28672, 8192)] {
            for backward in [false, true] {
                let (chunk, bytes) = linear_tile(ic, oc, 2, backward);
                assert!(bytes <= WEIGHT_CHUNK_BYTES);
                assert_eq!(chunk % CHUNK_QUANTUM, 0);
                s.weight_tile = s.weight_tile.max(bytes);
            }
        }
        assert_eq!(s.weight_tile, WEIGHT_CHUNK_BYTES);
    }

    #[test]
    fn a_large_vocabulary_is_decoded_a_bounded_chunk_at_a_time() {
        // Llama 3 8B (V 128256, C 4096) in bf16: 16384 rows (128 MiB) a chunk, 8 chunks.
        assert_eq!(lm_head_vocab_rows(4096, 128256, 2), 16384);
        // An f32 tile (a quantized head in an fp32 plan): half the rows.
        assert_eq!(lm_head_vocab_rows(4096, 128256, 4), 8192);
        // GPT-2 (V 50257, C 768) in bf16: the whole head; in f32, whole quanta of 256 rows.
        assert_eq!(lm_head_vocab_rows(768, 50257, 2), 50257);
        assert_eq!(lm_head_vocab_rows(768, 50257, 4), 43520);
        // A head within the bound is one chunk; a row past 256 KiB still takes a quantum.
        assert_eq!(lm_head_vocab_rows(576, 49152, 2), 49152);
        assert_eq!(lm_head_vocab_rows(1 << 20, 1000, 2), CHUNK_QUANTUM);
        assert_eq!(lm_head_vocab_rows(8, 0, 2), 1);
        for (c, v, elem) in [(4096, 128256, 2), (8192, 128256, 2), (768, 50257, 4)] {
            let rows = lm_head_vocab_rows(c, v, elem);
            assert!(rows as u64 * c as u64 * elem <= WEIGHT_CHUNK_BYTES);
            assert_eq!(rows % CHUNK_QUANTUM, 0);
        }

        // Training, 128 rows a chunk: the weight chunk, the bf16 dlogits of the row chunk,
        // then dinp's f32 sum over the 8 vocabulary chunks.
        let tile = lm_head_tile(4096, 128256, 128, DType::Bf16, true);
        let dlogits = 128 * 128256 * 2;
        assert_eq!(tile.vocab_rows, 16384);
        assert_eq!(tile.chunks, 8);
        assert_eq!(tile.dlogits, Some(WEIGHT_CHUNK_BYTES));
        assert_eq!(tile.dinp_sum, Some(WEIGHT_CHUNK_BYTES + dlogits));
        assert_eq!(tile.bytes, WEIGHT_CHUNK_BYTES + dlogits + 128 * 4096 * 4);
        // The whole weight would have been 1002 MiB.
        assert!(tile.bytes < 200 << 20);
        let mut op = lm_head(Some(BufId(4)));
        if let Op::LmHeadLoss {
            c,
            v,
            rows_per_chunk,
            w,
            ..
        } = &mut op.op
        {
            (*c, *v, *rows_per_chunk, *w) = (4096, 128256, 128, 0..4096 * 128256);
        }
        op.frozen = true;
        assert_eq!(
            Scratch::for_ops(std::slice::from_ref(&op), DType::Bf16).weight_tile,
            tile.bytes
        );
        // A quantized head in an fp32 plan: an f32 weight chunk, nothing else.
        assert_eq!(
            Scratch::for_ops(&[op], DType::F32).weight_tile,
            WEIGHT_CHUNK_BYTES
        );

        // Generation's last row: the weight chunk alone (a frozen, quantized head in fp32).
        let last = entry(
            Op::LmHeadLast {
                inp: BufId(0),
                logits: BufId(1),
                w: 0..4096 * 128256,
                rows: Rows { b: 1, t: 8 },
                c: 4096,
                v: 128256,
            },
            true,
        );
        assert_eq!(
            Scratch::for_ops(std::slice::from_ref(&last), DType::F32).weight_tile,
            WEIGHT_CHUNK_BYTES
        );
        let trained = OpEntry {
            frozen: false,
            ..last
        };
        assert_eq!(Scratch::for_ops(&[trained], DType::F32).weight_tile, 0);
    }

    #[test]
    fn lora_tiles_exist_under_mixed_precision_only() {
        let (n, ic, oc, r) = (16, 64, 96, 8);
        let (at, total) = lora_tile(n, ic, oc, r);
        assert_eq!(at, 512);
        assert_eq!(total, 512 + (r * oc * 4) as u64);
        let op = entry(
            Op::LoraForward {
                inp: BufId(0),
                out: BufId(1),
                h: BufId(2),
                a: 0..r * ic,
                b: r * ic..r * ic + oc * r,
                rows: Rows { b: 2, t: 8 },
                ic,
                oc,
                r,
                col: 0,
                ldo: oc,
                scale: 2.0,
                dropout: None,
            },
            false,
        );
        assert_eq!(
            Scratch::for_ops(std::slice::from_ref(&op), DType::F16).weight_tile,
            total
        );
        assert_eq!(Scratch::for_ops(&[op], DType::F32).weight_tile, 0);
    }
}
