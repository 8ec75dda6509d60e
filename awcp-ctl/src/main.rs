//! `awcp-ctl`: parse the command line, run the command. All logic lives in the library.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
