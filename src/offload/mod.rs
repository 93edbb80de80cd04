//! Model-agnostic offload engine: what lives where, and when it moves.
//!
//! A model exposes its parts as "build part i from a `VarBuilder`" (a run of transformer
//! blocks, or a whole component). The engine records which tensors each part asks for
//! ([`group::record`]), lays them out once as a host image in a few exact-size arenas, pinned or
//! pageable, or leaves them in the memory map, page-locked in place ([`host::HostStore`],
//! [`locked`]), and moves a part to the device just before it runs
//! ([`transfer::Transfer`]: one copy per dtype into device slots reused round-robin, on a copy
//! stream ordered with CUDA events) while the previous parts compute ([`streamer::Offloaded`]).
//! A finished part's slot is refilled with a later part; the host copy stays, nothing is copied
//! back. Tensors the weights hold compactly (GGUF blocks, `--storage-dtype` fp8) stay so on the
//! host and on the copy stream, and are expanded to the compute dtype where they land
//! ([`group::Slot::packed`]). Models know nothing of this: they only see a `VarBuilder`.

pub mod group;
pub mod host;
pub mod locked;
pub mod residency;
pub mod staging;
pub mod streamer;
pub mod transfer;

pub use group::{record, GroupLayout, Packing, Recording};
pub use host::{HostMemory, HostStore};
pub use residency::{ComponentLayout, DeviceWeights, Residency};
pub use staging::build_resident;
pub use streamer::{BuildGroup, Offloaded, StreamOptions, Usage};
pub use transfer::{CopyStats, Transfer};
