//! GDN-2 in the operator registry ([`crate::registry`]): FLA `chunk_gdn2`'s
//! names and options. Its draws are KDA's (the same named streams for q,
//! k, v, g and the gate parameters) with the erase gate `b` and the write
//! gate `w` drawn as the sigmoids FLA's layer applies.

use ndarray::ArrayD;
use serde::{Deserialize, Serialize};

use super::{chunk::Chunk, naive::Naive, Gdn2, Gdn2Inputs, Gdn2Options};
use crate::conv::Activation;
use crate::cp::Carry;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::gates::Gate;
use crate::inputs::{self, Draw, KdaSpec, Regime};
use crate::kda::KdaOptions;
use crate::precision::{self, Feature, Policy, Stage};
use crate::registry::{
    self, need, take, Build, ChunkSize, DrawRequest, Entry, GenFlag, GenFlags, MemoryModel, OpInfo,
    Options, Registered, Showcase, Tensors,
};

pub(crate) static ENTRY: Entry<Gdn2> = Entry::new();

/// What FLA 0.6.0's `chunk_gdn2` stores in which dtype with bf16 inputs
/// (the table in [`super::chunk`]'s docs; read from `fla/ops/gdn2/`
/// `chunk_fwd.py`, `chunk_intra.py`, `wy_fast.py`, `chunk_bwd.py` and the
/// shared `common/chunk_delta_h.py`, `gla/chunk.py`): fp32 cumsum, tf32
/// intra dots, everything else stored in the input dtype.
pub(crate) const FLA_BF16_STAGES: &[(Stage, Dtype)] = &[
    (Stage::Activations, Dtype::Bf16),
    (Stage::GCumsum, Dtype::F32),
    (Stage::FwdDots, Dtype::Tf32),
    (Stage::Aqk, Dtype::Bf16),
    (Stage::Akk, Dtype::Bf16),
    (Stage::KBeta, Dtype::Bf16),
    (Stage::W, Dtype::Bf16),
    (Stage::U, Dtype::Bf16),
    (Stage::Gated, Dtype::Bf16),
    (Stage::H, Dtype::Bf16),
    (Stage::VNew, Dtype::Bf16),
    (Stage::Dh, Dtype::Bf16),
    (Stage::Dv, Dtype::Bf16),
    (Stage::BwdOperands, Dtype::Bf16),
];

