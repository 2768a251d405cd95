//! The committed fixture set for other ports: deterministic cases (inputs,
//! upstream gradients and the float64 truth), with a manifest of options,
//! shapes, dtypes, seeds and SHA-256 hashes. Regenerating reproduces every
//! byte (see `deltaref::rng` for the generator).

use std::path::Path;

use deltaref::cp::Layout;
use deltaref::gates::Gate;
use deltaref::inputs::Regime;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::case::{Case, CaseError, CpLayout, Dtype, Op};
use crate::fuzz::draw::Extra;
use crate::generate::{generate, GenSpec};

/// One fixture: a name and how to generate it.
#[derive(Clone, Debug)]
pub struct Preset {
    pub name: &'static str,
    pub spec: GenSpec,
    pub cp: Option<CpLayout>,
    pub chunk_size: Option<usize>,
    /// Also store the oracle's forward intermediates (KDA; see `intermediates`).
    pub intermediates: bool,
    /// Optional inputs the draws make that this fixture leaves out (GDN-2's
    /// lower-bound gate without `A_log`, FLA #1107); its truth is computed
    /// without them.
    pub without: &'static [&'static str],
    /// A named regression case: the public bug it is for (`fla#1134`, …).
    pub bug: Option<&'static str>,
    /// Rewrites the drawn inputs into the shape the bug needed (its truth
    /// is recomputed after).
    pub edit: Option<fn(&mut Case)>,
}

fn kda(shape: Option<[usize; 6]>, lengths: Option<&[usize]>, seed: u64) -> GenSpec {
    GenSpec {
        shape: shape.map(|s| s.to_vec()),
        lengths: lengths.map(|l| l.to_vec()),
        seed,
        initial_state: true,
        expected: true,
        // The committed set predates unit-norm keys; its K = 8 cases are
        // stable with raw normal keys, and its bytes must not change.
        unit_norm_keys: false,
        ..GenSpec::new(Op::Kda)
    }
}

fn varlen(op: Op, lengths: &[usize], seed: u64) -> GenSpec {
    GenSpec {
        lengths: Some(lengths.to_vec()),
        seed,
        initial_state: true,
        expected: true,
        ..GenSpec::new(op)
    }
}

/// A varlen GDN-2 case with an initial state, H = 2, K = V = 8.
fn gdn2(lengths: &[usize], seed: u64) -> GenSpec {
    GenSpec {
        shape: Some(vec![1, lengths.iter().sum(), 2, 8, 8]),
        ..varlen(Op::Gdn2, lengths, seed)
    }
}

/// A fixture `name` generated from `spec` as drawn: no CP, the default
/// chunk size, no intermediates, nothing left out or edited, no bug.
fn plain(name: &'static str, spec: GenSpec) -> Preset {
    Preset {
        name,
        spec,
        cp: None,
        chunk_size: None,
        intermediates: false,
        without: &[],
        bug: None,
        edit: None,
    }
}

