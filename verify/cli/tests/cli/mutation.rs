//! In-process mutation fuzzer (stable Rust) for the case reader and the
//! command line. Inputs are mutated valid case files (truncation, bit flips,
//! byte edits, header-length edits, header JSON edits, dtype/shape swaps
//! between tensors, splices) parsed as a case and as a candidate, and
//! mutated valid `deltaref` argument vectors run in-process. Every input
//! runs under `catch_unwind` (a panic is counted and saved), a watchdog
//! aborts on an input running past `--hang-s` (a hang), and the commands
//! run under `--max-memory`.
//!
//! `cargo run --release -p deltaref-cli --features mutation-fuzz --example mutation_fuzz -- --inputs 1000000 --seed 1`
//! (`--cli-every N`: one command line per N inputs, default 20; `--save DIR`:
//! where panicking inputs go). Summary on stderr; exit 1 on a panic.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deltaref::gates::Gate;
use deltaref_verify::case::{Case, CpLayout, Dtype, Op};
use deltaref_verify::generate::{generate, GenSpec};
use deltaref_verify::impls::{Compute, Impl};
use serde_json::Value;

/// splitmix64: deterministic for a seed.
pub struct Rng(u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
    pub fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
}

/// A valid case file and its op.
pub struct Seed {
    pub bytes: Vec<u8>,
    pub op: Op,
}

fn kda(shape: [usize; 6], lengths: Option<&[usize]>) -> GenSpec {
    GenSpec {
        shape: Some(shape.to_vec()),
        lengths: lengths.map(<[usize]>::to_vec),
        ..GenSpec::new(Op::Kda)
    }
}

/// Small valid cases covering every op, option, dtype and layout.
pub fn seeds() -> Vec<Seed> {
    let lb = Gate::LowerBound { lower_bound: -4.0 };
    let mut specs = vec![
        GenSpec {
            expected: true,
            initial_state: true,
            ..kda([2, 6, 1, 2, 4, 3], None)
        },
        GenSpec {
            gate: Gate::Kda,
            use_beta_sigmoid_in_kernel: true,
            allow_neg_eigval: true,
            expected: true,
            ..kda([1, 9, 1, 1, 4, 4], Some(&[4, 0, 5]))
        },
        GenSpec {
            gate: lb,
            use_qk_l2norm_in_kernel: true,
            dtype: Dtype::Bf16,
            scale: Some(0.3),
            ..kda([1, 8, 2, 2, 2, 2], Some(&[3, 5]))
        },
        GenSpec {
            dtype: Dtype::F16,
            expected: true,
            ..kda([1, 5, 1, 1, 3, 2], None)
        },
        GenSpec {
            shape: Some(vec![1, 7, 1, 3, 2]),
            lengths: Some(vec![3, 1, 3]),
            initial_state: true,
            expected: true,
            ..GenSpec::new(Op::Dplr)
        },
        GenSpec {
            shape: Some(vec![1, 6, 4]),
            lengths: Some(vec![2, 0, 4]),
            initial_state: true,
            expected: true,
            dtype: Dtype::F32,
            ..GenSpec::new(Op::TokenShift)
        },
    ];
    let mut out: Vec<Seed> = specs
        .drain(..)
        .map(|s| {
            let mut c = generate(&s).expect("seed case");
            if s.op == Op::Kda && s.lengths.is_some() {
                c.meta.cp = Some(CpLayout::Cuts(vec![2, 5]));
                c.meta.chunk_size = Some(16);
            }
            Seed {
                bytes: c.to_bytes().expect("seed bytes"),
                op: s.op,
            }
        })
        .collect();
    // A candidate: results only, no inputs.
    let c = generate(&kda([1, 4, 1, 1, 2, 2], None)).expect("seed case");
    let mut cand = Case::new(c.meta.clone());
    for (n, t) in Impl::NAIVE.compute(&c, Compute::F64).expect("oracle") {
        cand.insert(&n, t, Dtype::F32);
    }
    out.push(Seed {
        bytes: cand.to_bytes().expect("candidate bytes"),
        op: Op::Kda,
    });
    out
}

