//! Two checkers of what the operator and the sidecars do to etcd's membership and leadership,
//! from the harness's own observation (docs/robustness.md, "Membership and leadership"):
//!
//! - `voter-removed-early`: the operator lane's member list, read every 50 ms, must never lose
//!   a voter while fewer voters than desired would be left, unless that voter's etcd was dead
//!   (the lane killed it: the planner's one removal before a replacement, a dead voter). A
//!   rolling replacement adds a learner, promotes it, and only then removes the old voter.
//! - `leader-defragmented`: a defragmentation (the sidecar's `defragmenting` log line, stamped
//!   by the harness when it appears, so a sidecar's faked clock does not move it) of the member
//!   that every leadership sample around that moment names as the leader: leadership was not
//!   moved first.
//!
//! The judgements are pure functions over the samples, tested below on made-up ones.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// One reading of the member list that differed from the one before: (member ID, learner,
/// client URLs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberSample {
    pub at: Duration,
    pub members: Vec<(u64, bool, Vec<String>)>,
}

/// Reads the member list of the cluster at `urls()` every 50 ms (from the first member that
/// answers) and records each change.
pub async fn watch_membership(
    urls: Arc<dyn Fn() -> Vec<String> + Send + Sync>,
    epoch: Instant,
    out: Arc<Mutex<Vec<MemberSample>>>,
    stop: CancellationToken,
) {
    let mut client: Option<etcd_client::Client> = None;
    let mut last: Option<Vec<(u64, bool, Vec<String>)>> = None;
    while !stop.is_cancelled() {
        if client.is_none() {
            for u in urls() {
                if let Ok(Ok(c)) =
                    tokio::time::timeout(Duration::from_millis(500), super::writer::connect(&u))
                        .await
                {
                    client = Some(c);
                    break;
                }
            }
        }
        if let Some(c) = client.as_mut() {
            match tokio::time::timeout(Duration::from_millis(500), c.member_list()).await {
                Ok(Ok(list)) => {
                    let mut members: Vec<(u64, bool, Vec<String>)> = list
                        .members()
                        .iter()
                        .map(|m| (m.id(), m.is_learner(), m.client_urls().to_vec()))
                        .collect();
                    members.sort();
                    if last.as_ref() != Some(&members) {
                        out.lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(MemberSample {
                                at: epoch.elapsed(),
                                members: members.clone(),
                            });
                        last = Some(members);
                    }
                }
                // A removed or dead member answers no more: ask another.
                _ => client = None,
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
}

/// Voters removed while fewer than `desired` voters were left, their etcd alive: between two
/// consecutive samples a voter is gone, the later sample has fewer than `desired` voters, and
/// no client URL of it is among `dead` (URLs whose etcd was killed, with when) at or before the
/// later sample. A removal and a promotion between the same two samples look like a
/// replacement done in order; the 50 ms reading makes that rare for a planner that acts once
/// per interval (200 ms in the lane).
pub fn voters_removed_early(
    samples: &[MemberSample],
    dead: &[(Duration, String)],
    desired: usize,
) -> Vec<String> {
    let mut out = Vec::new();
    for w in samples.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        let voters_after = b.members.iter().filter(|m| !m.1).count();
        if voters_after >= desired {
            continue;
        }
        for (id, learner, urls) in &a.members {
            if *learner || b.members.iter().any(|m| m.0 == *id) {
                continue;
            }
            let was_dead = dead
                .iter()
                .any(|(t, u)| *t <= b.at && urls.iter().any(|x| x == u));
            if was_dead {
                continue;
            }
            let learners = b.members.iter().filter(|m| m.1).count();
            out.push(format!(
                "{:.2}s: voter {id:x} ({}) removed, leaving {voters_after} voters of {desired} \
                 desired and {learners} learner(s) not promoted; its etcd was alive (the member \
                 list at {:.2}s: {})",
                b.at.as_secs_f64(),
                urls.join(","),
                a.at.as_secs_f64(),
                describe(&a.members)
            ));
        }
    }
    out
}

fn describe(members: &[(u64, bool, Vec<String>)]) -> String {
    members
        .iter()
        .map(|(id, l, _)| format!("{id:x}{}", if *l { " (learner)" } else { "" }))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What [`watch_leadership`] saw: the leader every ~200 ms (`None` when the members did not
/// agree on one) and each defragmentation a sidecar logged, stamped when it appeared.
#[derive(Debug, Default, Clone)]
pub struct Leadership {
    pub leaders: Vec<(Duration, Option<u64>)>,
    pub defrags: Vec<(Duration, u64, usize)>,
}

/// The member a sidecar's log line says it is defragmenting (`defragmenting member=<hex>`, in
/// the text or the JSON format), if the line says so.
pub fn defragmented_member(line: &str) -> Option<u64> {
    if line.contains("moving leadership") || !line.contains("defragmenting") {
        return None;
    }
    let rest = line
        .split_once("member=")
        .or_else(|| line.split_once("\"member\":\""))?
        .1;
    let hex: String = rest
        .chars()
        .skip_while(|c| *c == '"')
        .take_while(char::is_ascii_hexdigit)
        .collect();
    u64::from_str_radix(&hex, 16).ok()
}

/// Every ~200 ms: the leader the members at `urls` name (the one most of those that answer
/// name), and the new lines of every sidecar log in `logs` that start a defragmentation.
pub async fn watch_leadership(
    urls: Vec<String>,
    logs: Vec<PathBuf>,
    epoch: Instant,
    out: Arc<Mutex<Leadership>>,
    stop: CancellationToken,
) {
    let mut clients: Vec<Option<etcd_client::Client>> = urls.iter().map(|_| None).collect();
    let mut offsets: Vec<u64> = logs
        .iter()
        .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .collect();
    while !stop.is_cancelled() {
        let mut named = Vec::new();
        for (i, u) in urls.iter().enumerate() {
            if clients[i].is_none() {
                clients[i] =
                    tokio::time::timeout(Duration::from_millis(300), super::writer::connect(u))
                        .await
                        .ok()
                        .and_then(Result::ok);
            }
            if let Some(c) = clients[i].as_mut() {
                match tokio::time::timeout(Duration::from_millis(300), c.status()).await {
                    Ok(Ok(s)) if s.leader() != 0 => named.push(s.leader()),
                    Ok(Ok(_)) => {}
                    _ => clients[i] = None,
                }
            }
        }
        let leader = majority(&named, urls.len());
        let at = epoch.elapsed();
        let mut seen = Vec::new();
        for (m, p) in logs.iter().enumerate() {
            let Ok(bytes) = std::fs::read(p) else {
                continue;
            };
            let from = (offsets[m] as usize).min(bytes.len());
            // Up to the last whole line; a restarted sidecar's log may start again shorter.
            let end = bytes[from..]
                .iter()
                .rposition(|b| *b == b'\n')
                .map_or(from, |e| from + e + 1);
            for line in String::from_utf8_lossy(&bytes[from..end]).lines() {
                if let Some(id) = defragmented_member(line) {
                    seen.push((at, id, m));
                }
            }
            offsets[m] = if (bytes.len() as u64) < offsets[m] {
                0
            } else {
                end as u64
            };
        }
        {
            let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
            o.leaders.push((at, leader));
            o.defrags.extend(seen);
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}

/// The leader named by more than half of `members` members (`named` holds what each member
/// that answered named).
fn majority(named: &[u64], members: usize) -> Option<u64> {
    let mut counts: Vec<(u64, usize)> = Vec::new();
    for l in named {
        match counts.iter_mut().find(|(x, _)| x == l) {
            Some((_, n)) => *n += 1,
            None => counts.push((*l, 1)),
        }
    }
    counts
        .into_iter()
        .find(|(_, n)| *n > members / 2)
        .map(|(l, _)| l)
}

/// How far before a defragmentation was seen the leader samples are judged: the log line is
/// read at most one pass (200 ms) after it was written, plus a margin.
pub const BEFORE: Duration = Duration::from_millis(1000);
/// How far after: the leadership sample after the defragmentation began.
pub const AFTER: Duration = Duration::from_millis(600);

/// Defragmentations of the leader: every leadership sample from [`BEFORE`] before the line was
/// seen to [`AFTER`] after it (at least one on each side) names the defragmented member. A
/// leadership moved first shows in those samples as another leader (or none, mid-election).
/// `(seen at, member, sidecar)` per finding.
pub fn leader_defragmented(l: &Leadership) -> Vec<(Duration, u64, usize)> {
    l.defrags
        .iter()
        .copied()
        .filter(|(at, id, _)| {
            let window: Vec<Option<u64>> = l
                .leaders
                .iter()
                .filter(|(t, _)| *t + BEFORE >= *at && *t <= *at + AFTER)
                .map(|(_, x)| *x)
                .collect();
            let before = l
                .leaders
                .iter()
                .any(|(t, _)| *t + BEFORE >= *at && *t < *at);
            let after = l.leaders.iter().any(|(t, _)| *t > *at && *t <= *at + AFTER);
            before && after && window.iter().all(|x| *x == Some(*id))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn sample(at: u64, members: &[(u64, bool)]) -> MemberSample {
        MemberSample {
            at: ms(at),
            members: members
                .iter()
                .map(|(id, l)| (*id, *l, vec![format!("http://m{id}")]))
                .collect(),
        }
    }

    #[test]
    fn a_voter_removed_before_its_learner_is_promoted_is_early() {
        // 1, 2, 3 vote; learner 4 joins; voter 1 goes before 4 is promoted.
        let planted = [
            sample(0, &[(1, false), (2, false), (3, false)]),
            sample(100, &[(1, false), (2, false), (3, false), (4, true)]),
            sample(400, &[(2, false), (3, false), (4, true)]),
            sample(700, &[(2, false), (3, false), (4, false)]),
        ];
        let found = voters_removed_early(&planted, &[], 3);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("voter 1 "), "{found:?}");
        // A removal with no learner at all is early too.
        let shrunk = [
            sample(0, &[(1, false), (2, false), (3, false)]),
            sample(50, &[(2, false), (3, false)]),
        ];
        assert_eq!(voters_removed_early(&shrunk, &[], 3).len(), 1);
    }

    #[test]
    fn a_replacement_in_order_and_a_dead_voters_removal_are_not() {
        let in_order = [
            sample(0, &[(1, false), (2, false), (3, false)]),
            sample(100, &[(1, false), (2, false), (3, false), (4, true)]),
            sample(400, &[(1, false), (2, false), (3, false), (4, false)]),
            sample(700, &[(2, false), (3, false), (4, false)]),
        ];
        assert!(voters_removed_early(&in_order, &[], 3).is_empty());
        // The voter's etcd was killed before it was removed (the planner removes a dead voter
        // first): not early. Killed only after: early.
        let dead = [
            sample(0, &[(1, false), (2, false), (3, false)]),
            sample(3000, &[(2, false), (3, false)]),
        ];
        assert!(voters_removed_early(&dead, &[(ms(1000), "http://m1".into())], 3).is_empty());
        assert_eq!(
            voters_removed_early(&dead, &[(ms(4000), "http://m1".into())], 3).len(),
            1
        );
    }

    fn leadership(leaders: &[(u64, Option<u64>)], defrags: &[(u64, u64)]) -> Leadership {
        Leadership {
            leaders: leaders.iter().map(|(t, l)| (ms(*t), *l)).collect(),
            defrags: defrags.iter().map(|(t, id)| (ms(*t), *id, 0)).collect(),
        }
    }

    #[test]
    fn defragmenting_the_member_that_leads_throughout_is_flagged() {
        let every = |l: u64| (0..20).map(move |i| (i * 200, Some(l))).collect::<Vec<_>>();
        let l = leadership(&every(7), &[(2000, 7), (2100, 8)]);
        assert_eq!(leader_defragmented(&l), vec![(ms(2000), 7, 0)]);
    }

    #[test]
    fn leadership_moved_first_or_unknown_samples_are_not_flagged() {
        // Leadership moved from 7 to 8 just before 7's defragmentation was seen.
        let moved = leadership(
            &[
                (1200, Some(7)),
                (1400, Some(7)),
                (1600, Some(8)),
                (1800, Some(8)),
                (2000, Some(8)),
                (2200, Some(8)),
            ],
            &[(1700, 7)],
        );
        assert!(leader_defragmented(&moved).is_empty());
        // No sample after the line (the watcher stopped): not judged.
        let unseen = leadership(&[(1500, Some(7)), (1900, Some(7))], &[(2000, 7)]);
        assert!(leader_defragmented(&unseen).is_empty());
    }

    #[test]
    fn the_defragmented_member_is_read_from_the_sidecars_log_line() {
        let text = "2026-12-02T13:00:00.1Z  INFO etcd_warden::snapshot::engine: defragmenting \
                    member=8e9e05c52164694d leader=1 db_size=9";
        assert_eq!(defragmented_member(text), Some(0x8e9e_05c5_2164_694d));
        let json = r#"{"fields":{"message":"defragmenting","member":"a1b2","leader":"a1b2"}}"#;
        assert_eq!(defragmented_member(json), Some(0xa1b2));
        let moving = "INFO moving leadership before defragmenting the leader from=a1 to=b2";
        assert_eq!(defragmented_member(moving), None);
        assert_eq!(defragmented_member("defragmented member=a1"), None);
    }

    #[test]
    fn the_leader_is_the_one_most_members_name() {
        assert_eq!(majority(&[5, 5, 6], 3), Some(5));
        assert_eq!(majority(&[5], 3), None);
        assert_eq!(majority(&[5, 6], 3), None);
    }
}
