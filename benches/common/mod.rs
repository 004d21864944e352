//! A scratch database for a benchmark run, dropped at the end.

use sqlx::{Connection, PgPool};

pub struct Scratch {
    pub pool: PgPool,
    admin_url: String,
    name: String,
}

impl Scratch {
    /// Creates `almanac_bench_<what>_<pid>` next to `DATABASE_URL`'s database
    /// and applies the migrations.
    pub async fn new(what: &str) -> anyhow::Result<Scratch> {
        let base = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| almanac::config::DEFAULT_DATABASE_URL.into());
        let (prefix, _) = base
            .rsplit_once('/')
            .expect("DATABASE_URL names a database");
        let name = format!("almanac_bench_{what}_{}", std::process::id());
        let pool = almanac::db::connect_and_migrate(&format!("{prefix}/{name}"), 16).await?;
        Ok(Scratch {
            pool,
            admin_url: format!("{prefix}/postgres"),
            name,
        })
    }

    pub async fn drop(self) -> anyhow::Result<()> {
        self.pool.close().await;
        let mut admin = sqlx::PgConnection::connect(&self.admin_url).await?;
        sqlx::query(&format!("DROP DATABASE \"{}\" WITH (FORCE)", self.name))
            .execute(&mut admin)
            .await?;
        Ok(())
    }
}
