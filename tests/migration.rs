//! The migration of seed 001 end to end (`support::migration`): the source seed loses the owner
//! record, deactivates itself with one final snapshot, the copy Job copies, the destination seed
//! restores and serves every key; and the same when the source cannot reach its store at the
//! flip (the copy Job times out and proceeds with the latest snapshot).

use crate::support;

use std::time::Duration;

use support::migration::{Options, Stores, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_moves_every_key_with_exactly_one_final_snapshot() {
    let report = run(Options::demo()).await;
    assert!(report.passed(), "{report}");
    assert_eq!(report.source_finals.len(), 1, "{report}");
    let fin = &report.source_finals[0];
    assert!(fin.snap_name.ends_with(".final"), "{report}");
    assert_eq!(fin.last_revision, report.expected_revision, "{report}");
    assert_eq!(report.restored, report.expected, "{report}");
    assert_eq!(report.restored_revision, report.expected_revision);
    // 100 written, 5 deleted.
    assert_eq!(report.expected.len(), 95);
    assert!(!report.source_ready_again, "{report}");
    let l = &report.latencies;
    // The sidecars check every 300 ms; a second of slack for a loaded machine.
    let to_503 = l.flip_to_source_503.expect("measured");
    assert!(to_503 < Duration::from_millis(1300), "{report}");
    assert!(
        l.flip_to_source_killed.expect("measured") >= to_503,
        "{report}"
    );
    assert!(
        l.flip_to_final_snapshot.expect("measured") <= l.flip_to_copy_done.expect("measured"),
        "the copy waited for the final snapshot: {report}"
    );
    assert!(l.restore.is_some() && l.flip_to_destination_ready.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_with_the_source_store_down_at_the_flip_restores_the_last_snapshot() {
    let report = run(Options {
        stores: Stores::S3,
        source_store_outage: true,
    })
    .await;
    assert!(report.passed(), "{report}");
    assert!(report.source_finals.is_empty(), "{report}");
    // Exactly the data up to the last successful snapshot...
    assert_eq!(report.restored, report.expected, "{report}");
    assert_eq!(report.restored_revision, report.expected_revision);
    let newest = report
        .source_snapshots
        .iter()
        .map(|s| s.last_revision)
        .max();
    assert_eq!(newest, Some(report.expected_revision), "{report}");
    // ...and none of what the source acknowledged after it lost its store.
    assert_eq!(report.unsnapshotted.len(), 20);
    for k in report.unsnapshotted.keys() {
        assert!(!report.restored.contains_key(k), "{k} leaked: {report}");
    }
    assert!(!report.source_ready_again, "{report}");
    let l = &report.latencies;
    assert!(l.flip_to_source_503.is_some() && l.flip_to_source_killed.is_some());
    assert!(l.flip_to_final_snapshot.is_none(), "{report}");
    // The copy Job waited its whole timeout (3 s) for a final snapshot that could not come.
    assert!(
        l.copy.expect("measured") >= Duration::from_secs(3),
        "{report}"
    );
}
