//! `deltaref selfcheck`: every implementation against every other on built-in
//! cases, one row per tensor. The analytic gradients are checked against
//! central finite differences in f64, f32 against f64, and each further form
//! (chunked, context-parallel, GPU) against the naive f64 oracle.

use std::fmt;

use deltaref::conv::Activation;
use deltaref::dplr::{DplrInputs, DplrOptions};
use deltaref::gates::Gate;
use deltaref::inputs::{self, DplrSpec, Generated, KdaSpec, Layout, TokenShiftSpec};
use deltaref::kda::{KdaInputs, KdaOptions};
use deltaref::token_shift::TokenShiftInputs;
use deltaref::{dplr, kda, Result};
use ndarray::ArrayD;
use serde::Serialize;

use deltaref::Dtype;

use crate::case::{Case, CaseError, Op};
use crate::fd;
use crate::generate::{generate, GenSpec};
use crate::gpu;
use crate::impls::{Compute, Device, EngineName, Impl, ImplName, ImplRequest};
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

/// The built-in KDA case: GVA, varlen with 0- and 1-length sequences, the
/// lower-bound gate with `A_log`/`dt_bias`, l2norm, beta sigmoid, initial state.
pub fn kda_case(lengths: &[usize], k: usize, v: usize) -> (KdaSpec, Generated<KdaInputs<f64>>) {
    let opts = KdaOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        gate: Gate::LowerBound { lower_bound: -5.0 },
        use_beta_sigmoid_in_kernel: true,
        ..Default::default()
    };
    let spec = KdaSpec {
        layout: Layout::varlen(lengths),
        h: 1,
        hv: 2,
        k,
        v,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 2024,
    };
    let g = inputs::kda(&spec);
    (spec, g)
}

/// The built-in DPLR case (RWKV-7-like inputs, varlen, initial state).
pub fn dplr_case(lengths: &[usize], k: usize, v: usize) -> (DplrSpec, Generated<DplrInputs<f64>>) {
    let spec = DplrSpec {
        layout: Layout::varlen(lengths),
        h: 2,
        k,
        v,
        initial_state: true,
        seed: 2025,
    };
    let g = inputs::dplr(&spec);
    (spec, g)
}

/// The built-in token-shift case (varlen with cache).
pub fn token_shift_case(lengths: &[usize]) -> Generated<TokenShiftInputs<f64>> {
    inputs::token_shift(&TokenShiftSpec {
        layout: Layout::varlen(lengths),
        d: 6,
        cache: true,
        seed: 2026,
    })
}

/// Small lengths for finite differences, larger ones for the other checks.
const FD_LENGTHS: [usize; 4] = [6, 1, 0, 9];
const LENGTHS: [usize; 4] = [37, 1, 0, 64];

/// The loss as a function of one input tensor.
type Loss<'a> = Box<dyn Fn(&ArrayD<f64>) -> f64 + 'a>;

/// A differentiable input: name, value, analytic gradient, loss.
type FdInput<'a> = (&'a str, &'a ArrayD<f64>, Option<&'a ArrayD<f64>>, Loss<'a>);

/// Finite-difference rows for one op: `inputs` lists each differentiable
/// input with its analytic gradient and a loss as a function of it.
fn fd_rows(report: &mut Report, op: &str, inputs: Vec<FdInput<'_>>) {
    for (name, x, analytic, loss) in inputs {
        let numeric = fd::grad(x, 1e-5, loss);
        let cmp = match analytic {
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
            op,
            name,
            x.shape(),
            FD_TOL,
            cmp,
        );
    }
}

