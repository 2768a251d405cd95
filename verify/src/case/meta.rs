//! The `case` metadata entry: the op (with its FLA tensor names from the
//! operator contract) and its options under FLA's names, to and from JSON.

use deltaref::conv::{Activation, CausalConv1d, ConvOptions};
use deltaref::cp::Layout;
use deltaref::dplr::{Dplr, DplrOptions};
use deltaref::gates::Gate;
use deltaref::gdn::{Gdn, GdnOptions};
use deltaref::kda::{Kda, KdaOptions};
use deltaref::op::OpSpec;
use deltaref::token_shift::TokenShift;
use serde_json::{Map, Value};

use super::Dtype;

/// The operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Kda,
    Dplr,
    TokenShift,
    /// FLA's gated delta rule.
    Gdn,
    /// FLA's `causal_conv1d`.
    CausalConv1d,
}

/// An operator's names, as its contract declares them ([`OpSpec`]).
struct Names {
    name: &'static str,
    inputs: &'static [&'static str],
    upstream: &'static [&'static str],
    outputs: &'static [&'static str],
    grads: &'static [&'static str],
}

impl Names {
    fn of<O: OpSpec>() -> Names {
        Names {
            name: O::NAME,
            inputs: O::INPUTS,
            upstream: O::UPSTREAM,
            outputs: O::OUTPUTS,
            grads: O::GRADS,
        }
    }
}

impl Op {
    pub const ALL: [Op; 5] = [Op::Kda, Op::Dplr, Op::TokenShift, Op::Gdn, Op::CausalConv1d];

    /// A delta rule (KDA, DPLR, GDN): its CP carries `(S_ext, M)` and
    /// merges; token-shift and the conv pass their last tokens instead.
    pub fn is_delta_rule(self) -> bool {
        matches!(self, Op::Kda | Op::Dplr | Op::Gdn)
    }

    fn names(self) -> Names {
        match self {
            Op::Kda => Names::of::<Kda>(),
            Op::Dplr => Names::of::<Dplr>(),
            Op::TokenShift => Names::of::<TokenShift>(),
            Op::Gdn => Names::of::<Gdn>(),
            Op::CausalConv1d => Names::of::<CausalConv1d>(),
        }
    }

    /// `kda, dplr, …` for error messages.
    pub fn names_list() -> String {
        Op::ALL.map(Op::name).join(", ")
    }

    /// The first token input (`x` or `q`): where B and T are read.
    pub fn first_input(self) -> &'static str {
        self.inputs()[0]
    }

    /// Whether the state is a delta-rule state `[K, V]` per value head.
    pub fn has_heads(self) -> bool {
        !matches!(self, Op::TokenShift | Op::CausalConv1d)
    }

    pub fn name(self) -> &'static str {
        self.names().name
    }

    pub fn parse(s: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == s)
    }

    /// Input tensor names (FLA's), including the integer `cu_seqlens`.
    pub fn inputs(self) -> &'static [&'static str] {
        self.names().inputs
    }

    /// Upstream gradient names.
    pub fn upstream(self) -> &'static [&'static str] {
        self.names().upstream
    }

    /// The forward results: the output and the final state.
    pub fn forward_results(self) -> &'static [&'static str] {
        self.names().outputs
    }

    /// Output and gradient names (what a candidate provides), the forward
    /// results first.
    pub fn results(self) -> Vec<&'static str> {
        let n = self.names();
        [n.outputs, n.grads].concat()
    }

    /// Whether `name` is a tensor a case of this op may hold.
    pub fn knows(self, name: &str) -> bool {
        self.inputs().contains(&name)
            || self.upstream().contains(&name)
            || self.results().contains(&name)
            || crate::intermediates::is_intermediate(self, name)
    }
}

/// A CP layout stored with a case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CpLayout {
    /// FLA's equal split over `world` ranks, in its layout (`"layout"`,
    /// contiguous when absent).
    World(usize, Layout),
    /// Interior cut points.
    Cuts(Vec<usize>),
}

/// The `case` metadata: op and options with FLA's names.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseMeta {
    pub op: Op,
    pub scale: Option<f64>,
    pub use_qk_l2norm_in_kernel: bool,
    pub gate: Gate,
    pub use_beta_sigmoid_in_kernel: bool,
    pub allow_neg_eigval: bool,
    /// GDN: states are `[N, HV, V, K]`.
    pub state_v_first: bool,
    /// Causal conv1d.
    pub activation: Activation,
    pub chunk_size: Option<usize>,
    pub cp: Option<CpLayout>,
    pub seed: Option<u64>,
    pub dtype: Option<Dtype>,
    /// The input regime `gen` drew from (absent: FLA's test draws).
    pub regime: Option<deltaref::inputs::Regime>,
}

