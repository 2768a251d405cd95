//! The GPU runners by operator name: which engines the kernels have for
//! each registered operator ([`deltaref::registry`]) and one entry point
//! that runs a problem given as named tensors. An operator without kernels
//! has no runner; the CPU oracle still computes it.

use deltaref::dplr::{DplrOptions, DplrRefs};
use deltaref::gdn::GdnOptions;
use deltaref::kda::{KdaOptions, KdaRefs};
use deltaref::registry::{Options, Tensors};
use deltaref::token_shift::TokenShiftRefs;
use ndarray::ArrayD;

use crate::error::{GpuError, Result};
use crate::{Engine, Gpu, GpuImpl, Timings};

/// The GPU kernels' engines for operator `op` (empty: no kernels).
pub fn engines(op: &str) -> &'static [GpuEngine] {
    match op {
        "kda" | "gdn" => &[GpuEngine::Naive, GpuEngine::Chunk],
        "dplr" | "token_shift" => &[GpuEngine::Naive],
        _ => &[],
    }
}

/// An engine family the kernels may have, whatever the chunk size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuEngine {
    Naive,
    Chunk,
}

/// Refuses `engine` on `op` when the kernels lack it, saying what there is.
pub fn supports(op: &str, engine: Engine) -> std::result::Result<(), String> {
    let have = engines(op);
    if have.is_empty() {
        return Err(format!(
            "no GPU kernels for op {op}: use a CPU implementation (naive, chunk, cp)"
        ));
    }
    let want = match engine {
        Engine::Naive => GpuEngine::Naive,
        Engine::Chunk(_) => GpuEngine::Chunk,
    };
    if have.contains(&want) {
        Ok(())
    } else {
        Err(format!(
            "the GPU has naive {op} kernels only: use gpu-naive, or gpu-cp --cp-engine naive"
        ))
    }
}

/// Runs `op`'s kernels on the named inputs (borrowed where they are: a long
/// case's inputs are gigabytes) and returns the results under FLA's names,
/// moved out of the typed results, with the device timings.
#[allow(clippy::too_many_arguments)]
pub fn run(
    gpu: &Gpu,
    op: &str,
    t: &Tensors,
    cu: Option<&[i64]>,
    options: &Options,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    imp: &GpuImpl,
) -> Result<(Tensors, Timings)> {
    let bad_options = |why: String| GpuError::Input(deltaref::Error::option("case", why));
    match op {
        "kda" => {
            let opts = KdaOptions::from_case(options).map_err(bad_options)?;
            let r = crate::kda::run(
                gpu,
                &KdaRefs::from_tensors(t, cu, op)?,
                &opts,
                d_o,
                dht,
                imp,
            )?;
            let (o, g) = (r.outputs, r.grads);
            Ok((
                gated(
                    o.o,
                    o.final_state,
                    [g.dq, g.dk, g.dv, g.dg, g.dbeta],
                    [g.da_log, g.ddt_bias, g.dh0],
                ),
                r.timings,
            ))
        }
        "gdn" => {
            let opts = GdnOptions::from_case(options).map_err(bad_options)?;
            let r = crate::gdn::run(
                gpu,
                &KdaRefs::from_tensors(t, cu, op)?,
                &opts,
                d_o,
                dht,
                imp,
            )?;
            let (o, g) = (r.outputs, r.grads);
            Ok((
                gated(
                    o.o,
                    o.final_state,
                    [g.dq, g.dk, g.dv, g.dg, g.dbeta],
                    [g.da_log, g.ddt_bias, g.dh0],
                ),
                r.timings,
            ))
        }
        "dplr" => {
            let opts = DplrOptions::from_case(options).map_err(bad_options)?;
            let r = crate::dplr::run(gpu, &DplrRefs::from_tensors(t, cu)?, &opts, d_o, dht, imp)?;
            let (o, g) = (r.outputs, r.grads);
            let named = [
                ("o", Some(o.o)),
                ("final_state", o.final_state),
                ("dq", Some(g.dq)),
                ("dk", Some(g.dk)),
                ("dv", Some(g.dv)),
                ("da", Some(g.da)),
                ("db", Some(g.db)),
                ("dgk", Some(g.dgk)),
                ("dh0", g.dh0),
            ];
            Ok((tensors(named), r.timings))
        }
        "token_shift" => {
            let r =
                crate::token_shift::run(gpu, &TokenShiftRefs::from_tensors(t, cu)?, d_o, dht, imp)?;
            let (o, g) = (r.outputs, r.grads);
            let named = [
                ("y", Some(o.y)),
                ("final_cache", Some(o.final_cache)),
                ("dx", Some(g.dx)),
                ("dcache", g.dcache),
            ];
            Ok((tensors(named), r.timings))
        }
        _ => Err(GpuError::Unsupported(supports(op, imp.engine).unwrap_err())),
    }
}

/// KDA's and GDN's results (the same FLA names), moved.
fn gated(
    o: ArrayD<f64>,
    final_state: Option<ArrayD<f64>>,
    [dq, dk, dv, dg, dbeta]: [ArrayD<f64>; 5],
    [da_log, ddt_bias, dh0]: [Option<ArrayD<f64>>; 3],
) -> Tensors {
    tensors([
        ("o", Some(o)),
        ("final_state", final_state),
        ("dq", Some(dq)),
        ("dk", Some(dk)),
        ("dv", Some(dv)),
        ("dg", Some(dg)),
        ("dbeta", Some(dbeta)),
        ("dA_log", da_log),
        ("ddt_bias", ddt_bias),
        ("dh0", dh0),
    ])
}

/// Named results, absent ones left out.
fn tensors<const N: usize>(named: [(&str, Option<ArrayD<f64>>); N]) -> Tensors {
    named
        .into_iter()
        .filter_map(|(n, t)| Some((n.to_string(), t?)))
        .collect()
}
