//! A short run of the mutation fuzzer ([`super::mutation`], also the
//! `mutation_fuzz` example) in CI: mutated case files and command lines,
//! none of which may panic or hang.

use super::mutation as fuzz;

use std::time::Duration;

#[test]
fn two_thousand_fuzzed_inputs_cause_no_panic() {
    let before = std::fs::read_dir(".").unwrap().count();
    let silence = fuzz::Silence::start();
    let t = fuzz::campaign(2_000, 7, 10, Duration::from_secs(120), None, &silence);
    drop(silence);
    // Mutated `--out` values are relative paths: they stay in the campaign's
    // temporary directory, never in the one it was started from.
    assert_eq!(std::fs::read_dir(".").unwrap().count(), before);
    assert_eq!(t.inputs, 2_000);
    assert!(t.cli_inputs >= 200 && t.case_inputs >= 1_000, "{t:?}");
    assert_eq!(t.panics, 0, "{:#?}", t.first_panics);
    // The mutations reach past the framing checks in both targets.
    assert!(t.valid_cases > 0 && t.cli_ok > 0, "{t:?}");
}