impl CaseMeta {
    pub fn new(op: Op) -> Self {
        CaseMeta {
            op,
            scale: None,
            use_qk_l2norm_in_kernel: false,
            gate: Gate::None,
            use_beta_sigmoid_in_kernel: false,
            allow_neg_eigval: false,
            state_v_first: false,
            activation: Activation::None,
            chunk_size: None,
            cp: None,
            seed: None,
            dtype: None,
            regime: None,
        }
    }

    pub fn kda_options(&self) -> KdaOptions {
        KdaOptions {
            scale: self.scale,
            output_final_state: true,
            use_qk_l2norm_in_kernel: self.use_qk_l2norm_in_kernel,
            gate: self.gate,
            use_beta_sigmoid_in_kernel: self.use_beta_sigmoid_in_kernel,
            allow_neg_eigval: self.allow_neg_eigval,
        }
    }

    /// GDN's options; its in-kernel gate is `gate == Gate::Kda`
    /// (`use_gate_in_kernel` in the case file).
    pub fn gdn_options(&self) -> GdnOptions {
        GdnOptions {
            scale: self.scale,
            output_final_state: true,
            use_qk_l2norm_in_kernel: self.use_qk_l2norm_in_kernel,
            use_gate_in_kernel: self.gate == Gate::Kda,
            use_beta_sigmoid_in_kernel: self.use_beta_sigmoid_in_kernel,
            allow_neg_eigval: self.allow_neg_eigval,
            state_v_first: self.state_v_first,
        }
    }

    pub fn conv_options(&self) -> ConvOptions {
        ConvOptions {
            activation: self.activation,
            output_final_state: true,
        }
    }

    pub fn dplr_options(&self) -> DplrOptions {
        DplrOptions {
            scale: self.scale,
            output_final_state: true,
        }
    }

    /// The JSON object stored under `case` (keys that apply to the op only).
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("op".into(), self.op.name().into());
        if let Some(s) = self.scale {
            m.insert("scale".into(), s.into());
        }
        if self.op == Op::Kda {
            m.insert(
                "use_qk_l2norm_in_kernel".into(),
                self.use_qk_l2norm_in_kernel.into(),
            );
            m.insert("gate".into(), self.gate.name().into());
            if let Gate::LowerBound { lower_bound } = self.gate {
                m.insert("lower_bound".into(), lower_bound.into());
            }
            m.insert(
                "use_beta_sigmoid_in_kernel".into(),
                self.use_beta_sigmoid_in_kernel.into(),
            );
            m.insert("allow_neg_eigval".into(), self.allow_neg_eigval.into());
        }
        if self.op == Op::Gdn {
            for (key, on) in [
                ("use_qk_l2norm_in_kernel", self.use_qk_l2norm_in_kernel),
                ("use_gate_in_kernel", self.gate == Gate::Kda),
                (
                    "use_beta_sigmoid_in_kernel",
                    self.use_beta_sigmoid_in_kernel,
                ),
                ("allow_neg_eigval", self.allow_neg_eigval),
                ("state_v_first", self.state_v_first),
            ] {
                m.insert(key.into(), on.into());
            }
        }
        if self.op == Op::CausalConv1d {
            m.insert("activation".into(), self.activation.name().into());
        }
        if let Some(c) = self.chunk_size {
            m.insert("chunk_size".into(), c.into());
        }
        match &self.cp {
            Some(CpLayout::World(w, Layout::Contiguous)) => {
                m.insert("cp".into(), serde_json::json!({ "world": w }));
            }
            Some(CpLayout::World(w, layout)) => {
                m.insert(
                    "cp".into(),
                    serde_json::json!({ "world": w, "layout": layout.name() }),
                );
            }
            Some(CpLayout::Cuts(c)) => {
                m.insert("cp".into(), serde_json::json!({ "cuts": c }));
            }
            None => {}
        }
        if let Some(s) = self.seed {
            m.insert("seed".into(), s.into());
        }
        if let Some(d) = self.dtype {
            m.insert("dtype".into(), d.name().into());
        }
        if let Some(r) = self.regime {
            m.insert("regime".into(), r.name().into());
        }
        Value::Object(m)
    }

    /// Parses the `case` JSON; every unknown or mistyped key is an error naming it.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| format!("`case` is not valid JSON: {e}"))?;
        let Value::Object(m) = v else {
            return Err("`case` must be a JSON object".into());
        };
        let op_name = m.get("op").ok_or("`case` has no `op` key")?;
        let op_name = op_name.as_str().ok_or("key `op`: expected a string")?;
        let op = Op::parse(op_name).ok_or_else(|| {
            format!(
                "key `op`: unknown op \"{op_name}\" (expected one of {})",
                Op::names_list()
            )
        })?;
        let mut meta = CaseMeta::new(op);
        let mut gate_name: Option<String> = None;
        let mut lower_bound: Option<f64> = None;
        let mut gdn_gate = false;
        for (key, val) in &m {
            let only = |ops: &[Op]| {
                if ops.contains(&op) {
                    Ok(())
                } else {
                    Err(format!(
                        "key `{key}`: only applies to op {}, not {}",
                        ops.iter()
                            .map(|o| o.name())
                            .collect::<Vec<_>>()
                            .join(" or "),
                        op.name()
                    ))
                }
            };
            let delta = [Op::Kda, Op::Gdn];
            match key.as_str() {
                "op" => {}
                "scale" => meta.scale = Some(num(key, val)?),
                "use_qk_l2norm_in_kernel" => {
                    only(&delta)?;
                    meta.use_qk_l2norm_in_kernel = boolean(key, val)?;
                }
                "gate" => {
                    only(&[Op::Kda])?;
                    gate_name = Some(
                        val.as_str()
                            .ok_or(format!("key `{key}`: expected a string"))?
                            .to_string(),
                    );
                }
                "lower_bound" => {
                    only(&[Op::Kda])?;
                    lower_bound = Some(num(key, val)?);
                }
                "use_beta_sigmoid_in_kernel" => {
                    only(&delta)?;
                    meta.use_beta_sigmoid_in_kernel = boolean(key, val)?;
                }
                "allow_neg_eigval" => {
                    only(&delta)?;
                    meta.allow_neg_eigval = boolean(key, val)?;
                }
                "use_gate_in_kernel" => {
                    only(&[Op::Gdn])?;
                    gdn_gate = boolean(key, val)?;
                }
                "state_v_first" => {
                    only(&[Op::Gdn])?;
                    meta.state_v_first = boolean(key, val)?;
                }
                "activation" => {
                    only(&[Op::CausalConv1d])?;
                    let s = val
                        .as_str()
                        .ok_or(format!("key `{key}`: expected a string"))?;
                    meta.activation =
                        Activation::parse(s).map_err(|e| format!("key `{key}`: {e}"))?;
                }
                "chunk_size" => meta.chunk_size = Some(uint(key, val)? as usize),
                "cp" => meta.cp = Some(cp_layout(val)?),
                "seed" => meta.seed = Some(uint(key, val)?),
                "dtype" => {
                    let s = val
                        .as_str()
                        .ok_or(format!("key `{key}`: expected a string"))?;
                    meta.dtype = Some(Dtype::parse_among(
                        s,
                        &format!("key `{key}`"),
                        &Dtype::CASE_FILE,
                    )?);
                }
                "regime" => {
                    let s = val
                        .as_str()
                        .ok_or(format!("key `{key}`: expected a string"))?;
                    meta.regime = Some(deltaref::inputs::Regime::parse(s).ok_or(format!(
                        "key `{key}`: unknown regime \"{s}\" (fla-test, long-memory, mixed, sharp)"
                    ))?);
                }
                other => return Err(format!("unknown key `{other}` in `case`")),
            }
        }
        meta.gate = match (gate_name.as_deref(), lower_bound) {
            (None, None) if gdn_gate => Gate::Kda,
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
        Ok(meta)
    }
}

