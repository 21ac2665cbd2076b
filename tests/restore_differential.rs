//! Differential restore tests (issue 43): a seeded random etcd history is backed up with the
//! product's own snapshot code (full snapshots, a watch's deltas), restored by etcd-warden
//! (plain, `--to-revision` at a random revision, bumped and marked compacted) and by etcd's own
//! tools (`etcdctl snapshot save` when the source is at the revision, then `etcdutl snapshot
//! restore` on 3.5 or `etcdctl snapshot restore` on 3.4; `get --rev` on the source where no
//! etcd snapshot exists). Both restores are started and compared: every key, value, create and
//! mod revision, version and lease; reads at past revisions; the leases and their TTLs; the
//! compacted revision; the member list and cluster ID; the auth store.
//!
//! Where etcd-warden differs from etcd's own restore by design (docs/restore.md, "Differential
//! tests"), the expectation says so: a put replayed from a delta carries no lease, the lease
//! table is the full snapshot's, and the compaction is the full snapshot's.
//!
//! CI runs a few seeds per release. `DIFF_HISTORIES=N DIFF_SEED=S DIFF_RELEASE=3.4|3.5|both
//! DIFF_PARALLEL=P cargo test --release --test it restore_differential::many_histories --
//! --nocapture` runs N histories from seed S; a failure prints its seed and the
//! command replaying it alone.

use crate::restore::{file_store, options};
use crate::support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, CompactionOptions, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions,
    Permission, PutOptions, Txn, TxnOp,
};
use etcd_warden::restore::{EtcdTools, RevisionBump, Target, TempEtcd};
use etcd_warden::snapshot::delta::{DeltaWriter, Event};
use etcd_warden::snapshot::take_full;
use etcd_warden::snapshot::watcher::DeltaWatch;
use etcd_warden::store::{Codec, SnapshotStore};
use support::etcd::{EtcdCluster, Release};
use support::schedule::SplitMix64;

/// The root password of histories with auth enabled.
const ROOT_PASSWORD: &str = "root-password";
/// The bump of the bumped restore.
const BUMP: u64 = 1_000_000;
/// The largest value put: below etcd's default 1.5 MiB request limit with the key and framing.
const MAX_VALUE: u64 = 1_500_000;

/// A key as a restored etcd serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Kv {
    key: Vec<u8>,
    value: Vec<u8>,
    create_revision: i64,
    mod_revision: i64,
    version: i64,
    lease: i64,
}

impl Kv {
    fn from(kv: &etcd_client::KeyValue) -> Kv {
        Kv {
            key: kv.key().to_vec(),
            value: kv.value().to_vec(),
            create_revision: kv.create_revision(),
            mod_revision: kv.mod_revision(),
            version: kv.version(),
            lease: kv.lease(),
        }
    }
}

/// Users (with their roles) and roles (with their permissions), and whether auth is on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Auth {
    enabled: bool,
    users: BTreeMap<String, Vec<String>>,
    roles: BTreeMap<String, Vec<String>>,
    /// Whether the first user other than root can log in with its password.
    first_user_logs_in: Option<bool>,
}

/// What is compared of a running, restored etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
struct State {
    revision: i64,
    /// The oldest revision a read can be served at (1 when nothing is compacted).
    oldest_readable: i64,
    kvs: Vec<Kv>,
    /// Lease ID to granted TTL.
    leases: BTreeMap<i64, i64>,
    /// (ID, name, peer URLs, learner) of every member; client URLs are the run's own ports.
    members: Vec<(u64, String, Vec<String>, bool)>,
    cluster_id: u64,
    auth: Auth,
}

/// A full snapshot as the history took it, and what the source held then.
#[derive(Debug, Clone)]
struct FullTaken {
    name: String,
    revision: i64,
    leases: BTreeMap<i64, i64>,
    compacted: i64,
}

/// An `etcdctl snapshot save` taken when the source was at `revision`.
#[derive(Debug, Clone)]
struct Saved {
    file: PathBuf,
    revision: i64,
    leases: BTreeMap<i64, i64>,
    compacted: i64,
}

/// The history's record: what was backed up and what etcd saved.
struct History {
    fulls: Vec<FullTaken>,
    mid: Saved,
    end: Saved,
    /// A revision without an etcd snapshot and the source's keys at it (`get --rev`).
    past: Option<(i64, Vec<Kv>)>,
    auth: bool,
    ops: usize,
    /// What this history exercised, for the run's counts.
    features: Features,
}

/// What a history exercised, counted over a run.
#[derive(Debug, Default, Clone, Copy)]
struct Features {
    /// Users and roles written (auth enabled or not).
    auth_store: bool,
    auth_enabled: bool,
    compacted_before_full: bool,
    compacted_after_full: bool,
    fulls: usize,
    deltas: usize,
    lease_expired: bool,
    revoked: usize,
    leased_puts: usize,
    txns: usize,
    range_deletes: usize,
    big_values: usize,
    long_keys: usize,
    past: bool,
    bulk: bool,
}

/// The writer of one history: its random choices, the source and what it knows of it.
struct Gen {
    rng: SplitMix64,
    client: Client,
    endpoint: String,
    leases: Vec<i64>,
    compacted: i64,
    auth: bool,
    ops: usize,
    /// Whether this history has a lease left to expire.
    expiring: bool,
    features: Features,
}