fn kda_fd(report: &mut Report) -> Result<()> {
    let (spec, g) = kda_case(&FD_LENGTHS, 3, 2);
    let opts = spec.opts;
    let gr = kda::naive::backward(&g.inputs, &opts, &g.d_o, Some(&g.dht))?;
    let loss = |x: &KdaInputs<f64>| -> f64 {
        let out = kda::naive::forward(x, &opts).expect("inputs validated by the analytic run");
        fd::dot(&out.o, &g.d_o) + fd::dot(out.final_state.as_ref().expect("asked for"), &g.dht)
    };
    let x = &g.inputs;
    let with = |f: fn(&mut KdaInputs<f64>, ArrayD<f64>)| {
        let loss = &loss;
        Box::new(move |t: &ArrayD<f64>| {
            let mut xx = x.clone();
            f(&mut xx, t.clone());
            loss(&xx)
        }) as Loss<'_>
    };
    fd_rows(
        report,
        "kda",
        vec![
            ("dq", &x.q, Some(&gr.dq), with(|x, t| x.q = t)),
            ("dk", &x.k, Some(&gr.dk), with(|x, t| x.k = t)),
            ("dv", &x.v, Some(&gr.dv), with(|x, t| x.v = t)),
            ("dg", &x.g, Some(&gr.dg), with(|x, t| x.g = t)),
            ("dbeta", &x.beta, Some(&gr.dbeta), with(|x, t| x.beta = t)),
            (
                "dA_log",
                x.a_log.as_ref().expect("gate"),
                gr.da_log.as_ref(),
                with(|x, t| x.a_log = Some(t)),
            ),
            (
                "ddt_bias",
                x.dt_bias.as_ref().expect("gate"),
                gr.ddt_bias.as_ref(),
                with(|x, t| x.dt_bias = Some(t)),
            ),
            (
                "dh0",
                x.initial_state.as_ref().expect("h0"),
                gr.dh0.as_ref(),
                with(|x, t| x.initial_state = Some(t)),
            ),
        ],
    );
    Ok(())
}

fn dplr_fd(report: &mut Report) -> Result<()> {
    let (_, g) = dplr_case(&FD_LENGTHS, 3, 2);
    let opts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let gr = dplr::naive::backward(&g.inputs, &opts, &g.d_o, Some(&g.dht))?;
    let loss = |x: &DplrInputs<f64>| -> f64 {
        let out = dplr::naive::forward(x, &opts).expect("inputs validated by the analytic run");
        fd::dot(&out.o, &g.d_o) + fd::dot(out.final_state.as_ref().expect("asked for"), &g.dht)
    };
    let x = &g.inputs;
    let with = |f: fn(&mut DplrInputs<f64>, ArrayD<f64>)| {
        let loss = &loss;
        Box::new(move |t: &ArrayD<f64>| {
            let mut xx = x.clone();
            f(&mut xx, t.clone());
            loss(&xx)
        }) as Loss<'_>
    };
    fd_rows(
        report,
        "dplr",
        vec![
            ("dq", &x.q, Some(&gr.dq), with(|x, t| x.q = t)),
            ("dk", &x.k, Some(&gr.dk), with(|x, t| x.k = t)),
            ("dv", &x.v, Some(&gr.dv), with(|x, t| x.v = t)),
            ("da", &x.a, Some(&gr.da), with(|x, t| x.a = t)),
            ("db", &x.b, Some(&gr.db), with(|x, t| x.b = t)),
            ("dgk", &x.gk, Some(&gr.dgk), with(|x, t| x.gk = t)),
            (
                "dh0",
                x.initial_state.as_ref().expect("h0"),
                gr.dh0.as_ref(),
                with(|x, t| x.initial_state = Some(t)),
            ),
        ],
    );
    Ok(())
}

