//! `cp` and `verify` head block by head block (a large case streamed from
//! its file) against the same command on the whole case.

mod cp {
    use std::path::PathBuf;

    use deltaref::gates::Gate;
    use deltaref::inputs::Regime;
    use deltaref_cli::commands::cp::{go, streamed, Args};
    use deltaref_verify::case::{Dtype, Op};
    use deltaref_verify::generate::{generate, GenSpec};
    use deltaref_verify::heads::HeadFile;
    use std::path::Path;

    fn args(case: &Path, rest: &[&str]) -> Args {
        deltaref_cli::commands::parse_case_args("cp", case, rest)
    }

    /// KDA with GVA (H = 3, HV = 6), a gate, initial states and three
    /// sequences, long-memory draws (the merges carry a state); the same
    /// with a single query/key head (H = 1, HV = 2); DPLR.
    fn files(dir: &Path) -> Vec<PathBuf> {
        let mut kda = GenSpec::new(Op::Kda);
        kda.lengths = Some(vec![5, 40, 19]);
        kda.shape = Some(vec![1, 64, 3, 6, 8, 4]);
        kda.gate = Gate::Kda;
        kda.initial_state = true;
        kda.regime = Regime::LongMemory;
        kda.dtype = Dtype::Bf16;
        let mut dplr = GenSpec::new(Op::Dplr);
        dplr.lengths = Some(vec![30, 34]);
        dplr.shape = Some(vec![1, 64, 2, 8, 4]);
        dplr.initial_state = true;
        let mut single = kda.clone();
        single.shape = Some(vec![1, 64, 1, 2, 8, 4]);
        [("kda", kda), ("single", single), ("dplr", dplr)]
            .into_iter()
            .map(|(name, spec)| {
                let path = dir.join(format!("{name}.safetensors"));
                generate(&spec).unwrap().write(&path).unwrap();
                path
            })
            .collect()
    }

    /// Head block by head block, the per-rank table and the report are the
    /// whole case's, character for character.
    #[test]
    fn head_blocks_print_the_whole_cases_table_and_report() {
        let dir = tempfile::tempdir().unwrap();
        let runs: [&[&str]; 6] = [
            &["--world", "4"],
            &["--world", "2", "--layout", "zigzag", "--cp-engine", "naive"],
            &["--cuts", "3,20,50"],
            &["--intra", "--num-sms", "2"],
            &["--world", "2", "--compute", "f32"],
            &["--world", "2", "--precision", "drop-merged-state"],
        ];
        for path in files(dir.path()) {
            for flags in runs {
                let a = args(&path, flags);
                let whole = go(&a).unwrap();
                assert!(whole.0.contains("impl:cp"), "{}", whole.0);
                for n in [1, 2] {
                    let file = HeadFile::open(&path, 0)
                        .unwrap()
                        .unwrap()
                        .with_heads_per_block(n);
                    let got = streamed(&a, &file).unwrap();
                    assert_eq!(
                        got,
                        whole,
                        "{} {flags:?}, {n} heads per block",
                        path.display()
                    );
                }
            }
        }
    }

    /// The streamed path refuses what the whole one does, in its words.
    #[test]
    fn head_blocks_refuse_what_the_whole_case_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let path = &files(dir.path())[0];
        for flags in [
            &["--intra", "--world", "2"][..],
            &["--world", "5"],
            &["--world", "2", "--precision", "no-such-preset"],
        ] {
            let a = args(path, flags);
            let whole = go(&a).unwrap_err().to_string();
            let file = HeadFile::open(path, 0).unwrap().unwrap();
            let e = streamed(&a, &file).unwrap_err().to_string();
            assert_eq!(e, whole, "{flags:?}");
        }
    }
}

mod verify {
    use deltaref::gates::Gate;
    use deltaref_cli::commands::verify::{go, streamed, Args};
    use deltaref_verify::case::Dtype;
    use deltaref_verify::case::{Case, Op};
    use deltaref_verify::generate::{generate, GenSpec};
    use deltaref_verify::heads::HeadFile;
    use deltaref_verify::impls::{Compute, Impl};
    use deltaref_verify::report::VerifyReport;
    use std::path::Path;

    fn args(case: &Path, rest: &[&str]) -> Args {
        deltaref_cli::commands::parse_case_args("verify", case, rest)
    }

