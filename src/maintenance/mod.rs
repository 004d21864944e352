//! Background maintenance roles that any number of instances may run at once.

pub mod reaper;

pub use reaper::{Reaper, ReaperConfig};