/// The committed set: what ports break on, small enough to commit.
pub fn presets() -> Vec<Preset> {
    let lb = Gate::LowerBound { lower_bound: -5.0 };
    let p = plain;
    let cp = |name, spec, layout| Preset {
        name,
        spec,
        cp: Some(layout),
        chunk_size: Some(64),
        intermediates: false,
        without: &[],
        bug: None,
        edit: None,
    };
    let cp_kda = |lengths: &[usize], seed| GenSpec {
        gate: lb,
        use_qk_l2norm_in_kernel: true,
        initial_state: false,
        ..kda(
            Some([1, lengths.iter().sum(), 1, 1, 8, 8]),
            Some(lengths),
            seed,
        )
    };
    vec![
        p("kda_small", kda(Some([2, 24, 2, 2, 8, 8]), None, 1)),
        p("kda_gva", kda(Some([1, 40, 1, 4, 8, 8]), None, 2)),
        p(
            "kda_varlen_0_1",
            kda(Some([1, 48, 2, 2, 8, 8]), Some(&[17, 0, 1, 30]), 3),
        ),
        p(
            "kda_lowerbound_gate",
            GenSpec {
                gate: lb,
                use_beta_sigmoid_in_kernel: true,
                ..kda(Some([1, 53, 1, 2, 8, 8]), Some(&[33, 20]), 4)
            },
        ),
        p(
            "kda_in_kernel_gate",
            GenSpec {
                gate: Gate::Kda,
                ..kda(Some([1, 45, 1, 2, 8, 8]), Some(&[20, 25]), 5)
            },
        ),
        p(
            "kda_l2norm",
            GenSpec {
                use_qk_l2norm_in_kernel: true,
                ..kda(Some([2, 32, 1, 2, 8, 8]), None, 6)
            },
        ),
        p(
            "kda_lowerbound_l2norm_bf16",
            GenSpec {
                gate: lb,
                use_qk_l2norm_in_kernel: true,
                dtype: Dtype::Bf16,
                ..kda(Some([1, 70, 1, 2, 8, 8]), Some(&[64, 6]), 7)
            },
        ),
        p(
            "dplr_rwkv7",
            GenSpec {
                shape: Some(vec![1, 66, 2, 8, 8]),
                ..varlen(Op::Dplr, &[25, 1, 40], 8)
            },
        ),
        p(
            "dplr_rwkv7_bf16",
            GenSpec {
                shape: Some(vec![1, 66, 2, 8, 8]),
                dtype: Dtype::Bf16,
                ..varlen(Op::Dplr, &[25, 1, 40], 9)
            },
        ),
        p(
            "token_shift_varlen_cache",
            GenSpec {
                shape: Some(vec![1, 32, 16]),
                ..varlen(Op::TokenShift, &[10, 0, 1, 21], 10)
            },
        ),
        cp(
            "cp_kda_400_624_world2",
            cp_kda(&[400, 624], 11),
            CpLayout::World(2, Layout::Contiguous),
        ),
        cp(
            "cp_kda_4seqs_world4",
            cp_kda(&[100, 37, 150, 225], 12),
            CpLayout::World(4, Layout::Contiguous),
        ),
        cp(
            "cp_kda_long_world8",
            cp_kda(&[512], 13),
            CpLayout::World(8, Layout::Contiguous),
        ),
        cp(
            "cp_kda_unaligned_cuts",
            cp_kda(&[50, 90], 14),
            CpLayout::Cuts(vec![30, 77, 101]),
        ),
        cp(
            "cp_kda_400_624_world2_bf16",
            GenSpec {
                dtype: Dtype::Bf16,
                ..cp_kda(&[400, 624], 15)
            },
            CpLayout::World(2, Layout::Contiguous),
        ),
        cp(
            "cp_dplr_world2",
            GenSpec {
                shape: Some(vec![1, 128, 1, 8, 8]),
                initial_state: false,
                ..varlen(Op::Dplr, &[60, 68], 16)
            },
            CpLayout::World(2, Layout::Contiguous),
        ),
        cp(
            "cp_token_shift_world4",
            GenSpec {
                shape: Some(vec![1, 64, 8]),
                ..varlen(Op::TokenShift, &[5, 40, 19], 17)
            },
            CpLayout::World(4, Layout::Contiguous),
        ),
        // Long memory: M and the carried state stay O(1) across ranks, so
        // every CP fault preset fails one of these (tests/tests/cross/fault_fixtures.rs).
        // Chunks of 16 lengthen the M chain; a short first sequence makes
        // rank 0's first and last local sequences differ (wrong-preprocess).
        long_cp(
            "cp_kda_long_memory_lowerbound_world4",
            GenSpec {
                gate: lb,
                use_qk_l2norm_in_kernel: true,
                ..long_memory(Op::Kda, vec![1, 256, 1, 1, 16, 8], &[30, 190, 36], 31)
            },
            4,
        ),
        // bf16 inputs (the truth is exact on them): fla-bf16 passes and the
        // bf16 M chain (8 ranks in one sequence) does not.
        long_cp(
            "cp_kda_long_memory_world8_bf16",
            GenSpec {
                use_qk_l2norm_in_kernel: true,
                dtype: Dtype::Bf16,
                ..long_memory(Op::Kda, vec![1, 768, 1, 1, 8, 8], &[40, 700, 28], 21)
            },
            8,
        ),
        long_cp(
            "cp_dplr_long_memory_world4",
            long_memory(Op::Dplr, vec![1, 256, 1, 8, 8], &[30, 190, 36], 32),
            4,
        ),
        // FLA's zigzag layout: 4 intervals of 64 tokens, rank 0 holds 0..64
        // and 192..256; the long middle sequence crosses every interval.
        Preset {
            cp: Some(CpLayout::World(2, Layout::Zigzag)),
            ..long_cp(
                "cp_kda_long_memory_zigzag_world2",
                GenSpec {
                    gate: lb,
                    use_qk_l2norm_in_kernel: true,
                    ..long_memory(Op::Kda, vec![1, 256, 1, 1, 16, 8], &[30, 190, 36], 35)
                },
                2,
            )
        },
        // FLA's forward intermediates stored with the truth, so a port can
        // check its sub-functions one by one (README: "Intermediates").
        Preset {
            name: "kda_intermediates_lowerbound_l2norm",
            spec: GenSpec {
                gate: lb,
                use_qk_l2norm_in_kernel: true,
                initial_state: true,
                ..long_memory(Op::Kda, vec![1, 100, 1, 1, 8, 8], &[40, 60], 33)
            },
            cp: None,
            chunk_size: Some(32),
            intermediates: true,
            without: &[],
            bug: None,
            edit: None,
        },
        Preset {
            intermediates: true,
            ..long_cp(
                "cp_kda_intermediates_world2",
                GenSpec {
                    gate: lb,
                    use_qk_l2norm_in_kernel: true,
                    ..long_memory(Op::Kda, vec![1, 128, 1, 1, 8, 8], &[20, 108], 34)
                },
                2,
            )
        },
        p(
            "gdn_varlen_gate_l2norm",
            GenSpec {
                shape: Some(vec![1, 60, 1, 2, 8, 8]),
                gate: Gate::Kda,
                use_qk_l2norm_in_kernel: true,
                ..varlen(Op::Gdn, &[25, 0, 1, 34], 40)
            },
        ),
        // GDN-2 (FLA `chunk_gdn2`): each option once, H = 2, K = V = 8.
        p(
            "gdn2_plain",
            GenSpec {
                shape: Some(vec![2, 24, 2, 8, 8]),
                seed: 50,
                expected: true,
                ..GenSpec::new(Op::Gdn2)
            },
        ),
        p("gdn2_varlen_h0", gdn2(&[25, 0, 1, 34], 51)),
        p(
            "gdn2_gate_in_kernel_l2norm",
            GenSpec {
                gate: Gate::Kda,
                use_qk_l2norm_in_kernel: true,
                ..gdn2(&[30, 18], 52)
            },
        ),
        Preset {
            without: &["A_log"],
            bug: Some("fla#1107: the lower-bound gate without A_log is lower_bound * sigmoid(g + dt_bias)"),
            ..p(
                "gdn2_lowerbound_no_a_log",
                GenSpec {
                    gate: Gate::LowerBound { lower_bound: -3.0 },
                    ..gdn2(&[30, 18], 53)
                },
            )
        },
        p(
            "gdn2_safe_gate_lowerbound",
            GenSpec {
                gate: lb,
                use_qk_l2norm_in_kernel: true,
                ..gdn2(&[40, 24], 54)
            },
        ),
        p(
            "gdn2_state_v_first",
            GenSpec {
                state_v_first: true,
                shape: Some(vec![1, 48, 2, 8, 4]),
                ..gdn2(&[20, 28], 55)
            },
        ),
        p(
            "gdn2_bf16_inputs",
            GenSpec {
                dtype: Dtype::Bf16,
                use_qk_l2norm_in_kernel: true,
                ..gdn2(&[40, 24], 56)
            },
        ),
        cp(
            "cp_gdn2_world2",
            GenSpec {
                use_qk_l2norm_in_kernel: true,
                initial_state: false,
                ..gdn2(&[50, 78], 57)
            },
            CpLayout::World(2, Layout::Contiguous),
        ),
        p(
            "causal_conv1d_varlen_silu_bias",
            GenSpec {
                shape: Some(vec![1, 32, 16, 4]),
                activation: deltaref::conv::Activation::Silu,
                bias: true,
                ..varlen(Op::CausalConv1d, &[10, 0, 2, 20], 41)
            },
        ),
        // Conv1d's window handed across ranks (`conv-cache-drop`): sequence
        // 1 = [20, 64) is cut at 32, a cut 12 tokens into it.
        cp(
            "cp_causal_conv1d_world2",
            GenSpec {
                shape: Some(vec![1, 64, 8, 4]),
                activation: deltaref::conv::Activation::Silu,
                bias: true,
                initial_state: false,
                ..varlen(Op::CausalConv1d, &[20, 44], 42)
            },
            CpLayout::World(2, Layout::Contiguous),
        ),
        // Two heads with different gates and long memory, rank 1's first
        // piece two 64-token chunks long: FLA #781 (`gk-offset`) decays
        // head 1's carried dh by head 0's gate at the chunk boundary.
        cp(
            "cp_kda_heads2_world2",
            GenSpec {
                gate: lb,
                use_qk_l2norm_in_kernel: true,
                initial_state: false,
                ..long_memory(Op::Kda, vec![1, 256, 2, 2, 8, 8], &[256], 43)
            },
            CpLayout::World(2, Layout::Contiguous),
        ),
    ]
    .into_iter()
    .chain(regressions())
    .collect()
}

