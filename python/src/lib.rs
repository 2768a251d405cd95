//! `deltaref._deltaref`: the oracle behind the `deltaref` Python package.
//!
//! Everything goes through the verify crate's case model and implementation
//! registry, so a Python call and the `deltaref` CLI run the same code and
//! fail with the same messages. The Python layer (`python/deltaref/`) gives
//! the FLA-named functions; this module takes and returns plain pieces:
//! `case` metadata as JSON text, name → float64 array dicts, `cu_seqlens` as
//! a list. Every error is a `ValueError` carrying the CLI's message (without
//! its `error: ` prefix); heavy work runs with the GIL released.

use std::collections::BTreeMap;
use std::path::PathBuf;

use deltaref::cp::Layout;
use deltaref::gates::Gate;
use deltaref_verify::case::{Case, CaseMeta, Dtype, Op};
use deltaref_verify::convention;
use deltaref_verify::fuzz::{evaluate, FnRunner, FuzzConfig, KernelCase, Params};
use deltaref_verify::generate::{generate, GenSpec};
use deltaref_verify::impls::{Compute, Impl, ImplRequest};
use deltaref_verify::metrics;
use deltaref_verify::outputs::Tensors;
use deltaref_verify::report::VerifyReport;
use numpy::{PyArrayDyn, PyReadonlyArrayDyn};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

// Same allocator as the CLI: a backward pass frees and reallocates tens of
// MiB per call, which glibc would hand back to the kernel every time.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn value_error(e: impl ToString) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Runs `f` with the GIL released. Its error, and a panic too (a bug or an
/// input the validation missed), come back as a `ValueError`: nothing
/// unwinds into the interpreter.
fn released<T: Send, E: ToString + Send>(
    py: Python<'_>,
    f: impl FnOnce() -> Result<T, E> + Send,
) -> PyResult<T> {
    py.detach(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)))
        .map_err(|p| {
            let why = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            value_error(format!("deltaref internal error: {why}"))
        })?
        .map_err(value_error)
}

/// A case as Python sees it: `(case JSON, {name: f64 array}, {name: dtype}, cu_seqlens)`.
type PyCase<'py> = (
    String,
    Bound<'py, PyDict>,
    BTreeMap<String, String>,
    Option<Vec<i64>>,
);

fn tensors_to_py<'py>(py: Python<'py>, t: Tensors) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, x) in t {
        d.set_item(name, PyArrayDyn::from_owned_array(py, x))?;
    }
    Ok(d)
}

