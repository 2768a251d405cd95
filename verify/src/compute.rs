//! What an implementation computes in, and why it may produce nothing.
//! Kept apart from `impls`, `gpu`, `case` and `presets` so that each of them
//! can name these without importing another (no module cycles).

use deltaref_gpu::GpuError;
use thiserror::Error;

/// The scalar an implementation computes in (`--compute f64|f32`).
pub use deltaref::registry::Compute;

/// Why an implementation produced no results.
#[derive(Debug, Error)]
pub enum ComputeError {
    /// Invalid inputs (the oracle's validation, shared by every implementation).
    #[error(transparent)]
    Input(#[from] deltaref::Error),
    #[error("GPU: {0}")]
    Gpu(GpuError),
}

impl From<GpuError> for ComputeError {
    fn from(e: GpuError) -> Self {
        match e {
            GpuError::Input(i) => ComputeError::Input(i),
            other => ComputeError::Gpu(other),
        }
    }
}
