//! Reading the raft index of the last entry in an etcd WAL (`member/wal/*.wal`), to tell a
//! database that lags its own WAL (entries etcd replays on start) from an old directory.
//!
//! A segment is a sequence of frames: a little-endian `u64` whose low 56 bits are the record's
//! length and whose top byte, when its high bit is set, holds the padding to 8 bytes; then the
//! record (`walpb.Record`: type 1, crc 2, data 3) and the padding. Segments are preallocated, so
//! a zero length ends one; a frame cut short (a torn write at a crash) ends it as well, as etcd's
//! own repair would. An entry record (type 2) carries a `raftpb.Entry` (term 2, index 3).
//!
//! [`read_state`] reads a whole WAL as `quorum-restore` needs it: every record's CRC-32C
//! checked as etcd's decoder checks it, the member and cluster ids, the last hard state (its
//! commit index) and the terms of the entries.

use std::path::Path;

/// `walpb.Record` type of a raft entry.
const ENTRY_TYPE: u64 = 2;

/// The index of the last raft entry in the WAL under `wal_dir`, or `None` when it holds none.
/// Reads the newest segment first and goes back only while a segment holds no entry.
pub fn last_entry_index(wal_dir: &Path) -> Result<Option<u64>, String> {
    let segments = match segments(wal_dir) {
        Ok(s) => s,
        Err(WalError::NoSegment(_)) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    for segment in segments.iter().rev() {
        let bytes = std::fs::read(segment).map_err(|e| format!("{}: {e}", segment.display()))?;
        if let Some(index) = last_in_segment(&bytes) {
            return Ok(Some(index));
        }
    }
    Ok(None)
}

/// The index of the last entry record in one segment's bytes.
pub(crate) fn last_in_segment(bytes: &[u8]) -> Option<u64> {
    let mut at = 0usize;
    let mut last = None;
    while at + 8 <= bytes.len() {
        let field = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        if field == 0 {
            break;
        }
        let len = (field & 0x00ff_ffff_ffff_ffff) as usize;
        let pad = if field & (0x80 << 56) != 0 {
            ((field >> 56) & 0x7) as usize
        } else {
            0
        };
        let start = at + 8;
        // The record and its padding, whole (etcd's decoder treats less as a torn write).
        let Some(end) = start
            .checked_add(len)
            .filter(|&e| e.saturating_add(pad) <= bytes.len())
        else {
            break;
        };
        let Some((kind, data)) = record(&bytes[start..end]) else {
            break;
        };
        if kind == ENTRY_TYPE
            && let Some(index) = entry_index(data)
        {
            last = Some(index);
        }
        at = end + pad;
    }
    last
}

/// `walpb.Record` types besides entries.
const METADATA_TYPE: u64 = 1;
const STATE_TYPE: u64 = 3;
const CRC_TYPE: u64 = 4;
const SNAPSHOT_TYPE: u64 = 5;

/// etcd's WAL sectors: a torn write leaves whole zeroed sectors inside a record.
const SECTOR: usize = 512;

/// Why a WAL cannot be read as etcd's.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    /// A segment or the directory cannot be read.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No `*.wal` segment.
    #[error("{0}: no WAL segment (*.wal)")]
    NoSegment(String),
    /// A record fails its checksum or does not parse, before the tail a crash may tear.
    #[error("{segment}: corrupt WAL at byte {offset}: {reason}")]
    Corrupt {
        /// The segment.
        segment: String,
        /// Where its record starts.
        offset: usize,
        /// What is wrong.
        reason: String,
    },
}

/// What a WAL says about its member's raft state, read record by record with etcd's checksums.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WalState {
    /// `etcdserverpb.Metadata.NodeID`: this member's id.
    pub node_id: u64,
    /// `etcdserverpb.Metadata.ClusterID`.
    pub cluster_id: u64,
    /// The last `raftpb.HardState`'s term.
    pub term: u64,
    /// The last `raftpb.HardState`'s commit: the highest index this member knows committed.
    /// `--force-new-cluster` keeps the entries up to it and discards the rest.
    pub commit: u64,
    /// The index of the newest snapshot record.
    pub snapshot_index: u64,
    /// The index of the last entry (0 without entries).
    pub last_index: u64,
    /// Runs of entry terms: `(first index, term)`, ascending, as the log stands after later
    /// entries replaced earlier ones (a new leader's).
    term_runs: Vec<(u64, u64)>,
}

impl WalState {
    /// The term of the entry at `index`, when the WAL holds it.
    pub fn term_at(&self, index: u64) -> Option<u64> {
        if index == 0 || index > self.last_index {
            return None;
        }
        self.term_runs
            .iter()
            .rev()
            .find(|(first, _)| *first <= index)
            .map(|(_, term)| *term)
    }

