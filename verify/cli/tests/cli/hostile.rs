//! Hostile inputs and honest flags: special-file destinations, symlinks,
//! interrupted writes, diagnose failing where verify fails, overflowing
//! shapes, the memory estimate, unstable defaults, a reference that
//! overflows, flags that cannot apply, and partial checks.

use super::common::{code, deltaref, run_ok, s};

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use deltaref_verify::case::{Case, Dtype};

fn gen(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let p = dir.join(name);
    let mut args = vec!["gen", "--op", "kda", "--out", s(&p)];
    args.extend(extra);
    run_ok(&args);
    p
}

/// `(rc, stderr)`, asserting exit 2 and that stderr names every `needle`.
fn refused(args: &[&str], needles: &[&str]) -> String {
    let (rc, out, err) = code(args);
    assert_eq!(rc, 2, "{args:?}: rc {rc}\n{out}\n{err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: `{n}` not in: {err}");
    }
    err
}

#[test]
fn writes_refuse_special_files_and_name_their_kind() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let sock = dir.path().join("sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    for (path, kind) in [
        (fifo.as_path(), "FIFO"),
        (sock.as_path(), "socket"),
        (sub.as_path(), "directory"),
        (Path::new("/dev/null"), "character device"),
    ] {
        refused(&["gen", "--op", "kda", "--out", s(path)], &[s(path), kind]);
        let m = std::fs::symlink_metadata(path).unwrap();
        assert!(!m.is_file(), "{path:?} was replaced by a regular file");
    }
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
    // Every other writer goes through the same check.
    let case = gen(dir.path(), "c.safetensors", &["--expected"]);
    refused(&["run", "--case", s(&case), "--out", s(&fifo)], &["FIFO"]);
    refused(&["fixtures", "--out", s(&sock)], &["cannot write"]);
    refused(
        &["diagnose", "--case", s(&case), "--plot", s(&sub)],
        &["directory"],
    );
}

#[test]
fn writes_go_through_symlinks_and_failures_say_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let real = gen(dir.path(), "real.safetensors", &["--seed", "1"]);
    let link = dir.path().join("link.safetensors");
    std::os::unix::fs::symlink("real.safetensors", &link).unwrap();
    gen(dir.path(), "link.safetensors", &["--seed", "2"]);
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(Case::read(&real).unwrap().meta.seed, Some(2));
    // A dangling link is refused, not replaced.
    let dangling = dir.path().join("dangling.safetensors");
    std::os::unix::fs::symlink("nowhere/x.safetensors", &dangling).unwrap();
    refused(
        &["gen", "--op", "kda", "--out", s(&dangling)],
        &["cannot write", "symlink"],
    );
    let missing = dir.path().join("no/such/dir/x.safetensors");
    refused(
        &["gen", "--op", "kda", "--out", s(&missing)],
        &["cannot write"],
    );
}

fn temps(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect()
}

#[test]
fn interrupted_writes_remove_their_temporary_file() {
    for signal in ["-INT", "-TERM"] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("x.safetensors");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_deltaref"))
            .args(["gen", "--op", "kda", "--out", s(&out)])
            .env("DELTAREF_TEST_WRITE_PAUSE_MS", "30000")
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while temps(dir.path()).is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "no temporary file appeared"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let kill = std::process::Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
        let status = child.wait().unwrap();
        assert!(!status.success(), "{signal}: {status:?}");
        assert_eq!(temps(dir.path()), Vec::<String>::new(), "{signal}");
        assert!(!out.exists(), "{signal}: the destination was written");
    }
}

#[test]
fn diagnose_fails_where_verify_fails() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen(
        dir.path(),
        "c.safetensors",
        &["--expected", "--initial-state"],
    );
    let good = dir.path().join("good.safetensors");
    run_ok(&["run", "--case", s(&case), "--out", s(&good)]);
    let full = Case::read(&good).unwrap();
    let variant = |name: &str, edit: &dyn Fn(&mut Case)| {
        let mut c = full.clone();
        edit(&mut c);
        let p = dir.path().join(name);
        c.write(&p).unwrap();
        p
    };
    let missing = variant("missing.safetensors", &|c| {
        c.tensors.remove("dk");
        c.dtypes.remove("dk");
    });
    // A port writing [B,H,T,K] instead of FLA's [B,T,H,K].
    let transposed = variant("transposed.safetensors", &|c| {
        let dq = c.tensors["dq"].clone().permuted_axes(vec![0, 2, 1, 3]);
        c.insert("dq", dq.as_standard_layout().to_owned(), Dtype::F64);
    });
    let empty = variant("empty.safetensors", &|c| {
        for n in c.meta.op.results() {
            c.tensors.remove(n);
            c.dtypes.remove(n);
        }
    });
    for (cand, why) in [
        (&missing, "missing"),
        (&transposed, "shape"),
        (&empty, "missing"),
    ] {
        let (rc_v, out, _) = code(&["verify", "--case", s(&case), "--candidate", s(cand)]);
        assert_eq!(rc_v, 1, "verify {cand:?}: {out}");
        let (rc_d, out, err) = code(&["diagnose", "--case", s(&case), "--candidate", s(cand)]);
        assert_eq!(rc_d, 1, "diagnose {cand:?}: {out}{err}");
        assert!(err.contains(why), "{cand:?}: {err}");
    }
    let (rc, out, err) = code(&["diagnose", "--case", s(&case), "--candidate", s(&good)]);
    assert_eq!(rc, 0, "{out}{err}");
}

