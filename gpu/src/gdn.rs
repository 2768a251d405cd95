//! GDN on the GPU: KDA's kernels with the scalar gate `g [B,T,HV]` read once
//! per head and broadcast over K on the device (SPEC §3, GDN), its gradient
//! summed over K before it is rounded. The in-kernel gate
//! `−exp(A_log[h])·softplus(g + dt_bias[h])` runs per head in the
//! pre-processing kernels; `state_v_first` states are swapped on the host
//! (they are `[N, HV, K, V]`-sized, not token-sized).

use deltaref::gates::Gate;
use deltaref::gdn::{GdnGrads, GdnOptions, GdnOutputs, GdnRefs};
use deltaref::kda::{KdaOptions, KdaRefs};
use ndarray::ArrayD;

use crate::device::Gpu;
use crate::error::Result;
use crate::{GpuImpl, Run};

/// GDN forward and backward on the GPU from inputs borrowed where they
/// live (`GdnInputs::refs`, or a case's tensors, uncopied): `o`,
/// `final_state` (in the options' state layout) and every gradient, shaped
/// like the oracle's, with kernel and host timings.
pub fn run(
    gpu: &Gpu,
    x: &GdnRefs<'_, f64>,
    opts: &GdnOptions,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    imp: &GpuImpl,
) -> Result<Run<GdnOutputs<f64>, GdnGrads<f64>>> {
    let t = std::time::Instant::now();
    let (d, h0) = opts.validate_refs_kv(x)?;
    opts.validate_upstream(&d, d_o, dht)?;
    let dht = dht.map(|s| opts.kv_layout(s));
    let kopts = KdaOptions {
        output_final_state: true,
        // The in-kernel gate runs on the device, per head, from the raw `g`.
        gate: if opts.use_gate_in_kernel {
            Gate::Kda
        } else {
            Gate::None
        },
        ..opts.kda()
    };
    let refs = KdaRefs {
        initial_state: h0.as_deref(),
        ..*x
    };
    let checked_s = t.elapsed().as_secs_f64();
    let r = crate::kda::run_validated(gpu, d, &refs, &kopts, d_o, dht.as_deref(), imp)?;
    let mut timings = r.timings;
    timings.upload_s += checked_s;
    timings.check_s = checked_s;
    let back = |s: ArrayD<f64>| opts.kv_layout_owned(s);
    Ok(Run {
        outputs: GdnOutputs {
            o: r.outputs.o,
            final_state: r.outputs.final_state.map(back),
        },
        grads: GdnGrads {
            dq: r.grads.dq,
            dk: r.grads.dk,
            dv: r.grads.dv,
            dg: r.grads.dg,
            dbeta: r.grads.dbeta,
            da_log: r.grads.da_log,
            ddt_bias: r.grads.ddt_bias,
            dh0: r.grads.dh0.map(back),
        },
        timings,
    })
}
