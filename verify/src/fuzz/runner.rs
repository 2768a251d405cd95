//! Candidate runners: what computes a kernel's results for a fuzz case.
//!
//! # The runner protocol
//!
//! A case goes to a runner in the candidate's convention ([`KernelCase`]):
//! FLA's tensor names, the layout the convention declares (state `[V, K]`,
//! packed `[T, H, D]`, linear α, tiled value heads, …). Out of process it
//! is a safetensors file in deltaref's case format: every input and
//! upstream gradient (`q k v g beta [A_log dt_bias] [initial_state] do
//! [dht]`) stored in the fuzz `--dtype`, `cu_seqlens` as int64 when the
//! case is varlen, and two metadata entries: `case` (the JSON object of a
//! case file: `op` and FLA's option names, e.g. `scale`,
//! `use_qk_l2norm_in_kernel`) and `convention` (the JSON object of
//! [`crate::convention::Convention::to_json`]: `name`, `gate`, `state`,
//! `packed`, `heads`, `source`). The runner writes its results to the
//! output path, a safetensors file with at least `o` and `final_state`
//! (and any gradients `dq dk dv dg dbeta dh0 …` it computes, which are then
//! judged too) in the same convention, any float dtype; the `case`
//! metadata is optional.
//!
//! Two kinds of process runner:
//! - a **command** with `{case}` and `{out}` placeholders, run through
//!   `sh -c` once per case; exit status 0 means the output was written;
//! - a **worker** (`--worker CMD`): one long-lived process that reads one
//!   JSON request per line on stdin, `{"case": "/path/case.safetensors",
//!   "out": "/path/out.safetensors"}`, and answers one JSON line on stdout,
//!   `{"ok": true}` or `{"ok": false, "error": "…"}`, so a GPU runner keeps
//!   its compiled kernels and autotuning across cases. It exits when stdin
//!   closes.
//!
//! In process, a runner is anything implementing [`Runner`]: the oracle in
//! f32 or f64 ([`OracleRunner`], `builtin:f32`), or a closure
//! ([`FnRunner`], what the Python package wraps).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use crate::case::{Case, CaseMeta, Dtype, Op};
use crate::convention::{Convention, Dims};
use crate::impls::{Compute, EngineName, Impl, ImplName, ImplRequest};
use crate::outputs::Tensors;

/// A case as the candidate's convention lays it out.
#[derive(Clone, Debug)]
pub struct KernelCase {
    pub meta: CaseMeta,
    pub convention: &'static Convention,
    /// Inputs and upstream gradients in the convention's layout (FLA's names).
    pub tensors: Tensors,
    pub cu_seqlens: Option<Vec<i64>>,
    /// The sizes of the FLA case, which map results back.
    pub dims: Dims,
    pub dtype: Dtype,
}

impl KernelCase {
    /// The FLA case `case` in convention `conv` (which must take it).
    pub fn of(case: &Case, conv: &'static Convention, dtype: Dtype) -> Result<KernelCase, String> {
        conv.check(case)?;
        let mut fla = case.clone();
        fla.tensors.retain(|n, _| {
            case.meta.op.inputs().contains(&n.as_str())
                || case.meta.op.upstream().contains(&n.as_str())
        });
        Ok(KernelCase {
            meta: case.meta.clone(),
            convention: conv,
            tensors: conv.to_kernel(&fla)?,
            cu_seqlens: case.cu_seqlens.clone(),
            dims: Dims::of(case)?,
            dtype,
        })
    }

    pub fn op(&self) -> Op {
        self.meta.op
    }

    /// The FLA case again (inputs and upstream gradients), mapped back.
    pub fn to_fla(&self) -> Result<Case, String> {
        let mut case = Case::new(self.meta.clone());
        case.cu_seqlens = self.cu_seqlens.clone();
        for (n, x) in self
            .convention
            .to_fla(self.op(), &self.dims, self.tensors.clone())?
        {
            case.insert(&n, x, self.dtype);
        }
        Ok(case)
    }

    /// The safetensors bytes of the protocol's case file.
    pub fn to_bytes(&self) -> Result<Vec<u8>, String> {
        let mut case = Case::new(self.meta.clone());
        case.cu_seqlens = self.cu_seqlens.clone();
        for (n, x) in &self.tensors {
            case.insert(n, x.clone(), self.dtype);
        }
        case.to_bytes_with_metadata(&[("convention", self.convention.to_json().to_string())])
            .map_err(|e| e.to_string())
    }

    /// Results in this convention's layout mapped back to FLA's.
    pub fn results_to_fla(&self, results: Tensors) -> Result<Tensors, String> {
        self.convention.to_fla(self.op(), &self.dims, results)
    }
}

