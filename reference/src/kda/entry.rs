//! KDA in the operator registry ([`crate::registry`]): FLA `chunk_kda`'s
//! names, its case options, its draws and FLA's bf16 storage of its kernels.

use ndarray::ArrayD;
use serde::{Deserialize, Serialize};

use super::{chunk::Chunk, naive::Naive, Kda, KdaInputs, KdaOptions, KdaRefs};
use crate::conv::Activation;
use crate::cp::Carry;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::gates::Gate;
use crate::inputs::{self, Draw, KdaSpec};
use crate::precision::{self, Feature, Policy, Stage};
use crate::registry::{
    self, need, take, Build, ChunkPos, ChunkSize, DrawRequest, Entry, GenFlag, GenFlags, Job,
    MemoryModel, OpInfo, Options, Registered, Showcase, Tensors,
};

pub(crate) static ENTRY: Entry<Kda> = Entry::new();

static INFO: OpInfo = OpInfo {
    name: "kda",
    fla: &["chunk_kda", "naive_recurrent_kda"],
    inputs: <Kda as crate::op::OpSpec>::INPUTS,
    optional: &["A_log", "dt_bias", "initial_state", "cu_seqlens"],
    upstream: ["do", "dht"],
    outputs: <Kda as crate::op::OpSpec>::OUTPUTS,
    grads: <Kda as crate::op::OpSpec>::GRADS,
    axes: &[
        ("q", "B,T,H,K"),
        ("k", "B,T,H,K"),
        ("v", "B,T,HV,V"),
        ("g", "B,T,HV,K"),
        ("beta", "B,T,HV"),
        ("A_log", "HV"),
        ("dt_bias", "HV*K"),
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
        seed: 2024,
        flags: GenFlags {
            gate: Gate::LowerBound { lower_bound: -5.0 },
            l2norm: true,
            beta_sigmoid: true,
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
    fp32_results: &["final_state", "dh0", "dA_log", "ddt_bias"],
    gen_flags: &[
        GenFlag::Gate,
        GenFlag::L2norm,
        GenFlag::BetaSigmoid,
        GenFlag::AllowNegEigval,
        GenFlag::InitialState,
        GenFlag::Scale,
    ],
    intermediates: &[
        "g_cumsum",
        "Aqk",
        "Akk",
        "w",
        "u",
        "qg",
        "kg",
        "v_new",
        "h",
        "S_ext",
        "M",
        "merged_initial_state",
        "merged_dht",
    ],
};

/// KDA's options as a case file stores them; `gate` is `none`, `kda` or
/// `lowerbound` (with `lower_bound`).
#[derive(Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct CaseOptions {
    #[serde(skip_serializing_if = "Option::is_none")]
    scale: Option<f64>,
    use_qk_l2norm_in_kernel: bool,
    gate: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lower_bound: Option<f64>,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
}

impl CaseOptions {
    fn of(o: &KdaOptions) -> Self {
        CaseOptions {
            scale: o.scale,
            use_qk_l2norm_in_kernel: o.use_qk_l2norm_in_kernel,
            gate: Some(o.gate.name().into()),
            lower_bound: match o.gate {
                Gate::LowerBound { lower_bound } => Some(lower_bound),
                _ => None,
            },
            use_beta_sigmoid_in_kernel: o.use_beta_sigmoid_in_kernel,
            allow_neg_eigval: o.allow_neg_eigval,
        }
    }

    fn options(self) -> std::result::Result<KdaOptions, String> {
        let gate = match (self.gate.as_deref(), self.lower_bound) {
            (None | Some("none"), None) => Gate::None,
            (Some("kda"), None) => Gate::Kda,
            (Some("lowerbound"), Some(lb)) => Gate::LowerBound { lower_bound: lb },
            (Some("lowerbound"), None) => {
                return Err("key `gate`: \"lowerbound\" needs key `lower_bound`".into())
            }
            (_, Some(_)) => {
                return Err("key `lower_bound`: only valid with gate \"lowerbound\"".into())
            }
            (Some(g), None) => {
                return Err(format!(
                    "key `gate`: unknown gate \"{g}\" (none, kda, lowerbound)"
                ))
            }
        };
        Ok(KdaOptions {
            scale: self.scale,
            output_final_state: true,
            use_qk_l2norm_in_kernel: self.use_qk_l2norm_in_kernel,
            gate,
            use_beta_sigmoid_in_kernel: self.use_beta_sigmoid_in_kernel,
            allow_neg_eigval: self.allow_neg_eigval,
        })
    }
}

/// FLA's bf16 storage of KDA's and GDN's chunk kernels (fla-core 0.6.0;
/// the stage → tensor → file table is in debug.md): activations, `Aqk`,
/// `Akk`, `w`, `u`, `qg`/`kg`, `h`, `v_new`, `dh`, `dv` and the backward's
/// dot operands in bf16, `g_cumsum` fp32, tf32 intra-chunk dots.
pub(crate) const FLA_BF16_STAGES: &[(Stage, Dtype)] = &[
    (Stage::Activations, Dtype::Bf16),
    (Stage::GCumsum, Dtype::F32),
    (Stage::Aqk, Dtype::Bf16),
    (Stage::Akk, Dtype::Bf16),
    (Stage::W, Dtype::Bf16),
    (Stage::U, Dtype::Bf16),
    (Stage::Gated, Dtype::Bf16),
    (Stage::H, Dtype::Bf16),
    (Stage::VNew, Dtype::Bf16),
    (Stage::Dh, Dtype::Bf16),
    (Stage::Dv, Dtype::Bf16),
    (Stage::FwdDots, Dtype::Tf32),
    (Stage::BwdOperands, Dtype::Bf16),
    (Stage::HdhSum, Dtype::Bf16),
    (Stage::IntraDots, Dtype::Tf32),
];

/// A KDA case's tensors, one draw each (unit-norm keys as asked).
pub(crate) fn kda_draws(r: &DrawRequest<'_>, opts: KdaOptions, scalar_gate: bool) -> Vec<Draw> {
    let d = r.dims;
    let s = KdaSpec {
        layout: r.layout.clone(),
        h: d[0],
        hv: d[1],
        k: d[2],
        v: d[3],
        opts,
        initial_state: r.flags.initial_state,
        scalar_gate,
        seed: r.seed,
    };
    let unit = r.unit_norm_keys && !opts.use_qk_l2norm_in_kernel;
    super::spec::kda_draws(&s, r.regime)
        .into_iter()
        .map(|d| match d.name {
            "k" if unit => d.map(inputs::unit_norm),
            _ => d,
        })
        .collect()
}

impl<'t> KdaRefs<'t, f64> {
    /// KDA's (and GDN's) tensors borrowed from named tensors `t` (FLA's
    /// names, shapes as in [`KdaInputs`]) and `cu_seqlens` `[N + 1]`; a
    /// required tensor missing is an error naming it and operator `op`.
    pub fn from_tensors(t: &'t Tensors, cu: Option<&'t [i64]>, op: &str) -> Result<Self> {
        refs(t, cu, op)
    }
}

/// KDA's (and GDN's) tensors, borrowed from named tensors.
pub(crate) fn refs<'t>(
    t: &'t Tensors,
    cu: Option<&'t [i64]>,
    op: &str,
) -> Result<KdaRefs<'t, f64>> {
    Ok(KdaRefs {
        q: need(t, "q", op)?,
        k: need(t, "k", op)?,
        v: need(t, "v", op)?,
        g: need(t, "g", op)?,
        beta: need(t, "beta", op)?,
        a_log: t.get("A_log"),
        dt_bias: t.get("dt_bias"),
        initial_state: t.get("initial_state"),
        cu_seqlens: cu,
    })
}

