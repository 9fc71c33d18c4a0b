//! The AdamW moments as the optimizer stores them, borrowed for saving and loading.
//!
//! In `optimizer.safetensors`, f32 moments are saved per tensor under Hugging Face names
//! (`exp_avg.<name>`, `exp_avg_sq.<name>`, F32, the tensor's shape); bf16 moments as two flat
//! BF16 tensors `exp_avg`, `exp_avg_sq` \[params\]; int8 moments as flat code tensors
//! `exp_avg` (I8) and `exp_avg_sq` (U8) \[params\] with their F32 block scales
//! `exp_avg.absmax`, `exp_avg_sq.absmax` \[blocks\]. The bytes are the optimizer's own, so a
//! resumed run continues bitwise.

use super::strategy::OptimState;
use half::bf16;

/// Read-only moments (saving).
pub enum Moments<'a> {
    F32 {
        m: &'a [f32], // [params]
        v: &'a [f32], // [params]
    },
    Bf16 {
        m: &'a [bf16], // [params]
        v: &'a [bf16], // [params]
    },
    Int8 {
        m: &'a [i8],         // [params] codes
        m_absmax: &'a [f32], // [blocks]
        v: &'a [u8],         // [params] codes
        v_absmax: &'a [f32], // [blocks]
    },
}

/// Writable moments (loading).
pub enum MomentsMut<'a> {
    F32 {
        m: &'a mut [f32],
        v: &'a mut [f32],
    },
    Bf16 {
        m: &'a mut [bf16],
        v: &'a mut [bf16],
    },
    Int8 {
        m: &'a mut [i8],
        m_absmax: &'a mut [f32],
        v: &'a mut [u8],
        v_absmax: &'a mut [f32],
    },
}

impl Moments<'_> {
    pub fn format(&self) -> OptimState {
        match self {
            Moments::F32 { .. } => OptimState::F32,
            Moments::Bf16 { .. } => OptimState::Bf16,
            Moments::Int8 { .. } => OptimState::Int8,
        }
    }
}

impl MomentsMut<'_> {
    pub fn format(&self) -> OptimState {
        match self {
            MomentsMut::F32 { .. } => OptimState::F32,
            MomentsMut::Bf16 { .. } => OptimState::Bf16,
            MomentsMut::Int8 { .. } => OptimState::Int8,
        }
    }
}
