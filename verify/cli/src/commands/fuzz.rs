//! `deltaref fuzz`: property-test a candidate kernel (issue 49). Random
//! valid cases for the op and the candidate's convention go through the
//! runner; a failure is shrunk and reported with its likely cause.
//! Exit: 0 every case passed, 1 a failure was found, 2 usage error or a
//! runner that could not run.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args as ClapArgs;
use deltaref_verify::case::{CaseError, Dtype, Op};
use deltaref_verify::convention;
use deltaref_verify::fuzz::{
    self, CommandRunner, FuzzConfig, FuzzOptions, OracleRunner, Runner, WorkerRunner,
};
use deltaref_verify::progress::Progress;

use super::{check_ratio, fail, file_dtype, list};

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Any registered op: kda, gdn, dplr, gdn2, token_shift, causal_conv1d
    /// (conventions other than fla take kda and gdn).
    #[arg(long)]
    pub op: String,
    /// A command run once per case, with {case} and {out} placeholders;
    /// or builtin:f32 / builtin:f64 (the oracle, in process).
    #[arg(long, conflicts_with = "worker")]
    pub runner: Option<String>,
    /// A persistent worker: one JSON request per line on stdin
    /// ({"case": PATH, "out": PATH}), one JSON answer per line ({"ok": true}).
    #[arg(long)]
    pub worker: Option<String>,
    /// The candidate's convention: fla, flashkda, flashinfer-gdn, flashqla, opengdn, ggml.
    #[arg(long, default_value = "fla")]
    pub convention: String,
    /// Draw only cases this convention can express too (a runner wrapping,
    /// say, a ggml kernel for FLA's layout: --convention fla --within ggml).
    #[arg(long)]
    pub within: Option<String>,
    /// Number of cases (default 100 without --time).
    #[arg(long)]
    pub cases: Option<u64>,
    /// Run for this long: 90s, 10m, 1h (with --cases, whichever ends first).
    #[arg(long, value_parser = duration)]
    pub time: Option<Duration>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage dtype of the case files the runner reads: f64, f32, bf16, f16.
    #[arg(long, default_value = "f32", value_parser = file_dtype)]
    pub dtype: Dtype,
    /// A tensor passes when max_abs ≤ 1e-6 or norm_ratio < this (FLA's
    /// assert_close; default 1e-4 for f32/f64 storage, 5e-3 for bf16/f16).
    #[arg(long, conflicts_with = "band")]
    pub tolerance: Option<f64>,
    /// Judge each case in the noise band of this precision preset (the
    /// runner's: where a correct kernel with its storage lands on that
    /// case, from --samples jittered emulation runs) instead of a fixed
    /// tolerance. Without a value: fla-bf16.
    #[arg(long, value_name = "PRECISION", num_args = 0..=1, default_missing_value = "fla-bf16")]
    pub band: Option<String>,
    /// Emulation runs per case's band (drawn for every case: keep it small).
    #[arg(long, default_value_t = 4, requires = "band")]
    pub samples: usize,
    /// Draw no CP cut points (by default about a third of the one-row
    /// cases carry some, in the case file's `cp` metadata).
    #[arg(long)]
    pub no_cp: bool,
    /// Pin H,K,V (the sizes a GPU kernel autotunes on).
    #[arg(long)]
    pub fix: Option<String>,
    /// Most tokens per case.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Largest K and V drawn (without --fix).
    #[arg(long, default_value_t = 16)]
    pub max_dim: usize,
    /// Keep going after the first failure (each new way of failing is shrunk).
    #[arg(long)]
    pub keep_going: bool,
    /// Keep each failure's shrunk case file and the candidate's results here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `90s`, `10m`, `1h` or plain seconds.
fn duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s.split_at(
        s.find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(s.len()),
    );
    let x: f64 = num
        .parse()
        .map_err(|_| format!("expected a duration like 90s, 10m or 1h, got `{s}`"))?;
    let mult = match unit {
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => {
            return Err(format!(
                "expected a duration like 90s, 10m or 1h, got `{s}`"
            ))
        }
    };
    Ok(Duration::from_secs_f64(x * mult))
}