#[test]
fn overflowing_shapes_and_lengths_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.safetensors");
    for (flag, value) in [
        ("--shape", "1,18446744073709551615,1,1,1,1"),
        ("--shape", "4294967296,4294967296,2,2,2,2"),
        ("--lengths", "9223372036854775808"),
        ("--lengths", "18446744073709551615,1"),
    ] {
        refused(
            &["gen", "--op", "kda", flag, value, "--out", s(&out)],
            &[flag],
        );
    }
    for args in [
        ["--op", "dplr", "--shape", "1,9223372036854775807,3,3,3"],
        ["--op", "token_shift", "--shape", "3,6148914691236517206,1"],
    ] {
        let mut a = vec!["gen"];
        a.extend(args);
        a.extend(["--out", s(&out)]);
        let (rc, _, err) = code(&a);
        assert_eq!(rc, 2, "{a:?}: {err}");
    }
}

#[test]
fn memory_estimate_refuses_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.safetensors");
    let err = refused(
        &[
            "gen",
            "--op",
            "kda",
            "--shape",
            "1,100000000,4,4,128,128",
            "--out",
            s(&out),
        ],
        &["needs about", "TiB", "--max-memory"],
    );
    assert!(!out.exists(), "{err}");
    // --max-memory sets the budget both ways.
    refused(
        &[
            "--max-memory",
            "64K",
            "gen",
            "--op",
            "kda",
            "--out",
            s(&out),
        ],
        &["needs about", "64.0 KiB"],
    );
    run_ok(&["gen", "--op", "kda", "--max-memory", "1G", "--out", s(&out)]);
    refused(
        &[
            "verify",
            "--max-memory",
            "100K",
            "--case",
            s(&out),
            "--impl",
            "chunk",
        ],
        &["needs about"],
    );
    refused(
        &[
            "gen",
            "--op",
            "kda",
            "--max-memory",
            "lots",
            "--out",
            s(&out),
        ],
        &["--max-memory"],
    );
}

#[test]
fn special_and_inconsistent_case_files_are_refused_before_reading() {
    refused(
        &["run", "--case", "/dev/zero"],
        &["/dev/zero", "not a regular file"],
    );
    refused(&["verify", "--case", "/tmp"], &["directory"]);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("h.safetensors");
    let mut bytes = 1u64.wrapping_shl(62).to_le_bytes().to_vec();
    bytes.extend(b"{}");
    std::fs::write(&p, &bytes).unwrap();
    refused(&["run", "--case", s(&p)], &["header length"]);
}

fn max_abs(c: &Case, name: &str) -> f64 {
    c.tensors[name].iter().fold(0.0f64, |m, v| m.max(v.abs()))
}

#[test]
fn default_kda_cases_are_stable_with_unit_norm_keys() {
    let dir = tempfile::tempdir().unwrap();
    let p = gen(
        dir.path(),
        "c.safetensors",
        &["--shape", "1,1024,4,4,64,64", "--expected"],
    );
    let c = Case::read(&p).unwrap();
    for row in c.tensors["k"].rows() {
        let n = row.iter().map(|v| v * v).sum::<f64>().sqrt();
        assert!((n - 1.0).abs() < 1e-12, "key norm {n}");
    }
    // Bounded state: |o| stays of the order of ‖v‖ (raw keys gave 1e148).
    assert!(max_abs(&c, "o") < 1e3, "{}", max_abs(&c, "o"));
    for (n, t) in c.results() {
        assert!(t.iter().all(|v| v.is_finite()), "{n}");
    }
    // With in-kernel l2norm the drawn keys stay raw normals.
    let p = gen(dir.path(), "l2.safetensors", &["--l2norm"]);
    let c = Case::read(&p).unwrap();
    let n0 = c.tensors["k"]
        .rows()
        .into_iter()
        .next()
        .unwrap()
        .iter()
        .map(|v| v * v)
        .sum::<f64>();
    assert!((n0.sqrt() - 1.0).abs() > 1e-3, "{n0}");
}

