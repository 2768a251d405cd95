//! Input regimes do what they claim: long-memory and mixed cases carry an
//! O(1) transition `M` across CP ranks (for every KDA gate and DPLR), FLA's
//! draws and sharp gates forget within a rank, and the token-shift regimes
//! change `x` as documented.

use deltaref::gates::Gate;
use deltaref::inputs::{self, Layout, Regime, TokenShiftSpec};
use deltaref_verify::case::Op;
use deltaref_verify::generate::{generate, GenSpec};
use deltaref_verify::impls::{ImplName, ImplRequest};

/// The largest `|M|` entry over the ranks whose state a later rank merges.
fn max_merged_m(spec: &GenSpec) -> f64 {
    let case = generate(spec).expect("generates");
    let req = ImplRequest {
        name: ImplName::Cp,
        world: Some(4),
        ..ImplRequest::default()
    };
    let imp = req.resolve(&case).expect("resolves");
    let (_, diags) = imp.compute_with_diags(&case).expect("computes");
    diags
        .iter()
        .filter(|d| d.meta.post_num_ranks > 0)
        .flat_map(|d| d.m.iter().flat_map(|m| m.iter().map(|v| v.abs())))
        .fold(0.0, f64::max)
}

fn kda(gate: Gate, regime: Regime) -> GenSpec {
    GenSpec {
        shape: Some(vec![1, 1024, 1, 2, 16, 8]),
        gate,
        use_qk_l2norm_in_kernel: true,
        regime,
        seed: 5,
        ..GenSpec::new(Op::Kda)
    }
}

#[test]
fn long_memory_and_mixed_carry_m_across_ranks() {
    let gates = [
        Gate::None,
        Gate::Kda,
        Gate::LowerBound { lower_bound: -5.0 },
    ];
    for gate in gates {
        for regime in Regime::ALL {
            let m = max_merged_m(&kda(gate, regime));
            let carries = matches!(regime, Regime::LongMemory | Regime::Mixed);
            assert!(
                if carries { m > 0.3 } else { m < 1e-3 },
                "KDA {gate:?} {}: max |M| {m:e}",
                regime.name()
            );
        }
    }
    for regime in Regime::ALL {
        let m = max_merged_m(&GenSpec {
            shape: Some(vec![1, 512, 1, 16, 8]),
            regime,
            seed: 6,
            ..GenSpec::new(Op::Dplr)
        });
        let carries = matches!(regime, Regime::LongMemory | Regime::Mixed);
        assert!(
            if carries { m > 0.3 } else { m < 1e-3 },
            "DPLR {}: max |M| {m:e}",
            regime.name()
        );
    }
}

#[test]
fn fla_test_is_the_default_and_unrecorded() {
    let spec = kda(Gate::None, Regime::FlaTest);
    assert_eq!(GenSpec::new(Op::Kda).regime, Regime::FlaTest);
    assert!(spec.meta().unwrap().to_json().get("regime").is_none());
    let lm = kda(Gate::None, Regime::LongMemory)
        .meta()
        .unwrap()
        .to_json();
    assert_eq!(lm["regime"], "long-memory");
}

#[test]
fn token_shift_regimes_change_x() {
    let x = |regime| {
        inputs::TokenShiftSpec::generate_in(
            &TokenShiftSpec {
                layout: Layout::batch(1, 400),
                d: 16,
                cache: false,
                seed: 9,
            },
            regime,
        )
        .inputs
        .x
        .into_dimensionality::<ndarray::Ix3>()
        .unwrap()
    };
    let rms = |v: &mut dyn Iterator<Item = f64>| {
        let (s, n) = v.fold((0.0, 0.0), |(s, n), x| (s + x * x, n + 1.0));
        (s / n).sqrt()
    };
    // long-memory: consecutive tokens nearly equal (y = x_{t−1} − x_t small).
    let lm = x(Regime::LongMemory);
    let steps = rms(&mut (1..400).flat_map(|t| {
        let lm = &lm;
        (0..16).map(move |d| lm[[0, t, d]] - lm[[0, t - 1, d]])
    }));
    assert!(
        steps < 0.1 * rms(&mut lm.iter().copied()),
        "step rms {steps}"
    );
    // mixed: channel magnitudes six orders apart.
    let mx = x(Regime::Mixed);
    let per: Vec<f64> = (0..16)
        .map(|d| rms(&mut (0..400).map(|t| mx[[0, t, d]])))
        .collect();
    let (lo, hi) = per
        .iter()
        .fold((f64::MAX, 0.0f64), |(a, b), &v| (a.min(v), b.max(v)));
    assert!(hi / lo > 1e5, "channel rms {lo:e}..{hi:e}");
    // sharp: heavy tails (kurtosis far above the normal's 3).
    let sh = x(Regime::Sharp);
    let n = sh.len() as f64;
    let m2 = sh.iter().map(|v| v * v).sum::<f64>() / n;
    let m4 = sh.iter().map(|v| v.powi(4)).sum::<f64>() / n;
    assert!(m4 / (m2 * m2) > 10.0, "kurtosis {}", m4 / (m2 * m2));
}