fn case_to_py(py: Python<'_>, case: Case) -> PyResult<PyCase<'_>> {
    let dtypes = case
        .dtypes
        .iter()
        .map(|(n, d)| (n.clone(), d.name().to_string()))
        .collect();
    Ok((
        case.meta.to_json().to_string(),
        tensors_to_py(py, case.tensors)?,
        dtypes,
        case.cu_seqlens,
    ))
}

/// The dtype `name` (of `what`: an argument or a tensor), one a case file stores.
fn dtype(what: &str, name: &str) -> PyResult<Dtype> {
    Dtype::parse_among(name, what, &Dtype::CASE_FILE).map_err(value_error)
}

/// Builds an in-memory case; tensor names must be the op's (FLA's) names.
/// A tensor without an entry in `dtypes` is stored as f64.
fn build_case(
    meta_json: &str,
    tensors: BTreeMap<String, PyReadonlyArrayDyn<'_, f64>>,
    dtypes: &BTreeMap<String, String>,
    cu_seqlens: Option<Vec<i64>>,
) -> PyResult<Case> {
    let meta = CaseMeta::from_json(meta_json).map_err(|e| value_error(format!("metadata: {e}")))?;
    let op = meta.op;
    let mut case = Case::new(meta);
    for (name, x) in tensors {
        if !op.knows(&name) || name == "cu_seqlens" {
            return Err(value_error(format!(
                "tensor `{name}`: not a float tensor of op {}",
                op.name()
            )));
        }
        let dt = dtypes
            .get(&name)
            .map_or(Ok(Dtype::F64), |d| dtype(&format!("tensor `{name}`"), d))?;
        let x = x.as_array().to_owned();
        if dt == Dtype::F64 {
            // Rounding to f64 is the identity: skip `insert`'s copy.
            case.tensors.insert(name.clone(), x);
            case.dtypes.insert(name, dt);
        } else {
            case.insert(&name, x, dt);
        }
    }
    case.cu_seqlens = cu_seqlens;
    Ok(case)
}

/// `cp={"layout": ...}`: FLA's name, with the CLI's message for a bad one.
fn layout_of(name: Option<&str>) -> PyResult<Option<Layout>> {
    name.map(Layout::parse)
        .transpose()
        .map_err(|e| value_error(format!("--layout: {e}")))
}

fn compute_of(name: &str) -> PyResult<Compute> {
    name.parse()
        .map_err(|e: String| value_error(format!("compute: {e}")))
}

/// Every output and gradient of a case's inputs and upstream gradients under
/// one implementation of the registry (`deltaref run`).
///
/// Returns `(implementation name, {name: f64 array})`: `o`/`y`, the final
/// state and every gradient FLA names (`dq dk dv dg dbeta dA_log ddt_bias
/// dh0`; DPLR `da db dgk`; token-shift `dx dcache`), each shaped like its
/// input; with `forward_only`, the outputs and final state alone (no
/// upstream gradients needed). `compute` (f64 or f32) is used unless the
/// `precision` preset sets its own scalar.
#[pyfunction]
#[pyo3(signature = (meta_json, tensors, dtypes, cu_seqlens, impl_name, chunk_size, world, layout, cuts, cp_engine, precision, compute, forward_only))]
#[allow(clippy::too_many_arguments)]
fn run<'py>(
    py: Python<'py>,
    meta_json: &str,
    tensors: BTreeMap<String, PyReadonlyArrayDyn<'py, f64>>,
    dtypes: BTreeMap<String, String>,
    cu_seqlens: Option<Vec<i64>>,
    impl_name: &str,
    chunk_size: Option<usize>,
    world: Option<usize>,
    layout: Option<String>,
    cuts: Option<Vec<usize>>,
    cp_engine: Option<String>,
    precision: Option<String>,
    compute: &str,
    forward_only: bool,
) -> PyResult<(String, Bound<'py, PyDict>)> {
    let case = build_case(meta_json, tensors, &dtypes, cu_seqlens)?;
    let compute = compute_of(compute)?;
    let req = ImplRequest {
        name: impl_name.parse().map_err(value_error)?,
        chunk_size,
        world,
        layout: layout_of(layout.as_deref())?,
        cuts,
        cp_engine: cp_engine
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(value_error)?,
        precision,
        ..ImplRequest::default()
    };
    let (name, results) = released(py, move || -> Result<(String, Tensors), String> {
        // The forward validates its inputs itself; `validate` also needs `do`.
        if !forward_only {
            case.validate().map_err(|e| e.to_string())?;
        }
        let (imp, preset) = req.resolve_with_compute(&case).map_err(|e| e.to_string())?;
        let compute = preset.unwrap_or(compute);
        let t = if forward_only {
            imp.compute_forward(&case, compute)
        } else {
            imp.compute(&case, compute)
        };
        Ok((imp.name(), t.map_err(|e| e.to_string())?))
    })?;
    Ok((name, tensors_to_py(py, results)?))
}

/// Reads and validates a case file (`deltaref` reads it the same way).
#[pyfunction]
fn read_case(py: Python<'_>, path: PathBuf) -> PyResult<PyCase<'_>> {
    let case = released(py, || Case::read(&path))?;
    case_to_py(py, case)
}

/// Reads a candidate for a case of op `op` (`deltaref verify --candidate`):
/// inputs and metadata optional, non-finite values kept.
#[pyfunction]
fn read_candidate<'py>(py: Python<'py>, path: PathBuf, op: &str) -> PyResult<PyCase<'py>> {
    let op = Op::parse(op)
        .ok_or_else(|| value_error(format!("unknown op `{op}` ({})", Op::names_list())))?;
    let case = released(py, || Case::read_candidate(&path, op))?;
    case_to_py(py, case)
}

/// Writes a case file atomically; tensors are stored in their `dtypes`
/// (rounded to nearest even), f64 when absent. Returns the number of tensors.
#[pyfunction]
fn write_case<'py>(
    py: Python<'py>,
    path: PathBuf,
    meta_json: &str,
    tensors: BTreeMap<String, PyReadonlyArrayDyn<'py, f64>>,
    dtypes: BTreeMap<String, String>,
    cu_seqlens: Option<Vec<i64>>,
) -> PyResult<usize> {
    let case = build_case(meta_json, tensors, &dtypes, cu_seqlens)?;
    let n = case.tensors.len() + usize::from(case.cu_seqlens.is_some());
    released(py, || case.write(&path))?;
    Ok(n)
}

