//! tollgate's entry point: parse the command line, run one command, exit with its code.

use clap::Parser;
use std::process::ExitCode;
use tollgate::cli::{self, Cli, Command};

fn main() -> ExitCode {
    let args = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tollgate: cannot start the runtime: {e}");
            return ExitCode::from(cli::EXIT_INVALID);
        }
    };
    let code = match args.command {
        Command::Serve { policy } => rt.block_on(cli::serve(&policy)),
        Command::Check { policy } => cli::check(&policy),
        Command::Test { files, json } => rt.block_on(cli::test(&files, json)),
    };
    ExitCode::from(code)
}
