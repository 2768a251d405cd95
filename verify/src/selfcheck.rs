//! `deltaref selfcheck`: every implementation against every other on built-in
//! cases, one row per tensor. The analytic gradients are checked against
//! central finite differences in f64, f32 against f64, and each further form
//! (chunked, context-parallel, GPU) against the naive f64 oracle.

use std::fmt;

use deltaref::precision::Policy;
use deltaref::registry::Job;
use ndarray::ArrayD;
use serde::Serialize;

use deltaref::Dtype;

use crate::case::{Case, CaseError, Op};
use crate::fd;
use crate::generate::{generate, GenSpec};
use crate::gpu;
use crate::impls::{Compute, Device, Engine, EngineName, Impl, ImplName, ImplRequest};
use crate::metrics::{compare, Comparison};
use crate::outputs::Tensors;

/// Finite differences agree with the analytic gradient to this norm_ratio.
pub const FD_TOL: f64 = 1e-6;
/// f32 against f64 on the built-in cases.
pub const F32_TOL: f64 = 1e-4;
/// Two exact (f64) forms of the same algorithm.
pub const EXACT_TOL: f64 = 1e-10;
/// The f32 CUDA kernels against the f64 oracle on the same inputs.
pub const GPU_F32_TOL: f64 = 1e-5;
/// bf16 inputs: FLA's "rounding noise" bar for KDA CP (SPEC §7).
pub const GPU_BF16_TOL: f64 = 5e-3;

/// One compared tensor.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub check: String,
    pub op: String,
    pub tensor: String,
    pub shape: Vec<usize>,
    pub tol: f64,
    #[serde(flatten)]
    pub cmp: Comparison,
}

/// All rows of a self-check.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub rows: Vec<Row>,
    /// Groups of rows that could not run here, with the reason.
    pub skipped: Vec<String>,
}

impl Report {
    pub fn all_pass(&self) -> bool {
        self.rows.iter().all(|r| r.cmp.pass)
    }

    /// Adds one row per tensor present in both maps; a tensor of `reference`
    /// missing from `candidate` is a failing row.
    pub fn compare_maps(
        &mut self,
        check: &str,
        op: &str,
        reference: &Tensors,
        candidate: &Tensors,
        tol: f64,
    ) {
        for (name, r) in reference {
            let cmp = match candidate.get(name) {
                Some(c) if c.shape() == r.shape() => compare(&flat(r), &flat(c), tol),
                _ => Comparison {
                    norm_ratio: f64::NAN,
                    max_abs: f64::NAN,
                    argmax: 0,
                    pass: false,
                },
            };
            self.push(check, op, name, r.shape(), tol, cmp);
        }
    }

    fn push(
        &mut self,
        check: &str,
        op: &str,
        tensor: &str,
        shape: &[usize],
        tol: f64,
        cmp: Comparison,
    ) {
        self.rows.push(Row {
            check: check.to_string(),
            op: op.to_string(),
            tensor: tensor.to_string(),
            shape: shape.to_vec(),
            tol,
            cmp,
        });
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<46} {:<13} {:<12} {:<18} {:>11} {:>11} {:>8}  result",
            "check", "op", "tensor", "shape", "norm_ratio", "max_abs", "tol"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<46} {:<13} {:<12} {:<18} {:>11.3e} {:>11.3e} {:>8.0e}  {}",
                r.check,
                r.op,
                r.tensor,
                format!("{:?}", r.shape),
                r.cmp.norm_ratio,
                r.cmp.max_abs,
                r.tol,
                if r.cmp.pass { "pass" } else { "FAIL" }
            )?;
        }
        for why in &self.skipped {
            writeln!(f, "skipped: {why}")?;
        }
        let failed = self.rows.iter().filter(|r| !r.cmp.pass).count();
        write!(f, "{} passed, {} failed", self.rows.len() - failed, failed)
    }
}

fn flat(a: &ArrayD<f64>) -> Vec<f64> {
    a.iter().copied().collect()
}

/// Small lengths for finite differences, larger ones for the other checks.
const FD_LENGTHS: [usize; 4] = [6, 1, 0, 9];
const LENGTHS: [usize; 4] = [37, 1, 0, 64];

