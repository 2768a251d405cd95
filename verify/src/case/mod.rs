//! Case files (SPEC §8): one case = one safetensors file holding FLA-named
//! tensors and a `case` metadata entry (a JSON object with `op` and FLA's
//! option names). Reading validates everything and never panics; writing is
//! atomic (temporary file + rename, see [`files`]).
//!
//! Split by job: `error` (what can go wrong), `meta` (the `case`
//! metadata and the ops' names), `dtype` (storage dtypes), `io` (files,
//! framing, candidates); this module holds the case in memory.

mod dtype;
mod error;
pub mod files;
mod io;
pub mod memory;
mod meta;

use std::collections::BTreeMap;

use deltaref::conv::{self, ConvInputs, ConvRefs};
use deltaref::dplr::{self, DplrInputs, DplrRefs};
use deltaref::gdn::{self, GdnInputs};
use deltaref::kda::{self, KdaInputs, KdaRefs};
use deltaref::token_shift::{self, TokenShiftInputs, TokenShiftRefs};
use ndarray::ArrayD;

use crate::outputs::Tensors;
pub use deltaref::Dtype;
pub use dtype::stored_width;
pub use error::CaseError;
pub use io::{write_atomic, Drawn};
pub use meta::{is_intermediate, CaseMeta, CpLayout, Op, INTERMEDIATE_NAMES};

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
    Gdn(GdnInputs<f64>),
    CausalConv1d(ConvInputs<f64>),
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
    pub fn insert(&mut self, name: &str, x: ArrayD<f64>, dtype: Dtype) {
        self.tensors.insert(name.to_string(), stored(x, dtype));
        self.dtypes.insert(name.to_string(), dtype);
    }

    fn get(&self, name: &str) -> Option<ArrayD<f64>> {
        self.tensors.get(name).map(deltaref::tensor::cast)
    }

    /// A required tensor, borrowed; missing, an error naming the op.
    fn need_ref(&self, name: &str) -> Result<&ArrayD<f64>, deltaref::Error> {
        self.tensors.get(name).ok_or_else(|| {
            deltaref::Error::missing(
                name,
                format!("required input of op {}", self.meta.op.name()),
            )
        })
    }

    /// A KDA case's inputs, borrowed (a GDN case's have the same names).
    pub fn kda_refs(&self) -> Result<KdaRefs<'_, f64>, deltaref::Error> {
        let get = |name: &str| self.tensors.get(name);
        Ok(KdaRefs {
            q: self.need_ref("q")?,
            k: self.need_ref("k")?,
            v: self.need_ref("v")?,
            g: self.need_ref("g")?,
            beta: self.need_ref("beta")?,
            a_log: get("A_log"),
            dt_bias: get("dt_bias"),
            initial_state: get("initial_state"),
            cu_seqlens: self.cu_seqlens.as_deref(),
        })
    }

    /// A DPLR case's inputs, borrowed.
    pub fn dplr_refs(&self) -> Result<DplrRefs<'_, f64>, deltaref::Error> {
        Ok(DplrRefs {
            q: self.need_ref("q")?,
            k: self.need_ref("k")?,
            v: self.need_ref("v")?,
            a: self.need_ref("a")?,
            b: self.need_ref("b")?,
            gk: self.need_ref("gk")?,
            initial_state: self.tensors.get("initial_state"),
            cu_seqlens: self.cu_seqlens.as_deref(),
        })
    }

    /// A token-shift case's inputs, borrowed.
    pub fn token_shift_refs(&self) -> Result<TokenShiftRefs<'_, f64>, deltaref::Error> {
        Ok(TokenShiftRefs {
            x: self.need_ref("x")?,
            cache: self.tensors.get("cache"),
            cu_seqlens: self.cu_seqlens.as_deref(),
        })
    }

    /// A causal conv1d case's inputs, borrowed.
    pub fn conv_refs(&self) -> Result<ConvRefs<'_, f64>, deltaref::Error> {
        Ok(ConvRefs {
            x: self.need_ref("x")?,
            weight: self.need_ref("weight")?,
            bias: self.tensors.get("bias"),
            initial_state: self.tensors.get("initial_state"),
            cu_seqlens: self.cu_seqlens.as_deref(),
        })
    }

    /// The inputs, as the reference crate takes them (not yet validated).
    pub fn inputs(&self) -> Result<Inputs, deltaref::Error> {
        // `cast` to f64 is a copy, made on every core for a long tensor.
        self.assemble(|n| self.get(n))
    }

    /// The upstream gradients `(do, dht)` (`(dy, dfinal_cache)`); `do` is required.
    pub fn upstream(&self) -> Result<(ArrayD<f64>, Option<ArrayD<f64>>), deltaref::Error> {
        let (d_o, dht) = self.upstream_refs()?;
        Ok((deltaref::tensor::cast(d_o), dht.map(deltaref::tensor::cast)))
    }

    /// [`Case::upstream`], borrowed.
    pub fn upstream_refs(&self) -> Result<(&ArrayD<f64>, Option<&ArrayD<f64>>), deltaref::Error> {
        let [d_o, dht] = self.meta.op.upstream() else {
            unreachable!("two upstream names per op")
        };
        Ok((self.need_ref(d_o)?, self.tensors.get(*dht)))
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
        // KDA and GDN take the same FLA names (their gates differ in shape).
        macro_rules! gated {
            ($inputs:ident) => {
                $inputs {
                    q: need("q")?,
                    k: need("k")?,
                    v: need("v")?,
                    g: need("g")?,
                    beta: need("beta")?,
                    a_log: get("A_log"),
                    dt_bias: get("dt_bias"),
                    initial_state: get("initial_state"),
                    cu_seqlens: cu,
                }
            };
        }
        Ok(match op {
            Op::Kda => Inputs::Kda(gated!(KdaInputs)),
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
            Op::Gdn => Inputs::Gdn(gated!(GdnInputs)),
            Op::CausalConv1d => Inputs::CausalConv1d(ConvInputs {
                x: need("x")?,
                weight: need("weight")?,
                bias: get("bias"),
                initial_state: get("initial_state"),
                cu_seqlens: cu,
            }),
        })
    }

    /// The stored outputs and gradients (empty for a fixture without them).
    pub fn results(&self) -> Tensors {
        owned(self.result_refs())
    }

    /// The stored intermediates ([`INTERMEDIATE_NAMES`]) of a case or candidate.
    pub fn intermediates(&self) -> Tensors {
        owned(self.intermediate_refs())
    }

    /// [`Case::results`], borrowed.
    fn result_refs(&self) -> impl Iterator<Item = (&String, &ArrayD<f64>)> {
        let op = self.meta.op;
        self.tensors
            .iter()
            .filter(move |(k, _)| op.results().contains(&k.as_str()))
    }

    /// [`Case::intermediates`], borrowed.
    fn intermediate_refs(&self) -> impl Iterator<Item = (&String, &ArrayD<f64>)> {
        let op = self.meta.op;
        self.tensors
            .iter()
            .filter(move |(k, _)| is_intermediate(op, k))
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
        let name = match self.meta.op {
            Op::TokenShift | Op::CausalConv1d => "x",
            _ => "v",
        };
        self.tensors
            .get(name)
            .and_then(|t| t.shape().last().copied())
            .unwrap_or(0)
    }

    /// Checks inputs, upstream gradients and stored results for consistency
    /// with the reference crate's validation, each where it is (a long case
    /// holds gigabytes of them): no token-sized tensor is copied.
    pub fn validate(&self) -> Result<(), deltaref::Error> {
        let (d_o, dht) = self.upstream_refs()?;
        let meta = &self.meta;
        match meta.op {
            Op::Kda => {
                let d = kda::validate_refs(&self.kda_refs()?, &meta.kda_options())?;
                kda::validate_upstream(&d, d_o, dht)?;
            }
            Op::Dplr => {
                let d = dplr::validate_refs(&self.dplr_refs()?, &meta.dplr_options())?;
                dplr::validate_upstream(&d, d_o, dht)?;
            }
            Op::Gdn => {
                let opts = meta.gdn_options();
                let d = gdn::validate_refs(&self.kda_refs()?, &opts)?;
                gdn::validate_upstream(&d, opts.state_v_first, d_o, dht)?;
            }
            Op::TokenShift => {
                let (d, _) = token_shift::validate_refs(&self.token_shift_refs()?)?;
                token_shift::validate_upstream(&d, d_o, dht)?;
            }
            Op::CausalConv1d => {
                let (d, _) = conv::validate_refs(&self.conv_refs()?)?;
                conv::validate_upstream(&d, d_o, dht)?;
            }
        }
        for (name, x) in self.result_refs() {
            if let Some(want) = self.result_shape(name) {
                deltaref::tensor::expect_shape(
                    name,
                    "(as its input counterpart)",
                    &want,
                    x.shape(),
                )?;
            }
            deltaref::tensor::check_finite(name, x)?;
        }
        for (name, x) in self.intermediate_refs() {
            deltaref::tensor::check_finite(name, x)?;
        }
        Ok(())
    }

    /// The outputs and gradients the oracle computes for this case: every
    /// result name, less the gradients of optional inputs it lacks.
    pub fn expected_results(&self) -> Vec<&'static str> {
        results_of(self.meta.op, |n| self.shape_of(n))
    }

    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.get(name).map(|t| t.shape().to_vec())
    }

    /// Bytes of the case's tensors as held (f64).
    pub fn bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.len() as u64 * 8).sum()
    }

    /// Bytes of the results the oracle computes for the case (f64).
    pub fn result_bytes(&self) -> u64 {
        self.expected_results()
            .into_iter()
            .filter_map(|n| crate::memory::elements(&self.result_shape(n)?))
            .fold(0u64, u64::saturating_add)
            .saturating_mul(8)
    }

    /// The shape a result must have: a gradient is shaped like its input,
    /// `o`/`y` like `do`/`dy`, a final state like `dht` when present.
    pub fn result_shape(&self, name: &str) -> Option<Vec<usize>> {
        result_shape_of(name, |n| self.shape_of(n))
    }
}

