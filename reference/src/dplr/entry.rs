//! DPLR in the operator registry ([`crate::registry`]): FLA
//! `chunk_dplr_delta_rule`'s names, options, draws and bf16 storage.

use ndarray::ArrayD;
use serde::{Deserialize, Serialize};

use super::{chunk::Chunk, naive::Naive, Dplr, DplrInputs, DplrOptions, DplrRefs};
use crate::conv::Activation;
use crate::cp::Carry;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::gates::Gate;
use crate::inputs::{self, DplrSpec, Draw};
use crate::precision::{self, Feature, Policy, Stage};
use crate::registry::{
    self, need, take, Build, ChunkSize, DrawRequest, Entry, GenFlag, GenFlags, MemoryModel, OpInfo,
    Options, Registered, Showcase, Tensors,
};

pub(crate) static ENTRY: Entry<Dplr> = Entry::new();

static INFO: OpInfo = OpInfo {
    name: "dplr",
    fla: &["chunk_dplr_delta_rule", "naive_recurrent_dplr_delta_rule"],
    inputs: <Dplr as crate::op::OpSpec>::INPUTS,
    optional: &["initial_state", "cu_seqlens"],
    upstream: ["do", "dht"],
    outputs: <Dplr as crate::op::OpSpec>::OUTPUTS,
    grads: <Dplr as crate::op::OpSpec>::GRADS,
    axes: &[
        ("q", "B,T,H,K"),
        ("k", "B,T,H,K"),
        ("v", "B,T,H,V"),
        ("a", "B,T,H,K"),
        ("b", "B,T,H,K"),
        ("gk", "B,T,H,K"),
        ("initial_state", "N,H,K,V"),
        ("cu_seqlens", "N+1"),
        ("do", "B,T,H,V"),
        ("dht", "N,H,K,V"),
    ],
    shape: "B,T,H,K,V",
    default_shape: &[2, 64, 2, 16, 16],
    carry: Carry::State,
    chunked: true,
    showcase: Showcase {
        dims: &[2, 16, 16],
        fd_dims: &[2, 3, 2],
        seed: 2025,
        flags: GenFlags {
            gate: Gate::None,
            l2norm: false,
            beta_sigmoid: false,
            allow_neg_eigval: false,
            initial_state: true,
            state_v_first: false,
            activation: Activation::None,
            bias: false,
            scale: None,
        },
    },
    streams_by_head: true,
    regimes: &inputs::Regime::ALL,
    fp32_results: &["final_state", "dh0"],
    gen_flags: &[GenFlag::InitialState, GenFlag::Scale, GenFlag::Gate],
    intermediates: &[],
};

/// DPLR's options as a case file stores them.
#[derive(Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct CaseOptions {
    #[serde(skip_serializing_if = "Option::is_none")]
    scale: Option<f64>,
    /// FLA's `safe_gate` (absent: false).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    safe_gate: bool,
    /// FLA's `lower_bound` on `gk`.
    #[serde(skip_serializing_if = "Option::is_none")]
    lower_bound: Option<f64>,
}

/// FLA's bf16 storage of its DPLR chunk kernels: `q·scale` in bf16
/// (`chunk_dplr_fwd_intra`), the WY solve on fp16 operands (`wy_fast_fwd`'s
/// `.to(tl.float16)`), the other intermediates bf16, `g_cumsum` fp32.
const FLA_BF16_STAGES: &[(Stage, Dtype)] = &[
    (Stage::Activations, Dtype::Bf16),
    (Stage::GCumsum, Dtype::F32),
    (Stage::Aqk, Dtype::Bf16),
    (Stage::Akk, Dtype::F16),
    (Stage::W, Dtype::Bf16),
    (Stage::U, Dtype::Bf16),
    (Stage::Gated, Dtype::Bf16),
    (Stage::H, Dtype::Bf16),
    (Stage::VNew, Dtype::Bf16),
    (Stage::Dh, Dtype::Bf16),
    (Stage::Dv, Dtype::Bf16),
    (Stage::BwdOperands, Dtype::Bf16),
];

impl<'t> DplrRefs<'t, f64> {
    /// DPLR's tensors borrowed from named tensors `t` (FLA's names, shapes
    /// as in [`DplrInputs`](super::DplrInputs)) and `cu_seqlens` `[N + 1]`;
    /// a required tensor missing is an error naming it.
    pub fn from_tensors(t: &'t Tensors, cu: Option<&'t [i64]>) -> Result<Self> {
        refs(t, cu)
    }
}

