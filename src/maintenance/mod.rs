//! Background maintenance roles that any number of instances may run at once.

pub mod janitor;
pub mod reaper;

pub use janitor::{Janitor, JanitorConfig, JanitorReport};
pub use reaper::{Reaper, ReaperConfig};
