//! `deltaref tolerance`: the per-tensor bars a test at one shape should use
//! so that a correct kernel with a precision preset's storage fails it with
//! at most a given probability, from the band over several input draws.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

use clap::Args as ClapArgs;
use serde::Serialize;

use deltaref_verify::band::{self, ToleranceRow};
use deltaref_verify::case::CaseError;
use deltaref_verify::generate::generate;
use deltaref_verify::impls::oracle_truth;
use deltaref_verify::progress::Progress;

use super::band::{band_request, EnsembleArgs};
use super::gen::{spec, GenOpts};
use super::{fail, ImplArgs};

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The shape and options, as `deltaref gen` takes them; `--seed` is the
    /// first draw's seed (draw `d` uses seed + d).
    #[command(flatten)]
    pub gen: GenOpts,
    /// The implementation emulated (default: chunked; `--impl cp --world 8`
    /// for a CP test) and --precision, the preset (required).
    #[command(flatten)]
    pub imp: ImplArgs,
    /// The probability that a correct kernel fails a test asserting every
    /// tensor (each tensor gets an equal share).
    #[arg(long, default_value_t = 1e-3)]
    pub false_alarm: f64,
    /// Input draws (cases with seeds seed, seed+1, …), each with its own
    /// ensemble. The bar is fitted to the spread between draws with a
    /// small-sample (Student t) correction, so few draws give wide bars.
    #[arg(long, default_value_t = 8)]
    pub draws: usize,
    #[command(flatten)]
    pub ensemble: EnsembleArgs,
    /// Print the bars as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Report {
    precision: String,
    false_alarm: f64,
    draws: usize,
    samples: usize,
    rows: Vec<ToleranceRow>,
    python: String,
}

fn go(a: &Args) -> Result<Report, CaseError> {
    let usage = |m: String| Err(CaseError::Usage(m));
    let Some(precision) = a.imp.precision.as_deref() else {
        return usage(
            "--precision: name the preset the tested kernel stores like (e.g. fla-bf16)".into(),
        );
    };
    if !(a.false_alarm > 0.0 && a.false_alarm < 1.0) {
        return usage(format!(
            "--false-alarm: expected a probability in (0, 1), got {}",
            a.false_alarm
        ));
    }
    if a.draws < 2 {
        return usage(format!(
            "--draws: the bar is the spread between input draws, which needs at least 2 \
             (8 or more for a useful bar), got {}",
            a.draws
        ));
    }
    let spec_ = a.ensemble.spec();
    spec_.check().map_err(CaseError::Usage)?;
    let mut per_draw: BTreeMap<String, Vec<Vec<f64>>> = BTreeMap::new();
    let bar = Progress::bar(a.draws as u64, "input draws");
    for d in 0..a.draws {
        let mut gs = spec(&a.gen)?;
        gs.seed = a.gen.seed.wrapping_add(d as u64);
        gs.expected = false;
        let case = generate(&gs)?;
        let name = format!("<draw {d}, seed {}>", gs.seed);
        let path = Path::new(&name);
        bar.step(&format!("draw {d}: the f64 oracle"));
        let truth = oracle_truth(&case, path)?;
        let req = band_request(&a.imp, &case, precision)?;
        bar.step(&format!("draw {d}: {} emulation runs", spec_.samples));
        let (samples, _) = band::samples_of_case(&case, path, &truth, &req, &spec_)?;
        for (t, v) in band::per_tensor(&samples) {
            per_draw.entry(t).or_default().push(v);
        }
        bar.inc();
    }
    drop(bar);
    let rows = band::tolerance(&per_draw, a.false_alarm).map_err(CaseError::Usage)?;
    Ok(Report {
        precision: precision.to_string(),
        false_alarm: a.false_alarm,
        draws: a.draws,
        samples: spec_.samples,
        python: band::python_dict(&rows),
        rows,
    })
}

fn text(r: &Report) -> String {
    let mut s = format!(
        "bars for `{}` at false-alarm {:.0e} (a correct kernel fails some tensor with at most this \
         probability): {} input draws × {} emulation runs\n",
        r.precision, r.false_alarm, r.draws, r.samples
    );
    s += &format!(
        "{:<12} {:>9} {:>10} {:>10} {:>8} {:>8}\n",
        "tensor", "bar", "median", "max seen", "log sd", "between"
    );
    for row in &r.rows {
        s += &format!(
            "{:<12} {:>9.1e} {:>10.3e} {:>10.3e} {:>8.3} {:>8.3}\n",
            row.tensor, row.bar, row.median, row.max_seen, row.log_sd, row.log_sd_between
        );
    }
    if r.draws < 8 {
        // Student's t with few degrees of freedom has long tails: honest, but wide.
        s += &format!(
            "note: only {} input draws: the small-sample correction makes these bars wide; \
             use --draws 8 or more for bars a test can use\n",
            r.draws
        );
    }
    s + "# norm_ratio bars (FLA get_err_ratio / assert_close), from `deltaref tolerance`\n"
        + &r.python
}

pub fn run(a: Args) -> ExitCode {
    match go(&a) {
        Ok(r) => {
            if a.json {
                super::print(&serde_json::to_string_pretty(&r).expect("report serialises"));
            } else {
                super::print(&text(&r));
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}
