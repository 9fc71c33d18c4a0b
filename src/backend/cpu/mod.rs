//! CPU kernels (f32, multi-threaded with rayon). Each layer is a `_forward`/`_backward` pair
//! side by side; each fast kernel has a naive reference twin in `naive` used by the tests.
//! Shape legend: B batch, T sequence, C channels, NH heads, hs = C/NH head size, N = B·T rows,
//! V vocabulary, IC/OC input/output channels of a linear layer.
//!
//! Kernels never allocate: workspace comes in as slices, sized by the `*_workspace_len`
//! functions, so the memory plan can account for it.
