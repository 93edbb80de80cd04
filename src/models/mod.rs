//! Model families. Models expose their blocks and know nothing of offloading.

pub mod attention;
pub mod wan;
