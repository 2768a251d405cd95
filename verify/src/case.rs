//! Case files (SPEC §8): one case = one safetensors file holding FLA-named
//! tensors and a `case` metadata entry (a JSON object with `op` and FLA's
//! option names). Reading validates everything and never panics; writing is
//! atomic (temporary file + rename, see [`crate::files`]).

use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::path::Path;

use deltaref::cp::Layout;
use deltaref::dplr::{DplrInputs, DplrOptions};
use deltaref::gates::Gate;
use deltaref::kda::{KdaInputs, KdaOptions};
use deltaref::token_shift::TokenShiftInputs;
use half::{bf16, f16};
use ndarray::{ArrayD, IxDyn};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use safetensors::View;
use serde_json::{Map, Value};
use thiserror::Error;

use crate::gpu::ComputeError;
use crate::outputs::Tensors;

#[derive(Debug, Error)]
pub enum CaseError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: cannot write: {why}")]
    Write { path: String, why: String },
    #[error("{path}: not a valid safetensors file: {why}")]
    Format { path: String, why: String },
    #[error("{path}: metadata: {why}")]
    Metadata { path: String, why: String },
    #[error("{path}: tensor `{tensor}`: {why}")]
    Tensor {
        path: String,
        tensor: String,
        why: String,
    },
    #[error("{path}: {source}")]
    Invalid {
        path: String,
        source: deltaref::Error,
    },
    #[error("{path}: GPU: {source}")]
    Gpu {
        path: String,
        source: deltaref_gpu::GpuError,
    },
    #[error("{0}")]
    Usage(String),
}

impl CaseError {
    /// How an implementation's failure on the case at `path` is reported.
    pub fn computing(path: &Path) -> impl Fn(ComputeError) -> CaseError + Copy + '_ {
        move |e| match e {
            ComputeError::Input(source) => CaseError::Invalid {
                path: path.display().to_string(),
                source,
            },
            ComputeError::Gpu(source) => CaseError::Gpu {
                path: path.display().to_string(),
                source,
            },
        }
    }
}

/// The three operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Kda,
    Dplr,
    TokenShift,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Kda => "kda",
            Op::Dplr => "dplr",
            Op::TokenShift => "token_shift",
        }
    }

    pub fn parse(s: &str) -> Option<Op> {
        match s {
            "kda" => Some(Op::Kda),
            "dplr" => Some(Op::Dplr),
            "token_shift" => Some(Op::TokenShift),
            _ => None,
        }
    }

    /// Input tensor names (FLA's), including the integer `cu_seqlens`.
    pub fn inputs(self) -> &'static [&'static str] {
        match self {
            Op::Kda => &[
                "q",
                "k",
                "v",
                "g",
                "beta",
                "A_log",
                "dt_bias",
                "initial_state",
                "cu_seqlens",
            ],
            Op::Dplr => &["q", "k", "v", "a", "b", "gk", "initial_state", "cu_seqlens"],
            Op::TokenShift => &["x", "cache", "cu_seqlens"],
        }
    }

    /// Upstream gradient names.
    pub fn upstream(self) -> &'static [&'static str] {
        match self {
            Op::TokenShift => &["dy", "dfinal_cache"],
            _ => &["do", "dht"],
        }
    }

    /// The forward results: the output and the final state (the first two
    /// of [`Op::results`]).
    pub fn forward_results(self) -> &'static [&'static str] {
        &self.results()[..2]
    }

    /// Output and gradient names (what a candidate provides), the forward
    /// results first.
    pub fn results(self) -> &'static [&'static str] {
        match self {
            Op::Kda => &[
                "o",
                "final_state",
                "dq",
                "dk",
                "dv",
                "dg",
                "dbeta",
                "dA_log",
                "ddt_bias",
                "dh0",
            ],
            Op::Dplr => &[
                "o",
                "final_state",
                "dq",
                "dk",
                "dv",
                "da",
                "db",
                "dgk",
                "dh0",
            ],
            Op::TokenShift => &["y", "final_cache", "dx", "dcache"],
        }
    }

    /// Whether `name` is a tensor a case of this op may hold.
    pub fn knows(self, name: &str) -> bool {
        self.inputs().contains(&name)
            || self.upstream().contains(&name)
            || self.results().contains(&name)
            || crate::intermediates::is_intermediate(self, name)
    }
}

