//! The member directory `etcdutl snapshot restore` (3.5, and 3.6: see [`Release::of`]) and
//! `etcdctl snapshot restore` (3.4) write, written here without them: the WAL, the `.snap` file
//! and what the database must say about the new cluster.
//!
//! Both tools do the same thing for a new cluster of `n` members (ids from the initial cluster
//! and token, see [`Cluster`]):
//!
//! - `member/wal/0000000000000000-0000000000000000.wal`: a CRC record, the metadata (this
//!   member's id, the cluster id), an empty snapshot record, one `ConfChangeAddNode` entry per
//!   member (term 1, indexes 1..=n, ids ascending, the member's JSON as context), the hard state
//!   (term 1, vote for the lowest id, commit n) and a snapshot record at (n, term 1). 3.5 puts the
//!   voters in that last record, 3.4 does not. Every record carries the CRC-32C of all record
//!   data so far; the file is 64,000,000 bytes (etcd preallocates its segments; here the tail
//!   is a hole, which reads as the same zeros).
//! - `member/snap/0000000000000001-<n in hex>.snap`: the raft snapshot at (n, term 1) whose data
//!   is etcd's v2 store holding `/0/members/<id>/raftAttributes` for each member, the same bytes
//!   for 3.4 and 3.5.
//! - in the database, `meta/consistent_index` = n (3.5 also `meta/term` = 1); 3.5 empties the
//!   `members` and `members_removed` buckets and writes the new members into `members`, and makes
//!   sure `cluster` exists. 3.4 leaves those buckets as the snapshot had them: it reads the
//!   membership from the v2 store, never from them.
//!
//! Both WAL and `.snap` are byte for byte what etcd's tools write for the same parameters
//! (`tests/restore_member_dir.rs` compares them).

use std::fmt::Write as _;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use sha1::{Digest, Sha1};

use super::tools::MemberParams;

/// etcd's WAL segment size, to which a new segment is preallocated.
const SEGMENT_BYTES: u64 = 64 * 1000 * 1000;
/// WAL record types (`walpb.Record.Type`).
const METADATA: u64 = 1;
const ENTRY: u64 = 2;
const STATE: u64 = 3;
const CRC: u64 = 4;
const SNAPSHOT: u64 = 5;
/// The v2 store's event history holds this many events, the rest of its queue `null`.
const EVENT_HISTORY: usize = 1000;

const CASTAGNOLI: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);

/// Which release's tool the directory must equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// `etcdctl snapshot restore` of etcd 3.4.
    V34,
    /// `etcdutl snapshot restore` of etcd 3.5.
    V35,
}

impl Release {
    /// The layout for an etcd of this version; `None` for releases not checked against their
    /// tool (3.7 onwards), which keep it.
    ///
    /// 3.6 takes 3.5's: `etcdutl snapshot restore` 3.6.5 writes the same WAL and database
    /// (every bucket, key for key) as 3.5's for the same snapshot and parameters. Its `.snap`
    /// holds the same v2 store, its members added in Go's map order (so two runs of 3.6's own
    /// tool differ there); 3.6 reads the membership from the database's `members` bucket and
    /// keeps the v2 store only for a downgrade to 3.5, which reads it as 3.5's tool writes it.
    pub fn of(version: (u32, u32, u32)) -> Option<Release> {
        match (version.0, version.1) {
            (3, 4) => Some(Release::V34),
            (3, 5) | (3, 6) => Some(Release::V35),
            _ => None,
        }
    }
}

/// One member of the initial cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: u64,
    pub name: String,
    /// Sorted, as etcd sorts them.
    pub peer_urls: Vec<String>,
}

/// The new cluster as etcd derives it from `--initial-cluster` and `--initial-cluster-token`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    pub id: u64,
    /// By id, ascending.
    pub members: Vec<Member>,
    /// The id of the member being restored.
    pub local: u64,
}

/// Why the member directory cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum MemberDirError {
    #[error("initial cluster {cluster:?}: {reason}")]
    Cluster { cluster: String, reason: String },
    #[error("{path}: {cause}")]
    Io { path: String, cause: std::io::Error },
}

