//! `deltaref selfcheck`: all implementations against each other on built-in
//! cases; exits 1 if any row fails.

use std::process::ExitCode;

use clap::Args as ClapArgs;

use deltaref_verify::selfcheck;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Print the rows as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> ExitCode {
    let report = match selfcheck::run() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if args.json {
        super::print(&serde_json::to_string_pretty(&report).expect("rows serialise"));
    } else {
        super::print(&report.to_string());
    }
    if report.all_pass() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
