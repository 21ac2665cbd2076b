//! Every integration test in one binary, so `tests/support` and the crate are compiled and
//! linked once rather than once per file (there were 35). Each `tests/<name>.rs` is a module
//! here: run one file's tests with `cargo test --test it <name>::`, one test with
//! `cargo test --test it <name>::<test>`.
//!
//! `tests/snapshot_memory.rs` stays a binary of its own: it reads the process's peak resident
//! memory, which other tests running in the same process would inflate. `Cargo.toml` turns off
//! cargo's automatic test targets (`autotests = false`), so a new file under `tests/` runs only
//! once it is listed here; [`every_test_file_is_compiled`] fails when one is not.

mod support;

mod apiserver_double;
mod compact;
mod config;
mod control_plane_set_kube;
mod control_plane_set_plan;
mod copy;
mod defrag;
mod dns_harness;
mod encryption;
mod etcd36;
mod etcdbrctl;
mod fault_schedules;
mod harness;
mod http_limits;
mod kube_lease;
mod kube_objects;
mod kubeadm;
mod kubernetes_face;
mod machines_conformance;
mod manifests;
mod migration;
mod object_lock;
mod operator;
mod operator_config;
mod operator_kube;
mod operator_plan;
mod operator_release_check;
mod owner_resolve;
mod owner_watchdog;
mod ownership;
mod plant;
mod process_kill;
mod process_secrets;
mod promtool;
mod quorum_restore;
mod rejoin;
mod restore;
mod restore_datadir;
mod restore_differential;
mod restore_drill;
mod restore_member_dir;
mod restore_point_in_time;
mod robustness;
mod scratch_space;
mod secondary;
mod sidecar;
mod snapshot;
mod snapshot_etcd_connect;
mod store;
mod store_identity;
mod store_private;
mod store_sse;

/// Every `tests/*.rs` is a module of this binary or a test target of its own in `Cargo.toml`:
/// with `autotests = false`, a file listed in neither would never compile or run.
#[test]
fn every_test_file_is_compiled() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let root = std::fs::read_to_string(dir.join("it.rs")).expect("read tests/it.rs");
    let manifest = std::fs::read_to_string(dir.join("../Cargo.toml")).expect("read Cargo.toml");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("list tests/") {
        let path = entry.expect("list tests/").path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if path.extension().is_none_or(|e| e != "rs") || stem == "it" {
            continue;
        }
        let listed = root.lines().any(|l| l.trim() == format!("mod {stem};"));
        let own_target = manifest.contains(&format!("path = \"tests/{stem}.rs\""));
        if !listed && !own_target {
            missing.push(format!("tests/{stem}.rs"));
        }
    }
    assert!(
        missing.is_empty(),
        "not compiled by any test target (add `mod NAME;` to tests/it.rs): {missing:?}"
    );
}
