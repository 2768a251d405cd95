//! `deltaref selfcheck`: every implementation against every other on built-in
//! cases, one row per tensor. The analytic gradients are checked against
//! central finite differences in f64, f32 against f64, and each further form
//! (chunked, context-parallel, GPU) against the naive f64 oracle.

use std::fmt;

use deltaref::conv::Activation;
use deltaref::cp::plan::PlanSpec;
use deltaref::dplr::{DplrInputs, DplrOptions};
use deltaref::gates::Gate;
use deltaref::inputs::{self, DplrSpec, Generated, KdaSpec, Layout, TokenShiftSpec};
use deltaref::kda::{KdaInputs, KdaOptions};
use deltaref::token_shift::{Shift, TokenShiftInputs};
use deltaref::{dplr, kda, Result};
use ndarray::ArrayD;
use serde::Serialize;

use deltaref::Dtype;
use deltaref_gpu::{Engine as GpuEngine, GpuImpl};

use crate::case::{Case, CaseError, Op};
use crate::fd;
use crate::generate::{generate, GenSpec};
use crate::gpu::{self, ComputeError};
use crate::impls::{Compute, Impl, ImplName, ImplRequest};
use crate::metrics::{compare, Comparison};
use crate::outputs::{self, Tensors};

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

/// The built-in case of `op` for the implementation table, as `gen` writes
/// it (varlen with 0- and 1-length sequences, initial states): KDA with GVA,
/// the lower-bound gate, l2norm and beta sigmoid; GDN with its in-kernel
/// gate and l2norm; causal conv1d with SiLU and a bias.
fn table_case(op: Op) -> std::result::Result<Case, CaseError> {
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
    generate(&s)
}

/// The implementation table: each row a request as `--impl` and its flags
/// spell it, on an op's built-in case, in a compute scalar, with its bar
/// against the naive f64 oracle. f32 against f64 for every op; the chunked
/// form and CP (FLA's equal split and explicit cuts) in f64.
fn table() -> Vec<(Op, ImplRequest, Compute, f64)> {
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
        cp_engine: Some("naive".into()),
        ..ImplRequest::default()
    };
    let f32_rows = Op::ALL.map(|op| (op, ImplRequest::default(), Compute::F32, F32_TOL));
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
    .map(|(op, req)| (op, req, Compute::F64, EXACT_TOL));
    f32_rows.into_iter().chain(exact).collect()
}

/// Runs [`table`] through the registry users go through
/// ([`ImplRequest::resolve`], [`Impl::compute`]).
fn table_rows(report: &mut Report) -> std::result::Result<(), CaseError> {
    let builtin = std::path::Path::new("<built-in case>");
    let mut cases = std::collections::BTreeMap::new();
    for (op, req, compute, tol) in table() {
        if !cases.contains_key(op.name()) {
            let case = table_case(op)?;
            let truth = Impl::NAIVE
                .compute(&case, Compute::F64)
                .map_err(CaseError::computing(builtin))?;
            cases.insert(op.name(), (case, truth));
        }
        let (case, truth) = &cases[op.name()];
        let imp = req.resolve(case)?;
        let got = imp
            .compute(case, compute)
            .map_err(CaseError::computing(builtin))?;
        let scalar = match compute {
            Compute::F64 => "f64",
            Compute::F32 => "f32",
        };
        let check = format!("{} {scalar} vs naive f64", imp.name());
        report.compare_maps(&check, op.name(), truth, &got, tol);
    }
    Ok(())
}

