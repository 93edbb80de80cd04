//! Device probe, memory accounting and planning.
//!
//! The probe answers what kind of memory the selected device has; the rules in [`overrides`]
//! then adjust the offload options to it, so a unified-memory machine (DGX Spark) never pays
//! for host copies that only duplicate what the GPU already sees.

pub mod accounting;
pub mod options;
pub mod overrides;
pub mod plan;
pub mod probe;

pub use options::MemoryOptions;
pub use overrides::{apply_memory_rules, Override};
pub use probe::{probe, DeviceChoice, DeviceError, DeviceInfo, DeviceKind, MemoryModel};
