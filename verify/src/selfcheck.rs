//! `deltaref selfcheck`: every implementation against every other on built-in
//! cases, one row per tensor. The analytic gradients are checked against
//! central finite differences in f64, f32 against f64, and each further form
//! (chunked, context-parallel, GPU) against the naive f64 oracle.

use std::fmt;

use deltaref::conv::{Activation, ConvOptions, Direct};
use deltaref::cp::{plan::PlanSpec, CpOptions};
use deltaref::dplr::{DplrInputs, DplrOptions};
use deltaref::gates::Gate;
use deltaref::gdn::{GdnOptions, OnKda};
use deltaref::inputs::{
    self, ConvSpec, DplrSpec, GdnSpec, Generated, KdaSpec, Layout, TokenShiftSpec,
};
use deltaref::kda::{KdaInputs, KdaOptions};
use deltaref::token_shift::{Shift, TokenShiftInputs};
use deltaref::{dplr, kda, Result};
use ndarray::ArrayD;
use serde::Serialize;

use deltaref::Dtype;
use deltaref_gpu::{Engine as GpuEngine, GpuImpl};

use crate::fd;
use crate::gpu::{self, ComputeError};
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
            "{:<34} {:<12} {:<12} {:<18} {:>11} {:>11} {:>8}  result",
            "check", "op", "tensor", "shape", "norm_ratio", "max_abs", "tol"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<34} {:<12} {:<12} {:<18} {:>11.3e} {:>11.3e} {:>8.0e}  {}",
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

/// f32 through the same code against f64.
fn precision_rows(report: &mut Report) -> Result<()> {
    let check = "naive f32 vs naive f64";
    let (spec, g) = kda_case(&LENGTHS, 16, 16);
    let exact = outputs::all::<f64, _>(
        &kda::naive::Naive,
        &g.inputs,
        &spec.opts,
        &g.d_o,
        Some(&g.dht),
    )?;
    let single = outputs::all::<f32, _>(
        &kda::naive::Naive,
        &g.inputs,
        &spec.opts,
        &g.d_o,
        Some(&g.dht),
    )?;
    report.compare_maps(check, "kda", &exact, &single, F32_TOL);

    let (_, g) = dplr_case(&LENGTHS, 16, 16);
    let opts = DplrOptions::default();
    let exact =
        outputs::all::<f64, _>(&dplr::naive::Naive, &g.inputs, &opts, &g.d_o, Some(&g.dht))?;
    let single =
        outputs::all::<f32, _>(&dplr::naive::Naive, &g.inputs, &opts, &g.d_o, Some(&g.dht))?;
    report.compare_maps(check, "dplr", &exact, &single, F32_TOL);

    let g = token_shift_case(&LENGTHS);
    let exact = outputs::all::<f64, _>(&Shift, &g.inputs, &(), &g.d_o, Some(&g.dht))?;
    let single = outputs::all::<f32, _>(&Shift, &g.inputs, &(), &g.d_o, Some(&g.dht))?;
    report.compare_maps(check, "token_shift", &exact, &single, F32_TOL);
    Ok(())
}

/// The chunked form against the naive recurrence, both in f64.
fn chunk_rows(report: &mut Report) -> Result<()> {
    let (spec, g) = kda_case(&LENGTHS, 16, 16);
    let naive = outputs::all::<f64, _>(
        &kda::naive::Naive,
        &g.inputs,
        &spec.opts,
        &g.d_o,
        Some(&g.dht),
    )?;
    for c in [16, 64] {
        let chunk = kda::chunk::Chunk::new(c)?;
        let got = outputs::all::<f64, _>(&chunk, &g.inputs, &spec.opts, &g.d_o, Some(&g.dht))?;
        report.compare_maps(
            &format!("chunk C={c} vs naive (f64)"),
            "kda",
            &naive,
            &got,
            EXACT_TOL,
        );
    }
    let (_, g) = dplr_case(&LENGTHS, 16, 16);
    let opts = DplrOptions::default();
    let naive =
        outputs::all::<f64, _>(&dplr::naive::Naive, &g.inputs, &opts, &g.d_o, Some(&g.dht))?;
    let got = outputs::all::<f64, _>(
        &dplr::chunk::Chunk::new(32)?,
        &g.inputs,
        &opts,
        &g.d_o,
        Some(&g.dht),
    )?;
    report.compare_maps("chunk C=32 vs naive (f64)", "dplr", &naive, &got, EXACT_TOL);
    Ok(())
}

