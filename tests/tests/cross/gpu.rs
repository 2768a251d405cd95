//! The GPU kernels against the f64 oracle. Every test but the probe needs a
//! CUDA device: they are built as ignored (reported `ignored` by `cargo test`)
//! unless `DELTAREF_GPU_TESTS=1` is set at build time, and then a missing
//! device is a failure, never a silent pass (see `build.rs`).
//!
//! The oracle here is the truth (`deltaref::truth`, the definition) for the
//! outputs and the f64 naive engine for the gradients; on every case the
//! naive engine's outputs must first equal the truth's (≤ 1e-12 relative),
//! so its gradients, held to the truth's in the crate's own tests, stand in
//! for them.
//!
//! Bands: f32 inputs ≤ 1e-5 norm_ratio against the oracle; bf16 inputs ≤ 5e-3
//! per tensor (FLA's "rounding noise" bar) against the oracle run on the same
//! bf16-rounded inputs; CP equal to the non-CP GPU run within the same band.

use std::sync::{Mutex, OnceLock};

use deltaref::cp::PlanSpec;
use deltaref::dplr::DplrInputs;
use deltaref::dplr::{self, Dplr, DplrOptions};
use deltaref::gates::Gate;
use deltaref::gdn::{Gdn, GdnOptions, OnKda};
use deltaref::inputs::{self, DplrSpec, GdnSpec, KdaSpec, Layout, TokenShiftSpec};
use deltaref::kda::KdaInputs;
use deltaref::kda::{self, Kda, KdaOptions};
use deltaref::registry;
use deltaref::token_shift::{Shift, TokenShift};
use deltaref::truth::Truth;
use deltaref::Dtype;
use deltaref_gpu::{Engine, Gpu, GpuError, GpuImpl};
use deltaref_tests::ratio;
use deltaref_verify::case::Op;
use deltaref_verify::generate::{generate, GenSpec};
use deltaref_verify::gpu::stored;
use deltaref_verify::outputs::{self, Tensors};
use ndarray::ArrayD;

/// KDA (and GDN) inputs as the device reads them: token tensors in `s`,
/// states and gate parameters in f32.
fn stored_kda(x: &KdaInputs<f64>, s: Dtype) -> KdaInputs<f64> {
    let f32_ = |a: &ArrayD<f64>| stored(a, Dtype::F32);
    KdaInputs {
        q: stored(&x.q, s),
        k: stored(&x.k, s),
        v: stored(&x.v, s),
        g: stored(&x.g, s),
        beta: stored(&x.beta, s),
        a_log: x.a_log.as_ref().map(f32_),
        dt_bias: x.dt_bias.as_ref().map(f32_),
        initial_state: x.initial_state.as_ref().map(f32_),
        cu_seqlens: x.cu_seqlens.clone(),
    }
}

/// DPLR inputs as the device reads them.
fn stored_dplr(x: &DplrInputs<f64>, s: Dtype) -> DplrInputs<f64> {
    DplrInputs {
        q: stored(&x.q, s),
        k: stored(&x.k, s),
        v: stored(&x.v, s),
        a: stored(&x.a, s),
        b: stored(&x.b, s),
        gk: stored(&x.gk, s),
        initial_state: x.initial_state.as_ref().map(|a| stored(a, Dtype::F32)),
        cu_seqlens: x.cu_seqlens.clone(),
    }
}

/// One device for every test, used by one test at a time.
fn gpu() -> std::sync::MutexGuard<'static, Gpu> {
    static GPU: OnceLock<Result<Mutex<Gpu>, String>> = OnceLock::new();
    match GPU.get_or_init(|| Gpu::probe().map(Mutex::new).map_err(|e| e.to_string())) {
        Ok(g) => g.lock().unwrap_or_else(|p| p.into_inner()),
        Err(e) => panic!("DELTAREF_GPU_TESTS=1 but no usable GPU: {e}"),
    }
}

fn imp(engine: Engine, cp: Option<PlanSpec>, storage: Dtype) -> GpuImpl {
    GpuImpl {
        engine,
        cp,
        storage,
    }
}

