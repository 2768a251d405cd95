//! Case files: round trips, dtype handling, determinism, and every way a file
//! can be broken — each gives a clear error, none panics.

use deltaref::gates::Gate;
use deltaref_verify::case::{Case, CaseError, Dtype, Op};
use deltaref_verify::generate::{generate, GenSpec};
use deltaref_verify::impls::{Compute, Impl};
use deltaref_verify::outputs::Tensors;
use deltaref_verify::report::VerifyReport;

fn spec(op: Op) -> GenSpec {
    GenSpec {
        lengths: Some(vec![9, 0, 1, 14]),
        initial_state: true,
        expected: true,
        seed: 5,
        ..GenSpec::new(op)
    }
}

fn kda_variants() -> Vec<GenSpec> {
    let base = spec(Op::Kda);
    vec![
        base.clone(),
        GenSpec {
            gate: Gate::Kda,
            use_qk_l2norm_in_kernel: true,
            ..base.clone()
        },
        GenSpec {
            gate: Gate::LowerBound { lower_bound: -5.0 },
            use_beta_sigmoid_in_kernel: true,
            allow_neg_eigval: true,
            ..base.clone()
        },
        GenSpec {
            lengths: None,
            shape: Some(vec![2, 11, 1, 2, 4, 3]),
            initial_state: false,
            scale: Some(0.3),
            ..base
        },
    ]
}

fn tmp(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let p = dir.path().join(name);
    (dir, p)
}

#[test]
fn write_read_recompute_round_trip_is_exact() {
    let mut all = kda_variants();
    all.push(spec(Op::Dplr));
    all.push(spec(Op::TokenShift));
    for s in all {
        let case = generate(&s).expect("generate");
        let (_d, path) = tmp("c.safetensors");
        case.write(&path).expect("write");
        let back = Case::read(&path).expect("read");
        assert_eq!(back, case, "{s:?}");
        let got = Impl::NAIVE.compute(&back, Compute::F64).expect("compute");
        let report = VerifyReport::new("c", "case file", "naive", &back.results(), &got, 5e-3);
        assert!(report.pass, "{report}");
        assert!(
            report.rows.iter().all(|r| r.norm_ratio.unwrap() <= 1e-15),
            "{report}"
        );
        assert_eq!(report.rows.len(), back.results().len());
    }
}

#[test]
fn same_seed_gives_identical_bytes() {
    let s = kda_variants()[2].clone();
    let (_d1, p1) = tmp("a.safetensors");
    let (_d2, p2) = tmp("b.safetensors");
    generate(&s).unwrap().write(&p1).unwrap();
    generate(&s).unwrap().write(&p2).unwrap();
    assert_eq!(std::fs::read(&p1).unwrap(), std::fs::read(&p2).unwrap());
    let (_d3, p3) = tmp("c.safetensors");
    generate(&GenSpec { seed: 6, ..s })
        .unwrap()
        .write(&p3)
        .unwrap();
    assert_ne!(std::fs::read(&p1).unwrap(), std::fs::read(&p3).unwrap());
}

/// tf32 and e5m2 are precision stages' roundings: a case holding one cannot
/// be written, and the error names the tensor and the file dtypes.
#[test]
fn a_dtype_no_file_stores_is_refused_on_write() {
    let mut case = generate(&spec(Op::Kda)).expect("generate");
    let q = case.tensors["q"].clone();
    case.insert("q", q, Dtype::Tf32);
    let e = case.to_bytes().unwrap_err().to_string();
    assert!(
        e.contains("tensor `q`: dtype tf32 is not allowed here (allowed: f64, f32, bf16 or f16)"),
        "{e}"
    );
    let (_d, path) = tmp("c.safetensors");
    assert!(case.write(&path).is_err());
    assert!(!path.exists());
}

