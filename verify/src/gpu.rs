//! The GPU implementations (`--impl gpu-naive|gpu-chunk|gpu-cp`): the
//! process's device, opened on first use, and a case run on the
//! `deltaref-gpu` kernels ([`deltaref_gpu::runner`]) as a name → tensor map.

use std::sync::OnceLock;

use deltaref_gpu::{Gpu, GpuError, GpuImpl, Timings};
use ndarray::ArrayD;

use crate::case::{Case, Dtype, Op};
pub use crate::compute::ComputeError;
use crate::outputs::Tensors;

/// The process's GPU (device 0), opened once; a failed probe is retried on
/// the next call and its error returned.
pub fn device() -> Result<&'static Gpu, GpuError> {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    if let Some(g) = GPU.get() {
        return Ok(g);
    }
    let g = Gpu::probe()?;
    Ok(GPU.get_or_init(|| g))
}

/// The storage a case's inputs imply: bf16 when they are stored as bf16.
pub fn case_storage(case: &Case) -> Dtype {
    match case.dtypes.get(case.meta.op.first_input()) {
        Some(Dtype::Bf16) => Dtype::Bf16,
        _ => Dtype::F32,
    }
}

/// Rounds a tensor to the storage dtype (what the device reads).
pub fn stored(x: &ArrayD<f64>, s: Dtype) -> ArrayD<f64> {
    x.mapv(|v| s.round_f64(v))
}

/// `op`'s inputs as the device reads them: the per-token tensors (axes
/// `B,T,…`) in `s`, states and gate parameters in f32.
pub fn stored_inputs(op: Op, inputs: &Tensors, s: Dtype) -> Tensors {
    inputs
        .iter()
        .map(|(n, x)| {
            let token = op.info().axes_of(n).is_some_and(|a| a.starts_with("B,T"));
            (n.clone(), stored(x, if token { s } else { Dtype::F32 }))
        })
        .collect()
}

/// A case's results on the GPU, read from the case's tensors where they
/// are (a long case's inputs are gigabytes: no copy).
pub fn case(imp: &GpuImpl, case: &Case) -> Result<(Tensors, Timings), ComputeError> {
    let (d_o, dht) = case.upstream_refs()?;
    let p = case.problem();
    Ok(deltaref_gpu::runner::run(
        device()?,
        case.meta.op.name(),
        p.tensors,
        p.cu_seqlens,
        p.options,
        d_o,
        dht,
        imp,
    )?)
}