impl Gen {
    fn key(&mut self) -> Vec<u8> {
        let prefix = ["/a/", "/b/", "/c/", "/registry/pods/"][self.rng.range(0, 3) as usize];
        let i = self.rng.range(0, 40);
        if self.rng.chance(4) {
            // Larger than a page: bbolt stores it on overflow pages.
            let len = self.rng.range(4_100, 9_000) as usize;
            let mut k = format!("/long/{i}/").into_bytes();
            k.resize(len, b'k');
            self.features.long_keys += 1;
            return k;
        }
        format!("{prefix}{i:02}").into_bytes()
    }

    fn value(&mut self) -> Vec<u8> {
        let len = match self.rng.weighted(&[5, 50, 30, 10, 4, 1]) {
            0 => 0,
            1 => self.rng.range(1, 64),
            2 => self.rng.range(64, 4_096),
            3 => self.rng.range(4_096, 65_536),
            4 => self.rng.range(65_536, 300_000),
            _ => self.rng.range(1_000_000, MAX_VALUE),
        } as usize;
        if len >= 1_000_000 {
            self.features.big_values += 1;
        }
        let salt = self.rng.next_u64();
        (0..len)
            .map(|i| ((i as u64 ^ salt).wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect()
    }

    async fn revision(&mut self) -> i64 {
        self.client
            .get("/", None)
            .await
            .expect("read the source's revision")
            .header()
            .expect("a header")
            .revision()
    }

    async fn lease_table(&mut self) -> BTreeMap<i64, i64> {
        lease_table(&mut self.client).await
    }

    /// One random operation on the source.
    async fn op(&mut self) {
        self.ops += 1;
        match self.rng.weighted(&[40, 8, 8, 3, 2, 8, 5, 4, 1]) {
            0 => {
                let (k, v) = (self.key(), self.value());
                self.client.put(k, v, None).await.expect("put");
            }
            1 => {
                if self.leases.is_empty() {
                    self.grant().await;
                }
                let lease = self.leases[self.rng.range(0, self.leases.len() as u64 - 1) as usize];
                let (k, v) = (self.key(), self.value());
                let opts = PutOptions::new().with_lease(lease);
                self.client
                    .put(k, v, Some(opts))
                    .await
                    .expect("put on a lease");
                self.features.leased_puts += 1;
            }
            2 => {
                let k = self.key();
                self.client.delete(k, None).await.expect("delete");
            }
            3 => {
                let prefix = ["/a/", "/b/", "/c/", "/long/"][self.rng.range(0, 3) as usize];
                let opts = DeleteOptions::new().with_prefix();
                self.client
                    .delete(prefix, Some(opts))
                    .await
                    .expect("delete a prefix");
                self.features.range_deletes += 1;
            }
            4 => {
                // A range [from, to) within one prefix.
                let (lo, hi) = (self.rng.range(0, 30), self.rng.range(31, 40));
                let opts = DeleteOptions::new().with_range(format!("/b/{hi:02}"));
                self.client
                    .delete(format!("/b/{lo:02}"), Some(opts))
                    .await
                    .expect("delete a range");
                self.features.range_deletes += 1;
            }
            5 => {
                self.txn().await;
                self.features.txns += 1;
            }
            6 => self.grant().await,
            7 => {
                if !self.leases.is_empty() {
                    let i = self.rng.range(0, self.leases.len() as u64 - 1) as usize;
                    let id = self.leases.swap_remove(i);
                    self.client.lease_revoke(id).await.expect("revoke a lease");
                    self.features.revoked += 1;
                }
            }
            _ => {
                if self.expiring {
                    self.expiring = false;
                    self.expire().await;
                    self.features.lease_expired = true;
                }
            }
        }
    }

    /// Hundreds of small puts under one prefix, many to a bbolt page (the trees get branch
    /// pages), and sometimes a range delete of an earlier batch.
    async fn bulk(&mut self, batch: u64) {
        self.features.bulk = true;
        for i in 0..self.rng.range(100, 600) {
            let v = vec![b'v'; self.rng.range(0, 120) as usize];
            self.client
                .put(format!("/bulk/{batch}/{i:04}"), v, None)
                .await
                .expect("bulk put");
        }
        if batch > 0 && self.rng.chance(50) {
            let opts = DeleteOptions::new().with_prefix();
            let other = self.rng.range(0, batch - 1);
            self.client
                .delete(format!("/bulk/{other}/"), Some(opts))
                .await
                .expect("delete a batch");
        }
    }

    async fn grant(&mut self) {
        let ttl = 3_600 + self.rng.range(0, 1_000) as i64;
        let id = self
            .client
            .lease_grant(ttl, None)
            .await
            .expect("grant")
            .id();
        self.leases.push(id);
    }

    /// A transaction of distinct keys: puts and deletes, or others when a compare fails.
    async fn txn(&mut self) {
        let n = self.rng.range(2, 4);
        let mut keys: Vec<Vec<u8>> = Vec::new();
        while keys.len() < n as usize {
            let k = self.key();
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        let mut ops = Vec::new();
        for k in &keys {
            if self.rng.chance(75) {
                let v = self.value();
                // Keep the whole request under etcd's limit: one big value at most.
                let v = if v.len() > 200_000 {
                    v[..200_000].to_vec()
                } else {
                    v
                };
                ops.push(TxnOp::put(k.clone(), v, None));
            } else {
                ops.push(TxnOp::delete(k.clone(), None));
            }
        }
        let cmp = Compare::version(keys[0].clone(), CompareOp::Greater, 0);
        let other = vec![TxnOp::put(keys[1].clone(), "else", None)];
        self.client
            .txn(Txn::new().when([cmp]).and_then(ops).or_else(other))
            .await
            .expect("a transaction");
    }

    /// A lease of etcd's shortest TTL with a key, waited for until etcd revokes it.
    async fn expire(&mut self) {
        let id = self.client.lease_grant(1, None).await.expect("grant").id();
        let key = format!("/expiring/{}", self.rng.range(0, 9));
        let opts = PutOptions::new().with_lease(id);
        self.client
            .put(key.clone(), "e", Some(opts))
            .await
            .expect("put");
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let got = self.client.get(key.clone(), None).await.expect("get");
            if got.kvs().is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the lease of {key} did not expire in 30 s");
    }

    async fn compact(&mut self) {
        let now = self.revision().await;
        if now <= self.compacted + 1 {
            return;
        }
        let at = self.rng.range(self.compacted as u64 + 1, now as u64) as i64;
        let opts = CompactionOptions::new().with_physical();
        self.client.compact(at, Some(opts)).await.expect("compact");
        self.compacted = at;
    }

    /// Users and roles; then, maybe, root and auth enabled (the client logs in as root).
    async fn auth(&mut self) {
        self.features.auth_store = true;
        let roles = self.rng.range(1, 3);
        for r in 0..roles {
            let name = format!("role{r}");
            self.client.role_add(name.clone()).await.expect("role add");
            let perm = match self.rng.range(0, 2) {
                0 => Permission::read(format!("/a/{r}")).with_prefix(),
                1 => Permission::write("/b/").with_prefix(),
                _ => Permission::read_write("/c/00").with_range_end("/c/20"),
            };
            self.client
                .role_grant_permission(name, perm)
                .await
                .expect("grant a permission");
        }
        for u in 0..self.rng.range(1, 3) {
            let name = format!("user{u}");
            self.client
                .user_add(name.clone(), format!("pw{u}"), None)
                .await
                .expect("user add");
            let role = format!("role{}", self.rng.range(0, roles - 1));
            self.client
                .user_grant_role(name, role)
                .await
                .expect("grant a role");
        }
        if self.rng.chance(50) {
            self.client
                .user_add("root", ROOT_PASSWORD, None)
                .await
                .expect("add root");
            self.client
                .user_grant_role("root", "root")
                .await
                .expect("root role");
            self.client.auth_enable().await.expect("auth enable");
            self.auth = true;
            self.features.auth_enabled = true;
            self.client = connect(&self.endpoint, true).await;
        }
    }

    async fn save(&mut self, release: Release, file: PathBuf) -> Saved {
        let revision = self.revision().await;
        let leases = self.lease_table().await;
        etcdctl_save(release, &self.endpoint, &file, self.auth).await;
        Saved {
            file,
            revision,
            leases,
            compacted: self.compacted,
        }
    }
}

/// A client of `url`, as root when auth is on.
async fn connect(url: &str, auth: bool) -> Client {
    let opts = auth.then(|| ConnectOptions::new().with_user("root", ROOT_PASSWORD));
    Client::connect([url], opts)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// Lease ID to granted TTL.
async fn lease_table(c: &mut Client) -> BTreeMap<i64, i64> {
    let ids: Vec<i64> = c
        .leases()
        .await
        .expect("list leases")
        .leases()
        .iter()
        .map(|l| l.id())
        .collect();
    let mut table = BTreeMap::new();
    for id in ids {
        let ttl = c.lease_time_to_live(id, None).await.expect("lease TTL");
        table.insert(id, ttl.granted_ttl());
    }
    table
}

/// `etcdctl snapshot save` of the etcd at `url` into `file`.
async fn etcdctl_save(release: Release, url: &str, file: &Path, auth: bool) {
    let mut cmd = tokio::process::Command::new(release.bin("etcdctl"));
    cmd.env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={url}"))
        .args(["snapshot", "save"])
        .arg(file);
    if auth {
        cmd.arg(format!("--user=root:{ROOT_PASSWORD}"));
    }
    let out = cmd.output().await.expect("run etcdctl snapshot save");
    assert!(
        out.status.success(),
        "etcdctl snapshot save: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// etcd's own restore of `file` into `data_dir`, as the member etcd-warden's restore writes by
/// default (`default`, `http://localhost:2380`, token `etcd-cluster`).
async fn etcd_restore(release: Release, file: &Path, data_dir: &Path) {
    let tool = match release {
        Release::V35 | Release::V36 => "etcdutl",
        Release::V34 => "etcdctl",
    };
    let out = tokio::process::Command::new(release.bin(tool))
        .env("ETCDCTL_API", "3")
        .args(["snapshot", "restore"])
        .arg(file)
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--name", "default"])
        .args(["--initial-cluster", "default=http://localhost:2380"])
        .args(["--initial-cluster-token", "etcd-cluster"])
        .args(["--initial-advertise-peer-urls", "http://localhost:2380"])
        .output()
        .await
        .unwrap_or_else(|e| panic!("run {tool} snapshot restore: {e}"));
    assert!(
        out.status.success(),
        "{tool} snapshot restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes one history from `seed` into a new etcd of `release`, backing it up into `store`.
async fn write_history(release: Release, seed: u64, dir: &Path, store: &SnapshotStore) -> History {
    let etcd = EtcdCluster::single(release).await;
    let endpoint = etcd.endpoints()[0].clone();
    let client = connect(&endpoint, false).await;
    let mut g = Gen {
        rng: SplitMix64::new(seed),
        client,
        endpoint,
        leases: Vec::new(),
        compacted: 0,
        auth: false,
        ops: 0,
        expiring: false,
        features: Features::default(),
    };
    g.expiring = g.rng.chance(3);
    for _ in 0..g.rng.range(3, 25) {
        g.op().await;
    }
    if g.rng.chance(10) {
        g.bulk(0).await;
    }
    if g.rng.chance(30) {
        g.auth().await;
    }
    if g.rng.chance(40) {
        g.compact().await;
        g.features.compacted_before_full = g.compacted > 0;
    }
    let mut fulls = Vec::new();
    let full = take(&mut g, store).await;
    let mut writer = DeltaWriter::new(Codec::Gzip, full.revision);
    let mut watch = DeltaWatch::open(&g.client, full.revision + 1)
        .await
        .expect("watch");
    let mut last_full = full.revision;
    fulls.push(full);

    let segments = g.rng.range(1, 4);
    let mid_segment = g.rng.range(0, segments - 1);
    let mut mid = None;
    for segment in 0..segments {
        let n = g.rng.range(2, 15);
        let mid_at = g.rng.range(0, n);
        for i in 0..n {
            if segment == mid_segment && i == mid_at {
                mid = Some(g.save(release, dir.join("mid.db")).await);
            }
            g.op().await;
        }
        if g.rng.chance(8) {
            g.bulk(segment + 1).await;
        }
        if segment == mid_segment && mid.is_none() {
            mid = Some(g.save(release, dir.join("mid.db")).await);
        }
        // Drain the watch to the source's revision and store the events as one delta.
        let now = g.revision().await;
        let mut events: Vec<Event> = Vec::new();
        while events
            .last()
            .map_or(writer.previous_last(), Event::revision)
            < now
        {
            events.extend(watch.next().await.expect("watch events"));
        }
        writer.push(events, chrono::Utc::now());
        if writer.flush(store).await.expect("store a delta").is_some() {
            g.features.deltas += 1;
        }
        if g.rng.chance(30) {
            let before = g.compacted;
            g.compact().await;
            g.features.compacted_after_full |= g.compacted > before;
        }
        // Another full snapshot, only at a new revision: two at one revision could hold
        // different leases (a grant moves no revision) and either may be chosen.
        if segment + 1 < segments && g.rng.chance(50) && now > last_full {
            let full = take(&mut g, store).await;
            writer.rebase(full.revision);
            last_full = full.revision;
            fulls.push(full);
        }
    }
    let end = g.save(release, dir.join("end.db")).await;
    let mid = mid.expect("a snapshot at a revision inside the history");
    // A revision the source still serves with no etcd snapshot of it.
    let lowest = fulls[0].revision.max(g.compacted);
    let past = (g.rng.chance(50) && end.revision > lowest)
        .then(|| g.rng.range(lowest as u64, end.revision as u64) as i64);
    let past = match past {
        Some(r) => Some((r, get_all(&mut g.client, Some(r)).await)),
        None => None,
    };
    drop(etcd);
    let features = Features {
        fulls: fulls.len(),
        past: past.is_some(),
        ..g.features
    };
    History {
        features,
        fulls,
        mid,
        end,
        past,
        auth: g.auth,
        ops: g.ops,
    }
}

/// A full snapshot through the product's own code, with the leases and compaction of the
/// source when it was taken.
async fn take(g: &mut Gen, store: &SnapshotStore) -> FullTaken {
    let leases = g.lease_table().await;
    let full = take_full(&g.client, store, Codec::Gzip, false)
        .await
        .expect("a full snapshot");
    FullTaken {
        name: full.snap_name,
        revision: full.last_revision,
        leases,
        compacted: g.compacted,
    }
}

/// Every key at `rev` (`None`: now), with its lease. Values reach 1.5 MiB and a response
/// holds many: the client's 4 MiB default limit on a message is lifted.
async fn get_all(c: &mut Client, rev: Option<i64>) -> Vec<Kv> {
    let mut opts = GetOptions::new().with_from_key();
    if let Some(r) = rev {
        opts = opts.with_revision(r);
    }
    let resp = c
        .kv_client()
        .max_decoding_message_size(1 << 30)
        .get(vec![0u8], Some(opts))
        .await
        .unwrap_or_else(|e| panic!("read every key at {rev:?}: {e}"));
    resp.kvs().iter().map(Kv::from).collect()
}

/// Whether a read at `rev` is served (not compacted).
async fn readable(c: &mut Client, rev: i64) -> bool {
    let opts = GetOptions::new().with_revision(rev).with_count_only();
    match c.get("/", Some(opts)).await {
        Ok(_) => true,
        Err(e) if e.to_string().contains("compacted") => false,
        Err(e) => panic!("read at revision {rev}: {e}"),
    }
}

/// The oldest revision served: reads below etcd's compacted revision fail, at and above it
/// succeed.
async fn oldest_readable(c: &mut Client, revision: i64) -> i64 {
    let (mut lo, mut hi) = (1, revision);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if readable(c, mid).await {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// Everything compared of the etcd at `url`.
async fn capture(url: &str, auth: bool) -> State {
    let mut c = connect(url, auth).await;
    let head = c.get("/", None).await.expect("read");
    let header = head.header().expect("a header");
    let (revision, cluster_id) = (header.revision(), header.cluster_id());
    let kvs = get_all(&mut c, None).await;
    let leases = lease_table(&mut c).await;
    let mut members: Vec<(u64, String, Vec<String>, bool)> = c
        .member_list()
        .await
        .expect("member list")
        .members()
        .iter()
        .map(|m| {
            (
                m.id(),
                m.name().to_string(),
                m.peer_urls().to_vec(),
                m.is_learner(),
            )
        })
        .collect();
    members.sort();
    let oldest_readable = oldest_readable(&mut c, revision).await;
    State {
        revision,
        oldest_readable,
        kvs,
        leases,
        members,
        cluster_id,
        auth: capture_auth(url, &mut c).await,
    }
}

async fn capture_auth(url: &str, c: &mut Client) -> Auth {
    let mut auth = Auth::default();
    let mut anonymous = connect(url, false).await;
    auth.enabled = anonymous.get("/", None).await.is_err();
    let roles = c.role_list().await.expect("role list").roles().to_vec();
    for r in roles {
        let got = c.role_get(r.clone()).await.expect("role get");
        let mut perms: Vec<String> = got.permissions().iter().map(|p| format!("{p:?}")).collect();
        perms.sort();
        auth.roles.insert(r, perms);
    }
    let users = c.user_list().await.expect("user list").users().to_vec();
    for u in users {
        let mut roles = c
            .user_get(u.clone())
            .await
            .expect("user get")
            .roles()
            .to_vec();
        roles.sort();
        auth.users.insert(u, roles);
    }
    if auth.enabled && auth.users.contains_key("user0") {
        let opts = ConnectOptions::new().with_user("user0", "pw0");
        auth.first_user_logs_in = Some(Client::connect([url], Some(opts)).await.is_ok());
    }
    auth
}

/// A started, restored data directory.
struct Running {
    what: String,
    etcd: TempEtcd,
}

/// Starts etcd on each restored data directory at once.
async fn start_all(release: Release, dirs: Vec<(String, PathBuf)>) -> Vec<Running> {
    let tools = EtcdTools::locate(Some(&release.bin_dir()))
        .await
        .expect("etcd tools");
    let tools = Arc::new(tools);
    futures::future::join_all(dirs.into_iter().map(|(what, dir)| {
        let tools = tools.clone();
        async move {
            let log = dir.with_extension("log");
            let etcd = TempEtcd::start(&tools, &dir, "default", log.clone())
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "{what}: etcd does not start on {}: {e}; log:\n{}",
                        dir.display(),
                        std::fs::read_to_string(&log).unwrap_or_default()
                    )
                });
            Running { what, etcd }
        }
    }))
    .await
}

/// The differences between `a` and `b` (named by `what`), one line each.
fn diff(what: &str, a: &State, b: &State) -> Vec<String> {
    let mut out = Vec::new();
    let mut field = |name: &str, differ: Option<(String, String)>| {
        if let Some((x, y)) = differ {
            out.push(format!("{what}: {name}: {x} != {y}"));
        }
    };
    field(
        "revision",
        unequal(&a.revision, &b.revision, i64::to_string),
    );
    field(
        "oldest readable revision",
        unequal(&a.oldest_readable, &b.oldest_readable, i64::to_string),
    );
    field(
        "leases",
        unequal(&a.leases, &b.leases, |v| format!("{v:?}")),
    );
    field(
        "members",
        unequal(&a.members, &b.members, |v| format!("{v:?}")),
    );
    field(
        "cluster ID",
        unequal(&a.cluster_id, &b.cluster_id, |v| format!("{v:x}")),
    );
    field("auth", unequal(&a.auth, &b.auth, |v| format!("{v:?}")));
    out.extend(diff_kvs(what, &a.kvs, &b.kvs));
    out
}

/// `a` and `b` as `show` prints them, when they differ.
fn unequal<T: PartialEq>(a: &T, b: &T, show: impl Fn(&T) -> String) -> Option<(String, String)> {
    (a != b).then(|| (show(a), show(b)))
}

/// Key by key: the first few keys that differ, missing or extra.
fn diff_kvs(what: &str, a: &[Kv], b: &[Kv]) -> Vec<String> {
    let short = |k: &[u8]| {
        let s = String::from_utf8_lossy(k);
        if s.len() > 40 {
            format!("{}…({} bytes)", &s[..40], k.len())
        } else {
            s.into_owned()
        }
    };
    let meta = |kv: &Kv| {
        format!(
            "create {} mod {} version {} lease {:x} value {} bytes",
            kv.create_revision,
            kv.mod_revision,
            kv.version,
            kv.lease,
            kv.value.len()
        )
    };
    let am: BTreeMap<&[u8], &Kv> = a.iter().map(|kv| (kv.key.as_slice(), kv)).collect();
    let bm: BTreeMap<&[u8], &Kv> = b.iter().map(|kv| (kv.key.as_slice(), kv)).collect();
    let mut out = Vec::new();
    for (k, x) in &am {
        match bm.get(k) {
            None => out.push(format!(
                "{what}: key {} only in the first ({})",
                short(k),
                meta(x)
            )),
            Some(y) if x != y => out.push(format!(
                "{what}: key {}: {} != {}{}",
                short(k),
                meta(x),
                meta(y),
                if x.value != y.value {
                    " (values differ)"
                } else {
                    ""
                }
            )),
            _ => {}
        }
    }
    for (k, y) in &bm {
        if !am.contains_key(k) {
            out.push(format!(
                "{what}: key {} only in the second ({})",
                short(k),
                meta(y)
            ));
        }
    }
    out.truncate(8);
    out
}

/// What etcd-warden restores of `own` (etcd's restore at the same revision) from the full
/// snapshot `full`: a key last written after the full snapshot has no lease (puts from deltas
/// keep none); the lease table and the compaction are the full snapshot's.
fn warden_expected(own: &State, full: &FullTaken) -> State {
    let mut want = own.clone();
    for kv in &mut want.kvs {
        if kv.mod_revision > full.revision {
            kv.lease = 0;
        }
    }
    want.leases = full.leases.clone();
    want.oldest_readable = full.compacted.max(1);
    want
}

/// The full snapshot a restore to `revision` starts from: the newest at or before it.
fn full_for(h: &History, revision: i64) -> &FullTaken {
    h.fulls
        .iter()
        .rev()
        .find(|f| f.revision <= revision)
        .expect("a full snapshot at or before the target")
}

/// What a history found: the differences, one line each (none: the restores agree).
struct Outcome {
    features: Features,
    ops: usize,
    revision: i64,
    differences: Vec<String>,
}

/// etcd-warden's restore of `store` into `dir/name`, to `to` (`None`: the latest), bumped.
async fn warden(
    store: &SnapshotStore,
    dir: &Path,
    release: Release,
    name: &str,
    to: Option<i64>,
    bump: RevisionBump,
) -> (etcd_warden::restore::RestoreReport, PathBuf) {
    let target = dir.join(name);
    let mut opts = options(&target, release);
    opts.to = to.map(Target::Revision);
    opts.bump = bump;
    let report = etcd_warden::restore::restore(store, &opts)
        .await
        .unwrap_or_else(|e| panic!("etcd-warden restore {name} (to {to:?}): {e}"));
    (report, target)
}

/// One history: write it, restore it both ways, compare.
async fn one_history(release: Release, seed: u64) -> Outcome {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = file_store(&dir.path().join("store"));
    let h = write_history(release, seed, dir.path(), &store).await;
    let mut differences = Vec::new();

    // etcd-warden's restores: the latest, a revision inside the history, the latest bumped.
    let (plain, plain_dir) = warden(
        &store,
        dir.path(),
        release,
        "warden-latest",
        None,
        RevisionBump::default(),
    )
    .await;
    let (at_mid, mid_dir) = warden(
        &store,
        dir.path(),
        release,
        "warden-mid",
        Some(h.mid.revision),
        RevisionBump::default(),
    )
    .await;
    let bump = RevisionBump {
        by: BUMP,
        mark_compacted: true,
    };
    let (bumped, bumped_dir) =
        warden(&store, dir.path(), release, "warden-bumped", None, bump).await;
    let past = match &h.past {
        Some((r, _)) => Some(
            warden(
                &store,
                dir.path(),
                release,
                "warden-past",
                Some(*r),
                RevisionBump::default(),
            )
            .await,
        ),
        None => None,
    };
    let used = |report: &etcd_warden::restore::RestoreReport, revision| {
        let f = full_for(&h, revision);
        (report.full_snapshot == f.name)
            .then_some(())
            .ok_or_else(|| {
                format!(
                    "restore to {revision} used {} rather than {}",
                    report.full_snapshot, f.name
                )
            })
    };
    for (r, rev) in [(&plain, h.end.revision), (&at_mid, h.mid.revision)] {
        if let Err(e) = used(r, rev) {
            differences.push(e);
        }
    }

    // etcd's own restores of its snapshots at the same revisions.
    let own_end = dir.path().join("etcd-latest");
    let own_mid = dir.path().join("etcd-mid");
    etcd_restore(release, &h.end.file, &own_end).await;
    etcd_restore(release, &h.mid.file, &own_mid).await;

    let mut dirs = vec![
        ("etcd-warden".to_string(), plain_dir),
        ("etcd".to_string(), own_end),
        ("etcd-warden --to-revision".to_string(), mid_dir),
        ("etcd at the revision".to_string(), own_mid),
        ("etcd-warden bumped".to_string(), bumped_dir),
    ];
    if let Some((_, d)) = &past {
        dirs.push(("etcd-warden --to-revision (past)".to_string(), d.clone()));
    }
    let running = start_all(release, dirs).await;
    let mut states = Vec::new();
    for r in &running {
        states.push(capture(&r.etcd.client_url, h.auth).await);
    }

    // The latest: etcd's restore is the source at its end; etcd-warden's is what the model
    // says of it.
    let own = &states[1];
    let source_end = State {
        leases: h.end.leases.clone(),
        oldest_readable: h.end.compacted.max(1),
        ..own.clone()
    };
    differences.extend(diff("etcd's restore vs the source", own, &source_end));
    if own.revision != h.end.revision {
        differences.push(format!(
            "etcd's restore is at {}, the source was at {}",
            own.revision, h.end.revision
        ));
    }
    let want = warden_expected(own, full_for(&h, h.end.revision));
    differences.extend(diff("latest: etcd-warden vs etcd", &states[0], &want));
    if plain.revision != h.end.revision {
        differences.push(format!("latest: report revision {}", plain.revision));
    }

    // A revision inside the history.
    let own = &states[3];
    let want = warden_expected(own, full_for(&h, h.mid.revision));
    differences.extend(diff(
        &format!("--to-revision {}: etcd-warden vs etcd", h.mid.revision),
        &states[2],
        &want,
    ));
    if own.leases != h.mid.leases {
        differences.push(format!(
            "etcd's restore at {}: leases {:?}, the source had {:?}",
            h.mid.revision, own.leases, h.mid.leases
        ));
    }
    if at_mid.revision != h.mid.revision {
        differences.push(format!("mid: report revision {}", at_mid.revision));
    }

    // Reads at past revisions both restores serve.
    let mut rng = SplitMix64::new(seed ^ 0x5eed);
    for (w, o, what) in [(0, 1, "latest"), (2, 3, "mid")] {
        let lo = states[w].oldest_readable.max(states[o].oldest_readable);
        let hi = states[o].revision;
        let full = full_for(&h, hi).clone();
        let mut cw = connect(&running[w].etcd.client_url, h.auth).await;
        let mut co = connect(&running[o].etcd.client_url, h.auth).await;
        for _ in 0..2 {
            let r = rng.range(lo as u64, hi as u64) as i64;
            let mut expect = get_all(&mut co, Some(r)).await;
            for kv in &mut expect {
                if kv.mod_revision > full.revision {
                    kv.lease = 0;
                }
            }
            let got = get_all(&mut cw, Some(r)).await;
            differences.extend(diff_kvs(
                &format!("{what}: a read at revision {r}"),
                &got,
                &expect,
            ));
        }
    }

    // Bumped and marked compacted: etcd's latest restore moved up by the bump.
    let own = &states[1];
    let mut want = warden_expected(own, full_for(&h, h.end.revision));
    want.revision = h.end.revision + BUMP as i64;
    want.oldest_readable = want.revision;
    differences.extend(diff("bumped: etcd-warden vs etcd", &states[4], &want));
    if bumped.etcd_revision != want.revision {
        differences.push(format!(
            "bumped: report etcd revision {}",
            bumped.etcd_revision
        ));
    }

    // A revision no etcd snapshot holds: the source's `get --rev`.
    if let (Some((r, source)), Some((report, _))) = (&h.past, &past) {
        let restored = &states[5];
        let full = full_for(&h, *r);
        let mut expect = source.clone();
        for kv in &mut expect {
            if kv.mod_revision > full.revision {
                kv.lease = 0;
            }
        }
        differences.extend(diff_kvs(
            &format!("--to-revision {r}: etcd-warden vs the source's get --rev"),
            &restored.kvs,
            &expect,
        ));
        if restored.revision != *r || report.revision != *r {
            differences.push(format!(
                "--to-revision {r}: etcd at {}, report {}",
                restored.revision, report.revision
            ));
        }
        if restored.leases != full.leases {
            differences.push(format!(
                "--to-revision {r}: leases {:?}, the full snapshot's {:?}",
                restored.leases, full.leases
            ));
        }
    }

    for r in running {
        r.etcd
            .stop()
            .await
            .unwrap_or_else(|e| panic!("stop {}: {e}", r.what));
    }
    Outcome {
        features: h.features,
        ops: h.ops,
        revision: h.end.revision,
        differences,
    }
}

fn release_name(release: Release) -> &'static str {
    match release {
        Release::V35 => "3.5",
        Release::V34 => "3.4",
        Release::V36 => "3.6",
    }
}

/// The command that replays one history.
fn replay_command(release: Release, seed: u64) -> String {
    format!(
        "DIFF_RELEASE={} DIFF_SEED={seed:#x} DIFF_HISTORIES=1 cargo test --test it \
         restore_differential::many_histories -- --nocapture",
        release_name(release)
    )
}

/// Totals of a run.
#[derive(Debug, Default)]
struct Totals {
    histories: usize,
    ops: usize,
    revisions: i64,
    failed: Vec<String>,
    /// Histories with: users and roles, auth enabled, a compaction before the first full
    /// snapshot, one after, more than one full snapshot, an expired lease, a revoked lease, a
    /// put on a lease, a transaction, a range delete, a value of 1 MB or more, a key larger
    /// than a page, a restore compared with `get --rev`, a batch of hundreds of keys.
    with: [usize; 14],
    fulls: usize,
    deltas: usize,
}

/// Runs the histories of `seeds` on `release`, `parallel` at a time; a history that differs
/// (or panics) is reported with its seed and replay command.
async fn run(release: Release, seeds: Vec<u64>, parallel: usize) -> Totals {
    use futures::StreamExt;
    let results = futures::stream::iter(seeds.into_iter().map(|seed| async move {
        use futures::FutureExt;
        // Not a task of its own: the restore's future is not `Send` for every lifetime.
        let outcome = std::panic::AssertUnwindSafe(one_history(release, seed))
            .catch_unwind()
            .await;
        (seed, outcome)
    }))
    .buffer_unordered(parallel.max(1))
    .collect::<Vec<_>>()
    .await;
    let mut totals = Totals::default();
    for (seed, outcome) in results {
        totals.histories += 1;
        let failure = match outcome {
            Ok(o) => {
                totals.ops += o.ops;
                let f = o.features;
                println!(
                    "etcd {} seed {seed:#x}: {} ops, revision {}, {} differences, {f:?}",
                    release_name(release),
                    o.ops,
                    o.revision,
                    o.differences.len()
                );
                let flags = [
                    f.auth_store,
                    f.auth_enabled,
                    f.compacted_before_full,
                    f.compacted_after_full,
                    f.fulls > 1,
                    f.lease_expired,
                    f.revoked > 0,
                    f.leased_puts > 0,
                    f.txns > 0,
                    f.range_deletes > 0,
                    f.big_values > 0,
                    f.long_keys > 0,
                    f.past,
                    f.bulk,
                ];
                for (n, on) in totals.with.iter_mut().zip(flags) {
                    *n += on as usize;
                }
                totals.fulls += f.fulls;
                totals.deltas += f.deltas;
                totals.revisions += o.revision;
                (!o.differences.is_empty()).then(|| o.differences.join("\n  "))
            }
            Err(panic) => Some(format!(
                "panicked: {}",
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            )),
        };
        if let Some(what) = failure {
            let line = format!(
                "etcd {} seed {seed:#x}:\n  {what}\n  replay: {}",
                release_name(release),
                replay_command(release, seed)
            );
            eprintln!("{line}");
            totals.failed.push(line);
        }
    }
    totals
}

/// The fixed set CI runs, on each release: seeds chosen from a recorded run for what their
/// histories hold. 0x405: auth enabled, a batch of hundreds of keys, a value above 1 MB, a key
/// larger than a page, compactions before and after the first of two full snapshots, revoked
/// leases, a `get --rev` comparison. 0x469: a lease that expires, two full snapshots, four
/// deltas. 0x419: three full snapshots, users and roles without auth enabled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_warden_restores_what_etcds_own_restore_does() {
    for release in [Release::V35, Release::V34] {
        let totals = run(release, vec![0x405, 0x469, 0x419], 3).await;
        assert!(
            totals.failed.is_empty(),
            "{} histories differ:\n{}",
            totals.failed.len(),
            totals.failed.join("\n")
        );
    }
}

/// Many histories: `DIFF_HISTORIES` (default 1) from `DIFF_SEED` (default 1, decimal or 0x
/// hex) on `DIFF_RELEASE` (3.4, 3.5 or both; default both), `DIFF_PARALLEL` at a time
/// (default 3).
/// Runs nothing unless `DIFF_HISTORIES` is set (CI), and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_histories() {
    if std::env::var_os("DIFF_HISTORIES").is_none() {
        println!("DIFF_HISTORIES is not set: no histories run (see docs/restore.md)");
        return;
    }
    let env = |k: &str| std::env::var(k).ok();
    let num = |s: String| {
        s.strip_prefix("0x")
            .map_or_else(|| s.parse(), |h| u64::from_str_radix(h, 16))
            .unwrap_or_else(|e| panic!("{s}: {e}"))
    };
    let n = env("DIFF_HISTORIES").map_or(1, num);
    let seed = env("DIFF_SEED").map_or(1, num);
    let parallel = env("DIFF_PARALLEL").map_or(3, num) as usize;
    let releases = match env("DIFF_RELEASE").as_deref() {
        Some("3.4") => vec![Release::V34],
        Some("3.5") => vec![Release::V35],
        _ => vec![Release::V35, Release::V34],
    };
    let mut failed = Vec::new();
    for release in releases {
        let start = Instant::now();
        let totals = run(release, (seed..seed + n).collect(), parallel).await;
        println!(
            "etcd {}: {} histories from seed {seed:#x}, {} operations, {} revisions, {} full \
             snapshots, {} deltas, {} differ, {:.0} s",
            release_name(release),
            totals.histories,
            totals.ops,
            totals.revisions,
            totals.fulls,
            totals.deltas,
            totals.failed.len(),
            start.elapsed().as_secs_f64()
        );
        let names = [
            "users and roles",
            "auth enabled",
            "compaction before the full",
            "compaction after it",
            "several full snapshots",
            "an expired lease",
            "a revoked lease",
            "a put on a lease",
            "a transaction",
            "a range delete",
            "a value of 1 MB or more",
            "a key larger than a page",
            "a get --rev comparison",
            "hundreds of keys in a batch",
        ];
        let with: Vec<String> = names
            .iter()
            .zip(totals.with)
            .map(|(name, n)| format!("{name}: {n}"))
            .collect();
        println!("  histories with {}", with.join(", "));
        failed.extend(totals.failed);
    }
    assert!(
        failed.is_empty(),
        "{} histories differ:\n{}",
        failed.len(),
        failed.join("\n")
    );
}