/// Prints one row per tensor and asserts each is finite and ≤ `tol`.
fn check(what: &str, reference: &Tensors, got: &Tensors, tol: f64) {
    assert_eq!(
        reference.keys().collect::<Vec<_>>(),
        got.keys().collect::<Vec<_>>(),
        "{what}: tensor names"
    );
    let mut worst = (0.0f64, String::new());
    for (name, r) in reference {
        let g = &got[name];
        assert!(g.iter().all(|x| x.is_finite()), "{what}: {name} not finite");
        let v = ratio(r, g);
        eprintln!("{what:<44} {name:<12} norm_ratio {v:.3e}");
        if v > worst.0 {
            worst = (v, name.clone());
        }
    }
    assert!(
        worst.0 <= tol,
        "{what}: {} norm_ratio {:.3e} > {tol:e}",
        worst.1,
        worst.0
    );
}

fn round_f32(x: &ArrayD<f64>) -> ArrayD<f64> {
    stored(x, Dtype::F32)
}

fn kda_spec(lengths: &[usize], h: usize, hv: usize, k: usize, opts: KdaOptions) -> KdaSpec {
    KdaSpec {
        layout: Layout::varlen(lengths),
        h,
        hv,
        k,
        v: k,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 8,
    }
}

fn lower_bound_opts() -> KdaOptions {
    KdaOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        gate: Gate::LowerBound { lower_bound: -5.0 },
        ..Default::default()
    }
}

/// The reference a GPU run is judged against: `naive` (the f64 naive
/// engine's outputs and gradients on `x`) with its outputs replaced by the
/// truth's, after checking that they agree within 1e-12 relative.
fn with_truth<O: Truth>(
    naive: Tensors,
    x: &<O as Truth>::Inputs<f64>,
    opt: &O::Options,
) -> Tensors {
    let y = O::forward(x, &O::all_outputs(opt));
    let mut reference = naive;
    let mut replaced = 0;
    for (name, t) in O::OUTPUTS.iter().zip(O::outputs(&y)) {
        let (Some(t), Some(n)) = (t, reference.get_mut(*name)) else {
            continue;
        };
        let scale = t.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-300);
        let err = n
            .iter()
            .zip(t)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        assert!(
            err <= 1e-12,
            "{}: the f64 naive engine's {name} is {err:.1e} off the truth",
            O::NAME
        );
        *n = t.clone();
        replaced += 1;
    }
    assert!(
        replaced > 0,
        "{}: no output of the truth to judge by",
        O::NAME
    );
    reference
}

/// The oracle (the truth's outputs, the f64 naive engine's gradients) and
/// the GPU on the same stored inputs.
fn kda_pair(gpu: &Gpu, spec: &KdaSpec, imp: &GpuImpl) -> (Tensors, Tensors) {
    let g = inputs::KdaSpec::generate(spec);
    let x = stored_kda(&g.inputs, imp.storage);
    let d_o = stored(&g.d_o, imp.storage);
    let dht = round_f32(&g.dht);
    let naive = outputs::all::<f64, _>(&kda::Naive, &x, &spec.opts, &d_o, Some(&dht))
        .expect("valid inputs");
    let truth = with_truth::<Kda>(naive, &x, &spec.opts);
    let run = deltaref_gpu::kda::run(gpu, &x.refs(), &spec.opts, &d_o, Some(&dht), imp)
        .unwrap_or_else(|e| panic!("GPU run failed: {e}"));
    (
        truth,
        registry::named::<f64, Kda>(&run.outputs, Some(&run.grads)),
    )
}

#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn kda_f32_kernels_match_the_oracle() {
    let gpu = gpu();
    let kda_gate = KdaOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        gate: Gate::Kda,
        use_beta_sigmoid_in_kernel: true,
        allow_neg_eigval: true,
        ..Default::default()
    };
    let plain = KdaOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        ..Default::default()
    };
    let cases = [
        (
            "lower-bound gate, GVA, varlen 0/1/…",
            kda_spec(&[70, 0, 1, 129], 2, 4, 32, lower_bound_opts()),
        ),
        (
            "kda gate, beta sigmoid, neg eigval",
            kda_spec(&[100, 37], 1, 2, 64, kda_gate),
        ),
        ("no gate, K=V=128", kda_spec(&[200], 2, 2, 128, plain)),
    ];
    for (name, spec) in &cases {
        for engine in [Engine::Naive, Engine::Chunk(64), Engine::Chunk(16)] {
            let (truth, got) = kda_pair(&gpu, spec, &imp(engine, None, Dtype::F32));
            check(&format!("kda f32 {engine:?} {name}"), &truth, &got, 1e-5);
        }
    }
}

