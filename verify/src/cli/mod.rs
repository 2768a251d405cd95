//! One module per subcommand: each exposes `Args` and `run(args) -> ExitCode`.

pub mod selfcheck;
