//! GDN on the GPU: KDA's kernels with the scalar gate `g [B,T,HV]` read once
//! per head and broadcast over K on the device (SPEC §3, GDN), its gradient
//! summed over K before it is rounded. The in-kernel gate
//! `−exp(A_log[h])·softplus(g + dt_bias[h])` runs per head in the
//! pre-processing kernels; `state_v_first` states are swapped on the host
//! (they are `[N, HV, K, V]`-sized, not token-sized).

use std::borrow::Cow;

use deltaref::gates::Gate;
use deltaref::gdn::{self as oracle, GdnGrads, GdnInputs, GdnOptions, GdnOutputs, GdnRefs};
use deltaref::kda::{self, KdaOptions, KdaRefs};
use deltaref::tensor::expect_shape;
use ndarray::ArrayD;

use crate::device::Gpu;
use crate::error::Result;
use crate::{GpuImpl, Run};

/// GDN forward and backward on the GPU: `o`, `final_state` (in the
/// options' state layout) and every gradient, shaped like the oracle's.
pub fn run(
    gpu: &Gpu,
    x: &GdnInputs<f64>,
    opts: &GdnOptions,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    imp: &GpuImpl,
) -> Result<Run<GdnOutputs<f64>, GdnGrads<f64>>> {
    run_refs(gpu, &x.refs(), opts, d_o, dht, imp)
}

/// [`run`] on inputs borrowed where they live (a case's tensors, uncopied).
pub fn run_refs(
    gpu: &Gpu,
    x: &GdnRefs<'_, f64>,
    opts: &GdnOptions,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    imp: &GpuImpl,
) -> Result<Run<GdnOutputs<f64>, GdnGrads<f64>>> {
    let t = std::time::Instant::now();
    oracle::validate_refs(x, opts)?;
    let h0 = x.initial_state.map(|s| kv_layout(opts, s));
    let dht = match dht {
        Some(s) => Some(upstream_state(x, opts, s)?),
        None => None,
    };
    let refs = KdaRefs {
        a_log: None,
        dt_bias: None,
        initial_state: h0.as_deref(),
        ..*x
    };
    let mut kopts = KdaOptions {
        scale: opts.scale,
        output_final_state: true,
        use_qk_l2norm_in_kernel: opts.use_qk_l2norm_in_kernel,
        gate: Gate::None,
        use_beta_sigmoid_in_kernel: opts.use_beta_sigmoid_in_kernel,
        allow_neg_eigval: opts.allow_neg_eigval,
    };
    // KDA's checks on the decay form; the in-kernel gate's parameters were
    // checked above, and KDA's inputs cannot carry a per-head one.
    let d = kda::validate_refs(&refs, &kopts)?;
    kda::validate_upstream(&d, d_o, dht.as_deref())?;
    let refs = if opts.use_gate_in_kernel {
        kopts.gate = Gate::Kda;
        KdaRefs {
            a_log: x.a_log,
            dt_bias: x.dt_bias,
            ..refs
        }
    } else {
        refs
    };
    let checked_s = t.elapsed().as_secs_f64();
    let r = crate::kda::run_validated(gpu, d, &refs, &kopts, d_o, dht.as_deref(), imp)?;
    let mut timings = r.timings;
    timings.upload_s += checked_s;
    timings.check_s = checked_s;
    let back = |s: ArrayD<f64>| kv_layout(opts, &s).into_owned();
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

/// A state-shaped tensor in KDA's `[N, HV, K, V]` from the options' layout
/// (the swap is its own inverse).
fn kv_layout<'a>(opts: &GdnOptions, s: &'a ArrayD<f64>) -> Cow<'a, ArrayD<f64>> {
    if opts.state_v_first {
        Cow::Owned(oracle::swap_state(s))
    } else {
        Cow::Borrowed(s)
    }
}

/// `dht` in KDA's layout, its shape checked in the options' layout first
/// (swapping needs four axes).
fn upstream_state<'a>(
    x: &GdnRefs<'_, f64>,
    opts: &GdnOptions,
    dht: &'a ArrayD<f64>,
) -> Result<Cow<'a, ArrayD<f64>>> {
    if opts.state_v_first {
        let (q, v) = (x.q.shape(), x.v.shape());
        let n = x.cu_seqlens.map_or(q[0], |cu| cu.len().saturating_sub(1));
        expect_shape(
            "dht",
            "[N,HV,V,K] (state_v_first)",
            &[n, v[2], v[3], q[3]],
            dht.shape(),
        )?;
    }
    Ok(kv_layout(opts, dht))
}
