use std::process::ExitCode;

/// mimalloc instead of the system allocator: the relay and workers allocate
/// and free many small buffers across threads (rows, messages, futures), and
/// glibc's malloc took about a quarter of the relay's CPU in a profile.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    almanac::cli::main().await
}