/// KDA's (and GDN's) typed inputs, taken out of named tensors.
pub(crate) fn inputs_of(t: &mut Tensors, cu: Option<Vec<i64>>, op: &str) -> Result<KdaInputs<f64>> {
    Ok(KdaInputs {
        q: take(t, "q", op)?,
        k: take(t, "k", op)?,
        v: take(t, "v", op)?,
        g: take(t, "g", op)?,
        beta: take(t, "beta", op)?,
        a_log: t.remove("A_log"),
        dt_bias: t.remove("dt_bias"),
        initial_state: t.remove("initial_state"),
        cu_seqlens: cu,
    })
}

impl KdaOptions {
    /// The options of a case file's `case` entry (FLA's keyword names, a
    /// [`registry::Options`] object): an unknown key or a bad value is an
    /// error naming the key.
    pub fn from_case(o: &Options) -> std::result::Result<Self, String> {
        <Kda as Registered>::options(o)
    }
}

/// KDA's chunked engine for a job: its chunk size and precision policy.
impl Build for Chunk {
    const FEATURES: &'static [Feature] = Chunk::FEATURES;

    fn build(c: ChunkSize, policy: &Policy) -> Chunk {
        Chunk::sized(c).with_policy(policy.clone())
    }
}

impl Registered for Kda {
    const INFO: &'static OpInfo = &INFO;
    type Naive = Naive;
    type Chunk = Chunk;
    type Case = CaseOptions;

