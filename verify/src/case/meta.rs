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
use serde::de::{DeserializeOwned, Visitor};
use serde::{Deserialize, Serialize};
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
            || is_intermediate(self, name)
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

    /// The JSON object stored under `case`: `op`, the shared keys and the
    /// op's own options (keys that apply to the op only).
    pub fn to_json(&self) -> Value {
        let mut m = object(&Common::of(self));
        m.insert("op".into(), self.op.name().into());
        m.extend(match self.op {
            Op::Kda => object(&KdaMeta::of(self)),
            Op::Gdn => object(&GdnMeta::of(self)),
            Op::CausalConv1d => object(&ConvMeta::of(self)),
            Op::Dplr | Op::TokenShift => Map::new(),
        });
        Value::Object(m)
    }

    /// Parses the `case` JSON; every unknown or mistyped key is an error
    /// naming it, the op and what was expected.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| format!("`case` is not valid JSON: {e}"))?;
        let Value::Object(mut m) = v else {
            return Err("`case` must be a JSON object".into());
        };
        let op_name = m.remove("op").ok_or("`case` has no `op` key")?;
        let op_name = op_name.as_str().ok_or("key `op`: expected a string")?;
        let op = Op::parse(op_name).ok_or_else(|| {
            format!(
                "key `op`: unknown op \"{op_name}\" (expected one of {})",
                Op::names_list()
            )
        })?;
        if let Some(k) = m.keys().find(|k| !op.keys().contains(&k.as_str())) {
            return Err(not_a_key_of(op, k));
        }
        let common_keys = keys::<Common>();
        let (common, own) = m
            .into_iter()
            .partition(|(k, _)| common_keys.contains(&k.as_str()));
        let mut meta = CaseMeta::new(op);
        de::<Common>(op, common)?.apply(&mut meta)?;
        match op {
            Op::Kda => de::<KdaMeta>(op, own)?.apply(&mut meta)?,
            Op::Gdn => de::<GdnMeta>(op, own)?.apply(&mut meta),
            Op::CausalConv1d => de::<ConvMeta>(op, own)?.apply(&mut meta)?,
            Op::Dplr | Op::TokenShift => {}
        }
        Ok(meta)
    }
}

impl Op {
    /// The keys a case of this op may hold besides `op`.
    fn keys(self) -> Vec<&'static str> {
        let own = match self {
            Op::Kda => keys::<KdaMeta>(),
            Op::Gdn => keys::<GdnMeta>(),
            Op::CausalConv1d => keys::<ConvMeta>(),
            Op::Dplr | Op::TokenShift => &[],
        };
        [keys::<Common>(), own].concat()
    }
}

/// The keys every op's metadata takes.
#[derive(Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Common {
    #[serde(skip_serializing_if = "Option::is_none")]
    scale: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chunk_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cp: Option<CpMeta>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dtype: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    regime: Option<String>,
}

impl Common {
    fn of(m: &CaseMeta) -> Self {
        Common {
            scale: m.scale,
            chunk_size: m.chunk_size,
            cp: m.cp.as_ref().map(CpMeta::of),
            seed: m.seed,
            dtype: m.dtype.map(|d| d.name().into()),
            regime: m.regime.map(|r| r.name().into()),
        }
    }

    fn apply(self, m: &mut CaseMeta) -> Result<(), String> {
        m.scale = self.scale;
        m.chunk_size = self.chunk_size;
        m.cp = self.cp.map(CpMeta::layout).transpose()?;
        m.seed = self.seed;
        m.dtype = self
            .dtype
            .map(|s| Dtype::parse_among(&s, "key `dtype`", &Dtype::CASE_FILE))
            .transpose()?;
        m.regime = self
            .regime
            .map(|s| {
                deltaref::inputs::Regime::parse(&s).ok_or(format!(
                    "key `regime`: unknown regime \"{s}\" (fla-test, long-memory, mixed, sharp)"
                ))
            })
            .transpose()?;
        Ok(())
    }
}

/// `cp`: `{"world": N, "layout": …}` or `{"cuts": [...]}`.
#[derive(Default, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "an object {\"world\": N, \"layout\": \"contiguous\"|\"zigzag\"} or {\"cuts\": [...]}"
)]
struct CpMeta {
    #[serde(skip_serializing_if = "Option::is_none")]
    world: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    layout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cuts: Option<Vec<usize>>,
}

impl CpMeta {
    fn of(c: &CpLayout) -> Self {
        match c {
            CpLayout::World(w, l) => CpMeta {
                world: Some(*w),
                // Contiguous, FLA's default, is written as no `layout`.
                layout: (*l != Layout::Contiguous).then(|| l.name().into()),
                cuts: None,
            },
            CpLayout::Cuts(c) => CpMeta {
                cuts: Some(c.clone()),
                ..CpMeta::default()
            },
        }
    }

    fn layout(self) -> Result<CpLayout, String> {
        let layout = self
            .layout
            .map(|s| Layout::parse(&s).map_err(|e| format!("key `cp.layout`: {e}")))
            .transpose()?;
        match (self.world, self.cuts) {
            (None, Some(_)) if layout.is_some() => {
                Err("key `cp.layout`: applies to `world`, not to `cuts`".into())
            }
            (Some(w), None) => Ok(CpLayout::World(w, layout.unwrap_or_default())),
            (None, Some(c)) => Ok(CpLayout::Cuts(c)),
            _ => Err("key `cp`: give exactly one of `world` or `cuts`".into()),
        }
    }
}

/// KDA's options (FLA `chunk_kda`); `gate` is `none`, `kda` or
/// `lowerbound` (with `lower_bound`).
#[derive(Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct KdaMeta {
    use_qk_l2norm_in_kernel: bool,
    gate: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lower_bound: Option<f64>,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
}

