//! Stage bisection (`deltaref diagnose --bisect`): which rounded stage of a
//! precision preset drives each tensor's error. The preset runs once as is,
//! once with each stage (or arithmetic variant) made exact, and once with
//! each stage alone rounded; independent roundings add in squares, so a
//! stage's share of a tensor's error is its alone-run squared norm_ratio
//! over the sum of all stages' squares. The made-exact runs say how much of
//! the error goes away in context (the two agree when stages interact little).

use std::fmt;

use deltaref::cp::CpOptions;
use deltaref::precision::Policy;
use serde::Serialize;

use crate::impls::{ComputeError, Impl};
use crate::metrics::norm_ratio;
use crate::outputs::Tensors;

/// One stage's effect on one tensor.
#[derive(Clone, Debug, Serialize)]
pub struct StageEffect {
    /// The stage or variant (`Akk`, `exp2`, …).
    pub stage: String,
    /// norm_ratio with only this stage rounded.
    pub alone: f64,
    /// norm_ratio with every stage but this one rounded.
    pub without: f64,
    /// `alone²` over the sum of all stages' `alone²` (0 to 1).
    pub share: f64,
}

/// One tensor's error, broken down by stage (largest share first).
#[derive(Clone, Debug, Serialize)]
pub struct TensorBisection {
    pub tensor: String,
    /// norm_ratio of the full preset.
    pub full: f64,
    pub stages: Vec<StageEffect>,
}

impl TensorBisection {
    /// "dA_log: 61% from Akk" (the stage with the largest share).
    pub fn conclusion(&self) -> String {
        match self.stages.first() {
            Some(s) if s.share > 0.0 => format!(
                "{}: {:.0}% from {} (norm_ratio {:.3e}; that stage alone {:.3e})",
                self.tensor,
                100.0 * s.share,
                s.stage,
                self.full,
                s.alone
            ),
            _ => format!(
                "{}: no stage changes it (norm_ratio {:.3e})",
                self.tensor, self.full
            ),
        }
    }
}

/// The bisection of a preset on one case.
#[derive(Clone, Debug, Serialize)]
pub struct Bisection {
    pub preset: String,
    pub implementation: String,
    /// In [`Policy::features`] order.
    pub stages: Vec<String>,
    pub tensors: Vec<TensorBisection>,
    pub conclusions: Vec<String>,
}

/// `imp` with its (and its CP's) stage rounding replaced by `policy`.
fn under(imp: &Impl, policy: Policy) -> Impl {
    Impl {
        cp: imp.cp.as_ref().map(|(plan, o)| {
            (
                plan.clone(),
                CpOptions {
                    policy: policy.clone(),
                    ..o.clone()
                },
            )
        }),
        policy,
        ..imp.clone()
    }
}

/// Per tensor of `truth`, the norm_ratio of `got`.
fn ratios(truth: &Tensors, got: &Tensors) -> Vec<(String, f64)> {
    let flat = |a: &ndarray::ArrayD<f64>| a.iter().copied().collect::<Vec<f64>>();
    truth
        .iter()
        .filter_map(|(n, t)| {
            let g = got.get(n).filter(|g| g.shape() == t.shape())?;
            Some((n.clone(), norm_ratio(&flat(t), &flat(g))))
        })
        .collect()
}