fn config(a: &Args) -> Result<FuzzConfig, CaseError> {
    let op = Op::parse(&a.op).ok_or_else(|| {
        CaseError::Usage(format!(
            "--op: unknown op `{}` ({})",
            a.op,
            Op::names_list()
        ))
    })?;
    let conv = convention::find(&a.convention).ok_or_else(|| {
        CaseError::Usage(format!(
            "--convention: unknown `{}` (available: {})",
            a.convention,
            convention::names()
        ))
    })?;
    let fix = match &a.fix {
        None => None,
        Some(s) => match list("--fix", s)?.as_slice() {
            &[h, k, v] => Some([h, k, v]),
            other => {
                return Err(CaseError::Usage(format!(
                    "--fix H,K,V: expected three sizes, got {}",
                    other.len()
                )))
            }
        },
    };
    let within = match &a.within {
        None => None,
        Some(w) => Some(convention::find(w).ok_or_else(|| {
            CaseError::Usage(format!(
                "--within: unknown convention `{w}` (available: {})",
                convention::names()
            ))
        })?),
    };
    let cfg = FuzzConfig {
        within,
        dtype: a.dtype,
        fix,
        max_tokens: a.max_tokens,
        max_dim: a.max_dim,
        cp: !a.no_cp,
        ..FuzzConfig::new(op, conv)
    };
    cfg.check()?;
    Ok(cfg)
}

fn runner(a: &Args, dir: &std::path::Path) -> Result<Box<dyn Runner>, CaseError> {
    let usage = CaseError::Usage;
    match (&a.runner, &a.worker) {
        (Some(r), _) if r.starts_with("builtin:") => Ok(Box::new(OracleRunner::parse(r).map_err(usage)?)),
        (Some(r), _) => Ok(Box::new(CommandRunner::new(r, dir).map_err(usage)?)),
        (None, Some(w)) => Ok(Box::new(WorkerRunner::start(w, dir).map_err(usage)?)),
        (None, None) => Err(usage("give the candidate: --runner CMD (with {case} and {out}), --runner builtin:f32, or --worker CMD".into())),
    }
}

fn go(a: &Args) -> Result<fuzz::FuzzReport, CaseError> {
    let cfg = config(a)?;
    let tolerance = a.tolerance.unwrap_or(match a.dtype {
        Dtype::F64 | Dtype::F32 => 1e-4,
        _ => 5e-3,
    });
    check_ratio("--tolerance", tolerance)?;
    let dir = tempdir()?;
    let mut r = runner(a, &dir)?;
    let opt = FuzzOptions {
        cases: a.cases.or(if a.time.is_some() { None } else { Some(100) }),
        time: a.time,
        seed: a.seed,
        tolerance,
        band: band_rule(a)?,
        keep_going: a.keep_going,
        out: a.out.clone(),
        ..FuzzOptions::default()
    };
    let bar = Progress::bar(opt.cases.unwrap_or(0), "fuzz cases");
    let report = fuzz::fuzz(&cfg, r.as_mut(), &opt, |_, _| bar.inc());
    drop(bar);
    drop(r);
    let _ = std::fs::remove_dir_all(&dir);
    report
}

/// `--band PRESET --samples N`, the preset checked by name.
fn band_rule(a: &Args) -> Result<Option<fuzz::BandRule>, CaseError> {
    let Some(preset) = &a.band else {
        return Ok(None);
    };
    if deltaref_verify::presets::find(preset, 2).is_none() {
        return Err(CaseError::Usage(format!(
            "--band: unknown precision `{preset}` (available: {})",
            deltaref_verify::presets::names()
        )));
    }
    Ok(Some(fuzz::BandRule {
        preset: preset.clone(),
        samples: a.samples,
    }))
}

/// A private folder for the runner's case and output files.
fn tempdir() -> Result<PathBuf, CaseError> {
    let base = std::env::temp_dir().join(format!(
        "deltaref-fuzz-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&base)
        .map_err(|e| CaseError::Usage(format!("creating {}: {e}", base.display())))?;
    Ok(base)
}

pub fn run(a: Args) -> ExitCode {
    match go(&a) {
        Ok(report) => {
            if a.json {
                super::print(&serde_json::to_string_pretty(&report).expect("report serialises"));
            } else {
                super::print(&fuzz::render(&report));
            }
            if report.pass() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => fail(&e),
    }
}