/// The header JSON and the data after it, when the framing is intact.
fn split(bytes: &[u8]) -> Option<(Value, &[u8])> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header = bytes.get(8..8usize.checked_add(n)?)?;
    Some((serde_json::from_slice(header).ok()?, &bytes[8 + n..]))
}

fn join(header: &Value, data: &[u8]) -> Vec<u8> {
    let h = header.to_string();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h.as_bytes());
    out.extend(data);
    out
}

const DTYPES: [&str; 10] = [
    "F64", "F32", "BF16", "F16", "I64", "I32", "U8", "BOOL", "F8_E4M3", "XX",
];
const NAMES: [&str; 14] = [
    "q",
    "k",
    "v",
    "g",
    "beta",
    "A_log",
    "dt_bias",
    "initial_state",
    "cu_seqlens",
    "do",
    "dht",
    "o",
    "x",
    "gk",
];

fn big(rng: &mut Rng) -> u64 {
    let random = rng.next_u64();
    *rng.pick(&[
        0,
        1,
        2,
        3,
        7,
        64,
        255,
        65_536,
        1 << 31,
        1 << 32,
        (1 << 32) + 1,
        1 << 62,
        (1 << 63) - 1,
        1 << 63,
        u64::MAX,
        u64::MAX - 7,
        random,
    ])
}

/// One edit of the header JSON: a tensor entry or the `case` metadata.
fn edit_header(rng: &mut Rng, h: &mut Value) {
    let Some(obj) = h.as_object_mut() else { return };
    let names: Vec<String> = obj
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    if names.is_empty() {
        return;
    }
    let name = rng.pick(&names).clone();
    match rng.below(11) {
        0 => {
            obj[&name]["dtype"] = Value::from(*rng.pick(&DTYPES));
        }
        1 => {
            // Swap dtype and shape with another tensor.
            let other = rng.pick(&names).clone();
            let (a, b) = (obj[&name].clone(), obj[&other].clone());
            obj[&name]["dtype"] = b["dtype"].clone();
            obj[&other]["dtype"] = a["dtype"].clone();
            if rng.below(2) == 0 {
                obj[&name]["shape"] = b["shape"].clone();
                obj[&other]["shape"] = a["shape"].clone();
            }
        }
        2 => {
            if let Some(shape) = obj[&name]["shape"].as_array_mut() {
                match rng.below(5) {
                    0 if !shape.is_empty() => {
                        let i = rng.below(shape.len());
                        shape[i] = Value::from(big(rng));
                    }
                    1 => shape.push(Value::from(rng.below(4) as u64)),
                    2 => {
                        shape.pop();
                    }
                    3 if shape.len() > 1 => {
                        let (i, j) = (rng.below(shape.len()), rng.below(shape.len()));
                        shape.swap(i, j);
                    }
                    _ => shape.reverse(),
                }
            }
        }
        3 => {
            if let Some(off) = obj[&name]["data_offsets"].as_array_mut() {
                if !off.is_empty() {
                    let i = rng.below(off.len());
                    off[i] = match rng.below(3) {
                        0 => Value::from(big(rng)),
                        1 => Value::from(
                            off[i]
                                .as_u64()
                                .unwrap_or(0)
                                .wrapping_add(rng.below(9) as u64)
                                .wrapping_sub(4),
                        ),
                        _ => Value::from(-1),
                    };
                }
            }
        }
        4 => {
            obj.remove(&name);
        }
        5 => {
            // Rename (possibly onto another tensor's name or a foreign one).
            if let Some(v) = obj.remove(&name) {
                obj.insert(rng.pick(&NAMES).to_string(), v);
            }
        }
        6 => {
            let key = *rng.pick(&["dtype", "shape", "data_offsets"]);
            obj[&name][key] = match rng.below(4) {
                0 => Value::Null,
                1 => Value::from("F64"),
                2 => serde_json::json!([1, 2]),
                _ => serde_json::json!({}),
            };
        }
        _ => edit_metadata(rng, obj),
    }
}