/// The GPU kernels against the f64 oracle on the inputs they read (f32 and
/// bf16 storage), plain and under CP. `Err` says why they cannot run here.
fn gpu_rows(report: &mut Report) -> std::result::Result<(), ComputeError> {
    gpu::device()?;
    let cuts = PlanSpec::Cuts(CUTS.to_vec());
    // K = V = 64: with 16, dA_log is two sums of a few hundred cancelling
    // terms and its bf16 error is noise around the 5e-3 bar.
    let (spec, g) = kda_case(&LENGTHS, 64, 64);
    for storage in [Dtype::F32, Dtype::Bf16] {
        let x = gpu::stored_kda(&g.inputs, storage);
        let d_o = gpu::stored(&g.d_o, storage);
        let dht = gpu::stored(&g.dht, Dtype::F32);
        let truth = outputs::all::<f64, _>(&kda::naive::Naive, &x, &spec.opts, &d_o, Some(&dht))?;
        let tol = gpu_tol(storage);
        for (engine, cp) in [
            (GpuEngine::Naive, None),
            (GpuEngine::Chunk(16), None),
            (GpuEngine::Chunk(64), None),
            (GpuEngine::Chunk(16), Some(PlanSpec::World(2))),
            (GpuEngine::Naive, Some(cuts.clone())),
        ] {
            let imp = GpuImpl {
                engine,
                cp,
                storage,
            };
            let (got, _) = gpu::kda(&imp, &x, &spec.opts, &d_o, Some(&dht))?;
            report.compare_maps(&gpu_check(&imp), "kda", &truth, &got, tol);
        }
    }
    let (_, g) = dplr_case(&LENGTHS, 16, 16);
    let opts = DplrOptions::default();
    for storage in [Dtype::F32, Dtype::Bf16] {
        let x = gpu::stored_dplr(&g.inputs, storage);
        let d_o = gpu::stored(&g.d_o, storage);
        let dht = gpu::stored(&g.dht, Dtype::F32);
        let truth = outputs::all::<f64, _>(&dplr::naive::Naive, &x, &opts, &d_o, Some(&dht))?;
        for cp in [None, Some(cuts.clone())] {
            let imp = GpuImpl {
                engine: GpuEngine::Naive,
                cp,
                storage,
            };
            let (got, _) = gpu::dplr(&imp, &x, &opts, &d_o, Some(&dht))?;
            report.compare_maps(&gpu_check(&imp), "dplr", &truth, &got, gpu_tol(storage));
        }
    }
    let g = token_shift_case(&LENGTHS);
    let x = TokenShiftInputs {
        x: gpu::stored(&g.inputs.x, Dtype::F32),
        cache: g.inputs.cache.as_ref().map(|c| gpu::stored(c, Dtype::F32)),
        ..g.inputs.clone()
    };
    let dy = gpu::stored(&g.d_o, Dtype::F32);
    let truth = outputs::all::<f64, _>(&Shift, &x, &(), &dy, Some(&g.dht))?;
    for cp in [None, Some(cuts)] {
        let imp = GpuImpl {
            engine: GpuEngine::Naive,
            cp,
            storage: Dtype::F32,
        };
        let (got, _) = gpu::token_shift(&imp, &x, &dy, Some(&g.dht))?;
        report.compare_maps(&gpu_check(&imp), "token_shift", &truth, &got, GPU_F32_TOL);
    }
    Ok(())
}

fn gpu_tol(s: Dtype) -> f64 {
    if s == Dtype::Bf16 {
        GPU_BF16_TOL
    } else {
        GPU_F32_TOL
    }
}

/// E.g. `gpu chunk C=16 cp world=2 bf16 vs f64`.
fn gpu_check(imp: &GpuImpl) -> String {
    let engine = match imp.engine {
        GpuEngine::Naive => "naive".to_string(),
        GpuEngine::Chunk(c) => format!("chunk C={c}"),
    };
    let cp = match &imp.cp {
        None => String::new(),
        Some(PlanSpec::World(w)) => format!(" cp world={w}"),
        Some(PlanSpec::Zigzag(w)) => format!(" cp zigzag world={w}"),
        Some(PlanSpec::Cuts(c)) => format!(
            " cp cuts={}",
            c.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ),
    };
    format!("gpu {engine}{cp} {} vs f64", imp.storage.name())
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
    table_rows(&mut report)?;
    let mut gpu_report = Report::default();
    match gpu_rows(&mut gpu_report) {
        Ok(()) => report.rows.extend(gpu_report.rows),
        Err(ComputeError::Input(e)) => return Err(builtin(e)),
        Err(ComputeError::Gpu(e)) => report.skipped.push(format!("GPU rows ({e})")),
    }
    Ok(report)
}