#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn kda_scalar_gate_batch_mode_matches_the_oracle() {
    let gpu = gpu();
    let spec = KdaSpec {
        layout: Layout::batch(2, 90),
        scalar_gate: true,
        ..kda_spec(
            &[1],
            2,
            2,
            16,
            KdaOptions {
                output_final_state: true,
                use_qk_l2norm_in_kernel: true,
                ..Default::default()
            },
        )
    };
    for engine in [Engine::Naive, Engine::Chunk(32)] {
        let (truth, got) = kda_pair(&gpu, &spec, &imp(engine, None, Dtype::F32));
        check(&format!("kda f32 {engine:?} GDN batch"), &truth, &got, 1e-5);
    }
}

/// The reference GPU case: lengths [400, 624], H=4, K=V=128, lower-bound gate.
fn required_spec() -> KdaSpec {
    kda_spec(&[400, 624], 4, 4, 128, lower_bound_opts())
}

/// The bands on that case: naive, chunked and CP world 2 against the
/// oracle, every tensor ≤ 1e-5 (f32 inputs) or ≤ 5e-3 (bf16 inputs).
fn check_required_case(storage: Dtype, tol: f64) {
    let gpu = gpu();
    let spec = required_spec();
    for (engine, cp) in [
        (Engine::Naive, None),
        (Engine::Chunk(64), None),
        (Engine::Chunk(64), Some(PlanSpec::World(2))),
    ] {
        let label = format!("kda {storage:?} [400, 624] K=V=128 {engine:?} cp={cp:?}");
        let (truth, got) = kda_pair(&gpu, &spec, &imp(engine, cp, storage));
        check(&label, &truth, &got, tol);
    }
}

#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn kda_f32_required_case_matches_the_oracle() {
    check_required_case(Dtype::F32, 1e-5);
}

#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn kda_bf16_inputs_are_within_rounding_noise() {
    check_required_case(Dtype::Bf16, 5e-3);
}

#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn kda_cp_equals_non_cp_on_the_gpu() {
    let gpu = gpu();
    let spec = required_spec();
    for engine in [Engine::Chunk(64), Engine::Naive] {
        for storage in [Dtype::F32, Dtype::Bf16] {
            let (_, base) = kda_pair(&gpu, &spec, &imp(engine, None, storage));
            let tol = if storage == Dtype::F32 { 1e-5 } else { 5e-3 };
            for cp in [
                PlanSpec::World(2),
                PlanSpec::World(4),
                PlanSpec::Zigzag(2),
                PlanSpec::Cuts(vec![100, 399, 401, 700]),
            ] {
                let label = format!("kda {storage:?} {engine:?} {cp:?} vs non-CP");
                let (_, got) = kda_pair(&gpu, &spec, &imp(engine, Some(cp), storage));
                check(&label, &base, &got, tol);
            }
        }
    }
}

#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn kda_cp_f32_matches_the_oracle_with_a_sequence_over_many_ranks() {
    let gpu = gpu();
    let spec = kda_spec(&[5, 300, 1, 60], 1, 2, 64, lower_bound_opts());
    let cp = PlanSpec::Cuts(vec![3, 50, 51, 180, 305, 306]);
    for engine in [Engine::Chunk(64), Engine::Chunk(32), Engine::Naive] {
        let (truth, got) = kda_pair(&gpu, &spec, &imp(engine, Some(cp.clone()), Dtype::F32));
        check(&format!("kda f32 cp cuts {engine:?}"), &truth, &got, 1e-5);
    }
}

/// The oracle (the truth's outputs, the gradients of KDA's f64 naive engine
/// on GDN's pieces) and the GPU on the same stored inputs.
fn gdn_pair(gpu: &Gpu, spec: &GdnSpec, imp: &GpuImpl) -> (Tensors, Tensors) {
    let g = inputs::GdnSpec::generate(spec);
    let x = stored_kda(&g.inputs, imp.storage);
    let d_o = stored(&g.d_o, imp.storage);
    let dht = round_f32(&g.dht);
    let naive = OnKda(kda::Naive);
    let naive =
        outputs::all::<f64, _>(&naive, &x, &spec.opts, &d_o, Some(&dht)).expect("valid inputs");
    let truth = with_truth::<Gdn>(naive, &x, &spec.opts);
    let run = deltaref_gpu::gdn::run(gpu, &x.refs(), &spec.opts, &d_o, Some(&dht), imp)
        .unwrap_or_else(|e| panic!("GPU run failed: {e}"));
    (
        truth,
        registry::named::<f64, Gdn>(&run.outputs, Some(&run.grads)),
    )
}