fn edit_metadata(rng: &mut Rng, obj: &mut serde_json::Map<String, Value>) {
    let meta = obj
        .entry("__metadata__")
        .or_insert_with(|| serde_json::json!({}));
    let Some(m) = meta.as_object_mut() else {
        return;
    };
    let mut case: Value = m
        .get("case")
        .and_then(Value::as_str)
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_else(|| serde_json::json!({}));
    let keys = [
        "op",
        "scale",
        "use_qk_l2norm_in_kernel",
        "gate",
        "lower_bound",
        "use_beta_sigmoid_in_kernel",
        "allow_neg_eigval",
        "chunk_size",
        "cp",
        "seed",
        "dtype",
        "bogus",
    ];
    let vals = [
        serde_json::json!("kda"),
        serde_json::json!("dplr"),
        serde_json::json!("token_shift"),
        serde_json::json!("lowerbound"),
        serde_json::json!("kda"),
        serde_json::json!("none"),
        serde_json::json!(true),
        serde_json::json!(0),
        serde_json::json!(-1),
        serde_json::json!(16),
        serde_json::json!(1e308),
        serde_json::json!(-1e308),
        serde_json::json!(18446744073709551615u64),
        serde_json::json!({"world": 0}),
        serde_json::json!({"world": 3}),
        serde_json::json!({"world": 18446744073709551615u64}),
        serde_json::json!({"cuts": [0, 1, 18446744073709551615u64]}),
        serde_json::json!({"cuts": [5, 2]}),
        serde_json::json!({"world": 2, "cuts": [1]}),
        serde_json::json!("bf16"),
        serde_json::json!(null),
        serde_json::json!([]),
    ];
    match rng.below(4) {
        0 => {
            if let Some(c) = case.as_object_mut() {
                c.insert(rng.pick(&keys).to_string(), rng.pick(&vals).clone());
            }
        }
        1 => {
            if let Some(c) = case.as_object_mut() {
                let k = rng.pick(&keys).to_string();
                c.remove(&k);
            }
        }
        2 => case = rng.pick(&vals).clone(),
        _ => {
            m.remove("case");
            return;
        }
    }
    let text = if rng.below(8) == 0 {
        let mut s = case.to_string();
        s.truncate(rng.below(s.len() + 1));
        s
    } else {
        case.to_string()
    };
    m.insert("case".into(), Value::from(text));
}

/// One mutation of `bytes` (`other`: another seed, for splices).
pub fn mutate(rng: &mut Rng, bytes: &[u8], other: &[u8]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    match rng.below(9) {
        0 => b.truncate(rng.below(b.len() + 1)),
        1 => {
            for _ in 0..=rng.below(8) {
                if !b.is_empty() {
                    let i = rng.below(b.len());
                    b[i] ^= 1 << rng.below(8);
                }
            }
        }
        2 => {
            for _ in 0..=rng.below(4) {
                if !b.is_empty() {
                    let i = rng.below(b.len());
                    b[i] = *rng.pick(&[0u8, 0xff, 0x7f, 0x80, b'{', b'"', b'9', b'-']);
                }
            }
        }
        3 => {
            if b.len() >= 8 {
                let n = u64::from_le_bytes(b[..8].try_into().expect("8"));
                let v = match rng.below(4) {
                    0 => big(rng),
                    1 => n.wrapping_add(rng.below(17) as u64).wrapping_sub(8),
                    2 => b.len() as u64,
                    _ => n.wrapping_mul(2),
                };
                b[..8].copy_from_slice(&v.to_le_bytes());
            }
        }
        4..=6 => {
            if let Some((mut h, data)) = split(bytes) {
                for _ in 0..=rng.below(3) {
                    edit_header(rng, &mut h);
                }
                b = join(&h, data);
            }
        }
        7 => {
            // Header of one seed, data of another.
            if let (Some((h, _)), Some((_, data))) = (split(bytes), split(other)) {
                b = join(&h, data);
            }
        }
        _ => {
            let i = rng.below(b.len() + 1);
            if rng.below(2) == 0 {
                let n = rng.below(16);
                let fill: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                b.splice(i..i, fill);
            } else {
                let j = (i + rng.below(16)).min(b.len());
                b.drain(i..j);
            }
        }
    }
    b
}

