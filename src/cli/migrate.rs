//! `almanac migrate`

use super::Ctx;

#[derive(Debug, clap::Args)]
pub struct Args {}

pub async fn run(ctx: &Ctx, _args: Args) -> anyhow::Result<()> {
    let pool = ctx.migrated_pool(2).await?;
    let version: Option<i64> =
        sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(&pool)
            .await?;
    println!(
        "schema almanac is at migration {} on {}",
        version.unwrap_or(0),
        crate::db::Target::of(&pool.connect_options())
    );
    Ok(())
}
