//! The bucket layout shared with gardener's etcd-backup-restore (`v2`): snapshot names are
//! formatted and parsed here and nowhere else.
//!
//! key: `<prefix>/v2/<name>`; name: `<Kind>-<start:08>-<last:08>-<unix-seconds><compression><final>`
//! (Go: `fmt.Sprintf("%s-%08d-%08d-%d%s%s", ...)`), e.g. `Full-00000000-00001234-1700000000.gz.final`.
//! An encrypted snapshot (etcd-warden's extension) carries `.age` after the compression suffix:
//! `Full-00000000-00001234-1700000000.gz.age.final`. The reference's names parse unchanged.

use std::cmp::Ordering;
use std::fmt;

use chrono::{DateTime, TimeZone, Utc};
use serde::{Deserialize, Serialize};

use super::compression::Codec;

/// The layout version directory under the store prefix.
pub const LAYOUT_VERSION: &str = "v2";
/// The suffix of a final snapshot's name, after the compression suffix.
pub const FINAL_SUFFIX: &str = ".final";
/// The suffix of an encrypted snapshot's name (an age file), after the compression suffix.
pub const ENCRYPTED_SUFFIX: &str = ".age";

/// Full snapshot (a whole database) or delta (events since the previous snapshot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Kind {
    /// A whole database; its start revision is 0.
    Full,
    /// Watch events from `start` to `last`.
    Incr,
}

impl Kind {
    /// The name's first token.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Full => "Full",
            Kind::Incr => "Incr",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One snapshot's metadata, as the HTTP API and `ls --json` show it (the reference's JSON names).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// Full or Incr.
    pub kind: Kind,
    /// The object name under `<prefix>/v2/`, always [`Snapshot::format_name`] of the other fields.
    pub snap_name: String,
    /// The key prefix up to and including `v2/` (as the reference reports it).
    pub prefix: String,
    /// The payload codec, shown as its suffix (".gz").
    #[serde(rename = "compressionSuffix")]
    pub compression: Codec,
    /// First revision covered (0 for a full snapshot).
    pub start_revision: i64,
    /// Last revision covered.
    pub last_revision: i64,
    /// Creation time, whole seconds (the name keeps no more).
    pub created_on: DateTime<Utc>,
    /// Taken when this sidecar lost ownership: the last snapshot of its etcd.
    pub is_final: bool,
    /// The payload is an age file (encrypted after compression); reading it needs an identity.
    #[serde(default)]
    pub encrypted: bool,
}

/// Why a name is not a snapshot name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name:?} is not a snapshot name: {reason}")]
pub struct NameError {
    /// The rejected name.
    pub name: String,
    /// What is wrong with it.
    pub reason: String,
}

impl Snapshot {
    /// A new snapshot's metadata; `created_on` is truncated to whole seconds.
    pub fn new(
        prefix: &str,
        kind: Kind,
        start_revision: i64,
        last_revision: i64,
        created_on: DateTime<Utc>,
        compression: Codec,
        is_final: bool,
    ) -> Snapshot {
        let created_on = Utc
            .timestamp_opt(created_on.timestamp(), 0)
            .single()
            .unwrap_or(created_on);
        let mut s = Snapshot {
            kind,
            snap_name: String::new(),
            prefix: version_prefix(prefix),
            compression,
            start_revision,
            last_revision,
            created_on,
            is_final,
            encrypted: false,
        };
        s.snap_name = s.format_name();
        s
    }

    /// The same snapshot, encrypted or not, renamed to match.
    pub fn with_encryption(mut self, encrypted: bool) -> Snapshot {
        self.encrypted = encrypted;
        self.snap_name = self.format_name();
        self
    }

    /// The name from the fields (Go: `%s-%08d-%08d-%d%s%s`).
    pub fn format_name(&self) -> String {
        format!(
            "{}-{:08}-{:08}-{}{}{}{}",
            self.kind,
            self.start_revision,
            self.last_revision,
            self.created_on.timestamp(),
            self.compression.suffix(),
            if self.encrypted { ENCRYPTED_SUFFIX } else { "" },
            if self.is_final { FINAL_SUFFIX } else { "" }
        )
    }

    /// The object key: `<prefix>/v2/<name>`.
    pub fn key(&self) -> String {
        format!("{}{}", self.prefix, self.snap_name)
    }