/// Parses `bytes` as a case and as a candidate; a case that parses must
/// survive a write/read round trip unchanged, and small ones are run.
pub fn exercise_case(bytes: &[u8], op: Op, compute: bool) -> bool {
    let _ = Case::candidate_from_bytes(bytes, "fuzz", op);
    let parsed = Case::from_bytes(bytes, "fuzz");
    let valid = parsed.is_ok();
    if let Ok(c) = parsed {
        let again = Case::from_bytes(&c.to_bytes().expect("a read case serialises"), "fuzz")
            .expect("a written case reads back");
        assert!(
            again.meta == c.meta && again.cu_seqlens == c.cu_seqlens,
            "round trip changed the case"
        );
        let _ = c.expected_results();
        let _ = Impl::chunk(16).map(|i| i.memory_needed(&c));
        if compute {
            let _ = Impl::NAIVE.compute(&c, Compute::F64);
        }
    }
    valid
}

/// Command lines over small case files in `dir` (absolute paths stay inside
/// it, apart from `/dev/zero` as a read; the campaign runs with `dir` as the
/// current directory, so relative ones land there too).
pub struct CliCorpus {
    pub dir: PathBuf,
    pub lines: Vec<Vec<String>>,
    pub paths: Vec<String>,
}

impl CliCorpus {
    pub fn new(dir: &Path) -> CliCorpus {
        let p = |n: &str| dir.join(n).display().to_string();
        let lines: Vec<Vec<String>> = [
            "gen --op kda --shape 1,16,1,2,4,4 --out G",
            "gen --op kda --lengths 5,0,7 --gate lowerbound --lower-bound -3 --l2norm --beta-sigmoid --initial-state --expected --out G",
            "gen --op kda --gate kda --allow-neg-eigval --beta-sigmoid --scale 0.5 --dtype bf16 --shape 2,8,1,1,2,2 --out G",
            "gen --op dplr --lengths 4,9 --expected --shape 1,13,1,4,4 --out G",
            "gen --op token_shift --shape 2,8,3 --initial-state --dtype f16 --out G",
            "run --case K --impl chunk --chunk-size 16 --out R",
            "run --case D --impl cp --world 2 --compute f32",
            "verify --case K --impl cp --world 2 --cp-engine naive",
            "verify --case K --impl chunk --precision fla-bf16 --max-ratio 1e-2",
            "verify --case K --candidate C --json",
            "verify --case T --impl cp --cuts 3,7",
            "cp --case K --cuts 3,9 --precision drop-merged-state",
            "cp --case K --intra --num-sms 4 --subseq-len 16 --max-splits 3",
            "cp --case K --world 4 --compute f32 --max-ratio 1e-3",
            "diagnose --case K --impl cp --world 2 --precision fla-bf16 --band 1e-3",
            "diagnose --case K --candidate C --json",
            "bench --case K --impls naive,chunk --reps 1 --world 2 --json",
            "fixtures --check M",
        ]
        .iter()
        .map(|l| {
            l.split(' ')
                .map(|w| match w {
                    "G" => p("g.safetensors"),
                    "R" => p("r.safetensors"),
                    "K" => p("kda.safetensors"),
                    "D" => p("dplr.safetensors"),
                    "T" => p("ts.safetensors"),
                    "C" => p("cand.safetensors"),
                    "M" => p("missing"),
                    w => w.to_string(),
                })
                .collect()
        })
        .collect();
        let paths = [
            "g.safetensors",
            "r.safetensors",
            "kda.safetensors",
            "dplr.safetensors",
            "ts.safetensors",
            "cand.safetensors",
            "sub",
            "fifo",
            "missing/x.safetensors",
        ]
        .iter()
        .map(|n| p(n))
        .chain(["/dev/zero".to_string()])
        .collect();
        let c = CliCorpus {
            dir: dir.to_path_buf(),
            lines,
            paths,
        };
        c.reset();
        c
    }

