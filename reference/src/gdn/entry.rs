//! GDN in the operator registry ([`crate::registry`]): FLA
//! `chunk_gated_delta_rule`'s names and options. Its engines are KDA's
//! ([`OnKda`]), and so is FLA's bf16 storage of its kernels.

use ndarray::ArrayD;
use serde::{Deserialize, Serialize};

use super::{Gdn, GdnInputs, GdnOptions, OnKda};
use crate::conv::Activation;
use crate::cp::Carry;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::gates::Gate;
use crate::inputs::{self, Draw, GdnSpec};
use crate::kda::{self, chunk::Chunk, naive::Naive};
use crate::precision::{self, Feature, Policy, Stage};
use crate::registry::{
    self, eager_draws, Build, ChunkSize, DrawRequest, Entry, GenFlag, GenFlags, MemoryModel,
    OpInfo, Options, Registered, Showcase, Tensors,
};

pub(crate) static ENTRY: Entry<Gdn> = Entry::new();

static INFO: OpInfo = OpInfo {
    name: "gdn",
    fla: &["chunk_gated_delta_rule", "naive_recurrent_gated_delta_rule"],
    inputs: <Gdn as crate::op::OpSpec>::INPUTS,
    optional: &["A_log", "dt_bias", "initial_state", "cu_seqlens"],
    upstream: ["do", "dht"],
    outputs: <Gdn as crate::op::OpSpec>::OUTPUTS,
    grads: <Gdn as crate::op::OpSpec>::GRADS,
    axes: &[
        ("q", "B,T,H,K"),
        ("k", "B,T,H,K"),
        ("v", "B,T,HV,V"),
        ("g", "B,T,HV"),
        ("beta", "B,T,HV"),
        ("A_log", "HV"),
        ("dt_bias", "HV"),
        ("initial_state", "N,HV,K,V"),
        ("cu_seqlens", "N+1"),
        ("do", "B,T,HV,V"),
        ("dht", "N,HV,K,V"),
    ],
    shape: "B,T,H,HV,K,V",
    default_shape: &[2, 64, 2, 4, 16, 16],
    carry: Carry::State,
    chunked: true,
    showcase: Showcase {
        dims: &[1, 2, 16, 16],
        fd_dims: &[1, 2, 3, 2],
        seed: 2027,
        flags: GenFlags {
            gate: Gate::Kda,
            l2norm: true,
            beta_sigmoid: false,
            allow_neg_eigval: false,
            initial_state: true,
            state_v_first: false,
            activation: Activation::None,
            bias: false,
            scale: None,
        },
    },
    streams_by_head: false,
    regimes: &inputs::Regime::ALL,
    fp32_results: &["final_state", "dh0", "dA_log", "ddt_bias"],
    gen_flags: &[
        GenFlag::Gate,
        GenFlag::L2norm,
        GenFlag::BetaSigmoid,
        GenFlag::AllowNegEigval,
        GenFlag::InitialState,
        GenFlag::StateVFirst,
        GenFlag::Scale,
    ],
    intermediates: &[],
};

/// GDN's options as a case file stores them (FLA's names).
#[derive(Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct CaseOptions {
    #[serde(skip_serializing_if = "Option::is_none")]
    scale: Option<f64>,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
}

impl CaseOptions {
    fn of(o: &GdnOptions) -> Self {
        CaseOptions {
            scale: o.scale,
            use_qk_l2norm_in_kernel: o.use_qk_l2norm_in_kernel,
            use_gate_in_kernel: o.use_gate_in_kernel,
            use_beta_sigmoid_in_kernel: o.use_beta_sigmoid_in_kernel,
            allow_neg_eigval: o.allow_neg_eigval,
            state_v_first: o.state_v_first,
        }
    }

    fn options(self) -> GdnOptions {
        GdnOptions {
            scale: self.scale,
            output_final_state: true,
            use_qk_l2norm_in_kernel: self.use_qk_l2norm_in_kernel,
            use_gate_in_kernel: self.use_gate_in_kernel,
            use_beta_sigmoid_in_kernel: self.use_beta_sigmoid_in_kernel,
            allow_neg_eigval: self.allow_neg_eigval,
            state_v_first: self.state_v_first,
        }
    }
}

