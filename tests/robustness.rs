//! The robustness harness (docs/robustness.md): the whole product under a nemesis, judged from
//! the recorded history. `ci_profile` plays the short profile with a fixed seed; `soak` plays
//! any profile for as long as asked:
//!
//! ```text
//! SOAK_PROFILE=v35 SOAK_MINUTES=60 SOAK_SEED=0x1 cargo test --release --test it -- --nocapture robustness::soak
//! ```
//!
//! `SOAK_PROFILE` is `ci`, `druid` (the ci profile under `[druid]`), `v35` (etcd 3.5) or `v34`
//! (Debian's etcd 3.4). Each run re-runs its test inside a network namespace of its own (`unshare
//! --net`) for the partition fault (iptables there, nowhere else). Without `SOAK_SEED` the
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

/// Runs the test `name` of this binary again inside a network namespace of its own
/// (`unshare --net`, with `lo` up), where the partition fault may add packet filters: the
/// namespace holds the whole world (every process of the run talks over its loopback), and no
/// rule can touch anything outside it. `Some(passed)` when it ran there; `None` when this
/// process is that run already, or no namespace can be made (then the caller runs here,
/// without the partition, and the run says so).
fn in_own_netns(name: &str) -> Option<bool> {
    if std::env::var_os(soak::NETNS_ENV).is_some() {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let probe = std::process::Command::new("unshare")
        .args(["--net", "--", "ip", "link", "set", "lo", "up"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        println!("no network namespace of our own (unshare --net failed): running without it");
        return None;
    }
    let out = std::process::Command::new("unshare")
        .args([
            "--net",
            "--",
            "sh",
            "-c",
            "ip link set lo up && exec \"$@\"",
            "sh",
        ])
        .arg(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(soak::NETNS_ENV, "1")
        .output()
        .expect("run the test in a network namespace");
    println!("{}", String::from_utf8_lossy(&out.stdout));
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    Some(out.status.success())
}

/// The CI profile: three minutes of every feature and fault, about three hand-offs, fixed seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ci_profile() {
    if let Some(passed) = in_own_netns("robustness::ci_profile") {
        assert!(
            passed,
            "the run in its own network namespace failed (above)"
        );
        return;
    }
    let profile = Profile::named("ci").expect("the ci profile");
    let outcome = play(&profile, 0x40, 3.0).await;
    let h = &outcome.handoffs;
    println!("ci_profile hand-offs: {h}");
    assert!(
        outcome.violations.is_empty(),
        "violations: {:#?}",
        outcome.violations
    );
    // Both outcomes a hand-off may reach are judged in CI, and none is left unsettled.
    assert!(
        h.one_final >= 2 && h.timed_out >= 1 && h.unsettled == 0,
        "the CI run must reach outcome (a) at least twice and (b) at least once, with none \
         unsettled: {h}"
    );
}

/// Any profile for any time (runs nothing unless `SOAK_MINUTES` is set, and says so).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak() {
    let Some(minutes) = std::env::var("SOAK_MINUTES").ok() else {
        println!("SOAK_MINUTES is not set: no soak run (see docs/robustness.md)");
        return;
    };
    if let Some(passed) = in_own_netns("robustness::soak") {
        assert!(
            passed,
            "the run in its own network namespace failed (above)"
        );
        return;
    }
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

/// The operator lane alone, for `OPERATOR_LANE_MINUTES` (runs nothing unless set): a machine
/// replaced (or killed for good, then replaced) every 15–25 s, then the lane's checkers. A
/// planted operator defect (`voter-removed-early`) shows here in a minute or two, without the
/// sidecars' world.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn operator_lane() {
    let Some(minutes) = std::env::var("OPERATOR_LANE_MINUTES").ok() else {
        println!("OPERATOR_LANE_MINUTES is not set: no operator lane run");
        return;
    };
    let minutes: f64 = minutes.parse().expect("OPERATOR_LANE_MINUTES: minutes");
    let seed = std::env::var("SOAK_SEED").map_or(0x40, |s| parse_seed(&s));
    let epoch = std::time::Instant::now();
    let mut lane = soak::OperatorLane::start(support::etcd::Release::V34, seed, epoch)
        .await
        .expect("the operator lane starts");
    let mut rng = support::schedule::SplitMix64::new(seed);
    let until = epoch + Duration::from_secs_f64(minutes * 60.0);
    while std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(rng.range(15, 25))).await;
        let said = lane.act(&mut rng).await;
        println!("{:.1}s: {said}", epoch.elapsed().as_secs_f64());
    }
    let violations = lane.judge().await;
    println!(
        "operator lane {:.1} min: replacements={} dead_for_good={} operator_restarts={} \
         membership_changes={} violations={}",
        epoch.elapsed().as_secs_f64() / 60.0,
        lane.replacements,
        lane.deaths,
        lane.operator_restarts,
        lane.members.lock().unwrap_or_else(|e| e.into_inner()).len(),
        violations.len()
    );
    for v in &violations {
        println!("VIOLATION [{}] {}", v.kind, v.detail);
    }
    assert!(violations.is_empty(), "violations: {violations:#?}");
}