#[test]
fn gen_refuses_to_store_a_non_finite_truth() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.safetensors");
    refused(
        &[
            "gen",
            "--op",
            "kda",
            "--scale",
            "1e308",
            "--expected",
            "--out",
            s(&out),
        ],
        &["oracle's `", "non-finite", "flat index"],
    );
    assert!(!out.exists());
}

#[test]
fn an_overflowing_reference_is_reported_as_such() {
    let dir = tempfile::tempdir().unwrap();
    // Packed (B = 1), so that `cp` can split it: its CP run comes before
    // its reference.
    let gate = ["--gate", "kda", "--lengths", "64,64"];
    let p = gen(dir.path(), "c.safetensors", &gate);
    let mut c = Case::read(&p).unwrap();
    let a_log = c.tensors["A_log"].mapv(|_| 1e308);
    c.insert("A_log", a_log, Dtype::F64);
    c.write(&p).unwrap();
    let cand = dir.path().join("cand.safetensors");
    // The candidate carries the case's own inputs (a candidate with other
    // inputs is refused before any comparison).
    let mut good = Case::read(&p).unwrap();
    good.meta.seed = None;
    good.write(&cand).unwrap();
    for args in [
        vec!["verify", "--case", s(&p), "--candidate", s(&cand)],
        vec!["verify", "--case", s(&p), "--impl", "chunk"],
        vec!["diagnose", "--case", s(&p), "--candidate", s(&cand)],
        vec!["cp", "--case", s(&p), "--world", "2"],
    ] {
        refused(
            &args,
            &["oracle's result is non-finite", "not a candidate's fault"],
        );
    }
    refused(&["run", "--case", s(&p)], &["non-finite", "overflow"]);
}

#[test]
fn flags_that_cannot_apply_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let kda = gen(
        dir.path(),
        "k.safetensors",
        &["--expected", "--lengths", "64,64"],
    );
    let ts = dir.path().join("t.safetensors");
    run_ok(&[
        "gen",
        "--op",
        "token_shift",
        "--expected",
        "--lengths",
        "30,34",
        "--out",
        s(&ts),
    ]);
    let k = s(&kda);
    let t = s(&ts);
    for (args, needle) in [
        (
            vec!["cp", "--case", k, "--world", "2", "--impl", "gpu-cp"],
            "gpu-cp",
        ),
        (
            vec!["cp", "--case", k, "--world", "2", "--impl", "chunk"],
            "--impl chunk",
        ),
        (
            vec![
                "verify",
                "--case",
                t,
                "--impl",
                "cp",
                "--world",
                "2",
                "--precision",
                "drop-merged-state",
            ],
            "this case's op is token_shift, where it cannot apply",
        ),
        (
            vec![
                "verify",
                "--case",
                k,
                "--impl",
                "chunk",
                "--chunk-size",
                "0",
            ],
            "--chunk-size",
        ),
        (
            vec![
                "verify",
                "--case",
                k,
                "--impl",
                "naive",
                "--chunk-size",
                "32",
            ],
            "--chunk-size",
        ),
        (
            vec![
                "verify",
                "--case",
                k,
                "--impl",
                "cp",
                "--world",
                "2",
                "--cp-engine",
                "naive",
                "--chunk-size",
                "32",
            ],
            "--chunk-size",
        ),
        (
            vec!["verify", "--case", k, "--max-ratio", "nan"],
            "--max-ratio",
        ),
        (vec!["verify", "--case", k, "--max-ratio=-1"], "--max-ratio"),
        (
            vec!["cp", "--case", k, "--world", "2", "--max-ratio", "inf"],
            "--max-ratio",
        ),
        (vec!["diagnose", "--case", k, "--band=-0.1"], "--band"),
        (
            vec!["bench", "--case", k, "--impls", "naive", "--reps", "0"],
            "--reps",
        ),
        (
            vec!["cp", "--case", k, "--intra", "--num-sms", "0"],
            "--num-sms",
        ),
        (
            vec!["cp", "--case", k, "--world", "2", "--num-heads", "4"],
            "--intra",
        ),
    ] {
        refused(&args, &[needle]);
    }
    let out = dir.path().join("x.safetensors");
    for lb in ["-1000", "0", "-5.5"] {
        refused(
            &[
                "gen",
                "--op",
                "kda",
                "--gate",
                "lowerbound",
                "--lower-bound",
                lb,
                "--out",
                s(&out),
            ],
            &["[-5, 0)"],
        );
    }
    run_ok(&[
        "gen",
        "--op",
        "kda",
        "--gate",
        "lowerbound",
        "--lower-bound",
        "-5",
        "--out",
        s(&out),
    ]);
}