/// DPLR's tensors, borrowed from named tensors.
fn refs<'t>(t: &'t Tensors, cu: Option<&'t [i64]>) -> Result<DplrRefs<'t, f64>> {
    let op = INFO.name;
    Ok(DplrRefs {
        q: need(t, "q", op)?,
        k: need(t, "k", op)?,
        v: need(t, "v", op)?,
        a: need(t, "a", op)?,
        b: need(t, "b", op)?,
        gk: need(t, "gk", op)?,
        initial_state: t.get("initial_state"),
        cu_seqlens: cu,
    })
}

impl DplrOptions {
    /// The options of a case file's `case` entry (FLA's keyword names, a
    /// [`registry::Options`] object): an unknown key or a bad value is an
    /// error naming the key.
    pub fn from_case(o: &Options) -> std::result::Result<Self, String> {
        <Dplr as Registered>::options(o)
    }
}

/// DPLR's chunked engine for a job: its chunk size and precision policy.
impl Build for Chunk {
    const FEATURES: &'static [Feature] = Chunk::FEATURES;

    fn build(c: ChunkSize, policy: &Policy) -> Chunk {
        Chunk::sized(c).with_policy(policy.clone())
    }
}

impl Registered for Dplr {
    const INFO: &'static OpInfo = &INFO;
    type Naive = Naive;
    type Chunk = Chunk;
    type Case = CaseOptions;

    fn typed(c: CaseOptions) -> std::result::Result<DplrOptions, String> {
        Ok(DplrOptions {
            scale: c.scale,
            output_final_state: true,
            safe_gate: c.safe_gate,
            lower_bound: c.lower_bound,
        })
    }

    fn gen_options(f: &GenFlags) -> std::result::Result<Options, String> {
        // `gen --op dplr --lower-bound X` records FLA's `lower_bound` (the
        // draws keep gk in [X, 0)); the scheme it licenses is FLA's choice.
        let lower_bound = match f.gate {
            Gate::LowerBound { lower_bound } => Some(lower_bound),
            Gate::None => None,
            Gate::Kda => {
                return Err("dplr takes gk as given (no in-kernel gate): \
                     --gate kda does not apply; --lower-bound X bounds gk to [X, 0)"
                    .into())
            }
        };
        Ok(registry::to_options(&CaseOptions {
            scale: f.scale,
            safe_gate: false,
            lower_bound,
        }))
    }

    fn draws(r: &DrawRequest<'_>, opt: &DplrOptions) -> Vec<Draw> {
        let d = r.dims;
        let s = DplrSpec {
            layout: r.layout.clone(),
            h: d[0],
            k: d[1],
            v: d[2],
            initial_state: r.flags.initial_state,
            seed: r.seed,
        };
        super::spec::dplr_draws_bounded(&s, r.regime, opt.lower_bound)
    }

    fn fla_bf16(opt: &DplrOptions, cp: bool) -> Policy {
        let mut p = precision::fla_bf16(FLA_BF16_STAGES, cp);
        // FLA's scheme for these options: `safe_gate` itself, or a
        // `lower_bound` that licenses it at the engine's chunk size.
        p.safe_gate_midpoint = opt.safe_gate;
        p.safe_gate_bound = opt.lower_bound.filter(|_| !opt.safe_gate);
        if opt.safe_gate || opt.lower_bound.is_some() {
            // The safe-gate A stage multiplies fp32 operands on tensor
            // cores: tf32 under Triton's default input precision.
            p = p.with(Stage::FwdDots, Dtype::Tf32);
        }
        p.with(Stage::Outputs, Dtype::Bf16)
    }

    fn inputs(t: &mut Tensors, cu: Option<Vec<i64>>) -> Result<DplrInputs<f64>> {
        let op = INFO.name;
        Ok(DplrInputs {
            q: take(t, "q", op)?,
            k: take(t, "k", op)?,
            v: take(t, "v", op)?,
            a: take(t, "a", op)?,
            b: take(t, "b", op)?,
            gk: take(t, "gk", op)?,
            initial_state: t.remove("initial_state"),
            cu_seqlens: cu,
        })
    }

    fn validate(
        t: &Tensors,
        cu: Option<&[i64]>,
        opt: &DplrOptions,
        d_o: &ArrayD<f64>,
        dht: Option<&ArrayD<f64>>,
    ) -> Result<()> {
        let d = refs(t, cu)?.validate(opt)?;
        d.validate_upstream(d_o, dht)
    }

    fn memory(_: &DplrOptions) -> MemoryModel {
        MemoryModel {
            draw_eighths: 11,
            // `a` keeps the `kk` that `b` is drawn from beside it.
            streamed_draw_bytes: 16,
            copy_quarters: 9,
            qk_halves: 0,
            gate_halves: 0,
            chunk_rows: [10, 6, 6],
        }
    }
}
