//! What to train: the GPT-2 family's dimensions ([`ModelSpec`]) and its parameter inventory
//! ([`ParamLayout`]), with Hugging Face tensor names and layouts.

pub mod params;
pub mod spec;

pub use params::{LayerParams, ParamLayout, ParamTensor};
pub use spec::ModelSpec;