impl Cluster {
    /// The cluster `member` restores into, with etcd's checks: every entry `name=url`, URLs with
    /// a scheme and a port and no path, the member named and advertising the URLs the cluster
    /// gives it, no two members with one id.
    pub fn from_params(member: &MemberParams) -> Result<Cluster, MemberDirError> {
        let initial = member.initial_cluster();
        let fail = |reason: String| MemberDirError::Cluster {
            cluster: initial.clone(),
            reason,
        };
        let mut by_name: std::collections::BTreeMap<String, Vec<String>> = Default::default();
        for entry in initial.split(',') {
            let (name, url) = entry
                .split_once('=')
                .ok_or_else(|| fail(format!("{entry:?} is not name=URL")))?;
            by_name
                .entry(name.to_owned())
                .or_default()
                .push(peer_url(url).map_err(fail)?);
        }
        let mut members = Vec::with_capacity(by_name.len());
        for (name, mut urls) in by_name {
            urls.sort();
            let mut hashed = Sha1::new();
            hashed.update(urls.concat().as_bytes());
            hashed.update(member.initial_cluster_token.as_bytes());
            let id = first_u64(&hashed.finalize());
            if id == 0 {
                return Err(fail(format!("member {name:?} hashes to id 0")));
            }
            members.push(Member {
                id,
                name,
                peer_urls: urls,
            });
        }
        members.sort_by_key(|m| m.id);
        if let Some(w) = members.windows(2).find(|w| w[0].id == w[1].id) {
            return Err(fail(format!(
                "members {:?} and {:?} have the same id {:x}",
                w[0].name, w[1].name, w[0].id
            )));
        }
        let local = members
            .iter()
            .find(|m| m.name == member.name)
            .ok_or_else(|| fail(format!("no member named {:?}", member.name)))?;
        let mut advertised = member
            .initial_advertise_peer_urls
            .split(',')
            .map(peer_url)
            .collect::<Result<Vec<_>, _>>()
            .map_err(fail)?;
        advertised.sort();
        if advertised != local.peer_urls {
            return Err(fail(format!(
                "member {:?} advertises {advertised:?}, the initial cluster gives it {:?}",
                member.name, local.peer_urls
            )));
        }
        let local = local.id;
        let mut ids = Sha1::new();
        for m in &members {
            ids.update(m.id.to_be_bytes());
        }
        Ok(Cluster {
            id: first_u64(&ids.finalize()),
            members,
            local,
        })
    }

    /// Raft's commit index after the members were added: one entry each.
    pub fn index(&self) -> u64 {
        self.members.len() as u64
    }

    /// The `members` bucket etcd 3.5 writes: id in hex, the member's JSON.
    pub fn members_bucket(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut rows: Vec<_> = self
            .members
            .iter()
            .map(|m| {
                (
                    format!("{:x}", m.id).into_bytes(),
                    member_json(m).into_bytes(),
                )
            })
            .collect();
        rows.sort();
        rows
    }

    /// The keys the restore sets in the `meta` bucket, in key order.
    pub fn meta(&self, release: Release) -> Vec<(&'static [u8], Vec<u8>)> {
        let mut keys: Vec<(&'static [u8], Vec<u8>)> =
            vec![(b"consistent_index", self.index().to_be_bytes().to_vec())];
        if release == Release::V35 {
            keys.push((b"term", 1u64.to_be_bytes().to_vec()));
        }
        keys
    }
}

/// A peer URL as etcd keeps it: trimmed, its scheme lower-case, with a host and port and no
/// path.
fn peer_url(url: &str) -> Result<String, String> {
    let url = url.trim();
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| format!("URL {url:?} has no scheme"))?;
    let scheme = scheme.to_ascii_lowercase();
    if !["http", "https", "unix", "unixs"].contains(&scheme.as_str()) {
        return Err(format!(
            "URL {url:?}: scheme {scheme:?} is not http or https"
        ));
    }
    let port = rest.rsplit_once(':').map(|(_, p)| p);
    if rest.contains('/') || port.is_none_or(|p| p.parse::<u16>().is_err()) {
        return Err(format!("URL {url:?} must be scheme://host:port, no path"));
    }
    Ok(format!("{scheme}://{rest}"))
}

fn first_u64(hash: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&hash[..8]);
    u64::from_be_bytes(b)
}