/// Finite-difference rows for every float input of `op`'s built-in case
/// (its finite-difference sizes): the naive f64 engine's analytic
/// gradients through the registry against central differences of its loss
/// `Σ o·do + Σ final·dht`, one input element at a time.
fn fd_rows(report: &mut Report, op: Op) -> std::result::Result<(), CaseError> {
    let builtin = std::path::Path::new("<built-in case>");
    let show = &op.info().showcase;
    let t = FD_LENGTHS.iter().sum();
    let spec = GenSpec {
        shape: Some([&[1, t], show.fd_dims].concat()),
        ..table_spec(op, &FD_LENGTHS)
    };
    let case = generate(&spec)?;
    let analytic = Impl::NAIVE
        .compute(&case, Compute::F64)
        .map_err(CaseError::computing(builtin))?;
    let (d_o, dht) = case.upstream().map_err(|e| CaseError::Invalid {
        path: "<built-in case>".into(),
        source: e,
    })?;
    let policy = Policy::exact();
    let job = Job {
        engine: Engine::Naive,
        compute: Compute::F64,
        policy: &policy,
        cp: None,
    };
    let info = op.info();
    let loss = |tensors: &Tensors| -> f64 {
        let mut p = case.problem();
        p.tensors = tensors;
        let out = op
            .entry()
            .forward(&job, p)
            .expect("inputs validated by the analytic run");
        let [o, fin] = [info.outputs[0], info.outputs[1]];
        fd::dot(&out[o], &d_o) + dht.as_ref().map_or(0.0, |d| fd::dot(&out[fin], d))
    };
    for grad in info.grads {
        let Some(input) = info
            .source_of(grad)
            .filter(|i| case.tensors.contains_key(*i))
        else {
            continue;
        };
        let x = &case.tensors[input];
        let numeric = fd::grad(x, 1e-5, |v| {
            let mut t = case.inputs();
            t.insert(input.to_string(), v.clone());
            loss(&t)
        });
        let cmp = match analytic.get(*grad) {
            Some(a) => compare(&flat(&numeric), &flat(a), FD_TOL),
            None => Comparison {
                norm_ratio: f64::NAN,
                max_abs: f64::NAN,
                argmax: 0,
                pass: false,
            },
        };
        report.push(
            "naive analytic vs finite-diff",
            op.name(),
            grad,
            x.shape(),
            FD_TOL,
            cmp,
        );
    }
    Ok(())
}

/// The CP cuts of the table's `cuts` rows and of the GPU rows.
const CUTS: [usize; 3] = [20, 38, 90];

/// The `gen` request of `op`'s built-in case ([`deltaref::registry::Showcase`])
/// over sequences of `lengths`.
fn table_spec(op: Op, lengths: &[usize]) -> GenSpec {
    let show = &op.info().showcase;
    let f = &show.flags;
    GenSpec {
        shape: Some([&[1, lengths.iter().sum()], show.dims].concat()),
        lengths: Some(lengths.to_vec()),
        seed: show.seed,
        gate: f.gate,
        use_qk_l2norm_in_kernel: f.l2norm,
        use_beta_sigmoid_in_kernel: f.beta_sigmoid,
        allow_neg_eigval: f.allow_neg_eigval,
        initial_state: f.initial_state,
        state_v_first: f.state_v_first,
        activation: f.activation,
        bias: f.bias,
        scale: f.scale,
        ..GenSpec::new(op)
    }
}

/// The implementation table: each row a request as `--impl` and its flags
/// spell it, on an op's built-in case, in a compute scalar, with its bar
/// against the naive f64 oracle. f32 against f64 for every op; the chunked
/// form and CP (FLA's equal split and explicit cuts) in f64.
fn table() -> Vec<TableRow> {
    let chunk = |c| ImplRequest {
        name: ImplName::Chunk,
        chunk_size: Some(c),
        ..ImplRequest::default()
    };
    let world2 = ImplRequest {
        name: ImplName::Cp,
        chunk_size: Some(16),
        world: Some(2),
        ..ImplRequest::default()
    };
    let cuts = ImplRequest {
        name: ImplName::Cp,
        cuts: Some(CUTS.to_vec()),
        cp_engine: Some(EngineName::Naive),
        ..ImplRequest::default()
    };
    let mut rows = vec![];
    for op in Op::all() {
        let spec = table_spec(op, &LENGTHS);
        rows.push((spec.clone(), ImplRequest::default(), Compute::F32, F32_TOL));
        let chunked = op
            .info()
            .chunked
            .then_some([chunk(16), chunk(32), chunk(64)]);
        for req in chunked.into_iter().flatten() {
            rows.push((spec.clone(), req, Compute::F64, EXACT_TOL));
        }
        if op.is_delta_rule() {
            rows.push((spec.clone(), world2.clone(), Compute::F64, EXACT_TOL));
        }
        rows.push((spec, cuts.clone(), Compute::F64, EXACT_TOL));
    }
    rows
}

/// A table row: an `--impl` request on the built-in case `gen` writes for
/// the spec, in a compute scalar, with its bar against the naive f64 oracle
/// on that case.
type TableRow = (GenSpec, ImplRequest, Compute, f64);

