//! Causal conv1d in the operator registry ([`crate::registry`]): FLA's
//! `causal_conv1d` (its one option: the activation).

use ndarray::ArrayD;
use serde::{Deserialize, Serialize};

use super::{Activation, CausalConv1d, ConvInputs, ConvOptions, ConvRefs, Direct};
use crate::cp::Carry;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::gates::Gate;
use crate::inputs::{ConvSpec, Draw, Regime};
use crate::precision::{self, Policy, Stage};
use crate::registry::{
    self, eager_draws, need, take, Build, ChunkSize, DrawRequest, Entry, GenFlag, GenFlags,
    MemoryModel, OpInfo, Options, Registered, Showcase, Tensors,
};

pub(crate) static ENTRY: Entry<CausalConv1d> = Entry::new();

static INFO: OpInfo = OpInfo {
    name: "causal_conv1d",
    fla: &["causal_conv1d"],
    inputs: <CausalConv1d as crate::op::OpSpec>::INPUTS,
    optional: &["bias", "initial_state", "cu_seqlens"],
    upstream: ["dy", "dht"],
    outputs: <CausalConv1d as crate::op::OpSpec>::OUTPUTS,
    grads: <CausalConv1d as crate::op::OpSpec>::GRADS,
    axes: &[
        ("x", "B,T,D"),
        ("weight", "D,W"),
        ("bias", "D"),
        ("initial_state", "N,D,W"),
        ("cu_seqlens", "N+1"),
        ("dy", "B,T,D"),
        ("dht", "N,D,W"),
    ],
    shape: "B,T,D,W",
    default_shape: &[2, 64, 32, 4],
    carry: Carry::Tokens,
    chunked: false,
    showcase: Showcase {
        dims: &[6, 4],
        fd_dims: &[6, 4],
        seed: 2028,
        flags: GenFlags {
            gate: Gate::None,
            l2norm: false,
            beta_sigmoid: false,
            allow_neg_eigval: false,
            initial_state: true,
            state_v_first: false,
            activation: Activation::Silu,
            bias: true,
            scale: None,
        },
    },
    streams_by_head: false,
    regimes: &[Regime::FlaTest],
    fp32_results: &["final_state", "dh0"],
    gen_flags: &[GenFlag::Activation, GenFlag::Bias, GenFlag::InitialState],
    intermediates: &[],
};

/// The activation as a case file stores it (`none`, `silu`).
#[derive(Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct CaseOptions {
    activation: Option<String>,
}

impl ConvOptions {
    /// The options of a case file's `case` entry (FLA's keyword names, a
    /// [`registry::Options`] object): an unknown key or a bad value is an
    /// error naming the key.
    pub fn from_case(o: &Options) -> std::result::Result<Self, String> {
        <CausalConv1d as Registered>::options(o)
    }
}

/// The convolution has one engine: the chunked one is it, with no stages to round.
impl Build for Direct {
    fn build(_: ChunkSize, _: &Policy) -> Direct {
        Direct
    }
}

impl Registered for CausalConv1d {
    const INFO: &'static OpInfo = &INFO;
    type Naive = Direct;
    type Chunk = Direct;
    type Case = CaseOptions;

    fn typed(c: CaseOptions) -> std::result::Result<ConvOptions, String> {
        let activation = match c.activation {
            None => Activation::None,
            Some(s) => Activation::parse(&s).map_err(|e| format!("key `activation`: {e}"))?,
        };
        Ok(ConvOptions {
            activation,
            output_final_state: true,
        })
    }

    fn gen_options(f: &GenFlags) -> std::result::Result<Options, String> {
        Ok(registry::to_options(&CaseOptions {
            activation: Some(f.activation.name().into()),
        }))
    }

    fn draws(r: &DrawRequest<'_>, _: &ConvOptions) -> Vec<Draw> {
        let g = super::spec::conv(&ConvSpec {
            layout: r.layout.clone(),
            d: r.dims[0],
            w: r.dims[1],
            bias: r.flags.bias,
            initial_state: r.flags.initial_state,
            seed: r.seed,
        });
        let x = g.inputs;
        eager_draws(vec![
            ("x", Some(x.x)),
            ("weight", Some(x.weight)),
            ("bias", x.bias),
            ("initial_state", x.initial_state),
            ("dy", Some(g.d_o)),
            ("dht", Some(g.dht)),
        ])
    }

    fn fla_bf16(_: &ConvOptions, _: bool) -> Policy {
        precision::fla_bf16(&[], false).with(Stage::Outputs, Dtype::Bf16)
    }

    fn inputs(t: &mut Tensors, cu: Option<Vec<i64>>) -> Result<ConvInputs<f64>> {
        let op = INFO.name;
        Ok(ConvInputs {
            x: take(t, "x", op)?,
            weight: take(t, "weight", op)?,
            bias: t.remove("bias"),
            initial_state: t.remove("initial_state"),
            cu_seqlens: cu,
        })
    }

    fn validate(
        t: &Tensors,
        cu: Option<&[i64]>,
        _: &ConvOptions,
        d_o: &ArrayD<f64>,
        dht: Option<&ArrayD<f64>>,
    ) -> Result<()> {
        let op = INFO.name;
        let x = ConvRefs {
            x: need(t, "x", op)?,
            weight: need(t, "weight", op)?,
            bias: t.get("bias"),
            initial_state: t.get("initial_state"),
            cu_seqlens: cu,
        };
        let (d, _) = super::validate_refs(&x)?;
        super::validate_upstream(&d, d_o, dht)
    }

    fn memory(_: &ConvOptions) -> MemoryModel {
        MemoryModel {
            draw_eighths: 14,
            streamed_draw_bytes: 8,
            copy_quarters: 19,
            qk_halves: 0,
            gate_halves: 0,
            chunk_rows: [0, 0, 0],
        }
    }
}
