//! GDN's truth (FLA's gated delta rule): KDA's recurrence ([`super::kda`])
//! with one log-space gate per value head and token, `Diag(exp g_t) =
//! exp(g_t) I`. What GDN has of its own: with `use_gate_in_kernel` the
//! decay is `−exp(A_log[j]) · softplus(g + dt_bias[j])` (`dt_bias [HV]`), and
//! with `state_v_first` every state is stored `[N, HV, V, K]`.

use ndarray::{Array3, Array4, ArrayD, ArrayView4, Axis};

use super::kda::{inputs_of, map_inputs, DeltaRule};
use super::{softplus, state_layout, view3, view4, Real, Truth};
use crate::gates::Gate;
use crate::gdn::{Gdn, GdnInputs, GdnOptions, GdnOutputs};
use crate::kda::KdaOptions;

/// GDN forward. `x`: `q, k [B, T, H, K]`, `v [B, T, HV, V]`, `g [B, T, HV]`,
/// `beta [B, T, HV]`, `A_log [HV]`, `dt_bias [HV]`, `initial_state
/// [N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`), `cu_seqlens
/// [N + 1]`. Returns `o [B, T, HV, V]` and, with `output_final_state`,
/// `final_state` in the initial state's layout.
pub fn forward<R: Real>(x: &GdnInputs<R>, opt: &GdnOptions) -> GdnOutputs<R> {
    let as_kda = KdaOptions {
        scale: opt.scale,
        output_final_state: opt.output_final_state,
        use_qk_l2norm_in_kernel: opt.use_qk_l2norm_in_kernel,
        gate: Gate::None,
        use_beta_sigmoid_in_kernel: opt.use_beta_sigmoid_in_kernel,
        allow_neg_eigval: opt.allow_neg_eigval,
    };
    let rule = DeltaRule::new(x, decay(x, opt.use_gate_in_kernel), &as_kda);
    let layout = |s: ArrayView4<'_, R>| state_layout(s, opt.state_v_first);
    let h0 = x.initial_state.as_ref().map(|s| layout(view4(s)));
    let (o, final_state) = rule.run(h0.as_ref().map(|s| s.view()), x.cu_seqlens.as_deref());
    GdnOutputs {
        o: o.into_dyn(),
        final_state: opt
            .output_final_state
            .then(|| layout(final_state.view()).into_dyn()),
    }
}

/// The log-space decay `[B, T, HV]` broadcast over K (`[B, T, HV, K]`).
fn decay<R: Real>(x: &GdnInputs<R>, in_kernel: bool) -> Array4<R> {
    let g = view3(&x.g);
    let per_head = if in_kernel {
        let a_log = x.a_log.as_ref().expect("the in-kernel gate needs A_log");
        Array3::from_shape_fn(g.dim(), |(b, t, j)| {
            let bias = x.dt_bias.as_ref().map_or(R::zero(), |d| d[[j]]);
            -a_log[[j]].exp() * softplus(g[[b, t, j]] + bias)
        })
    } else {
        g.to_owned()
    };
    let kd = x.q.shape()[3];
    let shape = (g.dim().0, g.dim().1, g.dim().2, kd);
    let broadcast = per_head.insert_axis(Axis(3));
    broadcast.broadcast(shape).expect("over K").to_owned()
}

impl Truth for Gdn {
    type Inputs<R: Real> = GdnInputs<R>;
    type Outputs<R: Real> = GdnOutputs<R>;

    fn forward<R: Real>(x: &GdnInputs<R>, opt: &GdnOptions) -> GdnOutputs<R> {
        forward(x, opt)
    }

    fn tensors<R: Real>(x: &GdnInputs<R>) -> Vec<Option<&ArrayD<R>>> {
        inputs_of(x)
    }

    fn map_tensors<R: Real, S: Real>(
        x: &GdnInputs<R>,
        f: impl FnMut(usize, &ArrayD<R>) -> ArrayD<S>,
    ) -> GdnInputs<S> {
        map_inputs(x, f)
    }

    fn outputs<R: Real>(y: &GdnOutputs<R>) -> Vec<Option<&ArrayD<R>>> {
        vec![Some(&y.o), y.final_state.as_ref()]
    }
}