/// Runs a table through the registry users go through
/// ([`ImplRequest::resolve`], [`Impl::compute`]), each case written once.
fn run_table(report: &mut Report, rows: Vec<TableRow>) -> std::result::Result<(), CaseError> {
    let builtin = std::path::Path::new("<built-in case>");
    let mut cases: Vec<(GenSpec, Case, Tensors)> = vec![];
    for (spec, req, compute, tol) in rows {
        let i = match cases.iter().position(|(s, ..)| *s == spec) {
            Some(i) => i,
            None => {
                let case = generate(&spec)?;
                let truth = Impl::NAIVE
                    .compute(&case, Compute::F64)
                    .map_err(CaseError::computing(builtin))?;
                cases.push((spec.clone(), case, truth));
                cases.len() - 1
            }
        };
        let (_, case, truth) = &cases[i];
        let imp = req.resolve(case)?;
        let got = imp
            .compute(case, compute)
            .map_err(CaseError::computing(builtin))?;
        // The GPU kernels compute in f32 whatever `compute` says.
        let scalar = match (imp.device, compute) {
            (Device::Gpu(_), _) => "",
            (Device::Cpu, Compute::F64) => " f64",
            (Device::Cpu, Compute::F32) => " f32",
        };
        let check = format!("{}{scalar} vs naive f64", imp.name());
        report.compare_maps(&check, spec.op.name(), truth, &got, tol);
    }
    Ok(())
}

/// The GPU table: each row a request as `--impl gpu-*` and its flags spell
/// it, on an op's built-in case stored in a dtype the kernels read, with its
/// bar against the naive f64 oracle on the same stored inputs. KDA's case
/// has K = V = 64: with 16, dA_log is two sums of a few hundred cancelling
/// terms and its bf16 error is noise around the 5e-3 bar. GDN runs on KDA's
/// kernels; its bf16 gate-gradient sums are checked by the GPU tests.
fn gpu_table() -> Vec<TableRow> {
    let req = |name, chunk_size, world, cuts: bool, dtype| ImplRequest {
        name,
        chunk_size,
        world,
        cuts: cuts.then(|| CUTS.to_vec()),
        cp_engine: cuts.then_some(EngineName::Naive),
        gpu_dtype: Some(dtype),
        ..ImplRequest::default()
    };
    let spec = |op, dtype| {
        let mut s = table_spec(op, &LENGTHS);
        s.dtype = dtype;
        if op == Op::Kda {
            s.shape = Some(vec![1, LENGTHS.iter().sum(), 1, 2, 64, 64]);
        }
        s
    };
    let mut rows = vec![];
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let tol = if dtype == Dtype::Bf16 {
            GPU_BF16_TOL
        } else {
            GPU_F32_TOL
        };
        for r in [
            req(ImplName::GpuNaive, None, None, false, dtype),
            req(ImplName::GpuChunk, Some(16), None, false, dtype),
            req(ImplName::GpuChunk, Some(64), None, false, dtype),
            req(ImplName::GpuCp, Some(16), Some(2), false, dtype),
            req(ImplName::GpuCp, None, None, true, dtype),
        ] {
            rows.push((spec(Op::Kda, dtype), r, Compute::F64, tol));
        }
        for r in [
            req(ImplName::GpuNaive, None, None, false, dtype),
            req(ImplName::GpuCp, None, None, true, dtype),
        ] {
            rows.push((spec(Op::Dplr, dtype), r, Compute::F64, tol));
        }
    }
    for r in [
        req(ImplName::GpuNaive, None, None, false, Dtype::F32),
        req(ImplName::GpuCp, None, None, true, Dtype::F32),
    ] {
        rows.push((
            spec(Op::TokenShift, Dtype::F32),
            r,
            Compute::F64,
            GPU_F32_TOL,
        ));
    }
    for r in [
        req(ImplName::GpuNaive, None, None, false, Dtype::F32),
        req(ImplName::GpuChunk, Some(16), None, false, Dtype::F32),
        req(ImplName::GpuCp, Some(16), Some(2), false, Dtype::F32),
    ] {
        rows.push((spec(Op::Gdn, Dtype::F32), r, Compute::F64, GPU_F32_TOL));
    }
    rows
}

/// Runs every check on the built-in cases (the GPU rows when a device is here).
pub fn run() -> std::result::Result<Report, CaseError> {
    let mut report = Report::default();
    for op in Op::all() {
        fd_rows(&mut report, op)?;
    }
    run_table(&mut report, table())?;
    match gpu::device() {
        Ok(_) => run_table(&mut report, gpu_table())?,
        Err(e) => report.skipped.push(format!("GPU rows ({e})")),
    }
    Ok(report)
}