#[test]
fn cp_honours_compute_and_precision_and_intra_defaults_to_the_case_heads() {
    let dir = tempfile::tempdir().unwrap();
    let kda = gen(
        dir.path(),
        "k.safetensors",
        &["--shape", "1,256,1,4,16,16", "--l2norm"],
    );
    let k = s(&kda);
    let exact = run_ok(&["cp", "--case", k, "--world", "2"]);
    assert!(exact.contains("per-rank table"), "{exact}");
    // f32 is honoured: the errors are single-precision rounding, not 1e-16.
    let (rc, out, err) = code(&[
        "cp",
        "--case",
        k,
        "--world",
        "2",
        "--compute",
        "f32",
        "--max-ratio",
        "1e-3",
    ]);
    assert_eq!(rc, 0, "{out}{err}");
    assert!(out.contains("compute f32"), "{out}");
    let (rc, out, _) = code(&["cp", "--case", k, "--world", "2", "--compute", "f32"]);
    assert_eq!(rc, 1, "f32 must miss the 1e-10 bar: {out}");
    // A CP fault preset is applied (the merged state dropped: percent errors).
    let (rc, out, _) = code(&[
        "cp",
        "--case",
        k,
        "--world",
        "2",
        "--precision",
        "drop-merged-state",
    ]);
    assert_eq!(rc, 1, "{out}");
    // --intra uses the case's HV = 64 heads: FLA's subseq_len then differs
    // from the one-head value (4 pieces of ~T/4 against 2048 tokens).
    let wide = gen(
        dir.path(),
        "w.safetensors",
        &["--shape", "1,8208,1,64,4,4", "--l2norm"],
    );
    let intra = |extra: &[&str]| {
        let mut a = vec!["cp", "--case", s(&wide), "--intra", "--chunk-size", "16"];
        a.extend(extra);
        run_ok(&a)
    };
    let default = intra(&[]);
    assert_eq!(default, intra(&["--num-heads", "64"]));
    let one = intra(&["--num-heads", "1"]);
    assert_ne!(default, one);
}

#[test]
fn partial_truth_is_listed_and_fails_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen(dir.path(), "c.safetensors", &["--expected"]);
    let cand = dir.path().join("cand.safetensors");
    run_ok(&["run", "--case", s(&case), "--out", s(&cand)]);
    // The case keeps only `o`; the candidate's gradients are garbage.
    let mut c = Case::read(&case).unwrap();
    for n in c.meta.op.results() {
        if n != "o" {
            c.tensors.remove(n);
            c.dtypes.remove(n);
        }
    }
    c.write(&case).unwrap();
    let mut g = Case::read(&cand).unwrap();
    let garbage = g.tensors["dq"].mapv(|v| v * 1e3 + 1.0);
    g.insert("dq", garbage, Dtype::F64);
    g.write(&cand).unwrap();
    let (rc, out, _) = code(&["verify", "--case", s(&case), "--candidate", s(&cand)]);
    assert_eq!(rc, 1, "{out}");
    assert!(out.contains("unchecked") && out.contains("dq"), "{out}");
    let (rc, out, _) = code(&[
        "verify",
        "--case",
        s(&case),
        "--candidate",
        s(&cand),
        "--allow-partial",
    ]);
    assert_eq!(rc, 0, "{out}");
    assert!(
        out.contains("unchecked") && out.contains("accepted"),
        "{out}"
    );
    let (rc, _, err) = code(&["diagnose", "--case", s(&case), "--candidate", s(&cand)]);
    assert_eq!(rc, 1, "{err}");
    assert!(err.contains("unchecked"), "{err}");
}