fn gdn_spec(lengths: &[usize], h: usize, hv: usize, k: usize, opts: GdnOptions) -> GdnSpec {
    GdnSpec {
        layout: Layout::varlen(lengths),
        h,
        hv,
        k,
        v: k,
        opts,
        initial_state: true,
        seed: 11,
    }
}

/// GDN through the KDA kernels: the scalar gate broadcast on the device, the
/// per-head in-kernel gate, `state_v_first`; naive, chunked and CP, in the
/// bands of KDA's tests (f32 ≤ 1e-5, bf16 ≤ 5e-3).
#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn gdn_kernels_match_the_oracle() {
    let gpu = gpu();
    let plain = GdnOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        ..Default::default()
    };
    let gated = GdnOptions {
        use_gate_in_kernel: true,
        use_beta_sigmoid_in_kernel: true,
        state_v_first: true,
        ..plain
    };
    let cases = [
        (
            "plain, GVA, varlen 0/1/…",
            gdn_spec(&[70, 0, 1, 129], 2, 4, 32, plain),
        ),
        (
            "in-kernel gate, beta sigmoid, state_v_first",
            gdn_spec(&[100, 37], 1, 2, 64, gated),
        ),
        ("plain, K=V=128", gdn_spec(&[400, 624], 2, 2, 128, plain)),
    ];
    for (name, spec) in &cases {
        for engine in [Engine::Naive, Engine::Chunk(64), Engine::Chunk(16)] {
            let (truth, got) = gdn_pair(&gpu, spec, &imp(engine, None, Dtype::F32));
            check(&format!("gdn f32 {engine:?} {name}"), &truth, &got, 1e-5);
        }
        let cp = Some(PlanSpec::Cuts(vec![3, 50, 51, 120]));
        let (truth, got) = gdn_pair(&gpu, spec, &imp(Engine::Chunk(64), cp, Dtype::F32));
        check(&format!("gdn f32 cp cuts {name}"), &truth, &got, 1e-5);
        let (mut truth, mut got) = gdn_pair(&gpu, spec, &imp(Engine::Chunk(64), None, Dtype::Bf16));
        // GDN's dg sums KDA's per-key gate gradient over K, and the in-kernel
        // gate's parameter gradients sum over every token: terms that cancel,
        // so bf16's rounding of q/k (FLA's l2norm store) reaches them
        // amplified (measured: dg 5.2e-3 at K = 128, ddt_bias 9.1e-3; KDA's
        // bf16 test has neither a scalar gate nor the kda gate). Their band.
        let sums = |t: &mut Tensors| {
            ["dg", "dA_log", "ddt_bias"]
                .into_iter()
                .filter_map(|n| Some((n.to_string(), t.remove(n)?)))
                .collect::<Tensors>()
        };
        let (truth_s, got_s) = (sums(&mut truth), sums(&mut got));
        check(&format!("gdn bf16 Chunk(64) {name}"), &truth, &got, 5e-3);
        check(
            &format!("gdn bf16 gate sums {name}"),
            &truth_s,
            &got_s,
            2e-2,
        );
    }
}

