//! Device probe, memory accounting and planning.