/// A JSON string as Go's `encoding/json` writes it (`<`, `>`, `&` and U+2028/9 escaped too).
fn go_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || "<>&\u{2028}\u{2029}".contains(c) => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn go_strings(out: &mut String, items: &[String]) {
    out.push('[');
    for (i, s) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        go_string(out, s);
    }
    out.push(']');
}

/// `{"peerURLs":[…]}`: the member's raft attributes.
fn raft_attributes_json(m: &Member) -> String {
    let mut s = String::from("{\"peerURLs\":");
    go_strings(&mut s, &m.peer_urls);
    s.push('}');
    s
}

/// `{"id":…,"peerURLs":[…],"name":…}`: the member as the WAL's entries and 3.5's bucket hold it.
fn member_json(m: &Member) -> String {
    let mut s = format!("{{\"id\":{},\"peerURLs\":", m.id);
    go_strings(&mut s, &m.peer_urls);
    if !m.name.is_empty() {
        s.push_str(",\"name\":");
        go_string(&mut s, &m.name);
    }
    s.push('}');
    s
}

/// etcd's v2 store after the members were added (one create each, ids ascending), as JSON.
fn v2_store_json(cluster: &Cluster) -> String {
    const NEVER: &str = "\"ExpireTime\":\"0001-01-01T00:00:00Z\"";
    let dir = |path: &str, index: usize, children: &str| {
        format!(
            "{{\"Path\":\"{path}\",\"CreatedIndex\":{index},\"ModifiedIndex\":{index},{NEVER},\
             \"Value\":\"\",\"Children\":{children}}}"
        )
    };
    // Created in id order; a directory's children are listed by name (Go sorts map keys), and
    // a hex id without leading zeros can sort differently from its number.
    let mut by_name: Vec<(String, usize, &Member)> = cluster
        .members
        .iter()
        .enumerate()
        .map(|(i, m)| (format!("{:x}", m.id), i + 1, m))
        .collect();
    by_name.sort_by(|a, b| a.0.cmp(&b.0));
    let mut members = String::from("{");
    for (n, (hex, index, m)) in by_name.iter().enumerate() {
        if n > 0 {
            members.push(',');
        }
        let path = format!("/0/members/{hex}");
        let mut value = String::new();
        go_string(&mut value, &raft_attributes_json(m));
        let attrs = format!(
            "{{\"raftAttributes\":{{\"Path\":\"{path}/raftAttributes\",\"CreatedIndex\":{index},\
             \"ModifiedIndex\":{index},{NEVER},\"Value\":{value},\"Children\":null}}}}"
        );
        let _ = write!(members, "\"{hex}\":{}", dir(&path, *index, &attrs));
    }
    members.push('}');
    let zero = format!(
        "{{\"members\":{}}}",
        dir("/0/members", 1, &members) // created with the first member
    );
    let root = format!(
        "{{\"0\":{},\"1\":{}}}",
        dir("/0", 0, &zero),
        dir("/1", 0, "{}")
    );
    let n = cluster.members.len();
    let mut events = String::from("[");
    for (i, m) in cluster.members.iter().enumerate() {
        let mut value = String::new();
        go_string(&mut value, &raft_attributes_json(m));
        let _ = write!(
            events,
            "{{\"action\":\"create\",\"node\":{{\"key\":\"/0/members/{:x}/raftAttributes\",\
             \"value\":{value},\"modifiedIndex\":{},\"createdIndex\":{}}}}},",
            m.id,
            i + 1,
            i + 1
        );
    }
    for _ in n..EVENT_HISTORY {
        events.push_str("null,");
    }
    events.pop();
    events.push(']');
    format!(
        "{{\"Root\":{},\"WatcherHub\":{{\"EventHistory\":{{\"Queue\":{{\"Events\":{events},\
         \"Size\":{n},\"Front\":0,\"Back\":{n},\"Capacity\":{EVENT_HISTORY}}},\"StartIndex\":1,\
         \"LastIndex\":{n}}}}},\"CurrentIndex\":{n},\"Stats\":{{\"getsSuccess\":0,\"getsFail\":0,\
         \"setsSuccess\":0,\"setsFail\":0,\"deleteSuccess\":0,\"deleteFail\":0,\
         \"updateSuccess\":0,\"updateFail\":0,\"createSuccess\":{n},\"createFail\":0,\
         \"compareAndSwapSuccess\":0,\"compareAndSwapFail\":0,\"compareAndDeleteSuccess\":0,\
         \"compareAndDeleteFail\":0,\"expireCount\":0,\"watchers\":0}},\"CurrentVersion\":2}}",
        dir("/", 0, &root)
    )
}