/// DPLR, GDN and token-shift cases run from their own tensors (`verify`'s GPU path: no
/// copy of the inputs, results moved into the name map) with the bits of a
/// run on copied inputs, and time their host side: checks, uploads,
/// downloads.
#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn cases_run_from_their_own_tensors() {
    let _one_at_a_time = gpu();
    let dev = deltaref_verify::gpu::device().expect("a GPU");
    let dplr = GenSpec {
        shape: Some(vec![1, 48, 2, 16, 8]),
        ..GenSpec::new(Op::Dplr)
    };
    let gdn = GenSpec {
        shape: Some(vec![1, 48, 1, 2, 16, 8]),
        gate: Gate::Kda,
        use_qk_l2norm_in_kernel: true,
        ..GenSpec::new(Op::Gdn)
    };
    let token_shift = GenSpec {
        shape: Some(vec![1, 48, 24]),
        ..GenSpec::new(Op::TokenShift)
    };
    for spec in [dplr, gdn, token_shift] {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let case = generate(&GenSpec {
                lengths: Some(vec![30, 0, 18]),
                initial_state: true,
                dtype,
                seed: 4,
                ..spec.clone()
            })
            .expect("generated");
            for cp in [None, Some(PlanSpec::World(2))] {
                let what = format!("{:?} {dtype:?} cp={cp:?}", spec.op);
                let imp = imp(Engine::Naive, cp.clone(), dtype);
                let (got, t) = deltaref_verify::gpu::case(&imp, &case).expect("GPU run");
                let (d_o, dht) = case.upstream().expect("upstream");
                let (tensors, cu) = (&case.tensors, case.cu_seqlens.as_deref());
                let options = &case.meta.options;
                let want = match case.meta.op.name() {
                    "dplr" => {
                        let opts = dplr::DplrOptions::from_case(options).unwrap();
                        let x = dplr::DplrRefs::from_tensors(tensors, cu).unwrap();
                        let r = deltaref_gpu::dplr::run(dev, &x, &opts, &d_o, dht.as_ref(), &imp);
                        let r = r.expect("GPU run");
                        registry::named::<f64, Dplr>(&r.outputs, Some(&r.grads))
                    }
                    "gdn" => {
                        let opts = deltaref::gdn::GdnOptions::from_case(options).unwrap();
                        let x = kda::KdaRefs::from_tensors(tensors, cu, "gdn").unwrap();
                        let r = deltaref_gpu::gdn::run(dev, &x, &opts, &d_o, dht.as_ref(), &imp);
                        let r = r.expect("GPU run");
                        registry::named::<f64, Gdn>(&r.outputs, Some(&r.grads))
                    }
                    "token_shift" => {
                        let x = deltaref::token_shift::TokenShiftRefs::from_tensors(tensors, cu)
                            .unwrap();
                        let r = deltaref_gpu::token_shift::run(dev, &x, &d_o, dht.as_ref(), &imp);
                        let r = r.expect("GPU run");
                        registry::named::<f64, TokenShift>(&r.outputs, Some(&r.grads))
                    }
                    _ => panic!("{what}: not a DPLR, GDN or token-shift case"),
                };
                assert!(got == want, "{what}: in place ≠ copied");
                assert!(
                    t.check_s > 0.0 && t.upload_s > t.check_s && t.download_s > 0.0,
                    "{what}: host timings {t:?}"
                );
            }
        }
    }
}

#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn dplr_kernels_match_the_oracle_plain_and_cp() {
    let gpu = gpu();
    let spec = DplrSpec {
        layout: Layout::varlen(&[90, 0, 1, 200]),
        h: 2,
        k: 64,
        v: 32,
        initial_state: true,
        seed: 9,
    };
    let g = inputs::DplrSpec::generate(&spec);
    let opts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    for (storage, tol) in [(Dtype::F32, 1e-5), (Dtype::Bf16, 5e-3)] {
        let x = stored_dplr(&g.inputs, storage);
        let d_o = stored(&g.d_o, storage);
        let dht = round_f32(&g.dht);
        let naive =
            outputs::all::<f64, _>(&dplr::Naive, &x, &opts, &d_o, Some(&dht)).expect("valid");
        let truth = with_truth::<Dplr>(naive, &x, &opts);
        for cp in [
            None,
            Some(PlanSpec::World(3)),
            Some(PlanSpec::Cuts(vec![45, 91, 100])),
        ] {
            let run = deltaref_gpu::dplr::run(
                &gpu,
                &x.refs(),
                &opts,
                &d_o,
                Some(&dht),
                &imp(Engine::Naive, cp.clone(), storage),
            )
            .unwrap_or_else(|e| panic!("GPU run failed: {e}"));
            let got = registry::named::<f64, Dplr>(&run.outputs, Some(&run.grads));
            check(&format!("dplr {storage:?} cp={cp:?}"), &truth, &got, tol);
        }
    }
}

