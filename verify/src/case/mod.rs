//! Case files (SPEC §8): one case = one safetensors file holding FLA-named
//! tensors and a `case` metadata entry (a JSON object with `op` and FLA's
//! option names). Reading validates everything and never panics; writing is
//! atomic (temporary file + rename, see [`files`]).
//!
//! Split by job: `error` (what can go wrong), `meta` (the `case`
//! metadata and the ops' names), `dtype` (storage dtypes), `io` (files,
//! framing, candidates); this module holds the case in memory.

mod checks;
mod dtype;
mod error;
pub mod files;
mod io;
pub mod memory;
mod meta;

use std::collections::BTreeMap;

use deltaref::registry::Problem;
use ndarray::ArrayD;

use crate::outputs::Tensors;
pub use deltaref::Dtype;
pub use dtype::stored_width;
pub use error::CaseError;
pub use io::{write_atomic, Drawn};
pub use meta::{is_intermediate, CaseMeta, CpLayout, Op};

/// One case in memory: metadata, float tensors (widened to f64) and their
/// stored dtypes, and `cu_seqlens`.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    pub meta: CaseMeta,
    pub tensors: Tensors,
    pub dtypes: BTreeMap<String, Dtype>,
    pub cu_seqlens: Option<Vec<i64>>,
}

/// A case's inputs (FLA's names), `cu_seqlens` and upstream gradients
/// `(do, dht)`, owned.
pub type OwnedInputs = (Tensors, Option<Vec<i64>>, ArrayD<f64>, Option<ArrayD<f64>>);

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

    /// A required tensor, borrowed; missing, an error naming the op.
    fn need_ref(&self, name: &str) -> Result<&ArrayD<f64>, deltaref::Error> {
        deltaref::registry::need(&self.tensors, name, self.meta.op.name())
    }

    /// The problem as the op's registry entry reads it: the case's tensors
    /// (extra ones are not read), `cu_seqlens` and options, borrowed.
    pub fn problem(&self) -> Problem<'_> {
        Problem {
            tensors: &self.tensors,
            cu_seqlens: self.cu_seqlens.as_deref(),
            options: &self.meta.options,
        }
    }

    /// The upstream gradients `(do, dht)` (`(dy, dfinal_cache)`); `do` is required.
    pub fn upstream(&self) -> Result<(ArrayD<f64>, Option<ArrayD<f64>>), deltaref::Error> {
        let (d_o, dht) = self.upstream_refs()?;
        Ok((d_o.clone(), dht.cloned()))
    }

    /// [`Case::upstream`], borrowed.
    pub fn upstream_refs(&self) -> Result<(&ArrayD<f64>, Option<&ArrayD<f64>>), deltaref::Error> {
        let [d_o, dht] = self.meta.op.info().upstream;
        Ok((self.need_ref(d_o)?, self.tensors.get(dht)))
    }

    /// The inputs and the upstream gradients, moved out of the case instead
    /// of copied (a long case holds one set of them, not two).
    pub fn into_inputs(mut self) -> Result<OwnedInputs, deltaref::Error> {
        let op = self.meta.op;
        let [d_o, dht] = op.info().upstream;
        let d_o = deltaref::registry::take(&mut self.tensors, d_o, op.name())?;
        let dht = self.tensors.remove(dht);
        let inputs = std::mem::take(&mut self.tensors)
            .into_iter()
            .filter(|(n, _)| op.inputs().contains(&n.as_str()))
            .collect();
        Ok((inputs, self.cu_seqlens, d_o, dht))
    }

    /// The inputs, copied (FLA's names).
    pub fn inputs(&self) -> Tensors {
        let op = self.meta.op;
        self.tensors
            .iter()
            .filter(|(n, _)| op.inputs().contains(&n.as_str()))
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect()
    }

    /// The stored outputs and gradients (empty for a fixture without them).
    pub fn results(&self) -> Tensors {
        owned(self.result_refs())
    }

    /// The stored intermediates (what the op's entry declares) of a case or candidate.
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

    /// The value dimension (V; D for token-shift and the convolution): the
    /// last axis of the first input whose axes end in `V` or `D`; 0 if the
    /// inputs are absent.
    pub fn value_dim(&self) -> usize {
        let info = self.meta.op.info();
        let name = info.inputs.iter().find(|n| {
            info.axes_of(n)
                .is_some_and(|a| a.ends_with(",V") || a.ends_with(",D"))
        });
        name.and_then(|n| self.tensors.get(*n))
            .and_then(|t| t.shape().last().copied())
            .unwrap_or(0)
    }

    /// Checks inputs, upstream gradients and stored results for consistency
    /// with the reference crate's validation, each where it is (a long case
    /// holds gigabytes of them): no token-sized tensor is copied.
    pub fn validate(&self) -> Result<(), deltaref::Error> {
        let (d_o, dht) = self.upstream_refs()?;
        self.meta.op.entry().validate(self.problem(), d_o, dht)?;
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
        result_shape_of(self.meta.op, name, |n| self.shape_of(n))
    }
}

/// [`Case::expected_results`] of a case of `op` whose tensors have the
/// shapes `shape(name)` gives (`None`: no such tensor): every result, less
/// the gradients of optional inputs it lacks.
pub fn results_of(op: Op, shape: impl Fn(&str) -> Option<Vec<usize>>) -> Vec<&'static str> {
    let info = op.info();
    info.grads
        .iter()
        .filter(|&&g| {
            info.source_of(g)
                .is_none_or(|s| !info.optional.contains(&s) || shape(s).is_some())
        })
        .fold(info.outputs.to_vec(), |mut all, g| {
            all.push(g);
            all
        })
}

/// [`Case::result_shape`] given the case's tensor shapes as [`results_of`]:
/// its source's ([`deltaref::registry::OpInfo::source_of`]); a final state
/// without its gradient `dht` has the initial state's.
pub fn result_shape_of(
    op: Op,
    name: &str,
    shape: impl Fn(&str) -> Option<Vec<usize>>,
) -> Option<Vec<usize>> {
    let info = op.info();
    let source = info.source_of(name)?;
    shape(source).or_else(|| {
        let initial = info
            .inputs
            .iter()
            .find(|i| info.axes_of(i).is_some_and(|a| a.starts_with("N,")))?;
        (info.outputs.get(1) == Some(&name)).then(|| shape(initial))?
    })
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