fn num(key: &str, v: &Value) -> Result<f64, String> {
    v.as_f64()
        .ok_or(format!("key `{key}`: expected a number, got {v}"))
}

fn boolean(key: &str, v: &Value) -> Result<bool, String> {
    v.as_bool()
        .ok_or(format!("key `{key}`: expected true or false, got {v}"))
}

fn uint(key: &str, v: &Value) -> Result<u64, String> {
    v.as_u64().ok_or(format!(
        "key `{key}`: expected a non-negative integer, got {v}"
    ))
}

fn cp_layout(v: &Value) -> Result<CpLayout, String> {
    let m = v.as_object().ok_or(
        "key `cp`: expected an object {\"world\": N, \"layout\": \"contiguous\"|\"zigzag\"} or {\"cuts\": [...]}",
    )?;
    if let Some(k) = m
        .keys()
        .find(|k| !["world", "layout", "cuts"].contains(&k.as_str()))
    {
        return Err(format!("unknown key `cp.{k}`"));
    }
    let layout = match m.get("layout") {
        None => None,
        Some(Value::String(s)) => {
            Some(Layout::parse(s).map_err(|e| format!("key `cp.layout`: {e}"))?)
        }
        Some(other) => {
            return Err(format!(
                "key `cp.layout`: expected \"contiguous\" or \"zigzag\", got {other}"
            ))
        }
    };
    match (m.get("world"), m.get("cuts")) {
        (None, Some(_)) if layout.is_some() => {
            Err("key `cp.layout`: applies to `world`, not to `cuts`".into())
        }
        (Some(w), None) => Ok(CpLayout::World(
            uint("cp.world", w)? as usize,
            layout.unwrap_or_default(),
        )),
        (None, Some(Value::Array(c))) => Ok(CpLayout::Cuts(
            c.iter()
                .map(|x| uint("cp.cuts", x).map(|u| u as usize))
                .collect::<Result<_, _>>()?,
        )),
        (None, Some(other)) => Err(format!(
            "key `cp.cuts`: expected an array of integers, got {other}"
        )),
        _ => Err("key `cp`: give exactly one of `world` or `cuts`".into()),
    }
}