    /// The committed index, never below the snapshot's (a compacted log holds no HardState
    /// older than its snapshot, but a snapshot is committed by definition).
    pub fn committed(&self) -> u64 {
        self.commit.max(self.snapshot_index)
    }

    /// Records an entry as a WAL record adds it.
    pub(crate) fn entry(&mut self, index: u64, term: u64) {
        // A later entry at an index already written replaces it and every one after it.
        if index <= self.last_index {
            self.term_runs.retain(|(first, _)| *first < index);
        }
        if self.term_runs.last().is_none_or(|(_, t)| *t != term) {
            self.term_runs.push((index, term));
        }
        self.last_index = index;
    }
}

/// etcd's checksum: CRC-32C, continued across records (Go's `crc32.Update`).
fn crc32c_update(crc: u32, data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, slot) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82f6_3b78
                } else {
                    c >> 1
                };
            }
            *slot = c;
        }
        t
    });
    let mut c = !crc;
    for b in data {
        c = table[((c ^ u32::from(*b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// Reads every segment under `wal_dir` in order, checking each record's checksum as etcd does.
/// A record cut short, or failing its checksum with a zeroed sector inside, at the end of the
/// newest segment is a torn write etcd repairs: reading stops there. Anything else that does
/// not read is [`WalError::Corrupt`].
pub fn read_state(wal_dir: &Path) -> Result<WalState, WalError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| WalError::Io { path, source }
    };
    let segments = segments(wal_dir)?;
    let mut state = WalState::default();
    let mut crc = 0u32;
    let last = segments.len() - 1;
    for (n, segment) in segments.iter().enumerate() {
        let bytes = std::fs::read(segment).map_err(io(segment))?;
        read_segment(&bytes, n == last, &mut crc, &mut state).map_err(|(offset, reason)| {
            WalError::Corrupt {
                segment: segment.display().to_string(),
                offset,
                reason,
            }
        })?;
    }
    Ok(state)
}

/// How much of a segment [`member_id`] reads: a segment starts with its checksum, metadata and
/// hard state records (a few hundred bytes), and is 64 MiB, preallocated.
const HEAD: u64 = 64 * 1024;

/// This member's id (`Metadata.NodeID`) from the metadata record a segment starts with, the
/// newest segment first, reading only the first [`HEAD`] bytes of each with their checksums:
/// what the owner watchdog needs to fence a member whose etcd does not answer, without reading
/// the whole log (which held a sidecar at 160 MiB while it did). `None` when no segment's head
/// holds the metadata.
pub fn member_id(wal_dir: &Path) -> Result<Option<u64>, WalError> {
    use std::io::Read;
    let segments = segments(wal_dir)?;
    for segment in segments.iter().rev() {
        let io = |source| WalError::Io {
            path: segment.display().to_string(),
            source,
        };
        let mut head = Vec::new();
        std::fs::File::open(segment)
            .map_err(io)?
            .take(HEAD)
            .read_to_end(&mut head)
            .map_err(io)?;
        let mut state = WalState::default();
        // A record the head cuts reads as a torn tail does: where the reading stops.
        read_segment(&head, true, &mut 0, &mut state).map_err(|(offset, reason)| {
            WalError::Corrupt {
                segment: segment.display().to_string(),
                offset,
                reason,
            }
        })?;
        if state.node_id != 0 {
            return Ok(Some(state.node_id));
        }
    }
    Ok(None)
}

/// The `*.wal` segments under `wal_dir` in write order (names are `<seq>-<index>.wal` in
/// fixed-width hex); an error when there is none.
fn segments(wal_dir: &Path) -> Result<Vec<std::path::PathBuf>, WalError> {
    let mut segments: Vec<_> = std::fs::read_dir(wal_dir)
        .map_err(|source| WalError::Io {
            path: wal_dir.display().to_string(),
            source,
        })?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "wal"))
        .collect();
    segments.sort();
    if segments.is_empty() {
        return Err(WalError::NoSegment(wal_dir.display().to_string()));
    }
    Ok(segments)
}

/// One segment's records into `state`; `Err((offset, reason))` where it is corrupt.
pub(crate) fn read_segment(
    bytes: &[u8],
    newest: bool,
    crc: &mut u32,
    state: &mut WalState,
) -> Result<(), (usize, String)> {
    let mut at = 0usize;
    while at + 8 <= bytes.len() {
        let field = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        if field == 0 {
            return Ok(());
        }
        let len = (field & 0x00ff_ffff_ffff_ffff) as usize;
        let pad = if field & (0x80 << 56) != 0 {
            ((field >> 56) & 0x7) as usize
        } else {
            0
        };
        let start = at + 8;
        let torn = |reason: String| if newest { Ok(()) } else { Err((at, reason)) };
        let Some(end) = start
            .checked_add(len)
            .filter(|&e| e.saturating_add(pad) <= bytes.len())
        else {
            return torn(format!(
                "a record of {len} bytes runs past the segment's end"
            ));
        };
        let frame = &bytes[at..end];
        let zeroed_sector = frame.chunks(SECTOR).any(|c| c.iter().all(|b| *b == 0));
        let Some((kind, stored_crc, data)) = full_record(&bytes[start..end]) else {
            if newest && zeroed_sector {
                return Ok(());
            }
            return Err((at, "a record does not parse".into()));
        };
        if kind == CRC_TYPE {
            // A segment starts with the checksum so far; a purged log starts mid-chain.
            if *crc != 0 && stored_crc != *crc {
                return Err((
                    at,
                    format!(
                        "the segment's starting checksum {stored_crc:08x} is not the previous segment's {:08x}",
                        *crc
                    ),
                ));
            }
            *crc = stored_crc;
        } else {
            let next = crc32c_update(*crc, data);
            if next != stored_crc {
                if newest && zeroed_sector {
                    return Ok(());
                }
                return Err((
                    at,
                    format!(
                        "checksum mismatch: record says {stored_crc:08x}, its data gives {next:08x}"
                    ),
                ));
            }
            *crc = next;
            match kind {
                METADATA_TYPE => {
                    for (number, value) in
                        fields(data).ok_or((at, "metadata does not parse".to_string()))?
                    {
                        match (number, value) {
                            (1, Field::Varint(v)) => state.node_id = v,
                            (2, Field::Varint(v)) => state.cluster_id = v,
                            _ => {}
                        }
                    }
                }
                ENTRY_TYPE => {
                    let (mut term, mut index) = (0, 0);
                    for (number, value) in
                        fields(data).ok_or((at, "an entry does not parse".to_string()))?
                    {
                        match (number, value) {
                            (2, Field::Varint(v)) => term = v,
                            (3, Field::Varint(v)) => index = v,
                            _ => {}
                        }
                    }
                    state.entry(index, term);
                }
                STATE_TYPE => {
                    // An empty HardState is not written; a field left out is zero.
                    let (mut term, mut commit) = (0, 0);
                    for (number, value) in
                        fields(data).ok_or((at, "a hard state does not parse".to_string()))?
                    {
                        match (number, value) {
                            (1, Field::Varint(v)) => term = v,
                            (3, Field::Varint(v)) => commit = v,
                            _ => {}
                        }
                    }
                    state.term = term;
                    state.commit = commit;
                }
                SNAPSHOT_TYPE => {
                    for (number, value) in
                        fields(data).ok_or((at, "a snapshot record does not parse".to_string()))?
                    {
                        if let (1, Field::Varint(v)) = (number, value) {
                            state.snapshot_index = state.snapshot_index.max(v);
                        }
                    }
                }
                _ => {}
            }
        }
        at = end + pad;
    }
    Ok(())
}

/// A `walpb.Record`'s type, checksum and data.
fn full_record(b: &[u8]) -> Option<(u64, u32, &[u8])> {
    let mut kind = 0;
    let mut crc = 0;
    let mut data: &[u8] = &[];
    for (number, field) in fields(b)? {
        match (number, field) {
            (1, Field::Varint(v)) => kind = v,
            (2, Field::Varint(v)) => crc = u32::try_from(v).ok()?,
            (3, Field::Bytes(d)) => data = d,
            _ => {}
        }
    }
    Some((kind, crc, data))
}

/// A protobuf field: its number and value (a varint, or the bytes of a length-delimited one).
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Other,
}