static INFO: OpInfo = OpInfo {
    name: "gdn2",
    fla: &["chunk_gdn2", "naive_recurrent_gdn2"],
    inputs: <Gdn2 as crate::op::OpSpec>::INPUTS,
    optional: &["A_log", "dt_bias", "initial_state", "cu_seqlens"],
    upstream: ["do", "dht"],
    outputs: <Gdn2 as crate::op::OpSpec>::OUTPUTS,
    grads: <Gdn2 as crate::op::OpSpec>::GRADS,
    axes: &[
        ("q", "B,T,H,K"),
        ("k", "B,T,H,K"),
        ("v", "B,T,H,V"),
        ("g", "B,T,H,K"),
        ("b", "B,T,H,K"),
        ("w", "B,T,H,V"),
        ("A_log", "H"),
        ("dt_bias", "H*K"),
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
        seed: 2029,
        flags: GenFlags {
            gate: Gate::LowerBound { lower_bound: -5.0 },
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
    regimes: &Regime::ALL,
    fp32_results: &["final_state", "dh0", "dA_log", "ddt_bias"],
    gen_flags: &[
        GenFlag::Gate,
        GenFlag::L2norm,
        GenFlag::InitialState,
        GenFlag::StateVFirst,
        GenFlag::Scale,
    ],
    intermediates: &[],
};

/// GDN-2's options as a case file stores them (FLA `chunk_gdn2`'s names).
#[derive(Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct CaseOptions {
    #[serde(skip_serializing_if = "Option::is_none")]
    scale: Option<f64>,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    safe_gate: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    lower_bound: Option<f64>,
    state_v_first: bool,
}

impl CaseOptions {
    fn of(o: &Gdn2Options) -> Self {
        CaseOptions {
            scale: o.scale,
            use_qk_l2norm_in_kernel: o.use_qk_l2norm_in_kernel,
            use_gate_in_kernel: o.use_gate_in_kernel,
            safe_gate: o.safe_gate,
            lower_bound: o.lower_bound,
            state_v_first: o.state_v_first,
        }
    }

    fn options(self) -> Gdn2Options {
        Gdn2Options {
            scale: self.scale,
            output_final_state: true,
            use_qk_l2norm_in_kernel: self.use_qk_l2norm_in_kernel,
            use_gate_in_kernel: self.use_gate_in_kernel,
            safe_gate: self.safe_gate,
            lower_bound: self.lower_bound,
            state_v_first: self.state_v_first,
        }
    }
}

/// The KDA gate whose draws GDN-2's gate inputs share.
fn kda_gate(o: &Gdn2Options) -> Gate {
    match (o.use_gate_in_kernel, o.lower_bound) {
        (false, _) => Gate::None,
        (true, None) => Gate::Kda,
        (true, Some(lower_bound)) => Gate::LowerBound { lower_bound },
    }
}

/// GDN-2's typed inputs, taken out of named tensors.
fn inputs_of(t: &mut Tensors, cu: Option<Vec<i64>>) -> Result<Gdn2Inputs<f64>> {
    let op = INFO.name;
    Ok(Gdn2Inputs {
        q: take(t, "q", op)?,
        k: take(t, "k", op)?,
        v: take(t, "v", op)?,
        g: take(t, "g", op)?,
        b: take(t, "b", op)?,
        w: take(t, "w", op)?,
        a_log: t.remove("A_log"),
        dt_bias: t.remove("dt_bias"),
        initial_state: t.remove("initial_state"),
        cu_seqlens: cu,
    })
}

impl Gdn2Options {
    /// The options of a case file's `case` entry (FLA's keyword names, a
    /// [`registry::Options`] object): an unknown key or a bad value is an
    /// error naming the key.
    pub fn from_case(o: &Options) -> std::result::Result<Self, String> {
        <Gdn2 as Registered>::options(o)
    }
}

/// GDN-2's chunked engine for a job: its chunk size and precision policy.
impl Build for Chunk {
    const FEATURES: &'static [Feature] = Chunk::FEATURES;

    fn build(c: ChunkSize, policy: &Policy) -> Chunk {
        Chunk::sized(c).with_policy(policy.clone())
    }
}

impl Registered for Gdn2 {
    const INFO: &'static OpInfo = &INFO;
    type Naive = Naive;
    type Chunk = Chunk;
    type Case = CaseOptions;

    fn typed(c: CaseOptions) -> std::result::Result<Gdn2Options, String> {
        Ok(c.options())
    }

    fn gen_options(f: &GenFlags) -> std::result::Result<Options, String> {
        let (use_gate_in_kernel, lower_bound) = match f.gate {
            Gate::None => (false, None),
            Gate::Kda => (true, None),
            Gate::LowerBound { lower_bound } => (true, Some(lower_bound)),
        };
        let o = Gdn2Options {
            scale: f.scale,
            output_final_state: true,
            use_qk_l2norm_in_kernel: f.l2norm,
            use_gate_in_kernel,
            safe_gate: lower_bound.is_some(),
            lower_bound,
            state_v_first: f.state_v_first,
        };
        Ok(registry::to_options(&CaseOptions::of(&o)))
    }

    fn draws(r: &DrawRequest<'_>, opt: &Gdn2Options) -> Vec<Draw> {
        let d = r.dims;
        let s = KdaSpec {
            layout: r.layout.clone(),
            h: d[0],
            hv: d[0],
            k: d[1],
            v: d[2],
            opts: KdaOptions {
                gate: kda_gate(opt),
                use_qk_l2norm_in_kernel: opt.use_qk_l2norm_in_kernel,
                ..KdaOptions::default()
            },
            initial_state: r.flags.initial_state,
            scalar_gate: false,
            seed: r.seed,
        };
        let unit = r.unit_norm_keys && !opt.use_qk_l2norm_in_kernel;
        let (b, t) = (r.layout.b, r.layout.t);
        let seed = r.seed;
        let sigmoid = move |name: &'static str, shape: Vec<usize>| {
            Draw::new(name, shape, move |sh| {
                inputs::normal(seed, name, sh).mapv(|x| 1.0 / (1.0 + (-x).exp()))
            })
        };
        let state_v_first = opt.state_v_first;
        let state = move |d: Draw| {
            if state_v_first {
                d.map(|x| *x = super::swap_state(x))
            } else {
                d
            }
        };
        crate::kda::spec::kda_draws(&s, r.regime)
            .into_iter()
            .filter(|d| d.name != "beta")
            .map(|d| match d.name {
                "k" if unit => d.map(inputs::unit_norm),
                "initial_state" | "dht" => state(d),
                _ => d,
            })
            .chain([
                sigmoid("b", vec![b, t, d[0], d[1]]),
                sigmoid("w", vec![b, t, d[0], d[2]]),
            ])
            .collect()
    }

    /// FLA 0.6.0's gdn2 kernels in bf16 ([`FLA_BF16_STAGES`], base-2
    /// exponentials, the safe-gate path's anchored diagonal dots when
    /// `safe_gate` is on), outputs in bf16.
    fn fla_bf16(opt: &Gdn2Options, cp: bool) -> Policy {
        let mut p = precision::fla_bf16(FLA_BF16_STAGES, cp);
        p.exp2 = true;
        p.safe_gate_midpoint = opt.safe_gate;
        p.with(Stage::Outputs, Dtype::Bf16)
    }

    fn inputs(t: &mut Tensors, cu: Option<Vec<i64>>) -> Result<Gdn2Inputs<f64>> {
        inputs_of(t, cu)
    }

    fn validate(
        t: &Tensors,
        cu: Option<&[i64]>,
        opt: &Gdn2Options,
        d_o: &ArrayD<f64>,
        dht: Option<&ArrayD<f64>>,
    ) -> Result<()> {
        // GDN-2's checks read owned inputs: a copy of the named ones.
        let mut copy: Tensors = INFO
            .inputs
            .iter()
            .filter_map(|n| Some((n.to_string(), t.get(*n)?.clone())))
            .collect();
        need(t, "q", INFO.name)?;
        let x = inputs_of(&mut copy, cu.map(<[i64]>::to_vec))?;
        let d = x.validate(opt)?;
        super::validate_upstream(&d, opt.state_v_first, d_o, dht)
    }

    fn memory(opt: &Gdn2Options) -> MemoryModel {
        MemoryModel {
            draw_eighths: 11,
            streamed_draw_bytes: 8,
            copy_quarters: 12,
            qk_halves: if opt.use_qk_l2norm_in_kernel { 3 } else { 0 },
            gate_halves: if opt.use_gate_in_kernel { 9 } else { 0 },
            chunk_rows: [12, 8, 6],
        }
    }
}