/// Protobuf: a varint.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Protobuf: field `field` as a varint.
fn field_varint(out: &mut Vec<u8>, field: u64, v: u64) {
    varint(out, field << 3);
    varint(out, v);
}

/// Protobuf: field `field` as bytes.
fn field_bytes(out: &mut Vec<u8>, field: u64, b: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// `raftpb.ConfState` with every member a voter (gogoproto writes `auto_leave` even when false).
fn conf_state(cluster: &Cluster) -> Vec<u8> {
    let mut b = Vec::new();
    for m in &cluster.members {
        field_varint(&mut b, 1, m.id);
    }
    field_varint(&mut b, 5, 0);
    b
}

/// The WAL's records, framed: each an 8-byte little-endian length (its top byte 0x80 | the
/// padding when the record is padded to 8 bytes), the `walpb.Record`, the padding.
struct Wal {
    bytes: Vec<u8>,
    crc: crc::Digest<'static, u32>,
}

impl Wal {
    fn record(&mut self, kind: u64, data: Option<&[u8]>) {
        if let Some(d) = data {
            self.crc.update(d);
        }
        let mut rec = Vec::new();
        field_varint(&mut rec, 1, kind);
        field_varint(&mut rec, 2, u64::from(self.crc.clone().finalize()));
        if let Some(d) = data {
            field_bytes(&mut rec, 3, d);
        }
        let pad = (8 - rec.len() % 8) % 8;
        let mut len = rec.len() as u64;
        if pad > 0 {
            len |= (0x80 | pad as u64) << 56;
        }
        self.bytes.extend_from_slice(&len.to_le_bytes());
        self.bytes.extend_from_slice(&rec);
        self.bytes.resize(self.bytes.len() + pad, 0);
    }
}

/// The WAL's bytes before the preallocated zeros.
pub fn wal_bytes(cluster: &Cluster, release: Release) -> Vec<u8> {
    let mut wal = Wal {
        bytes: Vec::new(),
        crc: CASTAGNOLI.digest(),
    };
    wal.record(CRC, None);
    let mut metadata = Vec::new();
    field_varint(&mut metadata, 1, cluster.local);
    field_varint(&mut metadata, 2, cluster.id);
    wal.record(METADATA, Some(&metadata));
    wal.record(SNAPSHOT, Some(&[0x08, 0, 0x10, 0]));
    for (i, m) in cluster.members.iter().enumerate() {
        let mut change = Vec::new();
        field_varint(&mut change, 1, 0); // ID
        field_varint(&mut change, 2, 0); // ConfChangeAddNode
        field_varint(&mut change, 3, m.id);
        field_bytes(&mut change, 4, member_json(m).as_bytes());
        let mut entry = Vec::new();
        field_varint(&mut entry, 1, 1); // EntryConfChange
        field_varint(&mut entry, 2, 1); // term
        field_varint(&mut entry, 3, i as u64 + 1);
        field_bytes(&mut entry, 4, &change);
        wal.record(ENTRY, Some(&entry));
    }
    let mut state = Vec::new();
    field_varint(&mut state, 1, 1);
    field_varint(&mut state, 2, cluster.members[0].id);
    field_varint(&mut state, 3, cluster.index());
    wal.record(STATE, Some(&state));
    let mut snapshot = Vec::new();
    field_varint(&mut snapshot, 1, cluster.index());
    field_varint(&mut snapshot, 2, 1);
    if release == Release::V35 {
        field_bytes(&mut snapshot, 3, &conf_state(cluster));
    }
    wal.record(SNAPSHOT, Some(&snapshot));
    wal.bytes
}

/// The `.snap` file: `snappb.Snapshot` (CRC-32C, data) around the raft snapshot.
pub fn snap_bytes(cluster: &Cluster) -> Vec<u8> {
    let mut metadata = Vec::new();
    field_bytes(&mut metadata, 1, &conf_state(cluster));
    field_varint(&mut metadata, 2, cluster.index());
    field_varint(&mut metadata, 3, 1);
    let mut snapshot = Vec::new();
    field_bytes(&mut snapshot, 1, v2_store_json(cluster).as_bytes());
    field_bytes(&mut snapshot, 2, &metadata);
    let mut file = Vec::new();
    field_varint(&mut file, 1, u64::from(CASTAGNOLI.checksum(&snapshot)));
    field_bytes(&mut file, 2, &snapshot);
    file
}

/// `member/snap/<term>-<index>.snap`'s name.
pub fn snap_name(cluster: &Cluster) -> String {
    format!("{:016x}-{:016x}.snap", 1, cluster.index())
}

/// Creates `data_dir` (which must not exist) and `data_dir/member/{wal,snap}`, each 0700, and
/// writes the WAL and `.snap` file into them (the database goes to [`db_path`]). Nothing is
/// synced: the restore syncs the tree once.
pub fn write(data_dir: &Path, cluster: &Cluster, release: Release) -> Result<(), MemberDirError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |cause| MemberDirError::Io { path, cause }
    };
    let wal_dir = data_dir.join("member/wal");
    let snap_dir = data_dir.join("member/snap");
    // The directory itself is created here, fresh and private (as etcd creates its own): one
    // that appeared since the restore removed its leftovers is not ours to fill.
    for dir in [data_dir, &data_dir.join("member"), &wal_dir, &snap_dir] {
        crate::scratch::create_private_dir(dir).map_err(io(dir))?;
    }
    let wal = wal_dir.join("0000000000000000-0000000000000000.wal");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&wal)
        .map_err(io(&wal))?;
    f.write_all(&wal_bytes(cluster, release))
        .and_then(|()| f.set_len(SEGMENT_BYTES))
        .map_err(io(&wal))?;
    let snap = snap_dir.join(snap_name(cluster));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&snap)
        .and_then(|mut f| f.write_all(&snap_bytes(cluster)))
        .map_err(io(&snap))?;
    Ok(())
}