fn token_shift_fd(report: &mut Report) -> Result<()> {
    let g = token_shift_case(&FD_LENGTHS);
    let gr = deltaref::token_shift::backward(&g.inputs, &g.d_o, Some(&g.dht))?;
    let loss = |x: &TokenShiftInputs<f64>| -> f64 {
        let out = deltaref::token_shift::forward(x).expect("inputs validated by the analytic run");
        fd::dot(&out.y, &g.d_o) + fd::dot(&out.final_cache, &g.dht)
    };
    let x = &g.inputs;
    fd_rows(
        report,
        "token_shift",
        vec![
            (
                "dx",
                &x.x,
                Some(&gr.dx),
                Box::new(|t: &ArrayD<f64>| {
                    loss(&TokenShiftInputs {
                        x: t.clone(),
                        ..x.clone()
                    })
                }),
            ),
            (
                "dcache",
                x.cache.as_ref().expect("cache"),
                gr.dcache.as_ref(),
                Box::new(|t: &ArrayD<f64>| {
                    loss(&TokenShiftInputs {
                        cache: Some(t.clone()),
                        ..x.clone()
                    })
                }),
            ),
        ],
    );
    Ok(())
}

/// The CP cuts of the table's `cuts` rows and of the GPU rows.
const CUTS: [usize; 3] = [20, 38, 90];

/// The `gen` request of `op`'s built-in case for the implementation table
/// (varlen with 0- and 1-length sequences, initial states): KDA with GVA,
/// the lower-bound gate, l2norm and beta sigmoid; GDN with its in-kernel
/// gate and l2norm; causal conv1d with SiLU and a bias.
fn table_spec(op: Op) -> GenSpec {
    let t = LENGTHS.iter().sum();
    let mut s = GenSpec {
        lengths: Some(LENGTHS.to_vec()),
        initial_state: true,
        ..GenSpec::new(op)
    };
    let (shape, seed) = match op {
        Op::Kda => (vec![1, t, 1, 2, 16, 16], 2024),
        Op::Dplr => (vec![1, t, 2, 16, 16], 2025),
        Op::TokenShift => (vec![1, t, 6], 2026),
        Op::Gdn => (vec![1, t, 1, 2, 16, 16], 2027),
        Op::CausalConv1d => (vec![1, t, 6, 4], 2028),
    };
    (s.shape, s.seed) = (Some(shape), seed);
    match op {
        Op::Kda => {
            s.gate = Gate::LowerBound { lower_bound: -5.0 };
            s.use_qk_l2norm_in_kernel = true;
            s.use_beta_sigmoid_in_kernel = true;
        }
        Op::Gdn => {
            s.gate = Gate::Kda;
            s.use_qk_l2norm_in_kernel = true;
        }
        Op::CausalConv1d => {
            s.activation = Activation::Silu;
            s.bias = true;
        }
        Op::Dplr | Op::TokenShift => {}
    }
    s
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
    let f32_rows = Op::ALL.map(|op| {
        (
            table_spec(op),
            ImplRequest::default(),
            Compute::F32,
            F32_TOL,
        )
    });
    let exact = [
        (Op::Kda, chunk(16)),
        (Op::Kda, chunk(64)),
        (Op::Dplr, chunk(32)),
        (Op::Gdn, chunk(16)),
        (Op::Kda, world2.clone()),
        (Op::Dplr, world2.clone()),
        (Op::Gdn, world2),
        (Op::Kda, cuts.clone()),
        (Op::Dplr, cuts.clone()),
        (Op::TokenShift, cuts.clone()),
        (Op::CausalConv1d, cuts),
    ]
    .map(|(op, req)| (table_spec(op), req, Compute::F64, EXACT_TOL));
    f32_rows.into_iter().chain(exact).collect()
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
        let mut s = table_spec(op);
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
    let builtin = |source| CaseError::Invalid {
        path: "<built-in case>".into(),
        source,
    };
    kda_fd(&mut report).map_err(builtin)?;
    dplr_fd(&mut report).map_err(builtin)?;
    token_shift_fd(&mut report).map_err(builtin)?;
    run_table(&mut report, table())?;
    match gpu::device() {
        Ok(_) => run_table(&mut report, gpu_table())?,
        Err(e) => report.skipped.push(format!("GPU rows ({e})")),
    }
    Ok(report)
}