#[test]
fn low_precision_inputs_are_stored_rounded_and_truth_uses_them() {
    for dt in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
        let case = generate(&GenSpec {
            dtype: dt,
            ..spec(Op::Kda)
        })
        .expect("generate");
        assert_eq!(case.dtypes["q"], dt);
        assert_eq!(case.dtypes["o"], Dtype::F64);
        let (_d, path) = tmp("c.safetensors");
        case.write(&path).unwrap();
        let back = Case::read(&path).unwrap();
        assert!(back.tensors["q"].iter().all(|&v| dt.round(v) == v));
        let got = Impl::NAIVE.compute(&back, Compute::F64).unwrap();
        assert_eq!(
            got["o"], back.tensors["o"],
            "truth must be computed from the stored inputs"
        );
    }
}

#[test]
fn scaled_candidate_fails_on_exactly_that_tensor() {
    let case = generate(&spec(Op::Kda)).unwrap();
    let mut got = Impl::NAIVE.compute(&case, Compute::F64).unwrap();
    let dk = got.get_mut("dk").unwrap();
    dk.mapv_inplace(|v| v * 1.01);
    let report = VerifyReport::new("c", "case file", "scaled", &case.results(), &got, 5e-3);
    let failing: Vec<&str> = report
        .rows
        .iter()
        .filter(|r| !r.pass)
        .map(|r| r.tensor.as_str())
        .collect();
    assert_eq!(failing, vec!["dk"]);
    // Scaling by 1.01 gives diff = 0.01·ref, so norm_ratio = 0.01·rms/(rms + 1e-8).
    let r = &case.tensors["dk"];
    let rms = (r.iter().map(|v| v * v).sum::<f64>() / r.len() as f64).sqrt();
    let want = 0.01 * rms / (rms + 1e-8);
    let nr = report
        .rows
        .iter()
        .find(|r| r.tensor == "dk")
        .unwrap()
        .norm_ratio
        .unwrap();
    assert!((nr - want).abs() < 1e-12, "{nr} vs {want}");
}

#[test]
fn missing_candidate_tensor_is_a_failure() {
    let case = generate(&spec(Op::Dplr)).unwrap();
    let mut got = Impl::NAIVE.compute(&case, Compute::F64).unwrap();
    got.remove("dgk");
    let report = VerifyReport::new("c", "case file", "partial", &case.results(), &got, 5e-3);
    assert!(!report.pass);
    let row = report.rows.iter().find(|r| r.tensor == "dgk").unwrap();
    assert!(!row.pass && row.problem.as_deref() == Some("missing from the candidate"));
}

/// A safetensors file from a raw header and data (to build broken files).
fn raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    b
}

fn read_err(bytes: &[u8]) -> String {
    match Case::from_bytes(bytes, "test.safetensors") {
        Ok(_) => panic!("broken file accepted"),
        Err(e) => e.to_string(),
    }
}

fn good_bytes() -> Vec<u8> {
    let case = generate(&GenSpec {
        lengths: Some(vec![3, 2]),
        ..GenSpec::new(Op::TokenShift)
    })
    .unwrap();
    let (_d, path) = tmp("g.safetensors");
    case.write(&path).unwrap();
    std::fs::read(&path).unwrap()
}

const META_TS: &str = r#""__metadata__":{"case":"{\"op\":\"token_shift\"}"}"#;

#[test]
fn truncated_and_malformed_files_are_rejected() {
    let good = good_bytes();
    assert!(Case::from_bytes(&good, "g").is_ok());
    let e = read_err(&good[..5]);
    assert!(e.contains("too short"), "{e}");
    let e = read_err(&good[..good.len() - 7]);
    assert!(e.contains("truncated") || e.contains("shorter"), "{e}");
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&(good.len() as u64 * 4).to_le_bytes());
    let e = read_err(&huge);
    assert!(e.contains("larger than the file"), "{e}");
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = read_err(&huge);
    assert!(e.contains("implausibly large"), "{e}");
    let e = read_err(&raw("{not json", &[]));
    assert!(e.contains("not valid JSON"), "{e}");
}

