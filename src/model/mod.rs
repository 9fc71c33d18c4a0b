//! What to train: a model's dimensions ([`ModelSpec`]), its family ([`Family`], the seam
//! behind which each architecture lives in one module, [`gpt2`] today) and its parameter
//! inventory ([`ParamLayout`]) with Hugging Face tensor names and layouts.

pub mod family;
pub mod gpt2;
pub mod params;
pub mod spec;

pub use params::{Init, ParamGroup, ParamLayout, ParamTensor, TiedName};
pub use spec::{Family, ModelSpec, Norm, Position};

impl ParamLayout {
    /// The parameter inventory of `spec`, by its family.
    pub fn new(spec: &ModelSpec) -> ParamLayout {
        spec.family.layout(spec)
    }
}