/// Bisects `imp`'s policy (preset `preset`) on `case` against `truth`.
/// `run` computes an implementation's results (the caller's compute scalar).
pub fn bisect(
    preset: &str,
    imp: &Impl,
    truth: &Tensors,
    run: impl Fn(&Impl) -> Result<Tensors, ComputeError>,
) -> Result<Bisection, ComputeError> {
    let features = imp.policy.features();
    let full = ratios(truth, &run(imp)?);
    let mut alone = Vec::with_capacity(features.len());
    let mut without = Vec::with_capacity(features.len());
    for f in &features {
        alone.push(ratios(truth, &run(&under(imp, imp.policy.only(*f)))?));
        without.push(ratios(truth, &run(&under(imp, imp.policy.without(*f)))?));
    }
    let tensors: Vec<TensorBisection> = full
        .iter()
        .enumerate()
        .map(|(i, (name, full))| {
            let total: f64 = alone.iter().map(|a| a[i].1 * a[i].1).sum();
            let mut stages: Vec<StageEffect> = features
                .iter()
                .enumerate()
                .map(|(j, f)| StageEffect {
                    stage: f.name().to_string(),
                    alone: alone[j][i].1,
                    without: without[j][i].1,
                    share: if total > 0.0 {
                        alone[j][i].1 * alone[j][i].1 / total
                    } else {
                        0.0
                    },
                })
                .collect();
            // Stable: equal shares keep the policy's stage order.
            stages.sort_by(|a, b| b.share.total_cmp(&a.share));
            TensorBisection {
                tensor: name.clone(),
                full: *full,
                stages,
            }
        })
        .collect();
    Ok(Bisection {
        preset: preset.to_string(),
        implementation: imp.name(),
        stages: features.iter().map(|f| f.name().to_string()).collect(),
        conclusions: tensors.iter().map(TensorBisection::conclusion).collect(),
        tensors,
    })
}

/// Runs of the bisection: one full run, then two per stage.
pub fn runs(policy: &Policy) -> usize {
    1 + 2 * policy.features().len()
}

impl fmt::Display for Bisection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "bisection of --precision {} on impl:{} ({} stages: {})",
            self.preset,
            self.implementation,
            self.stages.len(),
            self.stages.join(", ")
        )?;
        for t in &self.tensors {
            writeln!(f, "\n{} (norm_ratio {:.3e})", t.tensor, t.full)?;
            writeln!(
                f,
                "  {:<14} {:>7} {:>11} {:>13}",
                "stage", "share", "alone", "made exact"
            )?;
            for s in &t.stages {
                writeln!(
                    f,
                    "  {:<14} {:>6.1}% {:>11.3e} {:>13.3e}",
                    s.stage,
                    100.0 * s.share,
                    s.alone,
                    s.without
                )?;
            }
        }
        writeln!(f)?;
        for c in &self.conclusions {
            writeln!(f, "{c}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltaref::precision::{Feature, Stage};
    use deltaref::Dtype;

    #[test]
    fn shares_follow_the_alone_errors_and_sort_largest_first() {
        // A fake implementation whose error is the policy's rounded stages:
        // Akk contributes 3e-3, w 4e-3 (independent: squares add).
        let truth: Tensors = [("o".to_string(), ndarray::arr1(&[1.0, -1.0]).into_dyn())].into();
        let policy = Policy::exact()
            .with(Stage::Akk, Dtype::Bf16)
            .with(Stage::W, Dtype::Bf16);
        let imp = Impl {
            policy: policy.clone(),
            ..Impl::NAIVE
        };
        let run = |i: &Impl| -> Result<Tensors, ComputeError> {
            let e2: f64 = i
                .policy
                .features()
                .iter()
                .map(|f| match f {
                    Feature::Round(Stage::Akk) => 9e-6,
                    Feature::Round(Stage::W) => 16e-6,
                    _ => 0.0,
                })
                .sum();
            let e = e2.sqrt();
            Ok([(
                "o".to_string(),
                ndarray::arr1(&[1.0 + e, -1.0 - e]).into_dyn(),
            )]
            .into())
        };
        let b = bisect("test", &imp, &truth, run).unwrap();
        let o = &b.tensors[0];
        assert!((o.full - 5e-3).abs() < 1e-9, "{}", o.full);
        assert_eq!(o.stages[0].stage, "w");
        assert!((o.stages[0].share - 0.64).abs() < 1e-9);
        assert!((o.stages[1].share - 0.36).abs() < 1e-9);
        assert!((o.stages[0].without - 3e-3).abs() < 1e-9);
        assert!(
            b.conclusions[0].starts_with("o: 64% from w"),
            "{}",
            b.conclusions[0]
        );
        assert_eq!(runs(&policy), 5);
    }
}