/// `deltaref gen`: a deterministic case (inputs, upstream gradients and,
/// with `expected`, the float64 truth).
#[pyfunction]
#[pyo3(signature = (op, shape, lengths, seed, gate, lower_bound, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, initial_state, scale, dtype, expected))]
#[allow(clippy::too_many_arguments)]
fn gen<'py>(
    py: Python<'py>,
    op: &str,
    shape: Option<Vec<usize>>,
    lengths: Option<Vec<usize>>,
    seed: u64,
    gate: &str,
    lower_bound: Option<f64>,
    use_qk_l2norm_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    initial_state: bool,
    scale: Option<f64>,
    dtype: &str,
    expected: bool,
) -> PyResult<PyCase<'py>> {
    let op = Op::parse(op)
        .ok_or_else(|| value_error(format!("op: unknown op `{op}` ({})", Op::names_list())))?;
    let gate = match (gate, lower_bound) {
        ("none", None) => Gate::None,
        ("kda", None) => Gate::Kda,
        ("lowerbound", lb) => Gate::LowerBound {
            lower_bound: lb.unwrap_or(-5.0),
        },
        ("none" | "kda", Some(_)) => {
            return Err(value_error("lower_bound needs gate=\"lowerbound\""))
        }
        (g, _) => {
            return Err(value_error(format!(
                "gate: unknown gate `{g}` (none, kda, lowerbound)"
            )))
        }
    };
    let spec = GenSpec {
        shape,
        lengths,
        seed,
        gate,
        use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel,
        allow_neg_eigval,
        initial_state,
        scale,
        dtype: self::dtype("dtype", dtype)?,
        expected,
        ..GenSpec::new(op)
    };
    let case = released(py, || generate(&spec))?;
    case_to_py(py, case)
}

/// `deltaref verify`: compares a candidate's tensors (or, with
/// `candidate=None`, an implementation's results) with the case's stored
/// truth, or with the f64 oracle when the case stores none and a candidate
/// is given. Returns `(report JSON, report table, pass)`.
#[pyfunction]
#[pyo3(signature = (meta_json, tensors, dtypes, cu_seqlens, candidate, max_ratio, case_name, candidate_name, impl_name, chunk_size, world, layout, cuts, cp_engine, precision, compute, forward_only=false, allow_partial=false))]
#[allow(clippy::too_many_arguments)]
fn verify<'py>(
    py: Python<'py>,
    meta_json: &str,
    tensors: BTreeMap<String, PyReadonlyArrayDyn<'py, f64>>,
    dtypes: BTreeMap<String, String>,
    cu_seqlens: Option<Vec<i64>>,
    candidate: Option<BTreeMap<String, PyReadonlyArrayDyn<'py, f64>>>,
    max_ratio: f64,
    case_name: &str,
    candidate_name: &str,
    impl_name: &str,
    chunk_size: Option<usize>,
    world: Option<usize>,
    layout: Option<String>,
    cuts: Option<Vec<usize>>,
    cp_engine: Option<String>,
    precision: Option<String>,
    compute: Option<String>,
    forward_only: bool,
    allow_partial: bool,
) -> PyResult<(String, String, bool)> {
    let case = build_case(meta_json, tensors, &dtypes, cu_seqlens)?;
    let cand = candidate
        .map(|c| build_case(meta_json, c, &BTreeMap::new(), None))
        .transpose()?;
    let compute = compute.as_deref().map(compute_of).transpose()?;
    let req = ImplRequest {
        name: impl_name.parse().map_err(value_error)?,
        chunk_size,
        world,
        layout: layout_of(layout.as_deref())?,
        cuts,
        cp_engine: cp_engine
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(value_error)?,
        precision,
        ..ImplRequest::default()
    };
    let report = released(py, move || -> Result<VerifyReport, String> {
        case.validate().map_err(|e| format!("{case_name}: {e}"))?;
        let stored = case.results();
        let computing = |e: deltaref_verify::gpu::ComputeError| format!("{case_name}: {e}");
        let (expected, reference, got, candidate) = match cand {
            Some(c) => {
                let (expected, reference) = if stored.is_empty() {
                    let oracle = Impl::NAIVE
                        .compute(&case, Compute::F64)
                        .map_err(computing)?;
                    (oracle, "impl:naive (f64 oracle)".to_string())
                } else {
                    (stored, "case file".to_string())
                };
                (expected, reference, c.results(), candidate_name.to_string())
            }
            None => {
                if stored.is_empty() {
                    return Err(format!(
                            "{case_name} stores no expected outputs: pass a candidate, or generate it with expected=True"
                        ));
                }
                let (imp, preset) = req.resolve_with_compute(&case).map_err(|e| e.to_string())?;
                let compute = compute.or(preset).unwrap_or(Compute::F64);
                let got = imp.compute(&case, compute).map_err(computing)?;
                let label = deltaref_verify::report::impl_label(
                    &imp.name(),
                    req.precision.as_deref(),
                    compute,
                );
                (stored, "case file".to_string(), got, label)
            }
        };
        // As `deltaref verify --forward-only --allow-partial`: the outputs
        // and final state alone; tensors the candidate lacks left unchecked
        // (and listed) instead of failing.
        let op = case.meta.op;
        let mut expected = expected;
        if forward_only {
            expected.retain(|n, _| op.forward_results().contains(&n.as_str()));
        }
        let mut unchecked: Vec<String> = case
            .expected_results()
            .into_iter()
            .filter(|n| !expected.contains_key(*n))
            .filter(|n| !forward_only || op.forward_results().contains(n))
            .map(String::from)
            .collect();
        if allow_partial {
            let missing: Vec<String> = expected
                .keys()
                .filter(|n| !got.contains_key(*n))
                .cloned()
                .collect();
            for n in missing {
                expected.remove(&n);
                unchecked.push(n);
            }
        }
        let report = VerifyReport::new(
            case_name, &reference, &candidate, &expected, &got, max_ratio,
        )
        .with_heads(case.meta.op, &expected, &got)
        .with_unchecked(unchecked, allow_partial);
        Ok(if forward_only {
            report.forward_only()
        } else {
            report
        })
    })?;
    let json = serde_json::to_string(&report).map_err(value_error)?;
    Ok((json, report.to_string(), report.pass))
}

