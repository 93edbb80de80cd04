//! Command line: flags to one resolved configuration.
