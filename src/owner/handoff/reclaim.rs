//! Undoing a hand-off (`etcd-warden reclaim`): an operator's deliberate act.

use serde::Serialize;

use super::HandOffError;
use super::objects::{HandOffObjects, Key};

/// What [`reclaim`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Reclaimed {
    /// Fence markers deleted.
    pub fences_removed: Vec<String>,
    /// Finals marked reclaimed.
    pub finals_reclaimed: Vec<String>,
}

/// Undoes a hand-off in the store: marks every final reclaimed, deletes the hand-off record, then
/// every fence marker, so restarted sidecars of this cluster may become Active again. The markers
/// go last: an interruption leaves members fenced, never unfenced with a hand-off still recorded.
pub async fn reclaim(objects: &HandOffObjects) -> Result<Reclaimed, HandOffError> {
    let mut done = Reclaimed::default();
    let mut names: Vec<String> = objects
        .finals()
        .await?
        .into_iter()
        .map(|f| f.snap_name)
        .collect();
    // The intent's final too, stored or not: an upload still in flight (or completed by the
    // store after its client gave up) must not land as the final of a hand-off that was undone.
    if let Some(intent) = objects.intent().await?
        && !names.contains(&intent.final_snapshot)
    {
        names.push(intent.final_snapshot);
    }
    for name in names {
        objects.mark_reclaimed(&name).await?;
        done.finals_reclaimed.push(name);
    }
    // The record, every intent (stale ones too) and every claim.
    let mut gone = vec![objects.path(&Key::Record)];
    gone.extend(
        objects
            .keys(&Key::Final)
            .await?
            .into_iter()
            .filter(|k| {
                k.ends_with(".json") && (k.starts_with("intent") || k.starts_with("claim-"))
            })
            .map(|k| objects.path(&Key::Final).join(k)),
    );
    for key in gone {
        objects.delete(&key).await?;
    }
    for key in objects.fence_keys().await? {
        objects.delete(&key).await?;
        done.fences_removed.push(key.to_string());
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::{Created, FinalIntent};
    use super::*;
    use bytes::Bytes;
    use chrono::{TimeZone, Utc};
    use std::collections::BTreeSet;

    #[tokio::test]
    async fn markers_round_trip_outside_the_snapshot_layout_and_reclaim_removes_them() {
        let (dir, store, objects) = objects();
        objects.write_fence(0xabc, &marker("abc")).await.unwrap();
        objects.write_fence(0x1, &marker("1")).await.unwrap();
        assert_eq!(
            objects.fenced().await.unwrap(),
            BTreeSet::from([0x1, 0xabc])
        );
        assert_eq!(objects.fence(0xabc).await.unwrap(), Some(marker("abc")));
        assert_eq!(objects.fence(0x2).await.unwrap(), None);
        assert!(
            dir.path()
                .join("shoot/etcd-main/etcd-warden/fence/0000000000000abc.json")
                .is_file()
        );
        // Not snapshots: the layout's listing never sees them.
        assert!(store.list().await.unwrap().is_empty());

        let fin = full(30, true);
        store
            .put_bytes(&store.adopt(&fin), Bytes::from_static(b"x"))
            .await
            .unwrap();
        assert_eq!(objects.finals().await.unwrap().len(), 1);
        assert!(objects.latest_full().await.unwrap().is_some());

        objects.write_record(&record(&fin)).await.unwrap();
        assert!(objects.record().await.unwrap().is_some());
        let done = reclaim(&objects).await.unwrap();
        assert_eq!(objects.record().await.unwrap(), None);
        assert_eq!(done.fences_removed.len(), 2);
        assert_eq!(done.finals_reclaimed, vec![fin.snap_name.clone()]);
        assert!(objects.fenced().await.unwrap().is_empty());
        assert!(objects.finals().await.unwrap().is_empty());
        // Reclaimed: still the newest full snapshot, no longer read as a final.
        assert_eq!(
            objects.latest_full().await.unwrap().map(|s| s.is_final),
            Some(false)
        );
        // The final itself is kept: reclaiming deletes no snapshot.
        assert_eq!(store.list().await.unwrap().len(), 1);
    }

    /// An older etcd-warden's reclaim (it knows no intents) marks the final reclaimed and
    /// deletes the record and fences, but leaves `final/intent.json`. Before intents could sit
    /// beside a stale one, every later hand-off found "exists" on create and "none" on read,
    /// forever, and never took its final.
    #[tokio::test]
    async fn a_stale_intent_an_older_reclaim_left_does_not_block_the_next_hand_off() {
        let (_dir, _, objects) = objects();
        let intent = |name: &str, revision: i64| FinalIntent {
            final_snapshot: name.into(),
            revision,
            member_id: "1".into(),
            owner_id: "seed-a".into(),
            fixed_at: Utc.timestamp_opt(1_700_000_000, 0).unwrap(),
        };
        let first = full(30, true);
        assert_eq!(
            objects
                .create_intent(&intent(&first.snap_name, 30))
                .await
                .unwrap(),
            Created::Created
        );
        // What the older reclaim leaves: the mark, and the intent still there.
        objects.mark_reclaimed(&first.snap_name).await.unwrap();
        assert_eq!(objects.intent().await.unwrap(), None);

        // The next hand-off fixes its own, beside the stale one; the first create wins.
        let second = full(80, true);
        let fixed = intent(&second.snap_name, 80);
        assert_eq!(
            objects.create_intent(&fixed).await.unwrap(),
            Created::Created
        );
        assert_eq!(
            objects
                .create_intent(&intent(&full(81, true).snap_name, 81))
                .await
                .unwrap(),
            Created::Exists
        );
        assert_eq!(objects.intent().await.unwrap(), Some(fixed.clone()));
        assert_eq!(objects.seen().await.unwrap().intent, Some(fixed));

        // It is undone too (an older reclaim again), and a third goes beside that one.
        objects.mark_reclaimed(&second.snap_name).await.unwrap();
        let third = intent(&full(99, true).snap_name, 99);
        assert_eq!(
            objects.create_intent(&third).await.unwrap(),
            Created::Created
        );
        assert_eq!(objects.intent().await.unwrap(), Some(third.clone()));

        // This version's reclaim removes every intent, stale or not, and marks the live one's.
        let done = reclaim(&objects).await.unwrap();
        assert!(done.finals_reclaimed.contains(&third.final_snapshot));
        assert!(objects.keys(&Key::Final).await.unwrap().is_empty());
        assert_eq!(objects.intent().await.unwrap(), None);
    }
}