/// A candidate without `final_state` (FLA's CP returns none) fails on it;
/// `--allow-partial` lists it as unchecked and still checks the rest.
#[test]
fn a_candidate_lacking_a_tensor_passes_only_with_allow_partial() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen(dir.path(), "c.safetensors", &["--expected"]);
    let cand = dir.path().join("cand.safetensors");
    run_ok(&["run", "--case", s(&case), "--out", s(&cand)]);
    let mut g = Case::read(&cand).unwrap();
    g.tensors.remove("final_state");
    g.dtypes.remove("final_state");
    g.write(&cand).unwrap();
    let verify = |extra: &[&str]| {
        let mut args = vec!["verify", "--case", s(&case), "--candidate", s(&cand)];
        args.extend_from_slice(extra);
        code(&args)
    };
    let (rc, out, _) = verify(&[]);
    assert_eq!(rc, 1, "{out}");
    assert!(out.contains("missing from the candidate"), "{out}");
    let (rc, out, _) = verify(&["--allow-partial"]);
    assert_eq!(rc, 0, "{out}");
    assert!(
        out.contains("unchecked") && out.contains("final_state") && !out.contains("FAIL"),
        "{out}"
    );
    // The rest is still checked: a wrong `dq` fails even with --allow-partial.
    let wrong = g.tensors["dq"].mapv(|v| v * 1.5);
    g.insert("dq", wrong, Dtype::F64);
    g.write(&cand).unwrap();
    let (rc, out, _) = verify(&["--allow-partial"]);
    assert_eq!(rc, 1, "{out}");
}

#[test]
fn a_candidate_stating_other_options_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen(
        dir.path(),
        "c.safetensors",
        &["--expected", "--gate", "kda"],
    );
    let cand = dir.path().join("cand.safetensors");
    run_ok(&["run", "--case", s(&case), "--out", s(&cand)]);
    let mut c = Case::read(&cand).unwrap();
    c.meta
        .options
        .insert("use_qk_l2norm_in_kernel".into(), true.into());
    c.meta.options.insert("scale".into(), 0.5.into());
    c.write(&cand).unwrap();
    refused(
        &["verify", "--case", s(&case), "--candidate", s(&cand)],
        &["use_qk_l2norm_in_kernel", "scale", "other options"],
    );
    refused(
        &["diagnose", "--case", s(&case), "--candidate", s(&cand)],
        &["use_qk_l2norm_in_kernel"],
    );
    // Options that do not change the math (seed, dtype, CP layout) may differ.
    let mut c = Case::read(&cand).unwrap();
    c.meta
        .options
        .insert("use_qk_l2norm_in_kernel".into(), false.into());
    c.meta.options.remove("scale");
    c.meta.seed = Some(99);
    c.meta.cp = Some(deltaref_verify::case::CpLayout::World(
        2,
        deltaref::cp::Layout::Contiguous,
    ));
    c.write(&cand).unwrap();
    run_ok(&["verify", "--case", s(&case), "--candidate", s(&cand)]);
}

#[test]
fn fixtures_check_fails_on_extra_files_and_a_missing_directory() {
    let dir = tempfile::tempdir().unwrap();
    let set = dir.path().join("set");
    run_ok(&["fixtures", "--out", s(&set)]);
    run_ok(&["fixtures", "--check", s(&set)]);
    std::fs::write(set.join("stray.safetensors"), b"x").unwrap();
    let (rc, _, err) = code(&["fixtures", "--check", s(&set)]);
    assert_eq!(rc, 1, "{err}");
    assert!(
        err.contains("stray.safetensors") && err.contains("extra"),
        "{err}"
    );
    refused(
        &["fixtures", "--check", s(&dir.path().join("absent"))],
        &["absent", "cannot read"],
    );
}

#[test]
fn verify_impl_recomputes_a_missing_truth() {
    let dir = tempfile::tempdir().unwrap();
    let case = gen(dir.path(), "c.safetensors", &["--lengths", "40,24"]);
    let out = run_ok(&["verify", "--case", s(&case), "--impl", "chunk"]);
    assert!(out.contains("f64 oracle") && out.contains("pass"), "{out}");
    let (rc, out, _) = code(&[
        "verify",
        "--case",
        s(&case),
        "--impl",
        "cp",
        "--world",
        "2",
        "--precision",
        "drop-merged-state",
    ]);
    assert_eq!(rc, 1, "{out}");
}

#[test]
fn quiet_is_accepted_everywhere_and_progress_stays_off_pipes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.safetensors");
    let o = deltaref()
        .args(["gen", "--op", "kda", "--expected", "--out", s(&out)])
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(
        o.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    run_ok(&["--quiet", "verify", "--case", s(&out)]);
    run_ok(&["verify", "-q", "--case", s(&out)]);
}

#[test]
fn intra_with_a_huge_subseq_len_splits_nothing() {
    // Found by the fuzzer: 3·subseq_len overflowed.
    let dir = tempfile::tempdir().unwrap();
    let kda = gen(dir.path(), "k.safetensors", &["--lengths", "10,14"]);
    let out = run_ok(&[
        "cp",
        "--case",
        s(&kda),
        "--intra",
        "--subseq-len",
        "18446744073709551615",
    ]);
    assert!(out.contains("pass") && !out.contains("FAIL"), "{out}");
}
