//! How messages name a GPU: as `--device` takes it.

/// GPU `index` as `--device` takes it (`cuda`, `cuda:1`).
pub fn flag(index: usize) -> String {
    match index {
        0 => "cuda".into(),
        i => format!("cuda:{i}"),
    }
}