    /// (Re)writes the case files the command lines use.
    pub fn reset(&self) {
        let d = &self.dir;
        let _ = std::fs::create_dir_all(d.join("sub"));
        if !d.join("fifo").exists() {
            let c = std::ffi::CString::new(d.join("fifo").display().to_string()).expect("path");
            // SAFETY: a valid NUL-terminated path.
            unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
        }
        let write = |name: &str, s: GenSpec| {
            let mut c = generate(&s).expect("corpus case");
            c.meta.chunk_size = Some(16);
            c.write(&d.join(name)).expect("corpus write");
            c
        };
        let k = write(
            "kda.safetensors",
            GenSpec {
                expected: true,
                gate: Gate::LowerBound { lower_bound: -5.0 },
                use_qk_l2norm_in_kernel: true,
                ..kda([1, 24, 1, 2, 4, 4], Some(&[10, 14]))
            },
        );
        write(
            "dplr.safetensors",
            GenSpec {
                shape: Some(vec![1, 12, 1, 4, 4]),
                lengths: Some(vec![5, 7]),
                ..GenSpec::new(Op::Dplr)
            },
        );
        write(
            "ts.safetensors",
            GenSpec {
                shape: Some(vec![1, 10, 3]),
                lengths: Some(vec![4, 6]),
                expected: true,
                ..GenSpec::new(Op::TokenShift)
            },
        );
        let mut cand = Case::new(k.meta.clone());
        for (n, t) in k.results() {
            cand.insert(&n, t.mapv(|v| v * 1.001), Dtype::Bf16);
        }
        cand.write(&d.join("cand.safetensors"))
            .expect("corpus write");
    }

    /// A mutated command line (program name and a memory cap first).
    pub fn mutated(&self, rng: &mut Rng) -> Vec<String> {
        const VALUES: [&str; 40] = [
            "0",
            "1",
            "-1",
            "2",
            "3",
            "16",
            "64",
            "65",
            "-5",
            "-0",
            "1e308",
            "nan",
            "inf",
            "-inf",
            "18446744073709551615",
            "18446744073709551616",
            "9223372036854775808",
            "4294967296",
            "",
            ",",
            "1,,2",
            "0,0",
            "1,18446744073709551615",
            "7,7,7",
            "a",
            "kda",
            "dplr",
            "token_shift",
            "lowerbound",
            "naive",
            "chunk",
            "cp",
            "gpu-naive",
            "gpu-cp",
            "f32",
            "bf16",
            "exact",
            "drop-merged-state",
            "partial-merge-v",
            "1K",
        ];
        const FLAGS: [&str; 40] = [
            "--op",
            "--shape",
            "--lengths",
            "--seed",
            "--gate",
            "--lower-bound",
            "--l2norm",
            "--beta-sigmoid",
            "--allow-neg-eigval",
            "--initial-state",
            "--scale",
            "--dtype",
            "--expected",
            "--out",
            "--case",
            "--candidate",
            "--impl",
            "--chunk-size",
            "--world",
            "--cuts",
            "--cp-engine",
            "--compute",
            "--precision",
            "--gpu-dtype",
            "--max-ratio",
            "--json",
            "--allow-partial",
            "--intra",
            "--subseq-len",
            "--num-sms",
            "--num-heads",
            "--max-splits",
            "--band",
            "--impls",
            "--reps",
            "--quiet",
            "--check",
            "--help",
            "--version",
            "--bogus",
        ];
        let mut a = rng.pick(&self.lines).clone();
        for _ in 0..rng.below(3) {
            let i = rng.below(a.len());
            match rng.below(7) {
                0 | 1 => a[i] = rng.pick(&VALUES).to_string(),
                2 => a[i] = rng.pick(&self.paths).clone(),
                3 if a.len() > 1 => {
                    a.remove(i);
                }
                4 => {
                    let f = rng.pick(&FLAGS).to_string();
                    let v = if rng.below(2) == 0 {
                        rng.pick(&VALUES).to_string()
                    } else {
                        rng.pick(&self.paths).clone()
                    };
                    a.splice(i..i, [f, v]);
                }
                5 => {
                    let j = rng.below(a.len());
                    a.swap(i, j);
                }
                _ => a[i] = format!("{},{}", a[i], rng.pick(&VALUES)),
            }
        }
        let mut full = vec!["deltaref".into(), "--max-memory".into(), "512M".into()];
        full.extend(a);
        full
    }
}