    /// Parses a name found under `<store prefix>/v2/`; `prefix` is the store prefix.
    ///
    /// ```
    /// use etcd_warden::store::{Kind, Snapshot};
    ///
    /// let s = Snapshot::parse_name("shoot--a/etcd-main", "Full-00000000-00001234-1700000000.gz.final").unwrap();
    /// assert_eq!((s.kind, s.last_revision, s.is_final), (Kind::Full, 1234, true));
    /// assert_eq!(s.key(), "shoot--a/etcd-main/v2/Full-00000000-00001234-1700000000.gz.final");
    /// assert!(Snapshot::parse_name("", "Full-1234.gz").is_err());
    /// ```
    pub fn parse_name(store_prefix: &str, name: &str) -> Result<Snapshot, NameError> {
        let fail = |reason: &str| NameError {
            name: name.to_string(),
            reason: reason.to_string(),
        };
        if name.contains('/') {
            return Err(fail("contains '/' (a chunk or an object of another tool)"));
        }
        let tokens: Vec<&str> = name.split('-').collect();
        if tokens.len() != 4 {
            return Err(fail("expected 4 '-'-separated parts: Kind-start-last-time"));
        }
        let kind = match tokens[0] {
            "Full" => Kind::Full,
            "Incr" => Kind::Incr,
            other => {
                return Err(fail(&format!(
                    "unknown kind {other:?}; expected Full or Incr"
                )));
            }
        };
        let start = revision(tokens[1]).map_err(|r| fail(&format!("start revision: {r}")))?;
        let last = revision(tokens[2]).map_err(|r| fail(&format!("last revision: {r}")))?;
        if start > last {
            return Err(fail("start revision is after last revision"));
        }
        let rest = tokens[3];
        let (rest, is_final) = match rest.strip_suffix(FINAL_SUFFIX) {
            Some(r) => (r, true),
            None => (rest, false),
        };
        let (rest, encrypted) = match rest.strip_suffix(ENCRYPTED_SUFFIX) {
            Some(r) => (r, true),
            None => (rest, false),
        };
        let digits = rest.find('.').unwrap_or(rest.len());
        let (time, suffix) = rest.split_at(digits);
        let compression = Codec::from_suffix(suffix).ok_or_else(|| {
            fail(&format!(
                "unknown compression suffix {suffix:?}; one of .gz, .zlib, .Z or none"
            ))
        })?;
        if time.is_empty() || !time.bytes().all(|b| b.is_ascii_digit()) {
            return Err(fail("creation time is not a number of seconds"));
        }
        if time.len() > 1 && time.starts_with('0') {
            return Err(fail("creation time has a leading zero"));
        }
        let secs: i64 = time
            .parse()
            .map_err(|_| fail("creation time is out of range"))?;
        let created_on = Utc
            .timestamp_opt(secs, 0)
            .single()
            .ok_or_else(|| fail("creation time is out of range"))?;
        let s = Snapshot {
            kind,
            snap_name: name.to_string(),
            prefix: version_prefix(store_prefix),
            compression,
            start_revision: start,
            last_revision: last,
            created_on,
            is_final,
            encrypted,
        };
        // Only canonical names are accepted, so a name and its parse are interchangeable.
        if s.format_name() != name {
            return Err(fail("not in the canonical form the reference writes"));
        }
        Ok(s)
    }

    /// Whether this snapshot is a full one.
    pub fn is_full(&self) -> bool {
        self.kind == Kind::Full
    }
}

/// A revision token: digits, zero-padded to at least 8 and with no extra leading zeros, so that
/// formatting a parsed name gives it back.
fn revision(token: &str) -> Result<i64, String> {
    if token.len() < 8 {
        return Err(format!("{token:?} is not zero-padded to 8 digits"));
    }
    if !token.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{token:?} is not a number"));
    }
    if token.len() > 8 && token.starts_with('0') {
        return Err(format!(
            "{token:?} has more leading zeros than 8 digits need"
        ));
    }
    token
        .parse()
        .map_err(|_| format!("{token:?} is out of range"))
}

/// `<prefix>/v2/` (or `v2/` for the bucket's root): where the layout's names live.
pub fn version_prefix(store_prefix: &str) -> String {
    let p = store_prefix.trim_matches('/');
    if p.is_empty() {
        format!("{LAYOUT_VERSION}/")
    } else {
        format!("{p}/{LAYOUT_VERSION}/")
    }
}

/// The reference's order (by last revision, then creation time), except that at equal revision a
/// final orders after a non-final: the final is the last word of its revision whatever the clocks
/// of the sidecars that named them said, so it stays the latest full snapshot.
pub fn compare(a: &Snapshot, b: &Snapshot) -> Ordering {
    a.last_revision
        .cmp(&b.last_revision)
        .then(a.is_final.cmp(&b.is_final))
        .then(a.created_on.cmp(&b.created_on))
}

/// Sorts in the reference's order (stable).
pub fn sort(list: &mut [Snapshot]) {
    list.sort_by(compare);
}

/// The latest full snapshot and every later delta: what a restore needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Chain {
    /// The base; `None` when the store has no full snapshot.
    pub full_snapshot: Option<Snapshot>,
    /// Deltas after it, in order.
    pub delta_snapshots: Vec<Snapshot>,
}

/// Picks the latest full snapshot and the deltas after it from a sorted list (as the reference's
/// restorer does: walk back from the end collecting deltas until a full snapshot). Without a
/// full snapshot every delta is returned, so a caller can still see what exists.
///
/// Deltas that add nothing are passed over: one wholly covered by the chain so far (a second
/// copy of a delta, which etcd-warden up to a76b888 stored under a new name each time the
/// store lost the answer to its upload), and one that overlaps the chain when a later delta continues it
/// exactly (a delta given up for a full snapshot, which the store kept all the same). Gaps and
/// other overlaps stay for [`first_gap`] and the restore to report.
pub fn latest_chain(sorted: &[Snapshot]) -> Chain {
    chain_from(sorted, sorted.iter().rposition(Snapshot::is_full))
}

