//! Every dashboard page's time for `bench --scale`, requested through the
//! real HTTP server (the dashboard mounted as `almanac run` mounts it, on
//! 127.0.0.1 at a port of its own), one connection per request.

use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use super::{fill::BROKER_KIND, median_ms, Figures, Goal};

/// Each page's median time over five requests (after one unmeasured);
/// `probe` is a dead job of the bench's kind, for the pages that show one.
pub async fn measure(pool: &PgPool, probe: i64, f: &mut Figures) -> anyhow::Result<()> {
    let server = crate::http::HttpServer::bind(
        "127.0.0.1:0".parse().expect("an address"),
        None,
        &pool.connect_options(),
    )
    .await?
    .mount(crate::ui::router(pool, crate::ui::UiConfig::default()));
    let addr = server.local_addr().to_string();
    let stop = CancellationToken::new();
    let serving = tokio::spawn(server.run(stop.clone()));
    let paths = [
        "/".to_string(),
        "/jobs".to_string(),
        "/jobs?status=ready".to_string(),
        format!("/jobs?kind={BROKER_KIND}"),
        format!("/jobs/{probe}"),
        "/dead".to_string(),
        "/dead?kind=scale.a".to_string(),
        "/schedules".to_string(),
        "/schedules/scale-0".to_string(),
        "/routes".to_string(),
        "/audit".to_string(),
    ];
    let mut result = Ok(());
    for path in paths {
        match median_ms(|| get(&addr, &path)).await {
            // The probe's id differs from size to size; the name may not.
            Ok(ms) => f.add(
                format!("page {}", path.replace(&probe.to_string(), "{id}")),
                "ms",
                Goal::Time,
                ms,
            ),
            Err(err) => {
                result = Err(err);
                break;
            }
        }
    }
    stop.cancel();
    serving.await??;
    result
}

/// One GET that must answer 200.
async fn get(addr: &str, path: &str) -> anyhow::Result<()> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let status = text.split_whitespace().nth(1).unwrap_or("");
    anyhow::ensure!(
        status == "200",
        "the dashboard answered {path} with {}",
        text.lines().next().unwrap_or("nothing")
    );
    Ok(())
}