    fn typed(c: CaseOptions) -> std::result::Result<KdaOptions, String> {
        c.options()
    }

    fn gen_options(f: &GenFlags) -> std::result::Result<Options, String> {
        let o = KdaOptions {
            scale: f.scale,
            output_final_state: true,
            use_qk_l2norm_in_kernel: f.l2norm,
            gate: f.gate,
            use_beta_sigmoid_in_kernel: f.beta_sigmoid,
            allow_neg_eigval: f.allow_neg_eigval,
        };
        Ok(registry::to_options(&CaseOptions::of(&o)))
    }

    fn draws(r: &DrawRequest<'_>, opt: &KdaOptions) -> Vec<Draw> {
        kda_draws(r, *opt, false)
    }

    fn fla_bf16(opt: &KdaOptions, cp: bool) -> Policy {
        let mut p = precision::fla_bf16(FLA_BF16_STAGES, cp);
        // Read from KDA's `recompute_w_u_fwd`: with a bf16 input β the
        // product `β k` rounds to bf16 (the in-kernel sigmoid returns fp32).
        if !opt.use_beta_sigmoid_in_kernel {
            p = p
                .with(Stage::KBeta, Dtype::Bf16)
                .with(Stage::KBetaBwd, Dtype::Bf16);
        }
        p.exp2 = true;
        p.safe_gate_midpoint = matches!(opt.gate, Gate::LowerBound { .. });
        p.with(Stage::Outputs, Dtype::Bf16)
    }

    fn inputs(t: &mut Tensors, cu: Option<Vec<i64>>) -> Result<KdaInputs<f64>> {
        inputs_of(t, cu, INFO.name)
    }

    fn validate(
        t: &Tensors,
        cu: Option<&[i64]>,
        opt: &KdaOptions,
        d_o: &ArrayD<f64>,
        dht: Option<&ArrayD<f64>>,
    ) -> Result<()> {
        let d = refs(t, cu, INFO.name)?.validate(opt)?;
        d.validate_upstream(d_o, dht)
    }

    fn memory(opt: &KdaOptions) -> MemoryModel {
        MemoryModel {
            draw_eighths: 11,
            streamed_draw_bytes: 8,
            copy_quarters: 9,
            qk_halves: if opt.use_qk_l2norm_in_kernel { 3 } else { 0 },
            gate_halves: if opt.gate != Gate::None { 9 } else { 0 },
            chunk_rows: [8, 5, 6],
        }
    }

    fn intermediates(
        job: &Job<'_>,
        x: &KdaInputs<f64>,
        opt: &KdaOptions,
        up: (&ArrayD<f64>, Option<&ArrayD<f64>>),
    ) -> Result<(Tensors, Vec<ChunkPos>)> {
        super::intermediates::compute(job, x, opt, up)
    }
}
