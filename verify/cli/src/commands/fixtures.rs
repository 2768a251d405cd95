//! `deltaref fixtures`: write the fixture set and its manifest, or check a
//! committed set against a fresh regeneration.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args as ClapArgs;
use deltaref_verify::fixtures;

use super::fail;

#[derive(ClapArgs, Debug)]
#[group(required = true, multiple = false)]
pub struct Args {
    /// Write the set and manifest.json into this directory.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Regenerate in memory and compare with this directory (exit 1 on any difference).
    #[arg(long)]
    pub check: Option<PathBuf>,
}

pub fn run(a: Args) -> ExitCode {
    if let Some(dir) = &a.out {
        return match fixtures::write(dir) {
            Ok(m) => {
                super::print(&format!(
                    "wrote {} fixtures and manifest.json to {}",
                    m.fixtures.len(),
                    dir.display()
                ));
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        };
    }
    let dir = a.check.expect("clap requires --out or --check");
    match fixtures::check(&dir) {
        Ok(problems) if problems.is_empty() => {
            super::print(&format!(
                "{}: every fixture regenerates byte for byte",
                dir.display()
            ));
            ExitCode::SUCCESS
        }
        Ok(problems) => {
            for p in problems {
                eprintln!("fixture mismatch: {p}");
            }
            ExitCode::from(1)
        }
        Err(e) => fail(&e),
    }
}
