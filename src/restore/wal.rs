//! Reading the raft index of the last entry in an etcd WAL (`member/wal/*.wal`), to tell a
//! database that lags its own WAL (entries etcd replays on start) from an old directory.
//!
//! A segment is a sequence of frames: a little-endian `u64` whose low 56 bits are the record's
//! length and whose top byte, when its high bit is set, holds the padding to 8 bytes; then the
//! record (`walpb.Record`: type 1, crc 2, data 3) and the padding. Segments are preallocated, so
//! a zero length ends one; a frame cut short (a torn write at a crash) ends it as well, as etcd's
//! own repair would. An entry record (type 2) carries a `raftpb.Entry` (term 2, index 3).

use std::path::Path;

/// `walpb.Record` type of a raft entry.
const ENTRY_TYPE: u64 = 2;

/// The index of the last raft entry in the WAL under `wal_dir`, or `None` when it holds none.
/// Reads the newest segment first and goes back only while a segment holds no entry.
pub fn last_entry_index(wal_dir: &Path) -> Result<Option<u64>, String> {
    let mut segments: Vec<_> = std::fs::read_dir(wal_dir)
        .map_err(|e| format!("{}: {e}", wal_dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "wal"))
        .collect();
    // Names are <seq>-<index>.wal in fixed-width hex: name order is write order.
    segments.sort();
    for segment in segments.iter().rev() {
        let bytes = std::fs::read(segment).map_err(|e| format!("{}: {e}", segment.display()))?;
        if let Some(index) = last_in_segment(&bytes) {
            return Ok(Some(index));
        }
    }
    Ok(None)
}

/// The index of the last entry record in one segment's bytes.
fn last_in_segment(bytes: &[u8]) -> Option<u64> {
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
