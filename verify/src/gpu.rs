//! The GPU implementations (`--impl gpu-naive|gpu-chunk|gpu-cp`): the
//! process's device, opened on first use, and the oracle-shaped results of
//! the `deltaref-gpu` kernels as name → tensor maps.

use std::sync::OnceLock;

use deltaref::dplr::{Dplr, DplrInputs, DplrOptions};
use deltaref::kda::{Kda, KdaInputs, KdaOptions};
use deltaref::token_shift::{TokenShift, TokenShiftInputs};
use deltaref_gpu::{Gpu, GpuError, GpuImpl, Timings};
use ndarray::ArrayD;

use crate::case::{Case, Dtype, Inputs};
pub use crate::compute::ComputeError;
use crate::outputs::{self, Tensors};

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

/// Rounds a token tensor to the storage dtype (what the device reads).
pub fn stored(x: &ArrayD<f64>, s: Dtype) -> ArrayD<f64> {
    x.mapv(|v| s.round_f64(v))
}

/// KDA inputs as the device reads them: token tensors in `s`, states and
/// gate parameters in f32.
pub fn stored_kda(x: &KdaInputs<f64>, s: Dtype) -> KdaInputs<f64> {
    let f32_ = |a: &ArrayD<f64>| stored(a, Dtype::F32);
    KdaInputs {
        q: stored(&x.q, s),
        k: stored(&x.k, s),
        v: stored(&x.v, s),
        g: stored(&x.g, s),
        beta: stored(&x.beta, s),
        a_log: x.a_log.as_ref().map(f32_),
        dt_bias: x.dt_bias.as_ref().map(f32_),
        initial_state: x.initial_state.as_ref().map(f32_),
        cu_seqlens: x.cu_seqlens.clone(),
    }
}

/// DPLR inputs as the device reads them.
pub fn stored_dplr(x: &DplrInputs<f64>, s: Dtype) -> DplrInputs<f64> {
    DplrInputs {
        q: stored(&x.q, s),
        k: stored(&x.k, s),
        v: stored(&x.v, s),
        a: stored(&x.a, s),
        b: stored(&x.b, s),
        gk: stored(&x.gk, s),
        initial_state: x.initial_state.as_ref().map(|a| stored(a, Dtype::F32)),
        cu_seqlens: x.cu_seqlens.clone(),
    }
}

/// KDA outputs and gradients on the GPU.
pub fn kda(
    imp: &GpuImpl,
    x: &KdaInputs<f64>,
    opts: &KdaOptions,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
) -> Result<(Tensors, Timings), ComputeError> {
    let r = deltaref_gpu::kda::run(device()?, x, opts, d_o, dht, imp)?;
    Ok((
        outputs::map::<f64, Kda>(&r.outputs, Some(&r.grads)),
        r.timings,
    ))
}

/// DPLR outputs and gradients on the GPU.
pub fn dplr(
    imp: &GpuImpl,
    x: &DplrInputs<f64>,
    opts: &DplrOptions,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
) -> Result<(Tensors, Timings), ComputeError> {
    let r = deltaref_gpu::dplr::run(device()?, x, opts, d_o, dht, imp)?;
    Ok((
        outputs::map::<f64, Dplr>(&r.outputs, Some(&r.grads)),
        r.timings,
    ))
}

/// Token-shift outputs and gradients on the GPU.
pub fn token_shift(
    imp: &GpuImpl,
    x: &TokenShiftInputs<f64>,
    dy: &ArrayD<f64>,
    dfinal_cache: Option<&ArrayD<f64>>,
) -> Result<(Tensors, Timings), ComputeError> {
    let r = deltaref_gpu::token_shift::run(device()?, x, dy, dfinal_cache, imp)?;
    Ok((
        outputs::map::<f64, TokenShift>(&r.outputs, Some(&r.grads)),
        r.timings,
    ))
}

/// A case's results on the GPU.
pub fn case(imp: &GpuImpl, case: &Case) -> Result<(Tensors, Timings), ComputeError> {
    let (d_o, dht) = case.upstream()?;
    match case.inputs()? {
        Inputs::Kda(x) => kda(imp, &x, &case.meta.kda_options(), &d_o, dht.as_ref()),
        Inputs::Dplr(x) => dplr(imp, &x, &case.meta.dplr_options(), &d_o, dht.as_ref()),
        Inputs::TokenShift(x) => token_shift(imp, &x, &d_o, dht.as_ref()),
        Inputs::Gdn(_) | Inputs::CausalConv1d(_) => {
            Err(ComputeError::Input(deltaref::Error::option(
                "impl",
                format!(
                    "no GPU kernels for op {} yet: use a CPU implementation (naive, chunk, cp)",
                    case.meta.op.name()
                ),
            )))
        }
    }
}
