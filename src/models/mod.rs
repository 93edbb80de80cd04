//! Model families, and how their files and weights are found. Models expose their blocks and
//! know nothing of offloading.

pub mod attention;
pub mod loader;
pub mod minimax_h3;
pub mod source;
pub mod wan;
