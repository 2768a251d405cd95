//! deltaref-gpu: CUDA kernels for KDA (and GDN through them), DPLR and token-shift, in the chunked
//! structure of FLA's kernels (SPEC §3.1, §4, §6), so the oracle's
//! intermediates line up with theirs.
//!
//! The driver and NVRTC are loaded at run time and the kernels are compiled
//! from source for the device at hand: the crate builds, and its tests run
//! (and report that they skipped), on machines with no GPU and no CUDA.
//!
//! Inputs are f32 or bf16 ([`deltaref::Dtype::GPU`]); every kernel accumulates in f32 and
//! keeps states in f32. Each operator's `run` validates with the oracle's own
//! checks, runs forward and backward, and returns f64 copies shaped like the
//! oracle's outputs and gradients.
//!
//! ```no_run
//! # use deltaref_gpu::{Gpu, GpuImpl, Engine};
//! # use deltaref::Dtype;
//! # fn demo(x: &deltaref::kda::KdaInputs<f64>, d_o: &ndarray::ArrayD<f64>) -> deltaref_gpu::Result<()> {
//! let gpu = Gpu::probe()?; // GpuError::NoDriver on a machine without a GPU
//! let imp = GpuImpl { engine: Engine::Chunk(64), cp: None, storage: Dtype::Bf16 };
//! let run = deltaref_gpu::kda::run(&gpu, &x.refs(), &Default::default(), d_o, None, &imp)?;
//! println!("o {:?}, forward {:.3} ms", run.outputs.o.shape(), run.timings.forward_s * 1e3);
//! # Ok(()) }
//! ```

mod cp;
pub mod device;
pub mod dplr;
pub mod error;
pub mod gdn;
pub mod kda;
pub mod kernels;
mod pieces;
mod recurrent;
pub mod runner;
pub mod token_shift;

use deltaref::cp::PlanSpec;
use deltaref::Dtype;

pub use device::Gpu;
pub use error::{GpuError, Result};

/// The engine the kernels follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// One token at a time (SPEC §3 / §4).
    Naive,
    /// FLA's chunked form with this chunk size (16, 32 or 64; KDA only).
    Chunk(usize),
}

/// A GPU implementation: an engine, optionally under simulated CP, with the
/// inputs stored in `storage`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuImpl {
    pub engine: Engine,
    pub cp: Option<PlanSpec>,
    pub storage: Dtype,
}

/// Seconds of device work (stream drained around each phase; uploads,
/// pre-processing and copies back excluded), and of the host work around it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    pub forward_s: f64,
    pub backward_s: f64,
    /// Checking the inputs, converting them to the storage dtype, copying
    /// them to the device and the pre-processing kernels.
    pub upload_s: f64,
    /// The checks alone (shapes, options, every value finite), part of
    /// `upload_s`.
    pub check_s: f64,
    /// Gradient chain kernels, copies back and the widening to f64.
    pub download_s: f64,
    /// Compiling (or loading from the PTX cache) kernel modules during the
    /// run; part of the phase that first needed them.
    pub compile_s: f64,
}

/// What a GPU run returns: outputs, gradients and timings.
#[derive(Clone, Debug)]
pub struct Run<O, G> {
    pub outputs: O,
    pub grads: G,
    pub timings: Timings,
}