fn varint(b: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// Every field of a message, or `None` if it does not parse.
fn fields(b: &[u8]) -> Option<Vec<(u64, Field<'_>)>> {
    let mut at = 0;
    let mut out = Vec::new();
    while at < b.len() {
        let tag = varint(b, &mut at)?;
        // Field 0 does not exist: zeros where a record was cut short.
        if tag >> 3 == 0 {
            return None;
        }
        let field = match tag & 7 {
            0 => Field::Varint(varint(b, &mut at)?),
            1 => {
                at = at.checked_add(8).filter(|&a| a <= b.len())?;
                Field::Other
            }
            2 => {
                let len = usize::try_from(varint(b, &mut at)?).ok()?;
                let end = at.checked_add(len).filter(|&e| e <= b.len())?;
                let bytes = &b[at..end];
                at = end;
                Field::Bytes(bytes)
            }
            5 => {
                at = at.checked_add(4).filter(|&a| a <= b.len())?;
                Field::Other
            }
            _ => return None,
        };
        out.push((tag >> 3, field));
    }
    Some(out)
}

/// A `walpb.Record`'s type and data.
fn record(b: &[u8]) -> Option<(u64, &[u8])> {
    let mut kind = 0;
    let mut data: &[u8] = &[];
    for (number, field) in fields(b)? {
        match (number, field) {
            (1, Field::Varint(v)) => kind = v,
            (3, Field::Bytes(d)) => data = d,
            _ => {}
        }
    }
    Some((kind, data))
}

/// A `raftpb.Entry`'s index.
fn entry_index(b: &[u8]) -> Option<u64> {
    fields(b)?
        .into_iter()
        .find_map(|(number, field)| match (number, field) {
            (3, Field::Varint(v)) => Some(v),
            _ => None,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put_varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    fn frame(kind: u64, data: &[u8]) -> Vec<u8> {
        let mut rec = Vec::new();
        put_varint(&mut rec, 1 << 3);
        put_varint(&mut rec, kind);
        put_varint(&mut rec, 2 << 3);
        put_varint(&mut rec, 0xdead_beef);
        put_varint(&mut rec, (3 << 3) | 2);
        put_varint(&mut rec, data.len() as u64);
        rec.extend_from_slice(data);
        let pad = (8 - rec.len() % 8) % 8;
        let mut field = rec.len() as u64;
        if pad != 0 {
            field |= ((0x80 | pad) as u64) << 56;
        }
        let mut out = field.to_le_bytes().to_vec();
        out.extend_from_slice(&rec);
        out.extend(std::iter::repeat_n(0, pad));
        out
    }

    /// A one-member cluster, as `restore` writes its WAL.
    fn one_member() -> crate::restore::member_dir::Cluster {
        let params = crate::restore::MemberParams {
            name: "m1".into(),
            initial_cluster: "m1=http://10.0.0.1:2380".into(),
            initial_cluster_token: "t".into(),
            initial_advertise_peer_urls: "http://10.0.0.1:2380".into(),
        };
        crate::restore::member_dir::Cluster::from_params(&params).unwrap()
    }

    fn entry(term: u64, index: u64) -> Vec<u8> {
        let mut e = Vec::new();
        put_varint(&mut e, 2 << 3);
        put_varint(&mut e, term);
        put_varint(&mut e, 3 << 3);
        put_varint(&mut e, index);
        put_varint(&mut e, (4 << 3) | 2);
        put_varint(&mut e, 3);
        e.extend_from_slice(b"put");
        e
    }

    #[test]
    fn a_restored_wal_reads_with_its_checksums_and_a_flipped_byte_is_named() {
        use crate::restore::member_dir::{Cluster, Release, wal_bytes};
        let params = crate::restore::MemberParams {
            name: "m1".into(),
            initial_cluster: "m1=http://10.0.0.1:2380,m2=http://10.0.0.2:2380".into(),
            initial_cluster_token: "t".into(),
            initial_advertise_peer_urls: "http://10.0.0.1:2380".into(),
        };
        let cluster = Cluster::from_params(&params).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let seg = dir.path().join("0000000000000000-0000000000000000.wal");
        let mut bytes = wal_bytes(&cluster, Release::V35);
        bytes.resize(bytes.len() + 4096, 0);
        std::fs::write(&seg, &bytes).unwrap();
        let state = read_state(dir.path()).unwrap();
        assert_eq!(state.node_id, cluster.local);
        assert_eq!(state.cluster_id, cluster.id);
        assert_eq!(state.commit, 2);
        assert_eq!(state.last_index, 2);
        assert_eq!(state.term_at(2), Some(1));
        assert_eq!(state.term_at(3), None);
        // A byte flipped inside a record before the tail: corrupt, never a torn write.
        let mut bad = bytes.clone();
        bad[40] ^= 0x55;
        std::fs::write(&seg, &bad).unwrap();
        let err = read_state(dir.path()).unwrap_err().to_string();
        assert!(err.contains("corrupt WAL") && err.contains(".wal"), "{err}");
        // Not a WAL directory at all.
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            read_state(empty.path()),
            Err(WalError::NoSegment(_))
        ));
    }

    /// The member id comes from the head of the newest segment: a preallocated 64 MiB segment
    /// is not read past its first records, and an older segment is not read at all (here a
    /// corrupt one, which fails the whole-log reader).
    #[test]
    fn the_member_id_is_read_from_the_newest_segments_head() {
        use crate::restore::member_dir::{Release, wal_bytes};
        let cluster = one_member();
        let dir = tempfile::tempdir().unwrap();
        let mut newest = wal_bytes(&cluster, Release::V35);
        newest.resize(64 << 20, 0);
        std::fs::write(
            dir.path().join("0000000000000001-0000000000000003.wal"),
            &newest,
        )
        .unwrap();
        let mut older = wal_bytes(&cluster, Release::V35);
        older[40] ^= 0x55;
        std::fs::write(
            dir.path().join("0000000000000000-0000000000000000.wal"),
            &older,
        )
        .unwrap();
        assert_eq!(member_id(dir.path()).unwrap(), Some(cluster.local));
        assert!(read_state(dir.path()).is_err());
        // A head without metadata, then no segment at all.
        let zeros = tempfile::tempdir().unwrap();
        std::fs::write(
            zeros.path().join("0000000000000000-0000000000000000.wal"),
            [0u8; 4096],
        )
        .unwrap();
        assert_eq!(member_id(zeros.path()).unwrap(), None);
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            member_id(empty.path()),
            Err(WalError::NoSegment(_))
        ));
    }

    #[test]
    fn a_torn_tail_of_the_newest_segment_is_a_crash_not_corruption() {
        use crate::restore::member_dir::{Release, wal_bytes};
        let cluster = one_member();
        let good = wal_bytes(&cluster, Release::V35);
        // A last record cut short (its length runs past the file), then a record whose data
        // is a zeroed sector (written length, lost data): both are what a crash leaves.
        let mut cut = good.clone();
        cut.extend_from_slice(&(600u64).to_le_bytes());
        cut.extend_from_slice(&[1, 2, 3]);
        let mut zeroed = good.clone();
        zeroed.extend(frame(ENTRY_TYPE, &[0; 1024]));
        for tail in [cut, zeroed] {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(
                dir.path().join("0000000000000000-0000000000000000.wal"),
                &tail,
            )
            .unwrap();
            let state = read_state(dir.path()).unwrap();
            assert_eq!(state.commit, 1);
            // The same bytes in an older segment are corruption: etcd wrote past them.
            std::fs::write(
                dir.path().join("0000000000000001-0000000000000002.wal"),
                &good,
            )
            .unwrap();
            let err = read_state(dir.path()).unwrap_err().to_string();
            assert!(
                err.contains("0000000000000000-0000000000000000.wal: corrupt WAL"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_new_leaders_entries_replace_the_old_terms() {
        let mut s = WalState::default();
        for i in 1..=5 {
            s.entry(i, 1);
        }
        s.entry(4, 2);
        assert_eq!(s.last_index, 4);
        assert_eq!(s.term_at(3), Some(1));
        assert_eq!(s.term_at(4), Some(2));
        assert_eq!(s.term_at(5), None);
    }

    #[test]
    fn the_last_entry_wins_and_a_torn_or_zero_tail_ends_the_segment() {
        let mut seg = frame(4, &[]);
        seg.extend(frame(1, b"metadata"));
        seg.extend(frame(ENTRY_TYPE, &entry(1, 7)));
        seg.extend(frame(ENTRY_TYPE, &entry(2, 8)));
        seg.extend(frame(3, b"hardstate"));
        assert_eq!(last_in_segment(&seg), Some(8));
        // Preallocated zeros after the last record.
        let mut zeros = seg.clone();
        zeros.extend(vec![0; 4096]);
        assert_eq!(last_in_segment(&zeros), Some(8));
        // A record cut short by a crash: the entries before it count.
        let mut torn = seg.clone();
        let next = frame(ENTRY_TYPE, &entry(2, 9));
        torn.extend(&next[..next.len() - 5]);
        assert_eq!(last_in_segment(&torn), Some(8));
        // No entry at all.
        assert_eq!(last_in_segment(&frame(4, &[])), None);
    }

    #[test]
    fn an_empty_newest_segment_reads_the_one_before() {
        let dir = tempfile::tempdir().unwrap();
        let mut old = frame(ENTRY_TYPE, &entry(1, 41));
        old.extend(frame(ENTRY_TYPE, &entry(1, 42)));
        std::fs::write(
            dir.path().join("0000000000000000-0000000000000000.wal"),
            old,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("0000000000000001-000000000000002b.wal"),
            frame(4, &[]),
        )
        .unwrap();
        std::fs::write(dir.path().join("0.tmp"), b"ignored").unwrap();
        assert_eq!(last_entry_index(dir.path()).unwrap(), Some(42));
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(last_entry_index(empty.path()).unwrap(), None);
    }
}