/// Named regression cases from public bugs: each carries the bug it is for
/// (`bug` in the manifest) and the truth a correct kernel gives.
fn regressions() -> Vec<Preset> {
    let named = |name, bug, spec| Preset {
        bug: Some(bug),
        ..plain(name, spec)
    };
    let lb = Gate::LowerBound { lower_bound: -5.0 };
    vec![
        Preset {
            without: &["A_log"],
            ..named(
                "fla1107_kda_lowerbound_no_a_log",
                "fla#1107: KDA's lower-bound gate with A_log = None is lower_bound * sigmoid(g + dt_bias)",
                GenSpec {
                    gate: Gate::LowerBound { lower_bound: -3.0 },
                    ..kda(Some([1, 40, 1, 2, 8, 8]), Some(&[17, 23]), 60)
                },
            )
        },
        Preset {
            cp: Some(CpLayout::World(3, Layout::Contiguous)),
            chunk_size: Some(16),
            ..named(
                "fla1093_cp_world3_partition",
                "fla#1093: CP splits the packed tokens into world equal parts (T = 96 over 3 ranks; \
                 sequences cross both cuts, which fall off the chunk grid)",
                GenSpec {
                    gate: lb,
                    initial_state: false,
                    ..kda(Some([1, 96, 1, 2, 8, 8]), Some(&[50, 13, 33]), 61)
                },
            )
        },
        named(
            "fla1134_kda_k_not_pow2",
            "fla#1134: fused_recurrent_kda read out of bounds when K is not a power of two (K = 12, V = 10)",
            kda(Some([1, 33, 1, 2, 12, 10]), Some(&[20, 13]), 62),
        ),
        Preset {
            edit: Some(|c| zero(c, "g")),
            ..named(
                "fla862_gdn_no_decay",
                "fla#862: GDN's backward with g = None must equal g = 0 (this case: g = 0)",
                GenSpec {
                    shape: Some(vec![1, 40, 1, 2, 8, 8]),
                    ..varlen(Op::Gdn, &[24, 16], 63)
                },
            )
        },
        Preset {
            edit: Some(|c| Extra::CorrelatedKeys.apply(Op::Kda, c, 64, Dtype::Bf16)),
            ..named(
                "cudnn1051_kda_correlated_keys_safe_gate",
                "cudnn-frontend#1051: strongly correlated bf16 keys with the lower-bound (safe) gate",
                GenSpec {
                    gate: lb,
                    dtype: Dtype::Bf16,
                    ..kda(Some([1, 64, 1, 2, 16, 16]), Some(&[64]), 64)
                },
            )
        },
        Preset {
            edit: Some(|c| Extra::SlowDecay.apply(Op::Gdn, c, 65, Dtype::Bf16)),
            ..named(
                "vmlx433_gdn_slow_decay_4096_bf16",
                "vmlx-swift#433: 4,096 steps of decay about 0.9999 with the gate stored in bf16",
                GenSpec {
                    shape: Some(vec![1, 4096, 1, 1, 4, 4]),
                    dtype: Dtype::Bf16,
                    initial_state: false,
                    ..varlen(Op::Gdn, &[4096], 65)
                },
            )
        },
        Preset {
            edit: Some(|c| Extra::LargeGateInChunk.apply(Op::Gdn, c, 66, Dtype::F64)),
            ..named(
                "transformers48455_gdn_large_gate_in_chunk",
                "transformers#48455: large |g| inside one chunk (exp of the in-chunk gate differences overflows \
                 where a kernel forms them unmasked)",
                GenSpec {
                    shape: Some(vec![1, 80, 1, 2, 8, 8]),
                    ..varlen(Op::Gdn, &[80], 66)
                },
            )
        },
        Preset {
            chunk_size: Some(16),
            edit: Some(fla1085_gates),
            ..named(
                "fla1085_dplr_safe_gate_heads",
                "fla#1085: DPLR safe_gate with H > 1 read each chunk's midpoint offset with a token stride of K \
                 instead of H*K (H = 2, chunk 16; head 0's gk = -9, inside the bound: the wrong anchor overflows fp32)",
                GenSpec {
                    shape: Some(vec![1, 64, 2, 16, 16]),
                    gate: Gate::LowerBound { lower_bound: -9.5 },
                    dtype: Dtype::Bf16,
                    ..varlen(Op::Dplr, &[40, 24], 67)
                },
            )
        },
    ]
}

