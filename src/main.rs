use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    almanac::cli::main().await
}
