pub mod cron;
pub mod spec;
pub mod timeline;