/// The chain that starts at the full snapshot `sorted[base]` (with `None`, every delta): the
/// deltas after it that [`latest_chain`] would take after that full snapshot.
pub fn chain_from(sorted: &[Snapshot], base: Option<usize>) -> Chain {
    let after = base.map_or(0, |i| i + 1);
    let deltas: Vec<&Snapshot> = sorted[after..]
        .iter()
        .filter(|s| s.kind == Kind::Incr)
        .collect();
    let Some(full) = base.map(|i| &sorted[i]) else {
        return Chain {
            full_snapshot: None,
            delta_snapshots: deltas.into_iter().cloned().collect(),
        };
    };
    let mut reach = full.last_revision;
    let mut chained = Vec::with_capacity(deltas.len());
    for (i, d) in deltas.iter().enumerate() {
        supersede(&mut chained, &mut reach, full.last_revision, d);
        match link(reach, d) {
            Link::Covered => continue,
            Link::Overlaps
                if deltas[i + 1..]
                    .iter()
                    .any(|later| link(reach, later) == Link::Continues) =>
            {
                continue;
            }
            Link::Continues | Link::Overlaps | Link::Gap => {}
        }
        reach = d.last_revision;
        chained.push((*d).clone());
    }
    Chain {
        full_snapshot: Some(full.clone()),
        delta_snapshots: chained,
    }
}

/// How a delta follows a chain that reaches revision `reach` (its full snapshot's, then each
/// delta's last revision): the one rule [`fallback_chain`], [`first_gap`] and through it
/// `verify`, `copy` and `restore` apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// It ends at or before `reach`: it adds nothing (passed over).
    Covered,
    /// It starts at `reach + 1`.
    Continues,
    /// It starts at or before `reach` and ends after it (events the chain already has).
    Overlaps,
    /// It starts after `reach + 1`: the revisions in between are in no snapshot of the chain.
    Gap,
}

/// Drops the deltas at the end of `chained` that `delta` holds whole and goes beyond: it starts
/// at or before each of them and ends after it (a leader that stored a delta late, after the next
/// leader had stored a longer one from the same revision). Both came from one etcd's history and
/// deltas hold whole revisions, so the longer one has every event of the shorter; applying both
/// would replay revisions out of order. `reach` follows (`base`: the full snapshot's revision).
fn supersede(chained: &mut Vec<Snapshot>, reach: &mut i64, base: i64, delta: &Snapshot) {
    while let Some(last) = chained.last()
        && delta.start_revision <= last.start_revision
        && delta.last_revision > last.last_revision
    {
        chained.pop();
        *reach = chained.last().map_or(base, |l| l.last_revision);
    }
}

/// How `delta` follows a chain that reaches revision `reach`.
pub fn link(reach: i64, delta: &Snapshot) -> Link {
    if delta.last_revision <= reach {
        Link::Covered
    } else if delta.start_revision == reach + 1 {
        Link::Continues
    } else if delta.start_revision <= reach {
        Link::Overlaps
    } else {
        Link::Gap
    }
}

/// Revisions no snapshot of a chain holds: a delta is lost (or was never written), and a
/// restore of the chain fails there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "revision gap in the latest chain: revisions {first} to {last} are in no snapshot \
     ({after} ends at {}, the next delta {delta} starts at {}); a delta is lost, and a restore \
     of this chain fails",
    first - 1,
    last + 1
)]
pub struct Gap {
    /// The snapshot the chain reaches `first - 1` with.
    pub after: String,
    /// The delta that starts at `last + 1`.
    pub delta: String,
    /// The first missing revision.
    pub first: i64,
    /// The last missing revision.
    pub last: i64,
}

/// The first revision gap between `chain`'s full snapshot and its deltas, by their names
/// (every delta starts where the previous snapshot ended, + 1). `None` without a full snapshot:
/// there is nothing to restore then, and that is reported as such.
pub fn first_gap(chain: &Chain) -> Option<Gap> {
    let full = chain.full_snapshot.as_ref()?;
    let (mut reach, mut after) = (full.last_revision, full);
    for d in &chain.delta_snapshots {
        match link(reach, d) {
            Link::Covered => continue,
            Link::Continues | Link::Overlaps => {}
            Link::Gap => {
                return Some(Gap {
                    after: after.snap_name.clone(),
                    delta: d.snap_name.clone(),
                    first: reach + 1,
                    last: d.start_revision - 1,
                });
            }
        }
        reach = d.last_revision;
        after = d;
    }
    None
}

/// The chain to restore when the full snapshots named in `skipped` failed verification: the
/// latest other full snapshot and the deltas after it, as far as each continues the previous
/// one exactly (a delta wholly covered is passed over; a gap or an overlap ends the chain).
/// Across a skipped full snapshot the chain usually ends at the last delta before it: the events
/// between that delta and the full snapshot's revision are in the full snapshot only.
pub fn fallback_chain(sorted: &[Snapshot], skipped: &[String]) -> Chain {
    let base = sorted
        .iter()
        .rposition(|s| s.is_full() && !skipped.contains(&s.snap_name));
    let Some(base) = base else {
        return Chain {
            full_snapshot: None,
            delta_snapshots: Vec::new(),
        };
    };
    let full = sorted[base].clone();
    let mut reach = full.last_revision;
    let mut deltas = Vec::new();
    for d in sorted[base + 1..].iter().filter(|s| s.kind == Kind::Incr) {
        supersede(&mut deltas, &mut reach, full.last_revision, d);
        match link(reach, d) {
            Link::Covered => continue,
            Link::Continues => {}
            Link::Overlaps | Link::Gap => break,
        }
        reach = d.last_revision;
        deltas.push(d.clone());
    }
    Chain {
        full_snapshot: Some(full),
        delta_snapshots: deltas,
    }
}