/// Storage dtypes a case may use for float tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F64,
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn parse(s: &str) -> Option<Dtype> {
        match s {
            "f64" | "float64" => Some(Dtype::F64),
            "f32" | "float32" => Some(Dtype::F32),
            "bf16" | "bfloat16" => Some(Dtype::Bf16),
            "f16" | "float16" => Some(Dtype::F16),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F64 => "f64",
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    /// Rounds an f64 to this dtype (round to nearest even) and back.
    pub fn round(self, x: f64) -> f64 {
        match self {
            Dtype::F64 => x,
            Dtype::F32 => x as f32 as f64,
            Dtype::Bf16 => bf16::from_f64(x).to_f64(),
            Dtype::F16 => f16::from_f64(x).to_f64(),
        }
    }

    fn st(self) -> StDtype {
        match self {
            Dtype::F64 => StDtype::F64,
            Dtype::F32 => StDtype::F32,
            Dtype::Bf16 => StDtype::BF16,
            Dtype::F16 => StDtype::F16,
        }
    }

    fn encode(self, x: &ArrayD<f64>) -> Vec<u8> {
        let it = x.iter().copied();
        match self {
            Dtype::F64 => it.flat_map(f64::to_le_bytes).collect(),
            Dtype::F32 => it.flat_map(|v| (v as f32).to_le_bytes()).collect(),
            Dtype::Bf16 => it.flat_map(|v| bf16::from_f64(v).to_le_bytes()).collect(),
            Dtype::F16 => it.flat_map(|v| f16::from_f64(v).to_le_bytes()).collect(),
        }
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
            format!("key `op`: unknown op \"{op_name}\" (expected kda, dplr or token_shift)")
        })?;
        let mut meta = CaseMeta::new(op);
        let mut gate_name: Option<String> = None;
        let mut lower_bound: Option<f64> = None;
        for (key, val) in &m {
            let kda_only = |ok: bool| {
                if ok {
                    Ok(())
                } else {
                    Err(format!(
                        "key `{key}`: only applies to op kda, not {}",
                        op.name()
                    ))
                }
            };
            match key.as_str() {
                "op" => {}
                "scale" => meta.scale = Some(num(key, val)?),
                "use_qk_l2norm_in_kernel" => {
                    kda_only(op == Op::Kda)?;
                    meta.use_qk_l2norm_in_kernel = boolean(key, val)?;
                }
                "gate" => {
                    kda_only(op == Op::Kda)?;
                    gate_name = Some(
                        val.as_str()
                            .ok_or(format!("key `{key}`: expected a string"))?
                            .to_string(),
                    );
                }
                "lower_bound" => {
                    kda_only(op == Op::Kda)?;
                    lower_bound = Some(num(key, val)?);
                }
                "use_beta_sigmoid_in_kernel" => {
                    kda_only(op == Op::Kda)?;
                    meta.use_beta_sigmoid_in_kernel = boolean(key, val)?;
                }
                "allow_neg_eigval" => {
                    kda_only(op == Op::Kda)?;
                    meta.allow_neg_eigval = boolean(key, val)?;
                }
                "chunk_size" => meta.chunk_size = Some(uint(key, val)? as usize),
                "cp" => meta.cp = Some(cp_layout(val)?),
                "seed" => meta.seed = Some(uint(key, val)?),
                "dtype" => {
                    let s = val
                        .as_str()
                        .ok_or(format!("key `{key}`: expected a string"))?;
                    meta.dtype =
                        Some(Dtype::parse(s).ok_or(format!("key `{key}`: unknown dtype \"{s}\""))?);
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

/// One case in memory: metadata, float tensors (widened to f64) and their
/// stored dtypes, and `cu_seqlens`.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    pub meta: CaseMeta,
    pub tensors: Tensors,
    pub dtypes: BTreeMap<String, Dtype>,
    pub cu_seqlens: Option<Vec<i64>>,
}

/// A case's inputs with its upstream gradients `(do, dht)`, owned.
pub type OwnedInputs = (Inputs, ArrayD<f64>, Option<ArrayD<f64>>);

/// The inputs of a case as the reference crate's types.
pub enum Inputs {
    Kda(KdaInputs<f64>),
    Dplr(DplrInputs<f64>),
    TokenShift(TokenShiftInputs<f64>),
}

impl Case {
    pub fn new(meta: CaseMeta) -> Self {
        Case {
            meta,
            tensors: Tensors::new(),
            dtypes: BTreeMap::new(),
            cu_seqlens: None,
        }
    }

    /// Adds a float tensor stored as `dtype` (its values are rounded to it).
    pub fn insert(&mut self, name: &str, mut x: ArrayD<f64>, dtype: Dtype) {
        if dtype != Dtype::F64 {
            x.mapv_inplace(|v| dtype.round(v));
        }
        self.tensors.insert(name.to_string(), x);
        self.dtypes.insert(name.to_string(), dtype);
    }

    fn get(&self, name: &str) -> Option<ArrayD<f64>> {
        self.tensors.get(name).map(deltaref::tensor::cast)
    }

    fn need(&self, name: &str) -> Result<ArrayD<f64>, deltaref::Error> {
        self.get(name).ok_or_else(|| {
            deltaref::Error::missing(
                name,
                format!("required input of op {}", self.meta.op.name()),
            )
        })
    }

    /// The inputs, as the reference crate takes them (not yet validated).
    pub fn inputs(&self) -> Result<Inputs, deltaref::Error> {
        // `cast` to f64 is a copy, made on every core for a long tensor.
        self.assemble(|n| self.get(n))
    }

    /// The upstream gradients `(do, dht)` (`(dy, dfinal_cache)`); `do` is required.
    pub fn upstream(&self) -> Result<(ArrayD<f64>, Option<ArrayD<f64>>), deltaref::Error> {
        let [d_o, dht] = self.meta.op.upstream() else {
            unreachable!("two upstream names per op")
        };
        Ok((self.need(d_o)?, self.get(dht)))
    }

    /// The inputs and the upstream gradients `(do, dht)`, moved out of the
    /// case instead of copied (a long case holds one set of them, not two).
    pub fn into_inputs(mut self) -> Result<OwnedInputs, deltaref::Error> {
        let [d_o, dht] = self.meta.op.upstream() else {
            unreachable!("two upstream names per op")
        };
        let d_o = self.tensors.remove(*d_o).ok_or_else(|| {
            deltaref::Error::missing(d_o, format!("required input of op {}", self.meta.op.name()))
        })?;
        let dht = self.tensors.remove(*dht);
        let mut t = std::mem::take(&mut self.tensors);
        Ok((self.assemble(|n| t.remove(n))?, d_o, dht))
    }

    /// The inputs from `get` (a tensor by name, `None` when absent).
    fn assemble(
        &self,
        mut get: impl FnMut(&str) -> Option<ArrayD<f64>>,
    ) -> Result<Inputs, deltaref::Error> {
        let op = self.meta.op;
        let mut need = |name: &str| {
            get(name).ok_or_else(|| {
                deltaref::Error::missing(name, format!("required input of op {}", op.name()))
            })
        };
        let cu = self.cu_seqlens.clone();
        Ok(match op {
            Op::Kda => Inputs::Kda(KdaInputs {
                q: need("q")?,
                k: need("k")?,
                v: need("v")?,
                g: need("g")?,
                beta: need("beta")?,
                a_log: get("A_log"),
                dt_bias: get("dt_bias"),
                initial_state: get("initial_state"),
                cu_seqlens: cu,
            }),
            Op::Dplr => Inputs::Dplr(DplrInputs {
                q: need("q")?,
                k: need("k")?,
                v: need("v")?,
                a: need("a")?,
                b: need("b")?,
                gk: need("gk")?,
                initial_state: get("initial_state"),
                cu_seqlens: cu,
            }),
            Op::TokenShift => Inputs::TokenShift(TokenShiftInputs {
                x: need("x")?,
                cache: get("cache"),
                cu_seqlens: cu,
            }),
        })
    }

    /// The stored outputs and gradients (empty for a fixture without them).
    pub fn results(&self) -> Tensors {
        self.tensors
            .iter()
            .filter(|(k, _)| self.meta.op.results().contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// A copy whose inputs and upstream gradients went through `round`
    /// (stored results are kept as they are).
    pub fn with_rounded_inputs(&self, round: impl Fn(f64) -> f64) -> Case {
        let mut c = self.clone();
        let op = self.meta.op;
        for (name, t) in c.tensors.iter_mut() {
            if op.inputs().contains(&name.as_str()) || op.upstream().contains(&name.as_str()) {
                t.mapv_inplace(&round);
            }
        }
        c
    }

    /// The value dimension (V; D for token-shift), 0 if the inputs are absent.
    pub fn value_dim(&self) -> usize {
        let name = if self.meta.op == Op::TokenShift {
            "x"
        } else {
            "v"
        };
        self.tensors
            .get(name)
            .and_then(|t| t.shape().last().copied())
            .unwrap_or(0)
    }

    /// Checks inputs, upstream gradients and stored results for consistency
    /// with the reference crate's validation.
    pub fn validate(&self) -> Result<(), deltaref::Error> {
        let (d_o, dht) = self.upstream()?;
        match self.inputs()? {
            Inputs::Kda(x) => {
                let d = deltaref::kda::validate(&x, &self.meta.kda_options())?;
                deltaref::kda::validate_upstream(&d, &d_o, dht.as_ref())?;
            }
            Inputs::Dplr(x) => {
                let d = deltaref::dplr::validate(&x, &self.meta.dplr_options())?;
                deltaref::dplr::validate_upstream(&d, &d_o, dht.as_ref())?;
            }
            Inputs::TokenShift(x) => {
                let (d, _) = deltaref::token_shift::validate(&x)?;
                deltaref::tensor::expect_shape("dy", "[B,T,D]", &[d.b, d.t, d.d], d_o.shape())?;
                if let Some(h) = &dht {
                    deltaref::tensor::expect_shape(
                        "dfinal_cache",
                        "[N,D]",
                        &[d.n, d.d],
                        h.shape(),
                    )?;
                }
            }
        }
        for (name, x) in self.results() {
            if let Some(want) = self.result_shape(&name) {
                deltaref::tensor::expect_shape(
                    &name,
                    "(as its input counterpart)",
                    &want,
                    x.shape(),
                )?;
            }
            deltaref::tensor::check_finite(&name, &x)?;
        }
        for (name, x) in crate::intermediates::stored(self) {
            deltaref::tensor::check_finite(&name, &x)?;
        }
        Ok(())
    }

    /// The outputs and gradients the oracle computes for this case: every
    /// result name, less the gradients of optional inputs it lacks.
    pub fn expected_results(&self) -> Vec<&'static str> {
        let has = |n: &str| self.tensors.contains_key(n);
        self.meta
            .op
            .results()
            .iter()
            .copied()
            .filter(|&n| match n {
                "dA_log" => has("A_log"),
                "ddt_bias" => has("dt_bias"),
                "dh0" => has("initial_state"),
                "dcache" => has("cache"),
                _ => true,
            })
            .collect()
    }

    /// The shape a result must have: a gradient is shaped like its input,
    /// `o`/`y` like `do`/`dy`, a final state like `dht` when present.
    pub fn result_shape(&self, name: &str) -> Option<Vec<usize>> {
        let like = |n: &str| self.tensors.get(n).map(|t| t.shape().to_vec());
        match name {
            "o" => like("do"),
            "y" => like("dy"),
            "final_state" => like("dht").or_else(|| like("initial_state")),
            "final_cache" => like("dfinal_cache").or_else(|| like("cache")),
            "dh0" => like("initial_state"),
            "dcache" => like("cache"),
            "dA_log" => like("A_log"),
            "ddt_bias" => like("dt_bias"),
            d => like(d.strip_prefix('d')?),
        }
    }

    /// The safetensors bytes of the case (deterministic).
    pub fn to_bytes(&self) -> Result<Vec<u8>, CaseError> {
        safetensors::tensor::serialize(self.views(), Some(self.meta_map())).map_err(|e| {
            CaseError::Format {
                path: "(in memory)".into(),
                why: e.to_string(),
            }
        })
    }

    /// Writes the case atomically: a temporary file next to `path`, then
    /// rename. The bytes are [`Case::to_bytes`]'s, each tensor encoded only
    /// as it is written (a long case is never in memory twice).
    pub fn write(&self, path: &Path) -> Result<(), CaseError> {
        let mut views = self.views();
        // safetensors' own serialisation, tensors without their bytes: the
        // length prefix and the header.
        let header = views.iter().map(|(n, v)| (n.clone(), HeaderOnly(v)));
        let head = safetensors::tensor::serialize(header, Some(self.meta_map())).map_err(|e| {
            CaseError::Format {
                path: path.display().to_string(),
                why: e.to_string(),
            }
        })?;
        // Then the bytes in safetensors' order: dtype alignment down, then name.
        views.sort_by(|(a, x), (b, y)| y.dtype().cmp(&x.dtype()).then(a.cmp(b)));
        crate::files::write_atomic_with(path, |tmp| {
            // `create_new` never follows a link planted at the temporary name.
            let f = std::fs::File::options()
                .write(true)
                .create_new(true)
                .open(tmp)?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            w.write_all(&head)?;
            for (_, v) in &views {
                w.write_all(&v.data())?;
            }
            w.flush()
        })
    }

    /// The `case` metadata entry of the file.
    fn meta_map(&self) -> std::collections::HashMap<String, String> {
        std::collections::HashMap::from([("case".to_string(), self.meta.to_json().to_string())])
    }

    /// The file's tensors, encoded on demand.
    fn views(&self) -> Vec<(String, Encoded<'_>)> {
        let mut views: Vec<(String, Encoded)> = self
            .tensors
            .iter()
            .map(|(n, x)| {
                let dt = self.dtypes.get(n).copied().unwrap_or(Dtype::F64);
                (n.clone(), Encoded::Float(x, dt, dt.st()))
            })
            .collect();
        if let Some(cu) = &self.cu_seqlens {
            views.push(("cu_seqlens".into(), Encoded::Int(cu, vec![cu.len()])));
        }
        views
    }

    /// Reads and validates a case file.
    pub fn read(path: &Path) -> Result<Case, CaseError> {
        let bytes = crate::files::read_bounded(path, READ_WIDEN)?;
        Case::from_bytes(&bytes, &path.display().to_string())
    }

    /// Parses a case from the bytes of a safetensors file (`what` names it in errors).
    pub fn from_bytes(bytes: &[u8], what: &str) -> Result<Case, CaseError> {
        let case = Case::parse(bytes, what, None)?;
        case.validate().map_err(|e| CaseError::Invalid {
            path: what.to_string(),
            source: e,
        })?;
        Ok(case)
    }

    /// Reads a candidate: the outputs and gradients a port produced for a
    /// case of op `op`. See [`Case::candidate_from_bytes`].
    pub fn read_candidate(path: &Path, op: Op) -> Result<Case, CaseError> {
        let bytes = crate::files::read_bounded(path, READ_WIDEN)?;
        Case::candidate_from_bytes(&bytes, &path.display().to_string(), op)
    }

    /// Reads a candidate for `case`: as [`Case::read_candidate`], and when
    /// the candidate states `case` metadata, every option it states that
    /// changes the math (scale, l2norm, gate, lower bound, beta sigmoid,
    /// negative eigenvalues; `op` is checked by the parser) must agree with
    /// the case's: else an error naming the differing keys (CP layout, chunk
    /// size, seed and dtype may differ).
    pub fn read_candidate_for(path: &Path, case: &Case) -> Result<Case, CaseError> {
        let bytes = crate::files::read_bounded(path, READ_WIDEN)?;
        let what = path.display().to_string();
        let cand = Case::candidate_from_bytes(&bytes, &what, case.meta.op)?;
        let stated: Vec<String> = SafeTensors::read_metadata(&bytes)
            .ok()
            .and_then(|(_, m)| m.metadata().as_ref()?.get("case").cloned())
            .and_then(|text| serde_json::from_str::<Map<String, Value>>(&text).ok())
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        let differ = case.math_options_differing(&cand.meta, &stated);
        if !differ.is_empty() {
            return Err(CaseError::Metadata {
                path: what,
                why: format!(
                    "the candidate's `case` states other options than the case: {}",
                    differ.join(", ")
                ),
            });
        }
        Ok(cand)
    }

    /// `key (case X, candidate Y)` for every math option `stated` by the
    /// candidate that differs from the case's (a port may state only some).
    fn math_options_differing(&self, other: &CaseMeta, stated: &[String]) -> Vec<String> {
        const MATH: [&str; 6] = [
            "scale",
            "use_qk_l2norm_in_kernel",
            "gate",
            "lower_bound",
            "use_beta_sigmoid_in_kernel",
            "allow_neg_eigval",
        ];
        let k = self
            .tensors
            .get("q")
            .and_then(|q| q.shape().last().copied());
        let with_scale = |m: &CaseMeta| {
            let mut j = m.to_json();
            if let (Some(k), None, Value::Object(o)) = (k, m.scale, &mut j) {
                o.insert("scale".into(), (k as f64).powf(-0.5).into());
            }
            j
        };
        let (a, b) = (with_scale(&self.meta), with_scale(other));
        MATH.iter()
            .filter(|key| stated.iter().any(|s| s == *key) && a.get(**key) != b.get(**key))
            .map(|key| {
                let show = |v: Option<&Value>| v.map_or("absent".to_string(), Value::to_string);
                format!(
                    "{key} (case {}, candidate {})",
                    show(a.get(*key)),
                    show(b.get(*key))
                )
            })
            .collect()
    }

    /// Parses a candidate. Unlike a case it needs no inputs (a port saves
    /// only what it computed), its `case` metadata is optional (when present
    /// its `op` must be `op`), and non-finite values are kept: a NaN in a
    /// port's output is a failed comparison, not an unreadable file. Framing,
    /// tensor names and dtypes are checked as for a case; shapes are checked
    /// by the comparison, tensor by tensor.
    pub fn candidate_from_bytes(bytes: &[u8], what: &str, op: Op) -> Result<Case, CaseError> {
        Case::parse(bytes, what, Some(op))
    }

    /// Framing, metadata, names and dtypes, without the cross-tensor
    /// validation. `candidate_of`: a candidate for a case of this op (its
    /// metadata is then optional but must name this op).
    fn parse(bytes: &[u8], what: &str, candidate_of: Option<Op>) -> Result<Case, CaseError> {
        let fmt_err = |why: String| CaseError::Format {
            path: what.to_string(),
            why,
        };
        check_header_length(bytes).map_err(fmt_err)?;
        reject_duplicate_names(bytes).map_err(fmt_err)?;
        let st = SafeTensors::deserialize(bytes).map_err(|e| fmt_err(describe(&e)))?;
        let (_, md) = SafeTensors::read_metadata(bytes).map_err(|e| fmt_err(describe(&e)))?;
        let meta_err = |why: String| CaseError::Metadata {
            path: what.to_string(),
            why,
        };
        let text = md.metadata().as_ref().and_then(|m| m.get("case"));
        let meta = match (text, candidate_of) {
            (Some(text), _) => CaseMeta::from_json(text).map_err(meta_err)?,
            (None, Some(op)) => CaseMeta::new(op),
            (None, None) => {
                return Err(meta_err(
                    "no `case` entry in the metadata (expected {\"op\": ...})".into(),
                ))
            }
        };
        if let Some(op) = candidate_of.filter(|&op| op != meta.op) {
            return Err(meta_err(format!(
                "candidate op `{}` differs from the case's `{}`",
                meta.op.name(),
                op.name()
            )));
        }
        let mut case = Case::new(meta);
        let mut names: Vec<(String, TensorView)> = st.tensors();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, view) in names {
            let terr = |why: String| CaseError::Tensor {
                path: what.to_string(),
                tensor: name.clone(),
                why,
            };
            if !case.meta.op.knows(&name) {
                return Err(terr(format!("not a tensor of op {}", case.meta.op.name())));
            }
            if name == "cu_seqlens" {
                case.cu_seqlens = Some(decode_cu_seqlens(&view).map_err(terr)?);
                continue;
            }
            let (values, dt) = decode(&view).map_err(terr)?;
            let arr = ArrayD::from_shape_vec(IxDyn(view.shape()), values)
                .map_err(|e| terr(e.to_string()))?;
            case.tensors.insert(name.clone(), arr);
            case.dtypes.insert(name, dt);
        }
        Ok(case)
    }
}

pub use crate::files::write_atomic;

/// A case tensor as safetensors writes it, encoded when its bytes are asked for.
enum Encoded<'a> {
    Float(&'a ArrayD<f64>, Dtype, StDtype),
    Int(&'a [i64], Vec<usize>),
}

/// A tensor's dtype and shape without its bytes (to build the header alone).
struct HeaderOnly<'a, 'b>(&'a Encoded<'b>);

impl safetensors::View for HeaderOnly<'_, '_> {
    fn dtype(&self) -> StDtype {
        self.0.dtype()
    }
    fn shape(&self) -> &[usize] {
        self.0.shape()
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        self.0.data_len()
    }
}

impl safetensors::View for Encoded<'_> {
    fn dtype(&self) -> StDtype {
        match self {
            Encoded::Float(_, _, d) => *d,
            Encoded::Int(..) => StDtype::I64,
        }
    }
    fn shape(&self) -> &[usize] {
        match self {
            Encoded::Float(x, ..) => x.shape(),
            Encoded::Int(_, s) => s,
        }
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        match self {
            Encoded::Float(x, dt, _) => dt.encode(x).into(),
            Encoded::Int(cu, _) => cu
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>()
                .into(),
        }
    }
    fn data_len(&self) -> usize {
        match self {
            Encoded::Float(x, _, d) => x.len() * d.bitsize() / 8,
            Encoded::Int(cu, _) => cu.len() * 8,
        }
    }
}

/// What reading a case costs per stored byte: the bytes, the f64 tensors
/// and a validation copy for an f64 file (a bf16 file widens more; the
/// command's compute estimate, from the shapes, covers that).
const READ_WIDEN: u64 = 4;

/// `cu_seqlens`: a 1-D int64 tensor.
fn decode_cu_seqlens(view: &TensorView) -> Result<Vec<i64>, String> {
    if view.dtype() != StDtype::I64 || view.shape().len() != 1 {
        return Err(format!(
            "must be a 1-D int64 tensor, got {:?} {:?}",
            view.dtype(),
            view.shape()
        ));
    }
    Ok(view
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// Float tensors only; integer dtypes are refused by name.
fn decode(view: &TensorView) -> Result<(Vec<f64>, Dtype), String> {
    let d = view.data();
    Ok(match view.dtype() {
        StDtype::F64 => (
            d.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8")))
                .collect(),
            Dtype::F64,
        ),
        StDtype::F32 => (
            d.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4")) as f64)
                .collect(),
            Dtype::F32,
        ),
        StDtype::BF16 => (
            d.chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
                .collect(),
            Dtype::Bf16,
        ),
        StDtype::F16 => (
            d.chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
                .collect(),
            Dtype::F16,
        ),
        other => {
            return Err(format!(
                "dtype {other:?} is not a supported float type (F64, F32, BF16 or F16)"
            ))
        }
    })
}

fn describe(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => "file too short for the 8-byte header length (truncated?)".into(),
        E::InvalidHeaderLength => "header length is larger than the file (truncated?)".into(),
        E::HeaderTooLarge => "header length is implausibly large".into(),
        E::InvalidHeaderDeserialization(j) => format!("header is not valid JSON: {j}"),
        E::MetadataIncompleteBuffer => {
            "tensor data is shorter than the header says (truncated?)".into()
        }
        E::TensorInvalidInfo => "a tensor's dtype and shape do not match its byte length".into(),
        other => other.to_string(),
    }
}

/// The 8-byte header length must fit in the file (checked before the
/// parser sizes anything by it).
fn check_header_length(bytes: &[u8]) -> Result<(), String> {
    let Some(n) = bytes.get(..8) else {
        return Err(format!(
            "file too short for the 8-byte header length ({} bytes; truncated?)",
            bytes.len()
        ));
    };
    let n = u64::from_le_bytes(n.try_into().expect("8 bytes"));
    let room = bytes.len() as u64 - 8;
    // The safetensors parser's own bound on a header.
    const MAX_HEADER: u64 = 100_000_000;
    if n > MAX_HEADER {
        return Err(format!(
            "header length {n} is implausibly large (at most {MAX_HEADER} bytes)"
        ));
    }
    if n > room {
        return Err(format!(
            "header length {n} is larger than the file ({room} bytes after it; truncated?)"
        ));
    }
    Ok(())
}

/// JSON objects silently keep the last of duplicate keys; a case must not.
fn reject_duplicate_names(bytes: &[u8]) -> Result<(), String> {
    struct Keys(Vec<String>);
    impl<'de> serde::Deserialize<'de> for Keys {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Keys;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut m: A,
                ) -> Result<Keys, A::Error> {
                    let mut keys = Vec::new();
                    while let Some((k, _)) = m.next_entry::<String, serde::de::IgnoredAny>()? {
                        keys.push(k);
                    }
                    Ok(Keys(keys))
                }
            }
            d.deserialize_map(V)
        }
    }
    // Framing errors are reported by the safetensors parser itself.
    let Some(n) = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8")) as usize)
    else {
        return Ok(());
    };
    let Some(header) = bytes.get(8..8usize.saturating_add(n)) else {
        return Ok(());
    };
    let Ok(Keys(mut keys)) = serde_json::from_slice::<Keys>(header) else {
        return Ok(());
    };
    keys.sort();
    match keys.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(format!("duplicate tensor name `{}` in the header", w[0])),
        None => Ok(()),
    }
}
