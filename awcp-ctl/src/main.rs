//! `awcp-ctl`: parse the command line, run the command. All logic lives in the library.

mod cli;

// Hundreds of thousands of small allocations per delegation (the manifest's entries, a
// mount's inode table): glibc's malloc and free were a fifth of the Executor's CPU samples
// over 100,000-file delegations. mimalloc, with a mount's inode table in huge pages.
#[global_allocator]
static GLOBAL: awcpfs::alloc::Alloc = awcpfs::alloc::Alloc;

fn main() -> std::process::ExitCode {
    cli::main()
}
