//! Backends compute; they do not decide. A backend never chooses placement or lifetime and
//! never allocates: every output and workspace slice is handed to it by the executor, carved
//! from the memory plan's arena. `cpu` is the only backend today.

pub mod cpu;
