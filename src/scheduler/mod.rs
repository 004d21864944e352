pub mod cron;
pub mod timeline;