/// Why a runner gave no results.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// The runner could not be started or talked to (exit status 2).
    #[error("the runner could not run: {0}")]
    Broken(String),
    /// The runner ran and failed on this case (a finding).
    #[error("the runner failed on this case: {0}")]
    Failed(String),
}

/// A candidate: a case in its convention in, its results (same convention) out.
pub trait Runner {
    /// What to call it in reports.
    fn name(&self) -> String;
    fn run(&mut self, case: &KernelCase) -> Result<Tensors, RunnerError>;
}

/// The oracle as a candidate (`builtin:f32`, `builtin:f64`, or a
/// precision preset `builtin:PRESET`): the case is mapped back to FLA,
/// computed (forward only, or with the backward when `backward`), and its
/// results mapped into the convention. The fuzzer's loop then maps them
/// back again: the round trip is what it tests. A case with `cp` metadata
/// is computed under simulated CP with those cut points (naive ranks
/// without a preset, chunked ranks with one, as FLA's kernels are); a
/// preset's CP fault (`partial-merge-v`, …) applies to CP cases only, the
/// others run the preset without its fault.
pub struct OracleRunner {
    pub compute: Compute,
    pub backward: bool,
    /// A precision preset ([`crate::presets`]) the oracle emulates.
    pub preset: Option<String>,
}

impl OracleRunner {
    /// The plain oracle, forward only, in `compute`.
    pub fn new(compute: Compute) -> OracleRunner {
        OracleRunner {
            compute,
            backward: false,
            preset: None,
        }
    }

    /// `builtin:f32`, `builtin:f64` or `builtin:PRESET` (forward only);
    /// an unknown name is an error listing the choices.
    pub fn parse(spec: &str) -> Result<OracleRunner, String> {
        let name = spec.strip_prefix("builtin:").unwrap_or(spec);
        if let Ok(compute) = name.parse::<Compute>() {
            return Ok(OracleRunner::new(compute));
        }
        if crate::presets::find(name, 2).is_some() {
            return Ok(OracleRunner {
                preset: Some(name.into()),
                ..OracleRunner::new(Compute::F32)
            });
        }
        Err(format!(
            "--runner {spec}: expected builtin:f32, builtin:f64 or builtin:PRESET with a precision preset ({})",
            crate::presets::names()
        ))
    }

    /// The implementation and compute scalar that run `fla` (FLA's layout).
    fn implementation(&self, fla: &Case) -> Result<(Impl, Compute), String> {
        let cp = fla.meta.cp.is_some();
        let Some(preset) = &self.preset else {
            if !cp {
                return Ok((Impl::NAIVE, self.compute));
            }
            let req = ImplRequest {
                name: ImplName::Cp,
                cp_engine: Some(EngineName::Naive),
                ..ImplRequest::default()
            };
            return Ok((req.resolve(fla).map_err(|e| e.to_string())?, self.compute));
        };
        let precision = if cp {
            preset.as_str()
        } else {
            crate::presets::without_fault(preset)
        };
        let req = ImplRequest {
            name: if cp { ImplName::Cp } else { ImplName::Chunk },
            precision: Some(precision.into()),
            ..ImplRequest::default()
        };
        let (imp, compute) = req.resolve_with_compute(fla).map_err(|e| e.to_string())?;
        Ok((imp, compute.unwrap_or(self.compute)))
    }
}

impl Runner for OracleRunner {
    fn name(&self) -> String {
        match &self.preset {
            Some(p) => format!("builtin:{p}"),
            None => format!("builtin:{}", self.compute.name()),
        }
    }

    fn run(&mut self, case: &KernelCase) -> Result<Tensors, RunnerError> {
        let fla = case.to_fla().map_err(RunnerError::Failed)?;
        let (imp, compute) = self.implementation(&fla).map_err(RunnerError::Failed)?;
        let out = if self.backward {
            imp.compute(&fla, compute)
        } else {
            imp.compute_forward(&fla, compute)
        }
        .map_err(|e| RunnerError::Failed(e.to_string()))?;
        let mut with = fla.clone();
        for (n, x) in out {
            with.tensors.insert(n, x);
        }
        let names = fla.meta.op.results();
        let mut kernel = case
            .convention
            .to_kernel(&with)
            .map_err(RunnerError::Failed)?;
        kernel.retain(|n, _| names.contains(&n.as_str()));
        Ok(kernel)
    }
}

/// A closure as a candidate (tests with planted faults, Python callables).
pub struct FnRunner<F: FnMut(&KernelCase) -> Result<Tensors, String>> {
    pub name: String,
    pub f: F,
}

impl<F: FnMut(&KernelCase) -> Result<Tensors, String>> Runner for FnRunner<F> {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn run(&mut self, case: &KernelCase) -> Result<Tensors, RunnerError> {
        (self.f)(case).map_err(RunnerError::Failed)
    }
}

