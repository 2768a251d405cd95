//! Why a case could not be read, written or computed.

use std::path::Path;

use thiserror::Error;

use crate::compute::ComputeError;

#[derive(Debug, Error)]
pub enum CaseError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: cannot write: {why}")]
    Write { path: String, why: String },
    #[error("{path}: not a valid safetensors file: {why}")]
    Format { path: String, why: String },
    #[error("{path}: metadata: {why}")]
    Metadata { path: String, why: String },
    #[error("{path}: tensor `{tensor}`: {why}")]
    Tensor {
        path: String,
        tensor: String,
        why: String,
    },
    #[error("{path}: {source}")]
    Invalid {
        path: String,
        source: deltaref::Error,
    },
    #[error("{path}: GPU: {source}")]
    Gpu {
        path: String,
        source: deltaref_gpu::GpuError,
    },
    #[error("{0}")]
    Usage(String),
}

impl CaseError {
    /// How an implementation's failure on the case at `path` is reported.
    pub fn computing(path: &Path) -> impl Fn(ComputeError) -> CaseError + Copy + '_ {
        move |e| match e {
            ComputeError::Input(source) => CaseError::Invalid {
                path: path.display().to_string(),
                source,
            },
            ComputeError::Gpu(source) => CaseError::Gpu {
                path: path.display().to_string(),
                source,
            },
        }
    }
}
