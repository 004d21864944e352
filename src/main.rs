use std::process::ExitCode;

/// mimalloc instead of the system allocator: the relay and workers allocate
/// and free many small buffers across threads (rows, messages, futures), and
/// glibc's malloc took about a quarter of the relay's CPU in a profile.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // A job command's watchdog (almanac::worker::watchdog): no runtime, no CLI.
    if let Some(code) = almanac::worker::watchdog::main_if_called() {
        return code;
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("could not start the tokio runtime")
        .block_on(almanac::cli::main())
}
