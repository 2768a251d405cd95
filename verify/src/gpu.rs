//! The GPU implementations (`--impl gpu-naive|gpu-chunk|gpu-cp`): the
//! process's device, opened on first use, and the oracle-shaped results of
//! the `deltaref-gpu` kernels as name → tensor maps.

use std::sync::OnceLock;

use deltaref::dplr::{Dplr, DplrGrads, DplrInputs, DplrOutputs};
use deltaref::gdn::{Gdn, GdnGrads, GdnInputs, GdnOutputs};
use deltaref::kda::{Kda, KdaGrads, KdaInputs, KdaOutputs};
use deltaref::op::OpSpec;
use deltaref::token_shift::{TokenShift, TokenShiftGrads, TokenShiftOutputs};
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

/// Rounds a token tensor to the storage dtype (what the device reads).
pub fn stored(x: &ArrayD<f64>, s: Dtype) -> ArrayD<f64> {
    x.mapv(|v| s.round_f64(v))
}

/// `stored_kda`/`kda_tensors` and `stored_gdn`/`gdn_tensors`: KDA and GDN
/// have the same FLA names (their gates differ in shape).
macro_rules! gated {
    ($(#[$doc:meta])* $name:ident, $tensors:ident, $op:ident, $inputs:ident, $outputs:ident, $grads:ident) => {
        $(#[$doc])*
        pub fn $name(x: &$inputs<f64>, s: Dtype) -> $inputs<f64> {
            let f32_ = |a: &ArrayD<f64>| stored(a, Dtype::F32);
            $inputs {
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

        /// The op's results under FLA's names, moved (not copied: a long
        /// case's results hold 10⁸ values each).
        pub fn $tensors(out: $outputs<f64>, gr: $grads<f64>) -> Tensors {
            named::<$op>(
                vec![Some(out.o), out.final_state],
                vec![
                    Some(gr.dq),
                    Some(gr.dk),
                    Some(gr.dv),
                    Some(gr.dg),
                    Some(gr.dbeta),
                    gr.da_log,
                    gr.ddt_bias,
                    gr.dh0,
                ],
            )
        }
    };
}

gated!(
    /// KDA inputs as the device reads them: token tensors in `s`, states and
    /// gate parameters in f32.
    stored_kda,
    kda_tensors,
    Kda,
    KdaInputs,
    KdaOutputs,
    KdaGrads
);
gated!(
    /// GDN inputs as the device reads them: token tensors in `s`, states and
    /// gate parameters in f32.
    stored_gdn,
    gdn_tensors,
    Gdn,
    GdnInputs,
    GdnOutputs,
    GdnGrads
);

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

/// Outputs and gradients in the order of `O`'s declared names, absent ones skipped.
fn named<O: OpSpec>(outputs: Vec<Option<ArrayD<f64>>>, grads: Vec<Option<ArrayD<f64>>>) -> Tensors {
    assert_eq!(
        (outputs.len(), grads.len()),
        (O::OUTPUTS.len(), O::GRADS.len()),
        "{}: one tensor per declared name",
        O::NAME
    );
    O::OUTPUTS
        .iter()
        .zip(outputs)
        .chain(O::GRADS.iter().zip(grads))
        .filter_map(|(name, t)| Some((name.to_string(), t?)))
        .collect()
}

/// DPLR's results under FLA's names, moved (not copied), as [`kda_tensors`] does.
pub fn dplr_tensors(out: DplrOutputs<f64>, gr: DplrGrads<f64>) -> Tensors {
    named::<Dplr>(
        vec![Some(out.o), out.final_state],
        vec![
            Some(gr.dq),
            Some(gr.dk),
            Some(gr.dv),
            Some(gr.da),
            Some(gr.db),
            Some(gr.dgk),
            gr.dh0,
        ],
    )
}

/// Token-shift's results under FLA's names, moved (not copied).
pub fn token_shift_tensors(out: TokenShiftOutputs<f64>, gr: TokenShiftGrads<f64>) -> Tensors {
    named::<TokenShift>(
        vec![Some(out.y), Some(out.final_cache)],
        vec![Some(gr.dx), gr.dcache],
    )
}

/// A case's results on the GPU, read from the case's tensors where they
/// are (a long case's inputs are gigabytes: no copy).
pub fn case(imp: &GpuImpl, case: &Case) -> Result<(Tensors, Timings), ComputeError> {
    let (d_o, dht) = case.upstream_refs()?;
    match case.meta.op {
        Op::Kda => {
            let (x, opts) = (case.kda_refs()?, case.meta.kda_options());
            let r = deltaref_gpu::kda::run(device()?, &x, &opts, d_o, dht, imp)?;
            Ok((kda_tensors(r.outputs, r.grads), r.timings))
        }
        Op::Gdn => {
            let (x, opts) = (case.kda_refs()?, case.meta.gdn_options());
            let r = deltaref_gpu::gdn::run(device()?, &x, &opts, d_o, dht, imp)?;
            Ok((gdn_tensors(r.outputs, r.grads), r.timings))
        }
        Op::Dplr => {
            let (x, opts) = (case.dplr_refs()?, case.meta.dplr_options());
            let r = deltaref_gpu::dplr::run(device()?, &x, &opts, d_o, dht, imp)?;
            Ok((dplr_tensors(r.outputs, r.grads), r.timings))
        }
        Op::TokenShift => {
            let x = case.token_shift_refs()?;
            let r = deltaref_gpu::token_shift::run(device()?, &x, d_o, dht, imp)?;
            Ok((token_shift_tensors(r.outputs, r.grads), r.timings))
        }
        Op::CausalConv1d => Err(ComputeError::Input(deltaref::Error::option(
            "impl",
            format!(
                "no GPU kernels for op {}: use a CPU implementation (naive, chunk, cp)",
                case.meta.op.name()
            ),
        ))),
    }
}

#[cfg(test)]
mod tests {
    use deltaref::dplr::DplrOptions;
    use deltaref::gdn::{GdnOptions, OnKda};
    use deltaref::inputs::{self, DplrSpec, GdnSpec, KdaSpec, Layout, TokenShiftSpec};
    use deltaref::kda::KdaOptions;

    use super::*;
    use crate::outputs;

    /// The moving name maps give what the copying [`outputs::map`] gives
    /// (KDA, GDN, DPLR, token-shift).
    #[test]
    fn moved_results_are_the_mapped_ones() {
        let spec = KdaSpec {
            layout: Layout::varlen(&[5, 3]),
            h: 1,
            hv: 2,
            k: 4,
            v: 3,
            opts: KdaOptions {
                output_final_state: true,
                ..Default::default()
            },
            initial_state: true,
            scalar_gate: true,
            seed: 3,
        };
        let g = inputs::kda(&spec);
        let e = deltaref::kda::naive::Naive;
        let out = deltaref::op::forward(&e, &g.inputs, &spec.opts).unwrap();
        let gr = deltaref::op::backward(&e, &g.inputs, &spec.opts, &g.d_o, Some(&g.dht)).unwrap();
        let want = outputs::map::<f64, Kda>(&out, Some(&gr));
        assert_eq!(want.len(), 8, "{:?}", want.keys());
        assert_eq!(kda_tensors(out, gr), want);

        let spec = GdnSpec {
            layout: Layout::varlen(&[5, 3]),
            h: 1,
            hv: 2,
            k: 4,
            v: 3,
            opts: GdnOptions {
                output_final_state: true,
                use_gate_in_kernel: true,
                ..Default::default()
            },
            initial_state: true,
            seed: 3,
        };
        let g = inputs::gdn(&spec);
        let e = OnKda(deltaref::kda::naive::Naive);
        let out = deltaref::op::forward(&e, &g.inputs, &spec.opts).unwrap();
        let gr = deltaref::op::backward(&e, &g.inputs, &spec.opts, &g.d_o, Some(&g.dht)).unwrap();
        let want = outputs::map::<f64, Gdn>(&out, Some(&gr));
        assert_eq!(want.len(), 10, "{:?}", want.keys());
        assert_eq!(gdn_tensors(out, gr), want);

        let spec = DplrSpec {
            layout: Layout::varlen(&[5, 3]),
            h: 2,
            k: 4,
            v: 3,
            initial_state: true,
            seed: 3,
        };
        let g = inputs::dplr(&spec);
        let opts = DplrOptions {
            output_final_state: true,
            ..Default::default()
        };
        let e = deltaref::dplr::naive::Naive;
        let out = deltaref::op::forward(&e, &g.inputs, &opts).unwrap();
        let gr = deltaref::op::backward(&e, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap();
        let want = outputs::map::<f64, Dplr>(&out, Some(&gr));
        assert_eq!(want.len(), 9, "{:?}", want.keys());
        assert_eq!(dplr_tensors(out, gr), want);

        let spec = TokenShiftSpec {
            layout: Layout::varlen(&[5, 0, 3]),
            d: 3,
            cache: true,
            seed: 3,
        };
        let g = inputs::token_shift(&spec);
        let out = deltaref::token_shift::forward(&g.inputs).unwrap();
        let gr = deltaref::token_shift::backward(&g.inputs, &g.d_o, Some(&g.dht)).unwrap();
        let want = outputs::map::<f64, TokenShift>(&out, Some(&gr));
        assert_eq!(want.len(), 4, "{:?}", want.keys());
        assert_eq!(token_shift_tensors(out, gr), want);
    }
}