/// Writes the protocol's case file for `case` to `path` and, after the
/// runner wrote `out`, reads its results (any float dtype, FLA's names).
fn exchange(
    case: &KernelCase,
    path: &Path,
    out: &Path,
    run: impl FnOnce() -> Result<(), RunnerError>,
) -> Result<Tensors, RunnerError> {
    let bytes = case.to_bytes().map_err(RunnerError::Broken)?;
    crate::case::write_atomic(path, &bytes).map_err(|e| RunnerError::Broken(e.to_string()))?;
    let _ = std::fs::remove_file(out);
    run()?;
    let cand = Case::read_candidate(out, case.op())
        .map_err(|e| RunnerError::Failed(format!("reading its output: {e}")))?;
    Ok(cand.tensors)
}

/// A command run once per case: `{case}` and `{out}` in `template` are
/// replaced by the paths (see the module docs).
pub struct CommandRunner {
    pub template: String,
    pub dir: PathBuf,
}

impl CommandRunner {
    /// Refuses a template without both placeholders.
    pub fn new(template: &str, dir: &Path) -> Result<CommandRunner, String> {
        if !template.contains("{case}") || !template.contains("{out}") {
            return Err(format!("--runner `{template}`: a command needs both {{case}} and {{out}} placeholders (or use --worker)"));
        }
        Ok(CommandRunner {
            template: template.into(),
            dir: dir.into(),
        })
    }
}

impl Runner for CommandRunner {
    fn name(&self) -> String {
        self.template.clone()
    }

    fn run(&mut self, case: &KernelCase) -> Result<Tensors, RunnerError> {
        let (path, out) = (
            self.dir.join("case.safetensors"),
            self.dir.join("out.safetensors"),
        );
        let cmd = self
            .template
            .replace("{case}", &shell_quote(&path))
            .replace("{out}", &shell_quote(&out));
        exchange(case, &path, &out, || {
            let o = Command::new("sh")
                .arg("-c")
                .arg(&cmd)
                .stdin(Stdio::null())
                .output()
                .map_err(|e| RunnerError::Broken(format!("sh -c {cmd}: {e}")))?;
            if o.status.success() {
                Ok(())
            } else {
                let err = String::from_utf8_lossy(&o.stderr);
                let tail: String = err
                    .lines()
                    .rev()
                    .take(5)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                Err(RunnerError::Failed(format!(
                    "`{cmd}` exited with {}: {tail}",
                    o.status
                )))
            }
        })
    }
}

/// A path quoted for `sh`.
fn shell_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', "'\\''"))
}

/// A persistent worker speaking the line protocol (see the module docs).
pub struct WorkerRunner {
    command: String,
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    dir: PathBuf,
}

impl WorkerRunner {
    /// Starts `command` through `sh -c`.
    pub fn start(command: &str, dir: &Path) -> Result<WorkerRunner, String> {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("--worker `{command}`: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().ok_or("--worker: no stdout")?);
        Ok(WorkerRunner {
            command: command.into(),
            child,
            stdin,
            stdout,
            dir: dir.into(),
        })
    }

    fn ask(&mut self, path: &Path, out: &Path) -> Result<(), RunnerError> {
        let req = serde_json::json!({"case": path, "out": out}).to_string();
        let broken = |e: String| RunnerError::Broken(format!("worker `{}`: {e}", self.command));
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| broken("stdin closed".into()))?;
        writeln!(stdin, "{req}")
            .and_then(|_| stdin.flush())
            .map_err(|e| broken(format!("writing the request: {e}")))?;
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .map_err(|e| broken(format!("reading the answer: {e}")))?;
        if n == 0 {
            return Err(broken("exited without answering".into()));
        }
        let v: serde_json::Value = serde_json::from_str(line.trim())
            .map_err(|e| broken(format!("answer `{}` is not JSON: {e}", line.trim())))?;
        match v.get("ok").and_then(serde_json::Value::as_bool) {
            Some(true) => Ok(()),
            Some(false) => Err(RunnerError::Failed(
                v.get("error")
                    .map_or("(no error given)".into(), |e| e.to_string()),
            )),
            None => Err(broken(format!(
                "answer `{}` has no boolean `ok`",
                line.trim()
            ))),
        }
    }
}

impl Runner for WorkerRunner {
    fn name(&self) -> String {
        format!("worker: {}", self.command)
    }

    fn run(&mut self, case: &KernelCase) -> Result<Tensors, RunnerError> {
        let (path, out) = (
            self.dir.join("case.safetensors"),
            self.dir.join("out.safetensors"),
        );
        exchange(case, &path, &out, || self.ask(&path, &out))
    }
}

impl Drop for WorkerRunner {
    fn drop(&mut self) {
        // Closing stdin asks the worker to exit; wait so no zombie is left.
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}