#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn token_shift_kernels_match_the_oracle_plain_and_cp() {
    let gpu = gpu();
    let spec = TokenShiftSpec {
        layout: Layout::varlen(&[7, 0, 1, 20]),
        d: 40,
        cache: true,
        seed: 10,
    };
    let g = inputs::TokenShiftSpec::generate(&spec);
    let naive =
        outputs::all::<f64, _>(&Shift, &g.inputs, &(), &g.d_o, Some(&g.dht)).expect("valid");
    let truth = with_truth::<TokenShift>(naive, &g.inputs, &());
    for cp in [
        None,
        Some(PlanSpec::World(4)),
        Some(PlanSpec::Cuts(vec![3, 8, 9, 20])),
    ] {
        let run = deltaref_gpu::token_shift::run(
            &gpu,
            &g.inputs.refs(),
            &g.d_o,
            Some(&g.dht),
            &imp(Engine::Naive, cp.clone(), Dtype::F32),
        )
        .unwrap_or_else(|e| panic!("GPU run failed: {e}"));
        let got = registry::named::<f64, TokenShift>(&run.outputs, Some(&run.grads));
        // One f32 rounding of the inputs and one subtraction: ≤ 1e-7.
        check(&format!("token-shift f32 cp={cp:?}"), &truth, &got, 1e-7);
    }
}

#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn gpu_rejects_bad_input_with_the_oracles_errors() {
    let gpu = gpu();
    let spec = kda_spec(&[10, 6], 1, 1, 16, lower_bound_opts());
    let g = inputs::KdaSpec::generate(&spec);
    let mut x = g.inputs.clone();
    x.q[[0, 3, 0, 2]] = f64::NAN;
    let e = deltaref_gpu::kda::run(
        &gpu,
        &x.refs(),
        &spec.opts,
        &g.d_o,
        None,
        &imp(Engine::Chunk(64), None, Dtype::F32),
    )
    .expect_err("NaN in q");
    assert!(
        matches!(e, GpuError::Input(deltaref::Error::NonFinite { .. })),
        "{e}"
    );
    let big = KdaSpec {
        k: 512,
        v: 8,
        ..spec.clone()
    };
    let g = inputs::KdaSpec::generate(&big);
    let e = deltaref_gpu::kda::run(
        &gpu,
        &g.inputs.refs(),
        &big.opts,
        &g.d_o,
        None,
        &imp(Engine::Naive, None, Dtype::F32),
    )
    .expect_err("K = 512");
    assert!(e.to_string().contains("K ≤ 256"), "{e}");
    let g = inputs::KdaSpec::generate(&spec);
    let e = deltaref_gpu::kda::run(
        &gpu,
        &g.inputs.refs(),
        &spec.opts,
        &g.d_o,
        None,
        &imp(Engine::Chunk(48), None, Dtype::F32),
    )
    .expect_err("chunk 48");
    assert!(e.to_string().contains("chunk_size"), "{e}");
    let spec = gdn_spec(
        &[10, 6],
        1,
        1,
        16,
        GdnOptions {
            state_v_first: true,
            ..Default::default()
        },
    );
    let g = inputs::GdnSpec::generate(&spec);
    let flat_dht = g
        .dht
        .clone()
        .into_shape_with_order(vec![2, 16 * 16])
        .unwrap();
    let e = deltaref_gpu::gdn::run(
        &gpu,
        &g.inputs.refs(),
        &spec.opts,
        &g.d_o,
        Some(&flat_dht),
        &imp(Engine::Naive, None, Dtype::F32),
    )
    .expect_err("dht of rank 2");
    assert!(
        matches!(e, GpuError::Input(deltaref::Error::Shape { .. }))
            && e.to_string().contains("dht"),
        "{e}"
    );
}

#[cfg_attr(
    not(deltaref_gpu_tests),
    ignore = "needs a CUDA GPU: build with DELTAREF_GPU_TESTS=1 (see README)"
)]
#[test]
fn out_of_memory_is_a_clear_error() {
    let gpu = gpu();
    let (_, total) = gpu.memory().expect("memory info");
    let e = gpu
        .zeros::<f32>("a test buffer", total)
        .expect_err("4× the device's memory");
    let msg = e.to_string();
    assert!(matches!(e, GpuError::OutOfMemory { .. }), "{msg}");
    assert!(
        msg.contains("a test buffer") && msg.contains("free"),
        "{msg}"
    );
}

/// Runs everywhere: on a machine without a driver the error must say so.
#[test]
fn probing_names_what_is_missing() {
    match Gpu::probe() {
        Ok(g) => assert!(!g.describe().is_empty()),
        Err(e @ GpuError::NoDriver { .. }) => {
            assert!(e.to_string().contains("no CUDA driver"), "{e}")
        }
        Err(e @ (GpuError::NoNvrtc { .. } | GpuError::NoDevice(_))) => {
            eprintln!("GPU present but unusable: {e}")
        }
        Err(e) => panic!("unexpected probe error: {e}"),
    }
}
