//! The `case` metadata entry: the op (a handle on its registry entry,
//! [`deltaref::registry`]) and its options under FLA's names, to and from
//! JSON.

use deltaref::cp::Layout;
use deltaref::registry::{self, OpEntry, OpInfo, Options};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::Dtype;

/// An operator: a handle on its registry entry. Two handles are equal when
/// they name the same operator.
#[derive(Clone, Copy)]
pub struct Op(&'static dyn OpEntry);

#[allow(non_upper_case_globals)]
impl Op {
    /// The operators by name, for built-in cases and tests: their places
    /// in [`registry::OPS`] (checked against their names by a test).
    pub const Kda: Op = Op(registry::OPS[0]);
    pub const Dplr: Op = Op(registry::OPS[1]);
    pub const TokenShift: Op = Op(registry::OPS[2]);
    pub const Gdn: Op = Op(registry::OPS[3]);
    pub const CausalConv1d: Op = Op(registry::OPS[4]);
    pub const Gdn2: Op = Op(registry::OPS[5]);
}

impl PartialEq for Op {
    fn eq(&self, other: &Op) -> bool {
        self.name() == other.name()
    }
}

impl Eq for Op {}

impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Op {
    /// Every registered operator.
    pub fn all() -> impl Iterator<Item = Op> {
        registry::OPS.into_iter().map(Op)
    }

    /// The registry entry: everything the operator declares.
    pub fn entry(self) -> &'static dyn OpEntry {
        self.0
    }

    pub fn info(self) -> &'static OpInfo {
        self.0.info()
    }

    /// A delta rule (KDA, DPLR, GDN): its CP carries `(S_ext, M)` and
    /// merges; token-shift and the conv pass their last tokens instead.
    pub fn is_delta_rule(self) -> bool {
        self.info().carry == deltaref::cp::Carry::State
    }

    /// `kda, dplr, …` for error messages.
    pub fn names_list() -> String {
        registry::names()
    }

    /// The first token input (`x` or `q`): where B and T are read.
    pub fn first_input(self) -> &'static str {
        self.inputs()[0]
    }

    pub fn name(self) -> &'static str {
        self.info().name
    }

    pub fn parse(s: &str) -> Option<Op> {
        registry::find(s).map(Op)
    }

    /// Input tensor names (FLA's), including the integer `cu_seqlens`.
    pub fn inputs(self) -> &'static [&'static str] {
        self.info().inputs
    }

    /// Upstream gradient names.
    pub fn upstream(self) -> &'static [&'static str] {
        &self.info().upstream
    }

    /// The forward results: the output and the final state.
    pub fn forward_results(self) -> &'static [&'static str] {
        self.info().outputs
    }

    /// Output and gradient names (what a candidate provides), the forward
    /// results first.
    pub fn results(self) -> Vec<&'static str> {
        self.info().results()
    }

    /// Whether `name` is a tensor a case of this op may hold.
    pub fn knows(self, name: &str) -> bool {
        self.inputs().contains(&name)
            || self.upstream().contains(&name)
            || self.results().contains(&name)
            || is_intermediate(self, name)
    }

    /// Every tensor name a case of this op may hold (inputs, upstream
    /// gradients, results, intermediates), for error messages.
    pub fn known_names(self) -> Vec<&'static str> {
        let mut v: Vec<&'static str> = [self.inputs(), self.upstream()].concat();
        v.extend(self.results());
        v.extend(self.info().intermediates.iter().copied());
        v
    }

    /// The keys a case of this op may hold besides `op`.
    fn keys(self) -> Vec<&'static str> {
        [keys::<Common>(), self.entry().option_keys()].concat()
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