/// Where the database goes in `data_dir`.
pub fn db_path(data_dir: &Path) -> std::path::PathBuf {
    data_dir.join("member/snap/db")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three() -> MemberParams {
        MemberParams {
            name: "m1".into(),
            initial_cluster: "m1=http://10.0.0.1:2380,m2=http://10.0.0.2:2380,\
                              m3=http://10.0.0.3:2380"
                .into(),
            initial_cluster_token: "tok".into(),
            initial_advertise_peer_urls: "http://10.0.0.1:2380".into(),
        }
    }

    #[test]
    fn ids_are_etcds() {
        // As `etcdutl snapshot restore` 3.5.1 derived them for these parameters.
        let c = Cluster::from_params(&three()).unwrap();
        let ids: Vec<String> = c.members.iter().map(|m| format!("{:x}", m.id)).collect();
        assert_eq!(
            ids,
            ["61b046c1789d11d8", "7aa181191753809e", "98521e8c6c48c6da"]
        );
        assert_eq!(format!("{:x}", c.local), "98521e8c6c48c6da");
        assert_eq!(format!("{:x}", c.id), "8e67f3b977698ab3");
    }

    #[test]
    fn a_member_not_in_the_cluster_or_advertising_other_urls_is_refused() {
        let p = MemberParams {
            name: "m4".into(),
            ..three()
        };
        let e = Cluster::from_params(&p).unwrap_err().to_string();
        assert!(e.contains("no member named \"m4\""), "{e}");
        let p = MemberParams {
            initial_advertise_peer_urls: "http://10.0.0.9:2380".into(),
            ..three()
        };
        let e = Cluster::from_params(&p).unwrap_err().to_string();
        assert!(e.contains("advertises"), "{e}");
        let p = MemberParams {
            initial_cluster: "m1=http://10.0.0.1:2380/path".into(),
            ..three()
        };
        let e = Cluster::from_params(&p).unwrap_err().to_string();
        assert!(e.contains("no path"), "{e}");
    }

    #[test]
    fn go_escapes_html_and_line_separators() {
        let mut s = String::new();
        go_string(&mut s, "a\"<b>&\u{2028}\n\u{1}");
        assert_eq!(s, r#""a\"\u003cb\u003e\u0026\u2028\n\u0001""#);
    }
}
