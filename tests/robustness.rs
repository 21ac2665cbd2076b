//! The robustness harness (docs/robustness.md): the whole product under a nemesis, judged from
//! the recorded history. `ci_profile` plays the short profile with a fixed seed; `soak` plays
//! any profile for as long as asked:
//!
//! ```text
//! SOAK_PROFILE=v35 SOAK_MINUTES=60 SOAK_SEED=0x1 cargo test --release --test it -- --nocapture robustness::soak
//! ```
//!
//! `SOAK_PROFILE` is `ci`, `v35` (etcd 3.5) or `v34` (Debian's etcd 3.4); without `SOAK_SEED` the
//! clock picks one and the run prints it. A run that finds a violation writes a report directory
//! (`SOAK_REPORT_DIR`, default `target/robustness/`; `SOAK_REPORT=1` writes one for a passing run
//! too) and prints the line that replays it. `FAULT_BIN=<path>` judges another build of
//! `etcd-warden` (a previous release) with the same harness.

use crate::support;

use std::time::Duration;

use support::soak::{self, Profile};

fn parse_seed(s: &str) -> u64 {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).expect("SOAK_SEED in hex"),
        None => s.parse().expect("SOAK_SEED"),
    }
}

async fn play(profile: &Profile, seed: u64, minutes: f64) -> soak::SoakOutcome {
    let outcome = soak::run(profile, seed, Duration::from_secs_f64(minutes * 60.0)).await;
    println!("{}", outcome.summary);
    if let Some(dir) = &outcome.report_dir {
        println!("report: {}", dir.display());
        if let Ok(s) = std::fs::read_to_string(dir.join("summary.txt")) {
            println!("{s}");
        }
    }
    outcome
}

/// The CI profile: three minutes of every feature and fault, about three hand-offs, fixed seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ci_profile() {
    let profile = Profile::named("ci").expect("the ci profile");
    let outcome = play(&profile, 0x40, 3.0).await;
    assert!(
        outcome.violations.is_empty(),
        "violations: {:#?}",
        outcome.violations
    );
}

/// Any profile for any time (runs nothing unless `SOAK_MINUTES` is set, and says so).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak() {
    let Some(minutes) = std::env::var("SOAK_MINUTES").ok() else {
        println!("SOAK_MINUTES is not set: no soak run (see docs/robustness.md)");
        return;
    };
    let minutes: f64 = minutes.parse().expect("SOAK_MINUTES: minutes");
    let name = std::env::var("SOAK_PROFILE").unwrap_or_else(|_| "v35".into());
    let profile = Profile::named(&name).unwrap_or_else(|| panic!("unknown SOAK_PROFILE {name}"));
    let seed = std::env::var("SOAK_SEED").map_or_else(
        |_| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_secs())
        },
        |s| parse_seed(&s),
    );
    println!("soak: profile {name} seed {seed:#x} for {minutes} min");
    let outcome = play(&profile, seed, minutes).await;
    assert!(
        outcome.violations.is_empty(),
        "violations: {:#?}",
        outcome.violations
    );
}
