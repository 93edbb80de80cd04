//! The stage runner.