/// A point in the past to restore to (`restore --to-revision`, `--to-time`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Every event up to and including this revision (a transaction is one revision, so all of
    /// it or none of it).
    Revision(i64),
    /// Every event the sidecar had received by this time, and the rest of the last revision
    /// among them.
    Time(DateTime<Utc>),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Revision(r) => write!(f, "revision {r}"),
            Target::Time(t) => {
                let t = t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);
                write!(f, "time {t}")
            }
        }
    }
}

/// Why no chain restores a [`Target`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    /// No full snapshot is old enough to start from.
    #[error(
        "{target} is before the oldest full snapshot{}: nothing in the store holds the state then",
        oldest.as_ref().map_or(String::new(), |o| format!(" ({o})"))
    )]
    BeforeOldest {
        target: Target,
        /// The oldest full snapshot not skipped, by name, with its revision and time.
        oldest: Option<String>,
    },
    /// The store's snapshots end before it.
    #[error(
        "{target} is after the newest snapshot ({newest}): the store does not hold the state \
         then; restore without a target for the latest state"
    )]
    AfterNewest { target: Target, newest: String },
    /// A delta between the full snapshot and the target is missing.
    #[error("{0}")]
    Gap(Gap),
    /// The deltas after the chosen full snapshot end before the target, and only later full
    /// snapshots (holding later writes too) cover it.
    #[error(
        "{target} is in no delta: the chain from {full} ends with {last}; only later full \
         snapshots hold that state, with later writes"
    )]
    Uncovered {
        target: Target,
        full: String,
        last: String,
    },
}

/// A snapshot's name with its revision and time, for messages.
fn described(s: &Snapshot) -> String {
    format!(
        "{} (revision {}, {})",
        s.snap_name,
        s.last_revision,
        s.created_on
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    )
}

/// Whether `s` holds everything up to `target`: it reaches the revision, or it was written
/// after the time (a name's time is truncated to seconds, so it is never later than the write).
fn reaches(s: &Snapshot, target: Target) -> bool {
    match target {
        Target::Revision(r) => s.last_revision >= r,
        Target::Time(t) => s.created_on >= t,
    }
}

