//! Token-shift in the operator registry ([`crate::registry`]): FLA's
//! `token_shift` (no options; one naive engine).

use ndarray::ArrayD;
use serde::{Deserialize, Serialize};

use super::{Shift, TokenShift, TokenShiftInputs, TokenShiftRefs};
use crate::conv::Activation;
use crate::cp::Carry;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::gates::Gate;
use crate::inputs::{self, Draw, TokenShiftSpec};
use crate::precision::{self, Policy, Stage};
use crate::registry::{
    eager_draws, need, take, Build, ChunkSize, DrawRequest, Entry, GenFlag, GenFlags, MemoryModel,
    OpInfo, Options, Registered, Showcase, Tensors,
};

pub(crate) static ENTRY: Entry<TokenShift> = Entry::new();

static INFO: OpInfo = OpInfo {
    name: "token_shift",
    fla: &["token_shift"],
    inputs: <TokenShift as crate::op::OpSpec>::INPUTS,
    optional: &["cache", "cu_seqlens"],
    upstream: ["dy", "dfinal_cache"],
    outputs: <TokenShift as crate::op::OpSpec>::OUTPUTS,
    grads: <TokenShift as crate::op::OpSpec>::GRADS,
    axes: &[
        ("x", "B,T,D"),
        ("cache", "N,D"),
        ("cu_seqlens", "N+1"),
        ("dy", "B,T,D"),
        ("dfinal_cache", "N,D"),
    ],
    shape: "B,T,D",
    default_shape: &[2, 64, 32],
    carry: Carry::Tokens,
    chunked: false,
    showcase: Showcase {
        dims: &[6],
        fd_dims: &[6],
        seed: 2026,
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
    streams_by_head: false,
    regimes: &inputs::Regime::ALL,
    fp32_results: &["final_cache"],
    gen_flags: &[GenFlag::InitialState],
    intermediates: &[],
};

/// Token-shift takes no options.
#[derive(Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct CaseOptions {}

impl<'t> TokenShiftRefs<'t, f64> {
    /// Token-shift's tensors borrowed from named tensors `t` (`x`
    /// `[B, T, D]`, `cache` `[N, 1, D]`) and `cu_seqlens` `[N + 1]`; `x`
    /// missing is an error naming it.
    pub fn from_tensors(t: &'t Tensors, cu: Option<&'t [i64]>) -> Result<Self> {
        refs(t, cu)
    }
}

/// Token-shift's tensors, borrowed from named tensors.
fn refs<'t>(t: &'t Tensors, cu: Option<&'t [i64]>) -> Result<TokenShiftRefs<'t, f64>> {
    Ok(TokenShiftRefs {
        x: need(t, "x", INFO.name)?,
        cache: t.get("cache"),
        cu_seqlens: cu,
    })
}

/// Token-shift has one engine: the chunked one is it, with no stages to round.
impl Build for Shift {
    fn build(_: ChunkSize, _: &Policy) -> Shift {
        Shift
    }
}

impl Registered for TokenShift {
    const INFO: &'static OpInfo = &INFO;
    type Naive = Shift;
    type Chunk = Shift;
    type Case = CaseOptions;

    fn typed(_: CaseOptions) -> std::result::Result<(), String> {
        Ok(())
    }

    fn gen_options(_: &GenFlags) -> std::result::Result<Options, String> {
        Ok(Options::new())
    }

    fn draws(r: &DrawRequest<'_>, _: &()) -> Vec<Draw> {
        let s = TokenShiftSpec {
            layout: r.layout.clone(),
            d: r.dims[0],
            cache: r.flags.initial_state,
            seed: r.seed,
        };
        let g = super::spec::token_shift_in(&s, r.regime);
        eager_draws(vec![
            ("x", Some(g.inputs.x)),
            ("cache", g.inputs.cache),
            ("dy", Some(g.d_o)),
            ("dfinal_cache", Some(g.dht)),
        ])
    }

    fn fla_bf16(_: &(), _: bool) -> Policy {
        precision::fla_bf16(&[], false).with(Stage::Outputs, Dtype::Bf16)
    }

    fn inputs(t: &mut Tensors, cu: Option<Vec<i64>>) -> Result<TokenShiftInputs<f64>> {
        Ok(TokenShiftInputs {
            x: take(t, "x", INFO.name)?,
            cache: t.remove("cache"),
            cu_seqlens: cu,
        })
    }

    fn validate(
        t: &Tensors,
        cu: Option<&[i64]>,
        _: &(),
        d_o: &ArrayD<f64>,
        dht: Option<&ArrayD<f64>>,
    ) -> Result<()> {
        let (d, _) = refs(t, cu)?.validate()?;
        d.validate_upstream(d_o, dht)
    }

    fn memory(_: &()) -> MemoryModel {
        MemoryModel {
            draw_eighths: 14,
            streamed_draw_bytes: 8,
            copy_quarters: 13,
            qk_halves: 0,
            gate_halves: 0,
            chunk_rows: [0, 0, 0],
        }
    }
}