/// FLA #1085's case: `safe_gate` on, and head 0's `gk` at −9 on every token
/// (as FLA's regression test sets one head's gate far from the others'): the
/// right anchor keeps each exponent of a 16-token chunk within 8·9 = 72
/// (e^72 fits fp32), the anchor #1085 read (token `(i_h + i_t·BT + mid)/H`)
/// puts up to 99 between it and a row.
fn fla1085_gates(case: &mut Case) {
    case.meta.options.insert("safe_gate".into(), true.into());
    if let Some(gk) = case.tensors.get_mut("gk") {
        gk.slice_mut(ndarray::s![.., .., 0, ..]).fill(-9.0);
    }
}

/// Sets every value of `case`'s tensor `name` to 0.
fn zero(case: &mut Case, name: &str) {
    if let Some(t) = case.tensors.get_mut(name) {
        t.fill(0.0);
    }
}

/// A long-memory varlen case (no initial state: FLA forbids it under CP).
fn long_memory(op: Op, shape: Vec<usize>, lengths: &[usize], seed: u64) -> GenSpec {
    GenSpec {
        shape: Some(shape),
        lengths: Some(lengths.to_vec()),
        seed,
        expected: true,
        regime: Regime::LongMemory,
        ..GenSpec::new(op)
    }
}