/// Counts of a campaign.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    pub inputs: u64,
    pub case_inputs: u64,
    pub cli_inputs: u64,
    /// Mutated files that still read as a valid case; command lines that
    /// exited 0 or 1 (ran to a verdict rather than being refused).
    pub valid_cases: u64,
    pub cli_ok: u64,
    pub panics: u64,
    pub slowest_s: f64,
    pub slowest_what: String,
    pub first_panics: Vec<String>,
}

/// Redirects stdout and stderr to /dev/null while alive (the commands'
/// tables and errors); `report` still reaches the real stderr.
pub struct Silence {
    saved: [i32; 2],
}

impl Silence {
    pub fn start() -> Silence {
        // SAFETY: plain descriptor calls on the process's own fds.
        unsafe {
            let saved = [libc::dup(1), libc::dup(2)];
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
            libc::dup2(null, 1);
            libc::dup2(null, 2);
            libc::close(null);
            Silence { saved }
        }
    }

    /// Writes to the real stderr.
    pub fn report(&self, s: &str) {
        write_fd(self.saved[1], s);
    }
}

fn write_fd(fd: i32, s: &str) {
    let line = format!("{s}\n");
    // SAFETY: writing a buffer to an open descriptor.
    unsafe { libc::write(fd, line.as_ptr().cast(), line.len()) };
}

impl Silence {
    fn real_stderr(&self) -> i32 {
        self.saved[1]
    }
}

impl Drop for Silence {
    fn drop(&mut self) {
        // SAFETY: restoring the descriptors saved in `start`.
        unsafe {
            libc::dup2(self.saved[0], 1);
            libc::dup2(self.saved[1], 2);
            libc::close(self.saved[0]);
            libc::close(self.saved[1]);
        }
    }
}