/// The chain that restores the state at `target` from a sorted list, passing over the full
/// snapshots named in `skipped`: the newest full snapshot before it and the deltas after that
/// full snapshot up to the first one that [reaches](reaches) it.
///
/// A full snapshot's name carries its time in whole seconds, taken after etcd fixed its
/// revision; for a time it counts as before the target only a whole second ahead of it. A delta
/// holds every event received before it was written, so for a time the chain ends with the
/// first delta written at or after it; the restore stops at the first event after the target.
pub fn chain_to(
    sorted: &[Snapshot],
    target: Target,
    skipped: &[String],
) -> Result<Chain, TargetError> {
    let fulls = || {
        sorted
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_full() && !skipped.contains(&s.snap_name))
    };
    let before = |s: &Snapshot| match target {
        Target::Revision(r) => s.last_revision <= r,
        Target::Time(t) => s.created_on + chrono::Duration::seconds(1) <= t,
    };
    let Some((at, full)) = fulls().rfind(|(_, s)| before(s)) else {
        return Err(TargetError::BeforeOldest {
            target,
            oldest: fulls().next().map(|(_, s)| described(s)),
        });
    };
    if !sorted.iter().any(|s| reaches(s, target)) {
        let newest = sorted.iter().max_by(|a, b| compare(a, b)).unwrap_or(full);
        return Err(TargetError::AfterNewest {
            target,
            newest: described(newest),
        });
    }
    let mut deltas: Vec<Snapshot> = Vec::new();
    let mut reach = full.last_revision;
    for d in sorted[at + 1..].iter().filter(|s| s.kind == Kind::Incr) {
        if deltas
            .last()
            .map_or(reaches(full, target), |l| reaches(l, target))
        {
            break;
        }
        supersede(&mut deltas, &mut reach, full.last_revision, d);
        match link(reach, d) {
            Link::Covered => continue,
            Link::Continues | Link::Overlaps => {}
            Link::Gap => {
                return Err(TargetError::Gap(Gap {
                    after: deltas.last().unwrap_or(full).snap_name.clone(),
                    delta: d.snap_name.clone(),
                    first: reach + 1,
                    last: d.start_revision - 1,
                }));
            }
        }
        reach = d.last_revision;
        deltas.push(d.clone());
    }
    let last = deltas.last().unwrap_or(full);
    if !reaches(last, target) {
        return Err(TargetError::Uncovered {
            target,
            full: full.snap_name.clone(),
            last: described(last),
        });
    }
    Ok(Chain {
        full_snapshot: Some(full.clone()),
        delta_snapshots: deltas,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(secs: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(secs, 0).unwrap()
    }

    /// A full snapshot up to revision `last`, taken at second `t`.
    fn full(last: i64, t: i64) -> Snapshot {
        Snapshot::new("", Kind::Full, 0, last, at(t), Codec::Gzip, false)
    }

    /// A delta of revisions `start..=last`, taken at second `t`.
    fn incr(start: i64, last: i64, t: i64) -> Snapshot {
        Snapshot::new("", Kind::Incr, start, last, at(t), Codec::Gzip, false)
    }

    #[test]
    fn formats_like_go() {
        let s = Snapshot::new(
            "backups/etcd",
            Kind::Full,
            0,
            1234,
            at(1_700_000_000),
            Codec::Gzip,
            true,
        );
        assert_eq!(s.snap_name, "Full-00000000-00001234-1700000000.gz.final");
        assert_eq!(
            s.key(),
            "backups/etcd/v2/Full-00000000-00001234-1700000000.gz.final"
        );
        let d = Snapshot::new("", Kind::Incr, 1235, 123_456_789, at(5), Codec::None, false);
        assert_eq!(d.snap_name, "Incr-00001235-123456789-5");
        assert_eq!(d.key(), "v2/Incr-00001235-123456789-5");
    }

    #[test]
    fn json_has_the_reference_field_names() {
        let s = Snapshot::new("p", Kind::Incr, 5, 9, at(1_700_000_000), Codec::Zlib, false);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["kind"], "Incr");
        assert_eq!(v["snapName"], "Incr-00000005-00000009-1700000000.zlib");
        assert_eq!(v["prefix"], "p/v2/");
        assert_eq!(v["compressionSuffix"], ".zlib");
        assert_eq!(v["startRevision"], 5);
        assert_eq!(v["lastRevision"], 9);
        assert_eq!(v["createdOn"], "2023-11-14T22:13:20Z");
        assert_eq!(v["isFinal"], false);
        let back: Snapshot = serde_json::from_value(v).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn parses_reference_names() {
        let s = Snapshot::parse_name("x", "Full-00000000-00001234-1700000000.gz.final").unwrap();
        assert_eq!(s.kind, Kind::Full);
        assert_eq!(s.last_revision, 1234);
        assert_eq!(s.compression, Codec::Gzip);
        assert!(s.is_final);
        let s = Snapshot::parse_name("x", "Incr-00001235-00001300-1700000100.Z").unwrap();
        assert_eq!(s.compression, Codec::Lzw);
        assert!(!s.is_final);
        let s = Snapshot::parse_name("x", "Full-00000000-00000007-1700000000.final").unwrap();
        assert_eq!(s.compression, Codec::None);
        assert!(s.is_final);
        assert!(!s.encrypted);
    }

    #[test]
    fn encrypted_names_carry_age_after_the_compression() {
        let s = Snapshot::new("p", Kind::Full, 0, 7, at(1_700_000_000), Codec::Gzip, true)
            .with_encryption(true);
        assert_eq!(
            s.snap_name,
            "Full-00000000-00000007-1700000000.gz.age.final"
        );
        assert_eq!(Snapshot::parse_name("p", &s.snap_name).unwrap(), s);
        let plain = Snapshot::parse_name("p", "Incr-00000008-00000009-1700000001.age").unwrap();
        assert!(plain.encrypted && plain.compression == Codec::None && !plain.is_final);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["encrypted"], true);
        assert_eq!(v["compressionSuffix"], ".gz");
        for bad in [
            "Full-00000000-00000007-1700000000.age.gz",
            "Full-00000000-00000007-1700000000.gz.final.age",
            "Full-00000000-00000007-1700000000.gz.age.age",
        ] {
            assert!(Snapshot::parse_name("p", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rejects_malformed_names_with_a_reason() {
        for (name, why) in [
            ("", "4 '-'-separated"),
            ("Backup-1700000000", "4 '-'-separated"),
            ("Chunk-00000000-00000001-1700000000", "unknown kind"),
            ("full-00000000-00000001-1700000000", "unknown kind"),
            ("Full-0000000-00000001-1700000000", "zero-padded"),
            ("Full-00000000-0000000x-1700000000", "not a number"),
            ("Full-000000000-00000001-1700000000", "leading zeros"),
            ("Incr-00000009-00000001-1700000000", "after last"),
            (
                "Full-00000000-00000001-1700000000.bz2",
                "compression suffix",
            ),
            (
                "Full-00000000-00000001-1700000000.final.gz",
                "compression suffix",
            ),
            ("Full-00000000-00000001-", "creation time"),
            ("Full-00000000-00000001-01700000000", "leading zero"),
            ("Full-00000000-00000001-17e9", "not a number of seconds"),
            (
                "Full-00000000-00000001-99999999999999999999",
                "out of range",
            ),
            ("Full-00000000-00000001-1700000000/0000001", "contains '/'"),
            ("Full-00000000-99999999999999999999-1", "out of range"),
            ("Full-00000000-00000001-1700000000-x", "4 '-'-separated"),
        ] {
            let e = Snapshot::parse_name("p", name).unwrap_err();
            assert!(e.reason.contains(why), "{name:?}: {e}");
        }
    }

    /// A store with fulls at 10 (t=100) and 50 (t=500) and deltas 11–20 (t=200), 21–30
    /// (t=300), 31–40 (t=400) after the first, 51–60 (t=600) after the second.
    fn pit_store() -> Vec<Snapshot> {
        let incr =
            |first, last, t| Snapshot::new("", Kind::Incr, first, last, at(t), Codec::Gzip, false);
        let mut v = vec![
            full(10, 100),
            incr(11, 20, 200),
            incr(21, 30, 300),
            incr(31, 40, 400),
            full(50, 500),
            incr(51, 60, 600),
        ];
        sort(&mut v);
        v
    }

    fn chain_names(c: &Chain) -> (i64, Vec<i64>) {
        (
            c.full_snapshot.as_ref().unwrap().last_revision,
            c.delta_snapshots.iter().map(|d| d.last_revision).collect(),
        )
    }

    #[test]
    fn a_point_in_time_chain_starts_at_the_newest_full_before_and_ends_with_the_first_delta_reaching_it()
     {
        let v = pit_store();
        let rev = |r| chain_to(&v, Target::Revision(r), &[]).map(|c| chain_names(&c));
        let time = |t| chain_to(&v, Target::Time(at(t)), &[]).map(|c| chain_names(&c));
        assert_eq!(rev(10), Ok((10, vec![])));
        assert_eq!(rev(11), Ok((10, vec![20])));
        assert_eq!(rev(20), Ok((10, vec![20])));
        assert_eq!(rev(25), Ok((10, vec![20, 30])));
        assert_eq!(rev(50), Ok((50, vec![])));
        assert_eq!(rev(60), Ok((50, vec![60])));
        // A full snapshot's time counts only a whole second ahead of the target (truncation).
        assert_eq!(
            time(100),
            Err(TargetError::BeforeOldest {
                target: Target::Time(at(100)),
                oldest: Some(described(&v[0]))
            })
        );
        assert_eq!(time(101), Ok((10, vec![20])));
        assert_eq!(time(250), Ok((10, vec![20, 30])));
        assert_eq!(time(300), Ok((10, vec![20, 30])));
        assert_eq!(time(600), Ok((50, vec![60])));
        // Skipping the full at 50 restores from the one at 10 with its deltas.
        let skipped = [v[4].snap_name.clone()];
        assert_eq!(
            chain_to(&v, Target::Revision(40), &skipped).map(|c| chain_names(&c)),
            Ok((10, vec![20, 30, 40]))
        );
        // Revisions 41 to 50 are only in the skipped full snapshot.
        assert!(matches!(
            chain_to(&v, Target::Revision(55), &skipped),
            Err(TargetError::Gap(Gap {
                first: 41,
                last: 50,
                ..
            }))
        ));
        // Before the oldest full, after the newest snapshot, between the last delta and a full.
        for (target, want) in [
            (
                rev(5),
                "before the oldest full snapshot (Full-00000000-00000010-100",
            ),
            (
                rev(61),
                "revision 61 is after the newest snapshot (Incr-00000051-00000060-600",
            ),
            (time(601), "after the newest snapshot"),
            (
                rev(45),
                "revisions 41 to 50 are in no snapshot (Incr-00000031-00000040-400.gz ends at 40",
            ),
            (time(450), "revisions 41 to 50 are in no snapshot"),
        ] {
            let e = target.unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        // A lost delta before the target is a gap; after it, it does not matter.
        let mut lost = v.clone();
        lost.retain(|s| s.last_revision != 20);
        let e = chain_to(&lost, Target::Revision(25), &[]).unwrap_err();
        assert!(
            e.to_string()
                .contains("revisions 11 to 20 are in no snapshot"),
            "{e}"
        );
        // Deltas that end before a later full snapshot, none after it: only that full
        // snapshot holds revision 45's successors.
        let mut ended = v.clone();
        ended.retain(|s| s.last_revision != 60);
        let e = chain_to(&ended, Target::Revision(45), &[]).unwrap_err();
        assert!(e.to_string().contains("revision 45 is in no delta: the chain from Full-00000000-00000010-100.gz ends with Incr-00000031-00000040-400.gz"), "{e}");
        let mut late = v.clone();
        late.retain(|s| s.last_revision != 40);
        assert_eq!(
            chain_to(&late, Target::Revision(25), &[]).map(|c| chain_names(&c)),
            Ok((10, vec![20, 30]))
        );
    }

    #[test]
    fn sorts_by_last_revision_then_time() {
        let mk = |last, t| Snapshot::new("", Kind::Incr, 1, last, at(t), Codec::Gzip, false);
        let mut v = vec![mk(20, 1), mk(10, 5), mk(10, 2), mk(5, 9)];
        sort(&mut v);
        let order: Vec<_> = v
            .iter()
            .map(|s| (s.last_revision, s.created_on.timestamp()))
            .collect();
        assert_eq!(order, vec![(5, 9), (10, 2), (10, 5), (20, 1)]);
    }

    #[test]
    fn at_equal_revision_a_final_orders_after_a_non_final_whatever_the_clock_says() {
        let full = |t, fin| Snapshot::new("", Kind::Full, 0, 50, at(t), Codec::Gzip, fin);
        // The final's clock was behind the other sidecar's.
        let mut v = vec![full(200, false), full(100, true), full(150, false)];
        sort(&mut v);
        assert!(v.last().unwrap().is_final, "{v:?}");
        assert!(latest_chain(&v).full_snapshot.unwrap().is_final);
        // A later revision still wins over a final.
        let mut v = vec![
            full(100, true),
            Snapshot::new("", Kind::Full, 0, 51, at(1), Codec::Gzip, false),
        ];
        sort(&mut v);
        assert!(!v.last().unwrap().is_final);
    }

    #[test]
    fn a_fallback_chain_skips_named_fulls_and_stops_at_the_first_gap() {
        let names = |c: &Chain| -> (Option<i64>, Vec<(i64, i64)>) {
            (
                c.full_snapshot.as_ref().map(|f| f.last_revision),
                c.delta_snapshots
                    .iter()
                    .map(|d| (d.start_revision, d.last_revision))
                    .collect(),
            )
        };
        // Deltas 11-20 and 21-25 lead up to the full at 30; revisions 26-30 are in that full
        // only, so skipping it reaches 25.
        let mut v = vec![
            full(10, 1),
            incr(11, 20, 2),
            incr(21, 25, 3),
            full(30, 4),
            incr(31, 40, 5),
        ];
        sort(&mut v);
        let latest = v[3].snap_name.clone();
        assert_eq!(names(&fallback_chain(&v, &[])), (Some(30), vec![(31, 40)]));
        assert_eq!(
            names(&fallback_chain(&v, std::slice::from_ref(&latest))),
            (Some(10), vec![(11, 20), (21, 25)])
        );
        // A delta that ends exactly at the skipped full's revision: the chain continues past it.
        let mut w = vec![
            full(10, 1),
            incr(11, 30, 2),
            full(30, 3),
            incr(31, 40, 4),
            incr(45, 50, 5),
        ];
        sort(&mut w);
        let skipped = w
            .iter()
            .find(|s| s.is_full() && s.last_revision == 30)
            .unwrap();
        assert_eq!(
            names(&fallback_chain(
                &w,
                std::slice::from_ref(&skipped.snap_name)
            )),
            (Some(10), vec![(11, 30), (31, 40)])
        );
        // Both fulls skipped: nothing to restore.
        let all: Vec<String> = w
            .iter()
            .filter(|s| s.is_full())
            .map(|s| s.snap_name.clone())
            .collect();
        assert_eq!(names(&fallback_chain(&w, &all)), (None, vec![]));
    }

    #[test]
    fn the_first_gap_is_named_by_the_snapshots_around_it() {
        let chain = |v: Vec<Snapshot>| {
            let mut v = v;
            sort(&mut v);
            latest_chain(&v)
        };
        // Continuous, with a delta covered by the full snapshot and one overlapping it.
        let ok = chain(vec![
            full(10, 1),
            incr(11, 20, 2),
            full(30, 3),
            incr(21, 25, 2),
            incr(21, 35, 4),
            incr(36, 40, 5),
        ]);
        assert_eq!(first_gap(&ok), None, "{ok:?}");
        // A gap before the full snapshot does not matter: the latest chain starts there.
        let before = chain(vec![full(10, 1), incr(15, 20, 2), full(30, 3)]);
        assert_eq!(first_gap(&before), None);
        // Delta 41-50 is lost.
        let lost = chain(vec![
            full(30, 3),
            incr(31, 40, 4),
            incr(51, 60, 5),
            incr(61, 70, 6),
        ]);
        let gap = first_gap(&lost).unwrap();
        assert_eq!((gap.first, gap.last), (41, 50));
        assert_eq!(gap.after, "Incr-00000031-00000040-4.gz");
        assert_eq!(gap.delta, "Incr-00000051-00000060-5.gz");
        let msg = gap.to_string();
        assert!(
            msg.contains("revisions 41 to 50 are in no snapshot")
                && msg.contains("Incr-00000031-00000040-4.gz ends at 40")
                && msg.contains("Incr-00000051-00000060-5.gz starts at 51"),
            "{msg}"
        );
        // Right after the full snapshot.
        let first = chain(vec![full(30, 3), incr(32, 40, 4)]);
        let gap = first_gap(&first).unwrap();
        assert_eq!((gap.first, gap.last), (31, 31));
        assert_eq!(gap.after, "Full-00000000-00000030-3.gz");
        // No full snapshot: nothing to restore, no gap to name.
        assert_eq!(first_gap(&chain(vec![incr(5, 9, 1)])), None);
    }

    #[test]
    fn latest_chain_is_last_full_and_later_deltas() {
        let mut v = vec![
            full(10, 1),
            incr(11, 20, 2),
            full(20, 3),
            incr(21, 30, 4),
            incr(31, 40, 5),
        ];
        sort(&mut v);
        let c = latest_chain(&v);
        assert_eq!(c.full_snapshot.as_ref().unwrap().last_revision, 20);
        let deltas: Vec<_> = c.delta_snapshots.iter().map(|s| s.last_revision).collect();
        assert_eq!(deltas, vec![30, 40]);
        let c = latest_chain(&v[..2]);
        assert_eq!(c.full_snapshot.unwrap().last_revision, 10);
        assert_eq!(c.delta_snapshots.len(), 1);
        assert_eq!(
            latest_chain(&[]),
            Chain {
                full_snapshot: None,
                delta_snapshots: vec![]
            }
        );
        let v = serde_json::to_value(latest_chain(&v)).unwrap();
        assert!(v["fullSnapshot"].is_object());
        assert_eq!(v["deltaSnapshots"].as_array().unwrap().len(), 2);
    }

    /// The soak's finding: the store lost the answers to a delta's uploads and an earlier
    /// release stored it again under new names; restore then failed with "events out of order".
    #[test]
    fn latest_chain_passes_over_copies_and_given_up_overlaps() {
        let ranges = |mut v: Vec<Snapshot>| {
            sort(&mut v);
            let c = latest_chain(&v);
            assert_eq!(first_gap(&c), None, "{c:?}");
            c.delta_snapshots
                .iter()
                .map(|d| (d.start_revision, d.last_revision, d.created_on))
                .collect::<Vec<_>>()
        };
        // Four copies of one delta: the first stays, the others add nothing.
        let copies = ranges(vec![
            full(100, 1),
            incr(101, 146, 2),
            incr(101, 146, 3),
            incr(101, 146, 4),
            incr(101, 146, 5),
            incr(147, 150, 6),
        ]);
        assert_eq!(copies, vec![(101, 146, at(2)), (147, 150, at(6))]);
        // A delta given up for the full snapshot at 120 (the store kept it all the same), then
        // the delta that continues the full snapshot: the chain takes the second.
        let given_up = ranges(vec![
            full(100, 1),
            incr(101, 130, 2),
            full(120, 3),
            incr(121, 135, 4),
        ]);
        assert_eq!(given_up, vec![(121, 135, at(4))]);
        // An overlap that nothing continues stays: the restore judges its events.
        let alone = ranges(vec![full(120, 3), incr(101, 130, 2), incr(131, 140, 4)]);
        assert_eq!(alone, vec![(101, 130, at(2)), (131, 140, at(4))]);
        // A gap stays for first_gap to name, whatever follows.
        let mut v = vec![full(100, 1), incr(111, 120, 2), incr(111, 120, 3)];
        sort(&mut v);
        let c = latest_chain(&v);
        assert_eq!(c.delta_snapshots.len(), 1);
        assert_eq!(first_gap(&c).map(|g| (g.first, g.last)), Some((101, 110)));
    }

    /// The soak's finding (issue 53's delta check): a snapshot leader frozen with a delta
    /// buffered stored it after the next leader had stored a longer delta from the same
    /// revision; the chain took both, and `restore --to-revision` failed with "events out of
    /// order". The longer delta holds every revision of the shorter one: the chain takes it.
    #[test]
    fn a_delta_that_a_longer_one_from_the_same_start_supersedes_is_passed_over() {
        let mut v = vec![
            full(100, 1),
            incr(101, 110, 2),
            incr(111, 130, 3),
            incr(111, 140, 4),
            incr(141, 150, 5),
        ];
        sort(&mut v);
        let c = latest_chain(&v);
        assert_eq!(first_gap(&c), None);
        assert_eq!(chain_names(&c), (100, vec![110, 140, 150]));
        let c = chain_to(&v, Target::Revision(145), &[]).unwrap();
        assert_eq!(chain_names(&c), (100, vec![110, 140, 150]));
        let c = chain_to(&v, Target::Revision(135), &[]).unwrap();
        assert_eq!(chain_names(&c), (100, vec![110, 140]));
    }

    fn any_snapshot() -> impl Strategy<Value = Snapshot> {
        (
            prop_oneof![Just(Kind::Full), Just(Kind::Incr)],
            0i64..=i64::MAX,
            0i64..=i64::MAX,
            0i64..=253_402_300_799, // up to 9999-12-31
            prop::sample::select(crate::store::compression::ALL_CODECS.to_vec()),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(kind, a, b, t, c, fin, enc)| {
                let (start, last) = if kind == Kind::Full {
                    (0, a.max(b))
                } else {
                    (a.min(b), a.max(b))
                };
                Snapshot::new("pre/fix", kind, start, last, at(t), c, fin).with_encryption(enc)
            })
    }

    proptest! {
        #[test]
        fn parse_inverts_format(s in any_snapshot()) {
            let parsed = Snapshot::parse_name("pre/fix", &s.format_name()).unwrap();
            prop_assert_eq!(&parsed, &s);
            prop_assert_eq!(parsed.format_name(), s.snap_name);
        }

        #[test]
        fn accepted_names_format_back_identically(name in "(Full|Incr|Chunk|x)-[0-9]{7,10}-[0-9]{7,10}-[0-9]{0,11}(\\.gz|\\.zlib|\\.Z|\\.bz2|)(\\.age|)(\\.final|)") {
            match Snapshot::parse_name("p", &name) {
                Ok(s) => prop_assert_eq!(s.format_name(), name),
                Err(e) => prop_assert!(!e.reason.is_empty()),
            }
        }

        #[test]
        fn arbitrary_text_never_panics(name in "\\PC{0,60}") {
            if let Ok(s) = Snapshot::parse_name("p", &name) {
                prop_assert_eq!(s.format_name(), name);
            }
        }
    }
}