fn long_cp(name: &'static str, spec: GenSpec, world: usize) -> Preset {
    Preset {
        cp: Some(CpLayout::World(world, Layout::Contiguous)),
        chunk_size: Some(16),
        ..plain(name, spec)
    }
}

impl Preset {
    pub fn case(&self) -> Result<Case, CaseError> {
        let mut c = generate(&self.spec)?;
        if let Some(edit) = self.edit {
            edit(&mut c);
        }
        if !self.without.is_empty() || self.edit.is_some() {
            // The draws' truth used the left-out or rewritten inputs: drop it.
            let stale: Vec<String> = c.results().into_keys().collect();
            for n in self.without.iter().map(|n| n.to_string()).chain(stale) {
                c.tensors.remove(&n);
            }
            let truth = crate::impls::Impl::NAIVE
                .compute(&c, crate::impls::Compute::F64)
                .map_err(|e| CaseError::Usage(format!("fixture {}: {e}", self.name)))?;
            for (n, t) in truth {
                c.insert(&n, t, Dtype::F64);
            }
        }
        c.meta.cp = self.cp.clone();
        c.meta.chunk_size = self.chunk_size;
        if self.intermediates {
            let imp = crate::impls::ImplRequest::chunked_for(&c).resolve(&c)?;
            let (tensors, _) = crate::intermediates::compute(&c, &imp, crate::impls::Compute::F64)?;
            for (n, t) in tensors {
                c.insert(&n, t, Dtype::F64);
            }
        }
        Ok(c)
    }
}

/// One manifest entry.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Entry {
    pub file: String,
    pub op: String,
    /// The `case` metadata (FLA's option names).
    pub case: serde_json::Value,
    /// Stored tensors: name → `[dtype, shape]`.
    pub tensors: std::collections::BTreeMap<String, (String, Vec<usize>)>,
    pub seed: u64,
    pub sha256: String,
    /// The public bug a named regression case is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bug: Option<String>,
}

/// `fixtures/manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Manifest {
    pub generator: String,
    pub fixtures: Vec<Entry>,
}

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A file name and its bytes.
pub type FixtureFile = (String, Vec<u8>);