/// Runs `inputs` inputs from `seed`: one command line every `cli_every`,
/// the rest case files. Panics are caught and counted; an input running past
/// `hang` aborts the process (exit 3) after printing it.
pub fn campaign(
    inputs: u64,
    seed: u64,
    cli_every: u64,
    hang: Duration,
    save: Option<&Path>,
    silence: &Silence,
) -> Tally {
    let seeds = seeds();
    let work = tempfile::tempdir().expect("temp dir");
    let corpus = CliCorpus::new(work.path());
    // Mutated command lines write to relative paths too: keep them in `work`.
    let cwd = std::env::current_dir().expect("current directory");
    std::env::set_current_dir(work.path()).expect("enter the temp dir");
    let current = Arc::new(Mutex::new(String::new()));
    let started_ms = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    {
        let (current, started, err) = (current.clone(), started_ms.clone(), silence.real_stderr());
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            let s = started.load(Ordering::Relaxed);
            if s > 0 && t0.elapsed().as_millis() as u64 - s > hang.as_millis() as u64 {
                let what = current.lock().map(|c| c.clone()).unwrap_or_default();
                write_fd(err, &format!("HANG (> {hang:?}): {what}"));
                std::process::exit(3);
            }
        });
    }
    let last_panic = Arc::new(Mutex::new(String::new()));
    {
        let last = last_panic.clone();
        std::panic::set_hook(Box::new(move |info| {
            if let Ok(mut l) = last.lock() {
                *l = info.to_string();
            }
        }));
    }
    deltaref_verify::memory::set_limit(Some(512 << 20));
    let mut rng = Rng(seed);
    let mut t = Tally::default();
    for i in 0..inputs {
        let cli = cli_every > 0 && i % cli_every == 0;
        let (what, run): (String, Box<dyn FnOnce() -> bool>) = if cli {
            if i % (cli_every * 500) == 0 {
                corpus.reset();
            }
            let args = corpus.mutated(&mut rng);
            t.cli_inputs += 1;
            (
                format!("cli {args:?}"),
                Box::new(move || {
                    // Ran to a verdict (0 pass, 1 fail), not refused (2).
                    let rc = deltaref_cli::run_args(args);
                    let ok = rc == std::process::ExitCode::SUCCESS
                        || rc == std::process::ExitCode::from(1);
                    deltaref_verify::memory::set_limit(Some(512 << 20));
                    ok
                }),
            )
        } else {
            let s = &seeds[rng.below(seeds.len())];
            let other = &seeds[rng.below(seeds.len())].bytes;
            let mut b = mutate(&mut rng, &s.bytes, other);
            if rng.below(4) == 0 {
                b = mutate(&mut rng, &b, other);
            }
            let compute = rng.below(32) == 0;
            let op = s.op;
            t.case_inputs += 1;
            let hex: String = if save.is_some() {
                b.iter().map(|x| format!("{x:02x}")).collect()
            } else {
                String::new()
            };
            (
                format!("case ({} bytes) {hex}", b.len()),
                Box::new(move || exercise_case(&b, op, compute)),
            )
        };
        if let Ok(mut c) = current.lock() {
            c.clone_from(&what);
        }
        let start = Instant::now();
        started_ms.store(t0.elapsed().as_millis().max(1) as u64, Ordering::Relaxed);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
        started_ms.store(0, Ordering::Relaxed);
        let dt = start.elapsed().as_secs_f64();
        if dt > t.slowest_s {
            t.slowest_s = dt;
            t.slowest_what = what.chars().take(300).collect();
        }
        t.inputs += 1;
        match (&r, cli) {
            (Ok(true), true) => t.cli_ok += 1,
            (Ok(true), false) => t.valid_cases += 1,
            _ => {}
        }
        if r.is_err() {
            t.panics += 1;
            let msg = last_panic.lock().map(|l| l.clone()).unwrap_or_default();
            let line = format!(
                "PANIC {msg} on {}",
                what.chars().take(2000).collect::<String>()
            );
            silence.report(&line);
            if let Some(dir) = save {
                let _ = std::fs::create_dir_all(dir);
                let _ = std::fs::write(dir.join(format!("panic-{i}.txt")), &line);
            }
            if t.first_panics.len() < 20 {
                t.first_panics.push(line);
            }
        }
        if (i + 1) % 100_000 == 0 {
            silence.report(&format!(
                "{} inputs, {} panics, {:.0} s",
                i + 1,
                t.panics,
                t0.elapsed().as_secs_f64()
            ));
        }
    }
    let _ = std::panic::take_hook();
    std::env::set_current_dir(cwd).expect("back to the starting directory");
    t
}

/// Peak resident memory of this process (`VmHWM`), in KiB.
pub fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let l = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    l.split_whitespace().nth(1)?.parse().ok()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let num = |name: &str, default: u64| {
        flag(name).map_or(default, |v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}: expected a number, got {v}"))
        })
    };
    let inputs = num("--inputs", 100_000);
    let seed = num("--seed", 1);
    let cli_every = num("--cli-every", 20);
    let hang = Duration::from_secs(num("--hang-s", 60));
    let save = flag("--save").map(PathBuf::from);
    let t0 = Instant::now();
    let silence = Silence::start();
    let t = campaign(inputs, seed, cli_every, hang, save.as_deref(), &silence);
    silence.report(&format!(
        "fuzz: {} inputs ({} case files, {} still valid; {} command lines, {} ran to a verdict), \
         {} panics, 0 hangs, {:.1} s, slowest input {:.3} s, peak RSS {} KiB\nslowest: {}",
        t.inputs,
        t.case_inputs,
        t.valid_cases,
        t.cli_inputs,
        t.cli_ok,
        t.panics,
        t0.elapsed().as_secs_f64(),
        t.slowest_s,
        peak_rss_kib().map_or("?".into(), |k| k.to_string()),
        t.slowest_what
    ));
    for p in &t.first_panics {
        silence.report(p);
    }
    if t.panics > 0 {
        std::process::exit(1);
    }
}
