pub mod cron;
pub mod ledger;
pub mod plan;
pub mod spec;
pub mod timeline;