/// FLA's `get_err_ratio`, `max |ref − x|` (with its flat index) and
/// `assert_close`'s verdict at `ratio`; with `name`, also the failure
/// message (`None` on a pass). `reference` and `x` must have one shape.
#[pyfunction]
#[pyo3(signature = (reference, x, ratio, name))]
fn compare(
    reference: PyReadonlyArrayDyn<'_, f64>,
    x: PyReadonlyArrayDyn<'_, f64>,
    ratio: f64,
    name: &str,
) -> PyResult<(f64, f64, usize, bool, Option<String>)> {
    let (r, c) = (reference.as_array(), x.as_array());
    if r.shape() != c.shape() {
        return Err(value_error(format!(
            "{name}: shapes differ: reference {:?}, candidate {:?}",
            r.shape(),
            c.shape()
        )));
    }
    let shape = r.shape().to_vec();
    let flat = |a: ndarray::ArrayViewD<'_, f64>| a.iter().copied().collect::<Vec<f64>>();
    let (r, c) = (flat(r), flat(c));
    let cmp = metrics::compare(&r, &c, ratio);
    let message = metrics::assert_close_shaped(name, &r, &c, &shape, ratio).err();
    Ok((cmp.norm_ratio, cmp.max_abs, cmp.argmax, cmp.pass, message))
}

/// The `precision=` preset names (`deltaref --precision`), one per entry.
#[pyfunction]
fn precision_names() -> Vec<&'static str> {
    deltaref_verify::presets::preset_names()
}

/// The fuzz case `params_json` (a `deltaref_verify::fuzz::Params` as JSON)
/// of `op` for `convention`, and the convention.
fn fuzz_setup(
    op: &str,
    convention: &str,
    params_json: &str,
    dtype: &str,
) -> PyResult<(FuzzConfig, Params)> {
    let op = Op::parse(op)
        .ok_or_else(|| value_error(format!("op: unknown op `{op}` ({})", Op::names_list())))?;
    let conv = convention::find(convention).ok_or_else(|| {
        value_error(format!(
            "convention: unknown `{convention}` (available: {})",
            convention::names()
        ))
    })?;
    let cfg = FuzzConfig {
        dtype: self::dtype("dtype", dtype)?,
        ..FuzzConfig::new(op, conv)
    };
    cfg.check().map_err(value_error)?;
    let p: Params =
        serde_json::from_str(params_json).map_err(|e| value_error(format!("params: {e}")))?;
    if !cfg.allows(&p) {
        return Err(value_error(format!(
            "params: convention {} cannot take {}",
            conv.name,
            p.describe()
        )));
    }
    Ok((cfg, p))
}

/// The operators of the registry, by name (`deltaref gen --op`).
#[pyfunction]
fn op_names() -> Vec<&'static str> {
    Op::all().map(|o| o.name()).collect()
}

