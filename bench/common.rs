//! What the benchmarks share: their numeric arguments, the median of timed runs, and running
//! a tool that must succeed.

// Each benchmark uses a part of this.
#![allow(dead_code)]

use std::process::Command;
use std::time::Duration;

/// The numeric command-line arguments, in order; `defaults` for those not given.
pub fn numeric_args<const N: usize>(defaults: [usize; N]) -> [usize; N] {
    let mut out = defaults;
    let given = std::env::args().skip(1).filter_map(|a| a.parse().ok());
    for (slot, value) in out.iter_mut().zip(given) {
        *slot = value;
    }
    out
}

/// The middle of `v` (the upper middle of an even count).
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Runs `cmd` to its end; a failure panics with its stderr.
pub fn run(cmd: &mut Command) {
    let out = cmd.output().expect("run command");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