impl GdnOptions {
    /// The options of a case file's `case` entry (FLA's keyword names, a
    /// [`registry::Options`] object): an unknown key or a bad value is an
    /// error naming the key.
    pub fn from_case(o: &Options) -> std::result::Result<Self, String> {
        <Gdn as Registered>::options(o)
    }
}

/// GDN's engines are KDA's, read through GDN's pre-processing.
impl<E: Build> Build for OnKda<E> {
    const FEATURES: &'static [Feature] = E::FEATURES;

    fn build(c: ChunkSize, policy: &Policy) -> OnKda<E> {
        OnKda(E::build(c, policy))
    }
}

impl Registered for Gdn {
    const INFO: &'static OpInfo = &INFO;
    type Naive = OnKda<Naive>;
    type Chunk = OnKda<Chunk>;
    type Case = CaseOptions;

    fn typed(c: CaseOptions) -> std::result::Result<GdnOptions, String> {
        Ok(c.options())
    }

    fn gen_options(f: &GenFlags) -> std::result::Result<Options, String> {
        let use_gate_in_kernel = match f.gate {
            Gate::None => false,
            Gate::Kda => true,
            Gate::LowerBound { .. } => {
                return Err(
                    "--op gdn: FLA's GDN gate is --gate kda (use_gate_in_kernel) or none".into(),
                )
            }
        };
        let o = GdnOptions {
            scale: f.scale,
            output_final_state: true,
            use_qk_l2norm_in_kernel: f.l2norm,
            use_gate_in_kernel,
            use_beta_sigmoid_in_kernel: f.beta_sigmoid,
            allow_neg_eigval: f.allow_neg_eigval,
            state_v_first: f.state_v_first,
        };
        Ok(registry::to_options(&CaseOptions::of(&o)))
    }

    fn draws(r: &DrawRequest<'_>, opt: &GdnOptions) -> Vec<Draw> {
        let d = r.dims;
        let s = GdnSpec {
            layout: r.layout.clone(),
            h: d[0],
            hv: d[1],
            k: d[2],
            v: d[3],
            opts: *opt,
            initial_state: r.flags.initial_state,
            seed: r.seed,
        };
        let mut g = super::spec::gdn_in(&s, r.regime);
        if r.unit_norm_keys && !opt.use_qk_l2norm_in_kernel {
            inputs::unit_norm(&mut g.inputs.k);
        }
        let x = g.inputs;
        eager_draws(vec![
            ("q", Some(x.q)),
            ("k", Some(x.k)),
            ("v", Some(x.v)),
            ("g", Some(x.g)),
            ("beta", Some(x.beta)),
            ("A_log", x.a_log),
            ("dt_bias", x.dt_bias),
            ("initial_state", x.initial_state),
            ("do", Some(g.d_o)),
            ("dht", Some(g.dht)),
        ])
    }

    /// FLA's `chunk_gated_delta_rule` stores KDA's intermediates in bf16
    /// and works in base 2 (`exp2`).
    fn fla_bf16(_: &GdnOptions, cp: bool) -> Policy {
        let mut p = precision::fla_bf16(kda::entry::FLA_BF16_STAGES, cp);
        p.exp2 = true;
        p.with(Stage::Outputs, Dtype::Bf16)
    }

    fn inputs(t: &mut Tensors, cu: Option<Vec<i64>>) -> Result<GdnInputs<f64>> {
        kda::entry::inputs_of(t, cu, INFO.name)
    }

    fn validate(
        t: &Tensors,
        cu: Option<&[i64]>,
        opt: &GdnOptions,
        d_o: &ArrayD<f64>,
        dht: Option<&ArrayD<f64>>,
    ) -> Result<()> {
        let d = opt.validate_refs(&kda::entry::refs(t, cu, INFO.name)?)?;
        opt.validate_upstream(&d, d_o, dht)
    }

    fn memory(opt: &GdnOptions) -> MemoryModel {
        MemoryModel {
            draw_eighths: 11,
            streamed_draw_bytes: 8,
            copy_quarters: 10,
            qk_halves: if opt.use_qk_l2norm_in_kernel { 3 } else { 0 },
            gate_halves: 0,
            chunk_rows: [10, 6, 6],
        }
    }
}