/// What `deltaref fuzz` draws for `op`, as JSON: which sizes it has (`heads`,
/// `value_heads`, `v`, and `width` when its `V` is the convolution's width
/// `W`, 1 to 4), which switches (`gate`, `l2norm`, `beta_sigmoid`,
/// `initial_state`, `activation`, `bias`), whether the extra gate/key
/// shapes apply (`extras`), and its input `regimes`.
#[pyfunction]
fn fuzz_switches(op: &str) -> PyResult<String> {
    let op = Op::parse(op)
        .ok_or_else(|| value_error(format!("op: unknown op `{op}` ({})", Op::names_list())))?;
    let has = deltaref_verify::fuzz::draw::Has::of(op);
    let regimes: Vec<&str> = op.info().regimes.iter().map(|r| r.name()).collect();
    Ok(serde_json::json!({
        "heads": has.heads,
        "value_heads": has.value_heads,
        "v": has.v,
        "width": op.info().shape.ends_with(",W"),
        "gate": has.gate,
        "l2norm": has.l2norm,
        "beta_sigmoid": has.beta_sigmoid,
        "initial_state": has.initial_state,
        "activation": has.activation,
        "bias": has.bias,
        "extras": has.extras,
        "regimes": regimes,
    })
    .to_string())
}

/// A built-in convention's declaration as JSON (`Convention::to_json`).
#[pyfunction]
fn convention_json(name: &str) -> PyResult<String> {
    convention::find(name)
        .map(|c| c.to_json().to_string())
        .ok_or_else(|| {
            value_error(format!(
                "convention: unknown `{name}` (available: {})",
                convention::names()
            ))
        })
}

/// The fuzz case `params_json` in `convention`'s layout: `(case JSON,
/// {name: f64 array}, cu_seqlens)` (inputs and upstream gradients).
#[pyfunction]
fn fuzz_case<'py>(
    py: Python<'py>,
    op: &str,
    convention: &str,
    params_json: &str,
    dtype: &str,
) -> PyResult<(String, Bound<'py, PyDict>, Option<Vec<i64>>)> {
    let (cfg, p) = fuzz_setup(op, convention, params_json, dtype)?;
    let k = released(py, || {
        let case = p
            .case(cfg.op, cfg.convention, cfg.dtype)
            .map_err(|e| e.to_string())?;
        KernelCase::of(&case, cfg.convention, cfg.dtype)
    })?;
    let meta = k.meta.to_json().to_string();
    Ok((meta, tensors_to_py(py, k.tensors)?, k.cu_seqlens))
}

/// Judges a candidate's `results` (the convention's layout) on the fuzz case
/// `params_json` against the float64 truth: `(verdict JSON, pass)`.
#[pyfunction]
fn fuzz_judge<'py>(
    py: Python<'py>,
    op: &str,
    convention: &str,
    params_json: &str,
    dtype: &str,
    results: BTreeMap<String, PyReadonlyArrayDyn<'py, f64>>,
    tolerance: f64,
) -> PyResult<(String, bool)> {
    let (cfg, p) = fuzz_setup(op, convention, params_json, dtype)?;
    let results: Tensors = results
        .into_iter()
        .map(|(n, x)| (n, x.as_array().to_owned()))
        .collect();
    let mut runner = FnRunner {
        name: "python".into(),
        f: move |_: &KernelCase| Ok(results.clone()),
    };
    let o = released(py, || {
        evaluate(&cfg, &p, &mut runner, tolerance).map_err(|e| e.to_string())
    })?;
    let v = serde_json::json!({"params": p, "verdict": o.verdict, "runner_error": o.runner_error});
    Ok((v.to_string(), o.verdict.pass() && o.runner_error.is_none()))
}

#[pymodule]
fn _deltaref(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run, m)?)?;
    m.add_function(wrap_pyfunction!(read_case, m)?)?;
    m.add_function(wrap_pyfunction!(read_candidate, m)?)?;
    m.add_function(wrap_pyfunction!(write_case, m)?)?;
    m.add_function(wrap_pyfunction!(gen, m)?)?;
    m.add_function(wrap_pyfunction!(verify, m)?)?;
    m.add_function(wrap_pyfunction!(compare, m)?)?;
    m.add_function(wrap_pyfunction!(precision_names, m)?)?;
    m.add_function(wrap_pyfunction!(convention_json, m)?)?;
    m.add_function(wrap_pyfunction!(fuzz_case, m)?)?;
    m.add_function(wrap_pyfunction!(fuzz_judge, m)?)?;
    m.add_function(wrap_pyfunction!(op_names, m)?)?;
    m.add_function(wrap_pyfunction!(fuzz_switches, m)?)?;
    Ok(())
}