impl KdaMeta {
    fn of(m: &CaseMeta) -> Self {
        KdaMeta {
            use_qk_l2norm_in_kernel: m.use_qk_l2norm_in_kernel,
            gate: Some(m.gate.name().into()),
            lower_bound: match m.gate {
                Gate::LowerBound { lower_bound } => Some(lower_bound),
                _ => None,
            },
            use_beta_sigmoid_in_kernel: m.use_beta_sigmoid_in_kernel,
            allow_neg_eigval: m.allow_neg_eigval,
        }
    }

    fn apply(self, m: &mut CaseMeta) -> Result<(), String> {
        m.use_qk_l2norm_in_kernel = self.use_qk_l2norm_in_kernel;
        m.use_beta_sigmoid_in_kernel = self.use_beta_sigmoid_in_kernel;
        m.allow_neg_eigval = self.allow_neg_eigval;
        m.gate = match (self.gate.as_deref(), self.lower_bound) {
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
        Ok(())
    }
}

/// GDN's options (FLA `chunk_gated_delta_rule`); its in-kernel gate is
/// `gate == Gate::Kda` in [`CaseMeta`].
#[derive(Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct GdnMeta {
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
}

impl GdnMeta {
    fn of(m: &CaseMeta) -> Self {
        GdnMeta {
            use_qk_l2norm_in_kernel: m.use_qk_l2norm_in_kernel,
            use_gate_in_kernel: m.gate == Gate::Kda,
            use_beta_sigmoid_in_kernel: m.use_beta_sigmoid_in_kernel,
            allow_neg_eigval: m.allow_neg_eigval,
            state_v_first: m.state_v_first,
        }
    }

    fn apply(self, m: &mut CaseMeta) {
        m.use_qk_l2norm_in_kernel = self.use_qk_l2norm_in_kernel;
        m.gate = if self.use_gate_in_kernel {
            Gate::Kda
        } else {
            Gate::None
        };
        m.use_beta_sigmoid_in_kernel = self.use_beta_sigmoid_in_kernel;
        m.allow_neg_eigval = self.allow_neg_eigval;
        m.state_v_first = self.state_v_first;
    }
}

/// Causal conv1d's options (FLA `causal_conv1d`).
#[derive(Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct ConvMeta {
    activation: Option<String>,
}

impl ConvMeta {
    fn of(m: &CaseMeta) -> Self {
        ConvMeta {
            activation: Some(m.activation.name().into()),
        }
    }

    fn apply(self, m: &mut CaseMeta) -> Result<(), String> {
        if let Some(s) = self.activation {
            m.activation = Activation::parse(&s).map_err(|e| format!("key `activation`: {e}"))?;
        }
        Ok(())
    }
}

/// `x` as a JSON object (every options type serialises to one).
fn object<T: Serialize>(x: &T) -> Map<String, Value> {
    match serde_json::to_value(x) {
        Ok(Value::Object(m)) => m,
        _ => unreachable!("options types are structs of JSON values"),
    }
}

/// Deserialises an options type from the keys `m`; serde's message names
/// the type expected, so the key is found by reading each alone.
fn de<T: DeserializeOwned>(op: Op, m: Map<String, Value>) -> Result<T, String> {
    if let Some(Value::Object(cp)) = m.get("cp") {
        if let Some(k) = cp.keys().find(|k| !keys::<CpMeta>().contains(&k.as_str())) {
            return Err(format!(
                "unknown key `cp.{k}` (expected world, layout or cuts)"
            ));
        }
    }
    serde_json::from_value(Value::Object(m.clone())).map_err(|e| {
        m.iter()
            .find_map(|(k, v)| {
                let one = Map::from_iter([(k.clone(), v.clone())]);
                let e = serde_json::from_value::<T>(Value::Object(one)).err()?;
                Some(format!("key `{k}` of op {}: {e}", op.name()))
            })
            .unwrap_or_else(|| format!("`case` of op {}: {e}", op.name()))
    })
}

/// The error for a key `op` does not take: the ops that do, if any.
fn not_a_key_of(op: Op, key: &str) -> String {
    let owners: Vec<&str> = Op::ALL
        .into_iter()
        .filter(|o| o.keys().contains(&key))
        .map(Op::name)
        .collect();
    if owners.is_empty() {
        format!(
            "unknown key `{key}` in `case` (op {} takes op, {})",
            op.name(),
            op.keys().join(", ")
        )
    } else {
        format!(
            "key `{key}`: only applies to op {}, not {}",
            owners.join(" or "),
            op.name()
        )
    }
}

/// The field names of an options type, as serde's derive declares them.
fn keys<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(FieldNames(&mut fields));
    fields
}

/// A deserializer that only records the fields a struct asks for.
struct FieldNames<'a>(&'a mut &'static [&'static str]);

impl<'de> serde::Deserializer<'de> for FieldNames<'_> {
    type Error = serde::de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(serde::de::Error::custom(
            "only a struct's field names are read",
        ))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Self::Error> {
        *self.0 = fields;
        self.deserialize_any(v)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
        byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map
        enum identifier ignored_any
    }
}

/// Every intermediate name a case may hold (KDA's forward and CP stages;
/// FLA's name where FLA has one).
pub const INTERMEDIATE_NAMES: [&str; 13] = [
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
];

/// Whether `name` is an intermediate of `op` (KDA only).
pub fn is_intermediate(op: Op, name: &str) -> bool {
    op == Op::Kda && INTERMEDIATE_NAMES.contains(&name)
}
