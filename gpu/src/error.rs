//! Typed GPU errors: a machine without a driver, a missing NVRTC, a kernel
//! that does not compile, memory that runs out and problems the kernels do not
//! support each say what happened and what to do.

use cudarc::driver::DriverError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum GpuError {
    #[error("no CUDA driver: {why}; the GPU implementations need an NVIDIA driver")]
    NoDriver { why: String },
    #[error(
        "NVRTC (CUDA's runtime compiler) not found (tried the library path and {tried}); set \
         DELTAREF_NVRTC to the libnvrtc.so file, or CUDA_HOME to the toolkit"
    )]
    NoNvrtc { tried: String },
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA driver error in {what}: {source}")]
    Driver { what: String, source: DriverError },
    #[error("kernel source `{source_name}` does not compile (options {options}):\n{log}")]
    Compile {
        source_name: String,
        options: String,
        log: String,
    },
    #[error(
        "out of GPU memory: {what} needs {bytes} bytes, {free} of {total} bytes are free \
         (shorten the sequences or run fewer heads)"
    )]
    OutOfMemory {
        what: String,
        bytes: usize,
        free: usize,
        total: usize,
    },
    #[error("not supported by the GPU kernels: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Input(#[from] deltaref::Error),
}

pub type Result<T> = std::result::Result<T, GpuError>;
