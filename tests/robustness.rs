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
    let (passed, stdout) = rerun(name, &[])?;
    println!("{stdout}");
    Some(passed)
}

/// Runs the test `name` of this binary again with `envs`, in a network namespace of its own
/// when one can be made (see [`in_own_netns`]), else here; `(passed, stdout)`. `None` when the
/// binary cannot be found.
fn rerun(name: &str, envs: &[(&str, &str)]) -> Option<(bool, String)> {
    let exe = std::env::current_exe().ok()?;
    let probe = std::process::Command::new("unshare")
        .args(["--net", "--", "ip", "link", "set", "lo", "up"])
        .output();
    let mut cmd = if probe.is_ok_and(|o| o.status.success()) {
        let mut c = std::process::Command::new("unshare");
        c.args([
            "--net",
            "--",
            "sh",
            "-c",
            "ip link set lo up && exec \"$@\"",
            "sh",
        ])
        .arg(exe)
        .env(soak::NETNS_ENV, "1");
        c
    } else if envs.is_empty() {
        println!("no network namespace of our own (unshare --net failed): running without it");
        return None;
    } else {
        println!("no network namespace of our own (unshare --net failed): running without it");
        std::process::Command::new(exe)
    };
    let out = cmd
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .envs(envs.iter().copied())
        .output()
        .expect("run the test in a network namespace");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    Some((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    ))
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

/// The variable naming the one plant a child run of [`plants`] plays.
const PLANT_ONE: &str = "ROBUSTNESS_PLANT_ONE";

/// Every planted defect caught: for each plant of `etcd_warden::plant` (the table in
/// `tests/support/plants.rs`), a short soak (the `plants` profile, seed 0x40) with the plant
/// switched on, stopped as soon as one of the plant's checkers fires; a table plant → checker
/// → seconds, and a failure if a plant whose checker is on this branch goes uncaught. Each plant
/// plays in a process of its own (this test run again), since the seam reads `WARDEN_PLANT`
/// once per process and the operator lane runs in the test's process. Runs only when `PLANTS`
/// is set: `PLANTS=all` (every plant whose checker is on this branch), `PLANTS=every`, or
/// `PLANTS=ready-late,never-final`.
/// Plants played at once (CI's three together).
const PLANTS_AT_ONCE: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plants() {
    use support::plants::{self, Caught};
    if let Ok(one) = std::env::var(PLANT_ONE) {
        let [e] = plants::select(Some(&one)).expect("the plant")[..] else {
            panic!("{PLANT_ONE} names one plant");
        };
        let profile = Profile::named("plants").expect("the plants profile");
        let outcome = soak::run_until(
            &profile,
            0x40,
            Duration::from_secs_f64(e.minutes * 60.0),
            e.checkers,
        )
        .await;
        println!("{}", outcome.summary);
        if let Some(dir) = &outcome.report_dir {
            println!("report: {}", dir.display());
        }
        let caught = Caught {
            plant: e.plant.to_string(),
            fired: plants::caught_by(&e, &outcome.fired),
            kinds: outcome.fired.keys().map(|k| k.to_string()).collect(),
        };
        println!("{}", plants::result_line(&caught));
        return;
    }
    let Ok(selection) = std::env::var("PLANTS") else {
        println!("PLANTS is not set: no plant played (PLANTS=all, or names; docs/robustness.md)");
        return;
    };
    if !etcd_warden::plant::COMPILED {
        panic!("the plants are in debug builds only: run without --release");
    }
    let chosen = plants::select(Some(&selection)).unwrap_or_else(|e| panic!("{e}"));
    let started = std::time::Instant::now();
    let mut rows = Vec::new();
    // Three at a time, each in its own process and network namespace: a soak spends most of
    // its time waiting on the protocol's timeouts, and whether a plant's checker fires does not
    // depend on the machine's load (what else fires is reported, never judged here).
    for batch in chosen.chunks(PLANTS_AT_ONCE) {
        let runs: Vec<_> = batch
            .iter()
            .map(|e| {
                let e = *e;
                let t = std::time::Instant::now();
                let mut envs = vec![
                    (PLANT_ONE, e.plant),
                    (support::warden::CHILD_PLANT_ENV, e.switched_on()),
                ];
                if e.in_process {
                    envs.push((support::warden::PLANT_ENV, e.switched_on()));
                }
                let name = "robustness::plants";
                tokio::task::spawn_blocking(move || (e, rerun(name, &envs), t.elapsed()))
            })
            .collect();
        for run in runs {
            let (e, out, took) = run.await.expect("the plant's run");
            let caught = out
                .as_ref()
                .and_then(|(_, stdout)| plants::parse_result(stdout));
            if let Some((_, stdout)) = &out {
                // The summary may follow libtest's "test … ... " on its line.
                for l in stdout.lines() {
                    let at = ["PASS profile=", "FAIL profile=", "report: "]
                        .iter()
                        .find_map(|p| l.find(p));
                    if let Some(at) = at {
                        println!("  {}: {}", e.plant, &l[at..]);
                    }
                }
            }
            rows.push((e, caught, took));
        }
    }
    for e in plants::EXPECT {
        if e.pending.is_some() && !rows.iter().any(|(r, _, _)| r.plant == e.plant) {
            println!(
                "  {}: not played: its checker ({}) is #53 part {}'s, not on this branch \
                 (PLANTS={} plays it)",
                e.plant,
                e.checkers.join(" / "),
                e.pending.unwrap_or(""),
                e.plant
            );
        }
    }
    let mut table = String::from(
        "plant | expected checker | fired? | seconds to fire | run took | other kinds found\n",
    );
    let mut uncaught = Vec::new();
    for (e, caught, took) in &rows {
        let (fired, secs) = match caught.as_ref().and_then(|c| c.fired.clone()) {
            Some((k, s)) => (format!("yes ({k})"), format!("{s:.0}")),
            None if e.pending.is_some() => (
                format!(
                    "no: PENDING, #53 part {} not on this branch",
                    e.pending.unwrap_or("")
                ),
                "-".into(),
            ),
            None => {
                uncaught.push(e.plant);
                ("NO".into(), "-".into())
            }
        };
        let others = caught
            .as_ref()
            .map(|c| c.kinds.join(","))
            .filter(|k| !k.is_empty())
            .unwrap_or_else(|| "-".into());
        table.push_str(&format!(
            "{} | {} | {fired} | {secs} | {:.0} s | {others}\n",
            e.plant,
            e.checkers.join(" / "),
            took.as_secs_f64()
        ));
    }
    println!(
        "{table}plants: {} played in {:.1} min",
        rows.len(),
        started.elapsed().as_secs_f64() / 60.0
    );
    assert!(uncaught.is_empty(), "plants not caught: {uncaught:?}");
}
