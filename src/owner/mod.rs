//! Ownership: owner DNS lookups, the pure state machine, and the watchdog that acts on it.