/// The `case` metadata: op, its options with FLA's names, and what the
/// case says of how it was made and how it is cut.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseMeta {
    pub op: Op,
    /// The op's options as its registry entry reads them (FLA's keys).
    pub options: Options,
    pub chunk_size: Option<usize>,
    pub cp: Option<CpLayout>,
    pub seed: Option<u64>,
    pub dtype: Option<Dtype>,
    /// The input regime `gen` drew from (absent: FLA's test draws).
    pub regime: Option<deltaref::inputs::Regime>,
    /// The `--precision` preset whose run produced a candidate's results
    /// (`run --out`; absent: not said): `diagnose --noise auto` takes its
    /// noise from it.
    pub precision: Option<String>,
}

impl CaseMeta {
    /// A case of `op` with its default options.
    pub fn new(op: Op) -> Self {
        CaseMeta {
            op,
            options: op
                .entry()
                .gen_options(&registry::GenFlags::default())
                .expect("every op takes no flags"),
            chunk_size: None,
            cp: None,
            seed: None,
            dtype: None,
            regime: None,
            precision: None,
        }
    }

    /// Option `key` as a bool (false when absent or not a bool).
    pub fn flag(&self, key: &str) -> bool {
        self.options.get(key).and_then(Value::as_bool) == Some(true)
    }

    /// The JSON object stored under `case`: `op`, the shared keys and the
    /// op's own options.
    pub fn to_json(&self) -> Value {
        let mut m = registry::to_options(&Common::of(self));
        m.insert("op".into(), self.op.name().into());
        m.extend(self.options.clone());
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
        let (common, own): (Map<String, Value>, Map<String, Value>) = m
            .into_iter()
            .partition(|(k, _)| common_keys.contains(&k.as_str()));
        op.entry().check_options(&own)?;
        let mut meta = CaseMeta {
            options: own,
            ..CaseMeta::new(op)
        };
        de::<Common>(op, common)?.apply(&mut meta)?;
        Ok(meta)
    }
}

/// The keys every op's metadata takes.
#[derive(Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Common {
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
    #[serde(skip_serializing_if = "Option::is_none")]
    precision: Option<String>,
}

impl Common {
    fn of(m: &CaseMeta) -> Self {
        Common {
            chunk_size: m.chunk_size,
            cp: m.cp.as_ref().map(CpMeta::of),
            seed: m.seed,
            dtype: m.dtype.map(|d| d.name().into()),
            regime: m.regime.map(|r| r.name().into()),
            precision: m.precision.clone(),
        }
    }

    fn apply(self, m: &mut CaseMeta) -> Result<(), String> {
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
        m.precision = self.precision;
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

/// Deserialises the shared keys `m`; each error names its key.
fn de<T: DeserializeOwned>(op: Op, m: Map<String, Value>) -> Result<T, String> {
    if let Some(Value::Object(cp)) = m.get("cp") {
        if let Some(k) = cp.keys().find(|k| !keys::<CpMeta>().contains(&k.as_str())) {
            return Err(format!(
                "unknown key `cp.{k}` (expected world, layout or cuts)"
            ));
        }
    }
    registry::parse_options(op.name(), &m)
}

/// The error for a key `op` does not take: the ops that do, if any.
fn not_a_key_of(op: Op, key: &str) -> String {
    let owners: Vec<&str> = Op::all()
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

/// The field names of an options type.
fn keys<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    registry::option_keys::<T>()
}

/// Whether `name` is an intermediate `op`'s entry declares.
pub fn is_intermediate(op: Op, name: &str) -> bool {
    op.info().intermediates.contains(&name)
}

#[cfg(test)]
mod tests {
    use super::Op;

    #[test]
    fn the_named_operators_are_the_registry_entries_of_their_names() {
        let named = [
            (Op::Kda, "kda"),
            (Op::Dplr, "dplr"),
            (Op::TokenShift, "token_shift"),
            (Op::Gdn, "gdn"),
            (Op::CausalConv1d, "causal_conv1d"),
            (Op::Gdn2, "gdn2"),
        ];
        for (op, name) in named {
            assert_eq!(op.name(), name);
            assert_eq!(Op::parse(name), Some(op));
        }
        assert_eq!(Op::all().count(), named.len());
    }
}