    /// Rows, pass and unchecked names equal; norm_ratio to rounding (the
    /// sums of squares add up block by block).
    fn assert_same(streamed: &VerifyReport, whole: &VerifyReport) {
        assert_eq!(streamed.rows.len(), whole.rows.len());
        for (r, w) in streamed.rows.iter().zip(&whole.rows) {
            assert_eq!(
                (&r.tensor, &r.shape, &r.argmax, r.max_abs, r.pass, &r.problem),
                (&w.tensor, &w.shape, &w.argmax, w.max_abs, w.pass, &w.problem)
            );
            match (r.norm_ratio, w.norm_ratio) {
                (Some(a), Some(b)) => {
                    assert!((a - b).abs() <= 1e-12 * b.abs(), "{}: {a} vs {b}", r.tensor)
                }
                (a, b) => assert_eq!(a, b, "{}", r.tensor),
            }
        }
        assert_eq!(
            (&streamed.reference, &streamed.candidate, streamed.pass),
            (&whole.reference, &whole.candidate, whole.pass)
        );
        assert_eq!(
            (&streamed.unchecked, streamed.forward_only),
            (&whole.unchecked, whole.forward_only)
        );
    }

    /// `verify --candidate` and `verify --impl` head block by head block
    /// give the whole-case report: a bf16 KDA case with GVA (H = 3,
    /// HV = 6, blocks of two heads; and a single head, H = 1, HV = 2, one
    /// block), gates, an initial state and three sequences, with and
    /// without stored truth, against a candidate with one tensor off, one
    /// in f32 and one missing, under `--forward-only` and `--allow-partial`.
    #[test]
    fn head_blocks_give_the_whole_cases_report() {
        let dir = tempfile::tempdir().unwrap();
        for (expected, (h, hv)) in [(true, (3, 6)), (false, (3, 6)), (true, (1, 2))] {
            let mut spec = GenSpec::new(Op::Kda);
            spec.lengths = Some(vec![5, 40, 19]);
            spec.shape = Some(vec![1, 64, h, hv, 8, 4]);
            spec.gate = Gate::Kda;
            spec.initial_state = true;
            spec.expected = expected;
            spec.dtype = Dtype::Bf16;
            let case = generate(&spec).unwrap();
            let path = dir.path().join("case.safetensors");
            case.write(&path).unwrap();

            let got = Impl::chunk(16)
                .unwrap()
                .compute(&case, Compute::F64)
                .unwrap();
            let mut cand = Case::new(case.meta.clone());
            for (name, t) in got.into_iter().filter(|(n, _)| n != "dh0") {
                match name.as_str() {
                    "dv" => cand.insert(&name, t.mapv(|v| v * 1.01), Dtype::F64),
                    "o" => cand.insert(&name, t, Dtype::F32),
                    _ => cand.insert(&name, t, Dtype::F64),
                }
            }
            let cpath = dir.path().join("cand.safetensors");
            cand.write(&cpath).unwrap();
            let c = cpath.to_str().unwrap();

            for flags in [
                vec!["--candidate", c],
                vec!["--candidate", c, "--forward-only"],
                vec!["--candidate", c, "--allow-partial"],
                vec!["--impl", "chunk", "--chunk-size", "16"],
                vec!["--impl", "cp", "--world", "4", "--allow-partial"],
            ] {
                let a = args(&path, &flags);
                let whole = go(&a).unwrap();
                let file = HeadFile::open(&path, 0).unwrap().unwrap();
                let file = file.with_heads_per_block(2);
                let cand = file.candidate(&cpath).unwrap().unwrap();
                let cand = a.candidate.as_ref().map(|_| &cand);
                let streamed = streamed(&a, &file, cand).unwrap();
                assert_same(&streamed, &whole);
            }
        }
    }

    /// A candidate stating other math options than the case is refused in
    /// head blocks as whole.
    #[test]
    fn a_candidate_with_other_options_is_refused_in_head_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = GenSpec::new(Op::Kda);
        spec.shape = Some(vec![1, 16, 2, 2, 8, 4]);
        spec.gate = Gate::Kda;
        spec.expected = true;
        let case = generate(&spec).unwrap();
        let path = dir.path().join("case.safetensors");
        case.write(&path).unwrap();
        spec.gate = Gate::None;
        let other = generate(&spec).unwrap();
        let cpath = dir.path().join("cand.safetensors");
        other.write(&cpath).unwrap();
        let a = args(&path, &["--candidate", cpath.to_str().unwrap()]);
        let whole = go(&a).unwrap_err().to_string();
        let file = HeadFile::open(&path, 0).unwrap().unwrap();
        let cand = file.candidate(&cpath).unwrap().unwrap();
        let e = streamed(&a, &file, Some(&cand)).unwrap_err().to_string();
        assert!(
            whole.contains("gate") && e.contains("gate"),
            "{whole} / {e}"
        );
        assert!(e.contains("heads 0..2"), "{e}");
    }
}
