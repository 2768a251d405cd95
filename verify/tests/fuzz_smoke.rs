//! A short run of the fuzzer (`examples/fuzz.rs`) in CI: mutated case files
//! and command lines, none of which may panic or hang.

#[path = "../examples/fuzz.rs"]
mod fuzz;

use std::time::Duration;

#[test]
fn two_thousand_fuzzed_inputs_cause_no_panic() {
    let silence = fuzz::Silence::start();
    let t = fuzz::campaign(2_000, 7, 10, Duration::from_secs(120), None, &silence);
    drop(silence);
    assert_eq!(t.inputs, 2_000);
    assert!(t.cli_inputs >= 200 && t.case_inputs >= 1_000, "{t:?}");
    assert_eq!(t.panics, 0, "{:#?}", t.first_panics);
    // The mutations reach past the framing checks in both targets.
    assert!(t.valid_cases > 0 && t.cli_ok > 0, "{t:?}");
}
