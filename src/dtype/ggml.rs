//! ggml tensor types as GGUF files number them: the id on disk, ggml's name, and the block
//! geometry (values per block, bytes per block) every type needs for its byte size, whether
//! or not memwall can dequantize it.
//!
//! The table follows `ggml_type` and `type_traits` in ggml.c (ids 4, 5 and 31–33, 36–38 were
//! removed from ggml and are refused by name). Which types [`super::dequant`] decodes is
//! [`GgmlType::dequantizable`].

use anyhow::{Result, bail};
use std::fmt;

/// A tensor type of a GGUF file (`ggml_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GgmlType {
    /// The id stored in the tensor info.
    pub id: u32,
    /// ggml's name (`Q4_K`, `IQ2_XS`, ...).
    pub name: &'static str,
    /// Values per block (1 for plain types).
    pub block_size: u64,
    /// Bytes per block.
    pub type_size: u64,
}

/// `(id, name, values per block, bytes per block)`, from ggml.c's `type_traits`.
const TABLE: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
];

/// Ids ggml once had and removed, with their old names.
const REMOVED: &[(u32, &str)] = &[
    (4, "Q4_2"),
    (5, "Q4_3"),
    (31, "Q4_0_4_4"),
    (32, "Q4_0_4_8"),
    (33, "Q4_0_8_8"),
    (36, "IQ4_NL_4_4"),
    (37, "IQ4_NL_4_8"),
    (38, "IQ4_NL_8_8"),
];

/// The types [`super::dequant::dequantize`] decodes, in the order messages list them.
pub const DEQUANTIZABLE: &[&str] = &[
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K",
];

impl GgmlType {
    pub const F32: GgmlType = GgmlType::known(0);
    pub const F16: GgmlType = GgmlType::known(1);
    pub const Q4_0: GgmlType = GgmlType::known(2);
    pub const Q4_1: GgmlType = GgmlType::known(3);
    pub const Q5_0: GgmlType = GgmlType::known(6);
    pub const Q8_0: GgmlType = GgmlType::known(8);
    pub const Q4_K: GgmlType = GgmlType::known(12);
    pub const Q6_K: GgmlType = GgmlType::known(14);
    pub const BF16: GgmlType = GgmlType::known(30);

    /// The type with id `id`; an unknown or removed id is an error naming it.
    pub fn from_id(id: u32) -> Result<GgmlType> {
        if let Some(&(id, name, block_size, type_size)) = TABLE.iter().find(|t| t.0 == id) {
            return Ok(GgmlType {
                id,
                name,
                block_size,
                type_size,
            });
        }
        if let Some((_, name)) = REMOVED.iter().find(|t| t.0 == id) {
            bail!(
                "tensor type id {id} ({name}) was removed from ggml; re-quantize the model with a current llama.cpp"
            );
        }
        bail!(
            "unknown tensor type id {id} (ggml knows ids 0-{}); the file is damaged or newer than this reader",
            TABLE.last().map_or(0, |t| t.0)
        )
    }

    /// A table entry by id, for the constants (panics at compile time if absent).
    const fn known(id: u32) -> GgmlType {
        let mut i = 0;
        while i < TABLE.len() {
            if TABLE[i].0 == id {
                return GgmlType {
                    id,
                    name: TABLE[i].1,
                    block_size: TABLE[i].2,
                    type_size: TABLE[i].3,
                };
            }
            i += 1;
        }
        panic!("GgmlType::known: id not in TABLE")
    }

    /// Bytes of `n` values of this type, or `None` when `n` is not a whole number of blocks
    /// (or the size overflows).
    pub fn bytes_for(&self, n: u64) -> Option<u64> {
        if !n.is_multiple_of(self.block_size) {
            return None;
        }
        (n / self.block_size).checked_mul(self.type_size)
    }

    /// Whether [`super::dequant::dequantize`] decodes this type.
    pub fn dequantizable(&self) -> bool {
        DEQUANTIZABLE.contains(&self.name)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_names_and_sizes() {
        let t = GgmlType::from_id(12).unwrap();
        assert_eq!((t.name, t.block_size, t.type_size), ("Q4_K", 256, 144));
        assert_eq!(GgmlType::Q6_K.bytes_for(512), Some(420));
        assert_eq!(GgmlType::Q8_0.bytes_for(33), None);
        assert!(GgmlType::Q4_1.dequantizable());
        assert!(!GgmlType::from_id(13).unwrap().dequantizable());
        let e = format!("{:#}", GgmlType::from_id(99).unwrap_err());
        assert!(e.contains("unknown tensor type id 99"), "{e}");
        let e = format!("{:#}", GgmlType::from_id(4).unwrap_err());
        assert!(e.contains("Q4_2") && e.contains("removed"), "{e}");
    }
}