/// Simulated context parallel against the non-CP naive oracle, in f64.
fn cp_rows(report: &mut Report) -> Result<()> {
    let cpo = CpOptions::default();
    let cuts = PlanSpec::Cuts(vec![20, 38, 90]);
    let (spec, g) = kda_case(&LENGTHS, 16, 16);
    let naive = outputs::all::<f64, _>(
        &kda::naive::Naive,
        &g.inputs,
        &spec.opts,
        &g.d_o,
        Some(&g.dht),
    )?;
    let chunk = kda::chunk::Chunk::new(16)?;
    let (got, _) = outputs::all_cp::<f64, _>(
        &chunk,
        g.inputs.clone(),
        &spec.opts,
        g.d_o.clone(),
        Some(&g.dht),
        &PlanSpec::World(2),
        &cpo,
    )?;
    report.compare_maps(
        "cp world=2 (chunk C=16) vs naive",
        "kda",
        &naive,
        &got,
        EXACT_TOL,
    );
    let (got, _) = outputs::all_cp::<f64, _>(
        &kda::naive::Naive,
        g.inputs.clone(),
        &spec.opts,
        g.d_o.clone(),
        Some(&g.dht),
        &cuts,
        &cpo,
    )?;
    report.compare_maps(
        "cp cuts=20,38,90 (naive) vs naive",
        "kda",
        &naive,
        &got,
        EXACT_TOL,
    );

    let (_, g) = dplr_case(&LENGTHS, 16, 16);
    let opts = DplrOptions::default();
    let naive =
        outputs::all::<f64, _>(&dplr::naive::Naive, &g.inputs, &opts, &g.d_o, Some(&g.dht))?;
    let (got, _) = outputs::all_cp::<f64, _>(
        &dplr::naive::Naive,
        g.inputs.clone(),
        &opts,
        g.d_o.clone(),
        Some(&g.dht),
        &cuts,
        &cpo,
    )?;
    report.compare_maps(
        "cp cuts=20,38,90 (naive) vs naive",
        "dplr",
        &naive,
        &got,
        EXACT_TOL,
    );
    let chunk = dplr::chunk::Chunk::new(16)?;
    let (got, _) = outputs::all_cp::<f64, _>(
        &chunk,
        g.inputs.clone(),
        &opts,
        g.d_o.clone(),
        Some(&g.dht),
        &PlanSpec::World(2),
        &cpo,
    )?;
    report.compare_maps(
        "cp world=2 (chunk C=16) vs naive",
        "dplr",
        &naive,
        &got,
        EXACT_TOL,
    );

    let g = token_shift_case(&LENGTHS);
    let plain = outputs::all::<f64, _>(&Shift, &g.inputs, &(), &g.d_o, Some(&g.dht))?;
    let got = outputs::all_cp::<f64, _>(
        &Shift,
        g.inputs.clone(),
        &(),
        g.d_o.clone(),
        Some(&g.dht),
        &cuts,
        &CpOptions::default(),
    )?
    .0;
    report.compare_maps(
        "cp cuts=20,38,90 vs non-CP",
        "token_shift",
        &plain,
        &got,
        EXACT_TOL,
    );
    Ok(())
}