/// [`Case::expected_results`] of a case of `op` whose tensors have the
/// shapes `shape(name)` gives (`None`: no such tensor).
pub fn results_of(op: Op, shape: impl Fn(&str) -> Option<Vec<usize>>) -> Vec<&'static str> {
    let has = |n: &str| shape(n).is_some();
    op.results()
        .iter()
        .copied()
        .filter(|&n| match n {
            "dA_log" => has("A_log"),
            "ddt_bias" => has("dt_bias"),
            "dh0" => has("initial_state"),
            "dcache" => has("cache"),
            "dbias" => has("bias"),
            _ => true,
        })
        .collect()
}

/// [`Case::result_shape`] given the case's tensor shapes as [`results_of`].
pub fn result_shape_of(
    name: &str,
    shape: impl Fn(&str) -> Option<Vec<usize>>,
) -> Option<Vec<usize>> {
    match name {
        "o" => shape("do"),
        "y" => shape("dy"),
        "final_state" => shape("dht").or_else(|| shape("initial_state")),
        "final_cache" => shape("dfinal_cache").or_else(|| shape("cache")),
        "dh0" => shape("initial_state"),
        "dcache" => shape("cache"),
        "dA_log" => shape("A_log"),
        "ddt_bias" => shape("dt_bias"),
        d => shape(d.strip_prefix('d')?),
    }
}

/// `x` rounded to the values `dtype` stores (in place).
fn stored(mut x: ArrayD<f64>, dtype: Dtype) -> ArrayD<f64> {
    if dtype != Dtype::F64 {
        x.mapv_inplace(|v| dtype.round(v));
    }
    x
}

/// Named tensors copied out of their borrows.
fn owned<'a>(refs: impl Iterator<Item = (&'a String, &'a ArrayD<f64>)>) -> Tensors {
    refs.map(|(k, v)| (k.clone(), v.clone())).collect()
}