/// Every preset's file name and bytes, plus the manifest.
pub fn build() -> Result<(Vec<FixtureFile>, Manifest), CaseError> {
    let mut files = vec![];
    let mut entries = vec![];
    let presets = presets();
    let progress = crate::progress::Progress::bar(presets.len() as u64, "fixtures");
    for p in presets {
        progress.inc();
        let case = p.case()?;
        let bytes = case.to_bytes()?;
        let file = format!("{}.safetensors", p.name);
        let mut tensors: std::collections::BTreeMap<String, (String, Vec<usize>)> = case
            .tensors
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    (case.dtypes[n].name().to_string(), t.shape().to_vec()),
                )
            })
            .collect();
        if let Some(cu) = &case.cu_seqlens {
            tensors.insert("cu_seqlens".into(), ("i64".into(), vec![cu.len()]));
        }
        entries.push(Entry {
            file: file.clone(),
            op: case.meta.op.name().into(),
            case: case.meta.to_json(),
            tensors,
            seed: p.spec.seed,
            sha256: hex(&bytes),
            bug: p.bug.map(str::to_string),
        });
        files.push((file, bytes));
    }
    let generator = format!(
        "deltaref {} (`deltaref fixtures --out DIR`)",
        env!("CARGO_PKG_VERSION")
    );
    Ok((
        files,
        Manifest {
            generator,
            fixtures: entries,
        },
    ))
}

/// Writes the set and `manifest.json` into `dir` (created if missing).
pub fn write(dir: &Path) -> Result<Manifest, CaseError> {
    let io = |e: std::io::Error| CaseError::Write {
        path: dir.display().to_string(),
        why: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let (files, manifest) = build()?;
    for (name, bytes) in &files {
        crate::case::write_atomic(&dir.join(name), bytes)?;
    }
    let json = serde_json::to_string_pretty(&manifest).expect("manifest serialises") + "\n";
    crate::case::write_atomic(&dir.join("manifest.json"), json.as_bytes())?;
    Ok(manifest)
}

/// Regenerates in memory and compares with `dir`: returns one line per
/// problem (a file whose bytes or hash differ, a missing file, a file that
/// is not part of the set, a stale manifest); empty when everything
/// matches. A `dir` that is not a readable directory is an error.
pub fn check(dir: &Path) -> Result<Vec<String>, CaseError> {
    let entries = std::fs::read_dir(dir).map_err(|e| CaseError::Io {
        path: dir.display().to_string(),
        source: e,
    })?;
    let on_disk: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let (files, manifest) = build()?;
    let mut problems: Vec<String> = on_disk
        .iter()
        .filter(|n| *n != "manifest.json" && !files.iter().any(|(f, _)| f == *n))
        .map(|n| format!("{n}: not part of the fixture set (extra file)"))
        .collect();
    problems.sort();
    let committed: Option<Manifest> = std::fs::read_to_string(dir.join("manifest.json"))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok());
    let extra = problems.len();
    match &committed {
        None => problems.push(format!(
            "{}: missing or unreadable",
            dir.join("manifest.json").display()
        )),
        Some(m) if m != &manifest => {
            for e in &manifest.fixtures {
                match m.fixtures.iter().find(|c| c.file == e.file) {
                    None => problems.push(format!("{}: not in the committed manifest", e.file)),
                    Some(c) if c != e => problems.push(format!(
                        "{}: manifest entry differs (sha256 {} committed, {} regenerated)",
                        e.file, c.sha256, e.sha256
                    )),
                    _ => {}
                }
            }
            for c in &m.fixtures {
                if !manifest.fixtures.iter().any(|e| e.file == c.file) {
                    problems.push(format!(
                        "{}: in the manifest but no longer generated",
                        c.file
                    ));
                }
            }
            if problems.len() == extra {
                problems.push("manifest.json: differs from the regenerated one".into());
            }
        }
        _ => {}
    }
    for (name, bytes) in &files {
        match std::fs::read(dir.join(name)) {
            Err(_) => problems.push(format!("{name}: missing")),
            Ok(on_disk) if on_disk != *bytes => problems.push(format!(
                "{name}: bytes differ (sha256 on disk {}, regenerated {})",
                hex(&on_disk),
                hex(bytes)
            )),
            _ => {}
        }
    }
    Ok(problems)
}