/// GDN (in-kernel gate, l2norm, GVA, varlen, initial state) and causal
/// conv1d (SiLU, bias, W = 4, varlen, initial state): chunk and CP against
/// the naive f64 oracle, and the naive form in f32.
fn gdn_conv_rows(report: &mut Report) -> Result<()> {
    let cpo = CpOptions::default();
    let spec = GdnSpec {
        layout: Layout::varlen(&LENGTHS),
        h: 1,
        hv: 2,
        k: 16,
        v: 16,
        opts: GdnOptions {
            output_final_state: true,
            use_qk_l2norm_in_kernel: true,
            use_gate_in_kernel: true,
            ..Default::default()
        },
        initial_state: true,
        seed: 2027,
    };
    let g = inputs::gdn(&spec);
    let (x, o, d_o, dht) = (&g.inputs, &spec.opts, &g.d_o, Some(&g.dht));
    let naive = OnKda(kda::naive::Naive);
    let exact = outputs::all::<f64, _>(&naive, x, o, d_o, dht)?;
    let chunk = OnKda(kda::chunk::Chunk::new(16)?);
    let got = outputs::all::<f64, _>(&chunk, x, o, d_o, dht)?;
    report.compare_maps("chunk C=16 vs naive (f64)", "gdn", &exact, &got, EXACT_TOL);
    let world = PlanSpec::World(2);
    let (got, _) = outputs::all_cp::<f64, _>(&chunk, x.clone(), o, d_o.clone(), dht, &world, &cpo)?;
    report.compare_maps(
        "cp world=2 (chunk C=16) vs naive",
        "gdn",
        &exact,
        &got,
        EXACT_TOL,
    );
    let single = outputs::all::<f32, _>(&naive, x, o, d_o, dht)?;
    report.compare_maps("naive f32 vs naive f64", "gdn", &exact, &single, F32_TOL);

    let g = inputs::conv(&ConvSpec {
        layout: Layout::varlen(&LENGTHS),
        d: 6,
        w: 4,
        bias: true,
        initial_state: true,
        seed: 2028,
    });
    let o = &ConvOptions {
        activation: Activation::Silu,
        output_final_state: true,
    };
    let (x, d_o, dht) = (&g.inputs, &g.d_o, Some(&g.dht));
    let exact = outputs::all::<f64, _>(&Direct, x, o, d_o, dht)?;
    let cuts = PlanSpec::Cuts(vec![20, 38, 90]);
    let (got, _) = outputs::all_cp::<f64, _>(&Direct, x.clone(), o, d_o.clone(), dht, &cuts, &cpo)?;
    report.compare_maps(
        "cp cuts=20,38,90 vs non-CP",
        "causal_conv1d",
        &exact,
        &got,
        EXACT_TOL,
    );
    let single = outputs::all::<f32, _>(&Direct, x, o, d_o, dht)?;
    report.compare_maps("f32 vs f64", "causal_conv1d", &exact, &single, F32_TOL);
    Ok(())
}

/// The GPU kernels against the f64 oracle on the inputs they read (f32 and
/// bf16 storage), plain and under CP. `Err` says why they cannot run here.
fn gpu_rows(report: &mut Report) -> std::result::Result<(), ComputeError> {
    gpu::device()?;
    let cuts = PlanSpec::Cuts(vec![20, 38, 90]);
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
pub fn run() -> Result<Report> {
    let mut report = Report::default();
    kda_fd(&mut report)?;
    dplr_fd(&mut report)?;
    token_shift_fd(&mut report)?;
    precision_rows(&mut report)?;
    chunk_rows(&mut report)?;
    cp_rows(&mut report)?;
    gdn_conv_rows(&mut report)?;
    let mut gpu_report = Report::default();
    match gpu_rows(&mut gpu_report) {
        Ok(()) => report.rows.extend(gpu_report.rows),
        Err(ComputeError::Input(e)) => return Err(e),
        Err(ComputeError::Gpu(e)) => report.skipped.push(format!("GPU rows ({e})")),
    }
    Ok(report)
}