#[test]
fn inconsistent_byte_length_is_rejected() {
    // x claims [1,2,2] f64 = 32 bytes but the offsets give 24.
    let h = format!(
        r#"{{{META_TS},"x":{{"dtype":"F64","shape":[1,2,2],"data_offsets":[0,24]}},"dy":{{"dtype":"F64","shape":[1,2,2],"data_offsets":[24,56]}}}}"#
    );
    let e = read_err(&raw(&h, &[0u8; 56]));
    assert!(
        e.contains("x") || e.contains("byte length") || e.contains("offset"),
        "{e}"
    );
}

#[test]
fn duplicate_names_are_rejected() {
    let h = format!(
        r#"{{{META_TS},"x":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[0,8]}},"x":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[8,16]}}}}"#
    );
    let e = read_err(&raw(&h, &[0u8; 16]));
    assert!(e.contains("duplicate tensor name `x`"), "{e}");
}

fn one_x(meta: &str) -> Vec<u8> {
    let h = format!(
        r#"{{{meta}"x":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[0,8]}},"dy":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[8,16]}}}}"#
    );
    raw(&h, &[0u8; 16])
}

#[test]
fn metadata_problems_name_the_key() {
    let e = read_err(&one_x(""));
    assert!(e.contains("no `case` entry"), "{e}");
    let e = read_err(&one_x(r#""__metadata__":{"case":"{\"op\":\"gla\"}"},"#));
    assert!(e.contains("unknown op \"gla\""), "{e}");
    let e = read_err(&one_x(
        r#""__metadata__":{"case":"{\"op\":\"token_shift\",\"chunksize\":64}"},"#,
    ));
    assert!(e.contains("unknown key `chunksize`"), "{e}");
    let e = read_err(&one_x(
        r#""__metadata__":{"case":"{\"op\":\"token_shift\",\"chunk_size\":\"64\"}"},"#,
    ));
    assert!(e.contains("key `chunk_size`"), "{e}");
    let e = read_err(&one_x(
        r#""__metadata__":{"case":"{\"op\":\"token_shift\",\"use_qk_l2norm_in_kernel\":true}"},"#,
    ));
    assert!(e.contains("key `use_qk_l2norm_in_kernel`"), "{e}");
    let e = read_err(&one_x(r#""__metadata__":{"case":"{\"op\":"},"#));
    assert!(e.contains("not valid JSON"), "{e}");
    let e = read_err(&one_x(
        r#""__metadata__":{"case":"{\"op\":\"token_shift\",\"cp\":{\"world\":2,\"rank\":1}}"},"#,
    ));
    assert!(e.contains("cp.rank"), "{e}");
    let e = read_err(&one_x(
        r#""__metadata__":{"case":"{\"op\":\"token_shift\",\"cp\":{\"world\":2,\"layout\":\"ring\"}}"},"#,
    ));
    assert!(e.contains("cp.layout") && e.contains("zigzag"), "{e}");
    let e = read_err(&one_x(
        r#""__metadata__":{"case":"{\"op\":\"token_shift\",\"cp\":{\"cuts\":[1],\"layout\":\"zigzag\"}}"},"#,
    ));
    assert!(
        e.contains("cp.layout") && e.contains("not to `cuts`"),
        "{e}"
    );
}

#[test]
fn tensor_problems_name_the_tensor() {
    // Integer dtype for a float tensor.
    let h = format!(
        r#"{{{META_TS},"x":{{"dtype":"I32","shape":[1,1,1],"data_offsets":[0,4]}},"dy":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[4,12]}}}}"#
    );
    let e = read_err(&raw(&h, &[0u8; 12]));
    assert!(
        e.contains("`x`") && e.contains("not a supported float type"),
        "{e}"
    );
    // An unknown tensor name.
    let h = format!(
        r#"{{{META_TS},"x":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[0,8]}},"d_y":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[8,16]}}}}"#
    );
    let e = read_err(&raw(&h, &[0u8; 16]));
    assert!(
        e.contains("`d_y`") && e.contains("not a tensor of op token_shift"),
        "{e}"
    );
    // Shapes inconsistent across tensors: dy [1,2,1] against x [1,1,1].
    let h = format!(
        r#"{{{META_TS},"x":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[0,8]}},"dy":{{"dtype":"F64","shape":[1,2,1],"data_offsets":[8,24]}}}}"#
    );
    let e = read_err(&raw(&h, &[0u8; 24]));
    assert!(e.contains("`dy`") && e.contains("expected"), "{e}");
    // cu_seqlens stored as float.
    let h = format!(
        r#"{{{META_TS},"x":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[0,8]}},"dy":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[8,16]}},"cu_seqlens":{{"dtype":"F64","shape":[2],"data_offsets":[16,32]}}}}"#
    );
    let e = read_err(&raw(&h, &[0u8; 32]));
    assert!(e.contains("`cu_seqlens`") && e.contains("int64"), "{e}");
    // NaN in an input.
    let mut data = f64::NAN.to_le_bytes().to_vec();
    data.extend_from_slice(&[0u8; 8]);
    let e = read_err(&one_x_with(&data));
    assert!(e.contains("`x`") && e.contains("non-finite"), "{e}");
    // A missing required input.
    let h = format!(r#"{{{META_TS},"dy":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[0,8]}}}}"#);
    let e = read_err(&raw(&h, &[0u8; 8]));
    assert!(e.contains("missing tensor `x`"), "{e}");
}

/// Every op's cases are checked where their tensors are (no copy of the
/// inputs): a bad input, upstream gradient or stored result is refused by
/// name, as the oracle refuses it.
#[test]
fn cases_are_checked_in_place() {
    // Per op: the spec, tensors to make non-finite (an input, an upstream
    // gradient, stored results), tensors to give a wrong shape, and a
    // required input to drop.
    let ops: [(GenSpec, &[&str], &[&str], &str); 5] = [
        (
            spec(Op::Kda),
            &["g", "q", "do", "dq", "o"],
            &["k", "v", "dk"],
            "beta",
        ),
        (
            spec(Op::Dplr),
            &["gk", "q", "do", "dq", "o"],
            &["k", "v", "dk"],
            "b",
        ),
        (
            GenSpec {
                gate: Gate::Kda,
                state_v_first: true,
                ..spec(Op::Gdn)
            },
            &["g", "A_log", "initial_state", "dht", "dg"],
            &["k", "beta", "dht", "final_state"],
            "A_log",
        ),
        (
            spec(Op::TokenShift),
            &["x", "cache", "dy", "dfinal_cache", "dx", "final_cache"],
            &["cache", "dfinal_cache", "dcache"],
            "x",
        ),
        (
            GenSpec {
                bias: true,
                ..spec(Op::CausalConv1d)
            },
            &["x", "weight", "bias", "dy", "dweight", "y"],
            &["weight", "bias", "initial_state", "dbias"],
            "weight",
        ),
    ];
    for (gen, non_finite, misshapen, required) in ops {
        let op = gen.op;
        let good = generate(&gen).expect("generated");
        good.validate().expect("a generated case is valid");
        // The error of `good` broken by `f`, which must name `name`.
        let broken = |name: &str, f: &dyn Fn(&mut Case)| -> String {
            let mut c = good.clone();
            f(&mut c);
            let e = c.validate().expect_err(name).to_string();
            assert!(e.contains(&format!("`{name}`")), "{op:?} {name}: {e}");
            e
        };
        for &name in non_finite {
            let e = broken(name, &|c: &mut Case| {
                let t = c.tensors.get_mut(name).expect(name);
                let last = t.len() - 1;
                t.as_slice_mut().expect("standard layout")[last] = f64::NAN;
            });
            assert!(e.contains("non-finite"), "{op:?} {name}: {e}");
        }
        for &name in misshapen {
            broken(name, &|c: &mut Case| {
                c.tensors
                    .insert(name.into(), ndarray::ArrayD::zeros(vec![1, 2, 3, 4]));
            });
        }
        let e = broken(required, &|c: &mut Case| {
            c.tensors.remove(required);
        });
        assert!(e.contains("missing"), "{op:?} {required}: {e}");
    }
}

fn one_x_with(data: &[u8]) -> Vec<u8> {
    let h = format!(
        r#"{{{META_TS},"x":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[0,8]}},"dy":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[8,16]}}}}"#
    );
    raw(&h, data)
}

#[test]
fn writing_is_atomic_and_leaves_no_temporary_file() {
    let case = generate(&spec(Op::TokenShift)).unwrap();
    let (dir, path) = tmp("c.safetensors");
    case.write(&path).unwrap();
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    // A write into a missing directory fails cleanly, says so, and creates nothing.
    let bad = dir.path().join("missing").join("c.safetensors");
    let e = case.write(&bad).expect_err("missing directory");
    assert!(matches!(e, CaseError::Write { .. }), "{e}");
    assert!(e.to_string().contains("cannot write"), "{e}");
    assert!(!bad.exists());
}

#[test]
fn offsets_outside_the_data_and_overflowing_shapes_are_rejected() {
    // Offsets past the end of the data.
    let h = format!(
        r#"{{{META_TS},"x":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[0,8]}},"dy":{{"dtype":"F64","shape":[1,1,100],"data_offsets":[8,808]}}}}"#
    );
    let e = read_err(&raw(&h, &[0u8; 16]));
    assert!(e.contains("not a valid safetensors file"), "{e}");
    // A gap between tensors (offsets must tile the data).
    let h = format!(
        r#"{{{META_TS},"x":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[0,8]}},"dy":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[16,24]}}}}"#
    );
    let e = read_err(&raw(&h, &[0u8; 24]));
    assert!(e.contains("not a valid safetensors file"), "{e}");
    // A shape whose element count overflows usize.
    let h = format!(
        r#"{{{META_TS},"x":{{"dtype":"F64","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}},"dy":{{"dtype":"F64","shape":[1,1,1],"data_offsets":[8,16]}}}}"#
    );
    let e = read_err(&raw(&h, &[0u8; 16]));
    assert!(e.contains("not a valid safetensors file"), "{e}");
}

#[test]
fn bad_cu_seqlens_and_gate_metadata_are_rejected() {
    let x = r#""x":{"dtype":"F64","shape":[1,3,1],"data_offsets":[0,24]},"dy":{"dtype":"F64","shape":[1,3,1],"data_offsets":[24,48]}"#;
    let cu = |shape: &str, vals: &[i64]| {
        let h = format!(
            r#"{{{META_TS},{x},"cu_seqlens":{{"dtype":"I64","shape":{shape},"data_offsets":[48,{}]}}}}"#,
            48 + 8 * vals.len()
        );
        let mut data = vec![0u8; 48];
        data.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        raw(&h, &data)
    };
    assert!(Case::from_bytes(&cu("[3]", &[0, 1, 3]), "ok").is_ok());
    let e = read_err(&cu("[1,3]", &[0, 1, 3]));
    assert!(e.contains("`cu_seqlens`") && e.contains("1-D int64"), "{e}");
    // Values inconsistent with T = 3: the reference crate's validation.
    let e = read_err(&cu("[3]", &[0, 2, 4]));
    assert!(e.contains("cu_seqlens"), "{e}");
    assert!(matches!(
        Case::from_bytes(&cu("[3]", &[0, 2, 1]), "t"),
        Err(CaseError::Invalid { .. })
    ));
    let meta = |case: &str| one_x(&format!(r#""__metadata__":{{"case":"{case}"}},"#));
    let e = read_err(&meta(r#"{\"op\":\"kda\",\"gate\":\"sometimes\"}"#));
    assert!(e.contains("unknown gate \"sometimes\""), "{e}");
    let e = read_err(&meta(r#"{\"op\":\"kda\",\"gate\":\"lowerbound\"}"#));
    assert!(e.contains("needs key `lower_bound`"), "{e}");
    let e = read_err(&meta(
        r#"{\"op\":\"kda\",\"gate\":\"kda\",\"lower_bound\":-5}"#,
    ));
    assert!(e.contains("key `lower_bound`"), "{e}");
    let e = read_err(&meta(r#"{\"op\":\"kda\",\"scale\":\"0.25\"}"#));
    assert!(
        e.contains("key `scale` of op kda: invalid type: string \"0.25\", expected f64"),
        "{e}"
    );
    let e = read_err(&meta(
        r#"{\"op\":\"kda\",\"cp\":{\"world\":2,\"cuts\":[3]}}"#,
    ));
    assert!(e.contains("exactly one of `world` or `cuts`"), "{e}");
    let e = read_err(&meta(r#"[\"kda\"]"#));
    assert!(e.contains("must be a JSON object"), "{e}");
    let e = read_err(&meta(r#"{\"op\":\"token_shift\",\"dtype\":\"f8\"}"#));
    assert!(e.contains("unknown dtype \"f8\""), "{e}");
    // tf32 is a precision stage's dtype, not one a file stores.
    let e = read_err(&meta(r#"{\"op\":\"kda\",\"dtype\":\"tf32\"}"#));
    assert!(
        e.contains("key `dtype`: dtype tf32 is not allowed here (allowed: f64, f32, bf16 or f16)"),
        "{e}"
    );
}

/// The results of `case` as a port writes them: f32, no inputs, and no
/// metadata unless `meta` is given.
fn port_candidate(results: &Tensors, meta: Option<&str>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if let Some(m) = meta {
        header.insert("__metadata__".into(), serde_json::json!({ "case": m }));
    }
    let mut data = Vec::new();
    for (name, t) in results {
        let start = data.len();
        data.extend(t.iter().flat_map(|&v| (v as f32).to_le_bytes()));
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": t.shape(), "data_offsets": [start, data.len()]}),
        );
    }
    raw(&serde_json::Value::Object(header).to_string(), &data)
}

#[test]
fn candidates_need_only_results_and_no_metadata() {
    let case = generate(&spec(Op::Kda)).unwrap();
    let results = case.results();
    for meta in [None, Some(r#"{"op": "kda"}"#)] {
        let bytes = port_candidate(&results, meta);
        let cand = Case::candidate_from_bytes(&bytes, "cand", Op::Kda).expect("candidate");
        assert_eq!(cand.results().len(), results.len());
        assert!(cand.dtypes.values().all(|&d| d == Dtype::F32));
        let report = VerifyReport::new("c", "case file", "cand", &results, &cand.results(), 5e-3);
        assert!(report.pass, "{report}");
        // The same bytes are not a case: its inputs are missing.
        assert!(Case::from_bytes(&bytes, "cand").is_err());
    }
    let bytes = port_candidate(&results, Some(r#"{"op": "dplr"}"#));
    let e = Case::candidate_from_bytes(&bytes, "cand", Op::Kda).unwrap_err();
    assert!(e.to_string().contains("candidate op `dplr`"), "{e}");
    // A misspelt name is still refused.
    let mut renamed = results.clone();
    let dq = renamed.remove("dq").unwrap();
    renamed.insert("grad_q".into(), dq);
    let e =
        Case::candidate_from_bytes(&port_candidate(&renamed, None), "cand", Op::Kda).unwrap_err();
    assert!(e.to_string().contains("`grad_q`"), "{e}");
}

#[test]
fn non_finite_candidate_values_fail_their_row_only() {
    let case = generate(&spec(Op::Dplr)).unwrap();
    let results = case.results();
    for bad in [f64::NAN, f64::INFINITY] {
        let mut got = results.clone();
        got.get_mut("da").unwrap()[[0, 3, 1, 2]] = bad;
        let cand = Case::candidate_from_bytes(&port_candidate(&got, None), "cand", Op::Dplr)
            .expect("a NaN is a failed comparison, not an unreadable file");
        let report = VerifyReport::new("c", "case file", "cand", &results, &cand.results(), 5e-3);
        let failing: Vec<_> = report.rows.iter().filter(|r| !r.pass).collect();
        assert_eq!(failing.len(), 1, "{report}");
        assert_eq!(failing[0].tensor, "da");
        assert_eq!(failing[0].argmax.as_deref(), Some(&[0, 3, 1, 2][..]));
        assert_eq!(
            failing[0].problem.as_deref(),
            Some("non-finite values in the candidate")
        );
    }
}
