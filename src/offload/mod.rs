//! Model-agnostic offload engine: what lives where, and when it moves.
