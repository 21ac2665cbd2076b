//! The control-plane migration of seed 001, end to end on one machine, written once for the
//! README demo (`examples/migration_demo.rs`) and the CI test (`tests/migration.rs`).
//!
//! Real parts throughout: a DNS server answering the owner TXT record, etcd 3.5 processes, the
//! `etcd-warden` binary as sidecars and as the copy Job, `file://` directories or an S3 server.
//!
//! 1. The source seed: etcd under a kubelet-like loop, its sidecar owning the record as `seed-a`.
//! 2. Keys are written to the source (with an outage: snapshotted, then the source sidecar loses
//!    its store, then more keys that no snapshot can hold).
//! 3. The owner record is flipped to `seed-b`; the copy Job starts at once and waits for the
//!    source's final snapshot (seed 001 steps 2, 5, 6).
//! 4. Measured: the source turning 503, its etcd killed, its one final snapshot stored, the copy
//!    done (steps 7, 9).
//! 5. The destination seed: its sidecar (owner `seed-b`, `restore.initialize`) restores the data
//!    directory from the copied snapshots, then its etcd starts on it, then the sidecar is ready.
//! 6. Every key at the destination is compared with what was written.
//!
//! [`run`] returns a [`Report`]: the timeline, the measured latencies, the checks and the data
//! compared. It never panics on a failed check; it stops at the first step that cannot go on and
//! says why in a failed check, so the demo can print FAIL with the reason.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions};
use etcd_warden::store::{Kind, Snapshot, SnapshotStore};

use super::dns::DnsServer;
use super::etcd::{EtcdMember, Release, member_healthy};
use super::finals;
use super::pod::Pod;
use super::s3::S3Server;
use super::timeline;
use super::warden::{Warden, command};

/// The owner record both seeds watch.
pub const RECORD: &str = "owner.shoot.warden.test";
/// The source seed's owner ID.
pub const SOURCE_ID: &str = "seed-a";
/// The destination seed's owner ID.
pub const DEST_ID: &str = "seed-b";

/// How often the sidecars check the owner record.
const INTERVAL: &str = "300ms";
/// How long any one step may take before the scenario gives up.
const STEP_TIMEOUT: Duration = Duration::from_secs(45);

/// Where the two seeds keep their snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stores {
    /// Two local directories (`file://`), the embedded default kind of store.
    File,
    /// Two buckets of one S3 server.
    S3,
}

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    pub stores: Stores,
    /// The source sidecar cannot reach its store from just before the flip on (S3 only: the
    /// server moves to another port, so the copy Job reaches it and the source sidecar does not).
    pub source_store_outage: bool,
}

impl Options {
    /// The demo: file stores, no outage.
    pub fn demo() -> Options {
        Options {
            stores: Stores::File,
            source_store_outage: false,
        }
    }

    /// How long the copy Job waits for the final snapshot.
    fn final_timeout(&self) -> &'static str {
        if self.source_store_outage {
            "3s"
        } else {
            "60s"
        }
    }
}

/// One line of the timeline.
#[derive(Debug, Clone)]
pub struct Step {
    /// Since the start of the scenario.
    pub at: Duration,
    pub what: String,
}

/// One named check of the outcome.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

/// The measured latencies; `None` when the step did not happen.
#[derive(Debug, Clone, Default)]
pub struct Latencies {
    /// Flip → the source's `/healthz` answers 503.
    pub flip_to_source_503: Option<Duration>,
    /// Flip → the source's etcd process died.
    pub flip_to_source_killed: Option<Duration>,
    /// Flip → the final snapshot is listed in the source store.
    pub flip_to_final_snapshot: Option<Duration>,
    /// Flip → the copy Job exited successfully.
    pub flip_to_copy_done: Option<Duration>,
    /// The copy Job from its start to its exit (waiting included).
    pub copy: Option<Duration>,
    /// The destination sidecar's start → the restored data directory in place.
    pub restore: Option<Duration>,
    /// Destination etcd started → healthy.
    pub destination_etcd_start: Option<Duration>,
    /// Flip → the destination etcd healthy with the restored data.
    pub flip_to_destination_etcd_ready: Option<Duration>,
    /// Flip → the destination sidecar's `/healthz` answers 200.
    pub flip_to_destination_ready: Option<Duration>,
}

/// What happened.
#[derive(Debug, Clone)]
pub struct Report {
    pub options: Options,
    pub steps: Vec<Step>,
    /// Since the start of the scenario.
    pub flip_at: Option<Duration>,
    pub latencies: Latencies,
    pub checks: Vec<Check>,
    /// Every key the destination must hold, with its value.
    pub expected: BTreeMap<String, String>,
    /// Keys written after the source lost its store (outage variant): must not reach the
    /// destination.
    pub unsnapshotted: BTreeMap<String, String>,
    /// Every key the destination etcd holds after the restore.
    pub restored: BTreeMap<String, String>,
    /// The revision of the last write that a snapshot of the source can hold.
    pub expected_revision: i64,
    /// The destination etcd's revision after the restore.
    pub restored_revision: i64,
    /// Final full snapshots in the source store at the end.
    pub source_finals: Vec<Snapshot>,
    /// Every snapshot in the source store at the end.
    pub source_snapshots: Vec<Snapshot>,
    /// Whether the source's `/healthz` answered 200 again after it first answered 503.
    pub source_ready_again: bool,
}

impl Report {
    /// Every check passed (and there was at least one).
    pub fn passed(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.ok)
    }

    /// `PASS: …` or `FAIL: …` naming the failed checks.
    pub fn verdict(&self) -> String {
        if self.passed() {
            format!(
                "PASS: {} keys written to the source are at the destination",
                self.expected.len()
            )
        } else {
            let failed: Vec<&str> = self
                .checks
                .iter()
                .filter(|c| !c.ok)
                .map(|c| c.name.as_str())
                .collect();
            format!("FAIL: {}", failed.join("; "))
        }
    }
}

fn secs(d: Duration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}

/// The measured latencies, the checks and the verdict (what the demo prints after its live
/// timeline).
pub struct Summary<'a>(&'a Report);

impl Report {
    /// Everything but the timeline.
    pub fn summary(&self) -> Summary<'_> {
        Summary(self)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "== timeline (seconds since the owner record flipped)")?;
        for s in &self.steps {
            let offset = match self.flip_at {
                Some(flip) if s.at >= flip => format!("+{:.3}", (s.at - flip).as_secs_f64()),
                Some(flip) => format!("-{:.3}", (flip - s.at).as_secs_f64()),
                None => format!("@{:.3}", s.at.as_secs_f64()),
            };
            writeln!(f, "  {offset:>8}  {}", s.what)?;
        }
        write!(f, "{}", self.summary())
    }
}

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let report = self.0;
        writeln!(f, "== measured")?;
        let l = &report.latencies;
        let rows = [
            ("flip -> source /healthz 503", l.flip_to_source_503),
            ("flip -> source etcd killed", l.flip_to_source_killed),
            ("flip -> final snapshot stored", l.flip_to_final_snapshot),
            ("copy job (waiting included)", l.copy),
            ("flip -> copy done", l.flip_to_copy_done),
            ("restore (destination sidecar)", l.restore),
            ("destination etcd start", l.destination_etcd_start),
            (
                "flip -> destination etcd ready",
                l.flip_to_destination_etcd_ready,
            ),
            (
                "flip -> destination sidecar ready",
                l.flip_to_destination_ready,
            ),
        ];
        for (name, d) in rows {
            let v = d.map(secs).unwrap_or_else(|| "-".into());
            writeln!(f, "  {name:<34} {v:>9}")?;
        }
        writeln!(f, "== checks")?;
        for c in &report.checks {
            let mark = if c.ok { "ok  " } else { "FAIL" };
            writeln!(f, "  {mark} {}: {}", c.name, c.detail)?;
        }
        write!(f, "{}", report.verdict())
    }
}

/// Builds the report while the scenario runs, printing each step as it happens.
struct Recorder {
    start: Instant,
    report: Report,
}

impl Recorder {
    fn new(options: Options) -> Recorder {
        Recorder {
            start: Instant::now(),
            report: Report {
                options,
                steps: Vec::new(),
                flip_at: None,
                latencies: Latencies::default(),
                checks: Vec::new(),
                expected: BTreeMap::new(),
                unsnapshotted: BTreeMap::new(),
                restored: BTreeMap::new(),
                expected_revision: 0,
                restored_revision: 0,
                source_finals: Vec::new(),
                source_snapshots: Vec::new(),
                source_ready_again: false,
            },
        }
    }

    fn step(&mut self, what: impl Into<String>) {
        let step = Step {
            at: self.start.elapsed(),
            what: what.into(),
        };
        let offset = match self.report.flip_at {
            Some(flip) => format!("+{:.3}s", step.at.saturating_sub(flip).as_secs_f64()),
            None => "before".to_string(),
        };
        println!("{offset:>8}  {}", step.what);
        self.report.steps.push(step);
    }

    fn flipped(&mut self) {
        self.report.flip_at = Some(self.start.elapsed());
    }

    fn since_flip(&self) -> Duration {
        let flip = self.report.flip_at.unwrap_or_default();
        self.start.elapsed().saturating_sub(flip)
    }

    fn check(&mut self, name: &str, ok: bool, detail: impl Into<String>) {
        self.report.checks.push(Check {
            name: name.to_string(),
            ok,
            detail: detail.into(),
        });
    }
}

/// Runs the migration; processes and directories are gone when it returns.
pub async fn run(options: Options) -> Report {
    assert!(
        options.stores == Stores::S3 || !options.source_store_outage,
        "the store outage needs the S3 server (a file:// store cannot be cut off)"
    );
    let mut r = Recorder::new(options);
    if let Err(e) = scenario(options, &mut r).await {
        r.check("the scenario ran to the end", false, e);
    }
    r.report
}

/// The two seeds' stores.
struct Backups {
    dir: tempfile::TempDir,
    s3: Option<S3Server>,
}

#[derive(Clone, Copy)]
enum Side {
    Source,
    Destination,
}

impl Side {
    fn bucket(self) -> &'static str {
        match self {
            Side::Source => "source-bkt",
            Side::Destination => "dest-bkt",
        }
    }
}

/// The prefix inside each S3 bucket.
const PREFIX: &str = "etcd";

impl Backups {
    fn start(stores: Stores) -> Backups {
        let dir = tempfile::tempdir().expect("temp dir");
        let s3 = match stores {
            Stores::File => None,
            Stores::S3 => Some(S3Server::start(&[
                Side::Source.bucket(),
                Side::Destination.bucket(),
            ])),
        };
        Backups { dir, s3 }
    }

    fn root(&self, side: Side) -> PathBuf {
        self.dir.path().join(side.bucket())
    }

    fn url(&self, side: Side) -> String {
        match &self.s3 {
            None => format!("file://{}", self.root(side).display()),
            Some(_) => format!("s3://{}/{PREFIX}", side.bucket()),
        }
    }

    /// Configuration keys (dotted) pointing `section` at this side's store, as it is reached now.
    fn keys(&self, side: Side, section: &str) -> Vec<(String, String)> {
        match &self.s3 {
            None => vec![(format!("{section}.url"), self.url(side))],
            Some(s3) => s3.config_overrides(section, side.bucket(), PREFIX),
        }
    }

    /// A client of this side's store for the scenario's own observations.
    fn store(&self, side: Side) -> SnapshotStore {
        match &self.s3 {
            None => {
                let root = self.root(side);
                std::fs::create_dir_all(&root).expect("store directory");
                let local = object_store::local::LocalFileSystem::new_with_prefix(&root)
                    .expect("local store");
                SnapshotStore::new(Arc::new(local), "")
            }
            Some(s3) => SnapshotStore::new(s3.object_store(side.bucket()), PREFIX),
        }
    }
}

/// A child process killed on drop (a failed step, or the demo interrupted), like the harness's.
struct Job(Child);

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `ETCD_WARDEN_SECTION_KEY` for a dotted key.
fn env_name(key: &str) -> String {
    format!("ETCD_WARDEN_{}", key.replace('.', "_").to_ascii_uppercase())
}

fn owner_keys(id: &str, dns: &DnsServer, data_dir: &Path) -> Vec<(String, String)> {
    [
        ("owner.name", RECORD.to_string()),
        ("owner.id", id.to_string()),
        ("owner.interval", INTERVAL.to_string()),
        ("owner.timeout", INTERVAL.to_string()),
        ("owner.failure_threshold", "2".to_string()),
        // The test zone's TTL is 60 s: trust no answer, so a flip is seen at the next check.
        ("owner.ttl_cap", "0s".to_string()),
        ("owner.nameservers", dns.addr().to_string()),
        ("kill.process_name", "etcd".to_string()),
        // Only this seed's etcd: other etcd processes run beside it on the machine.
        ("kill.cmdline_contains", data_dir.display().to_string()),
        ("kill.grace", "3s".to_string()),
        ("kill.settle", "1s".to_string()),
        ("snapshot.delta_period", "300ms".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn start_warden(keys: &[(String, String)]) -> Warden {
    let refs: Vec<(&str, String)> = keys.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    Warden::start(&refs)
}

async fn healthz(w: &Warden) -> u16 {
    w.get("/healthz").await.map(|(c, _)| c).unwrap_or(0)
}

/// The last lines of a log, for a failure's detail.
fn tail(name: &str, text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(25);
    format!("\n--- last lines of {name}:\n{}", lines[from..].join("\n"))
}

/// Polls `f` every 25 ms until it yields a value or [`STEP_TIMEOUT`] passes.
async fn wait_for<T, F, Fut>(mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    while start.elapsed() < STEP_TIMEOUT {
        if let Some(v) = f().await {
            return Some(v);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    None
}

/// Every key with its value, and the revision.
async fn dump(client: &mut Client) -> Result<(BTreeMap<String, String>, i64), String> {
    let resp = client
        .get(vec![0u8], Some(GetOptions::new().with_from_key()))
        .await
        .map_err(|e| format!("reading every key: {e}"))?;
    let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
    let kvs = resp
        .kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                String::from_utf8_lossy(kv.value()).into_owned(),
            )
        })
        .collect();
    Ok((kvs, revision))
}

/// Puts (and deletes) as the tag says, keeping `model` equal to what etcd acknowledged; returns
/// the revision of the last write.
async fn write(
    client: &mut Client,
    model: &mut BTreeMap<String, String>,
    tag: &str,
    keys: usize,
    overwrite: usize,
    delete: usize,
) -> Result<i64, String> {
    let mut revision = 0;
    let err = |e: etcd_client::Error| format!("writing to the source etcd: {e}");
    for i in 0..keys {
        let (k, v) = (format!("/registry/{tag}/key{i:03}"), format!("value {i}"));
        let resp = client.put(k.clone(), v.clone(), None).await.map_err(err)?;
        revision = resp.header().map_or(revision, |h| h.revision());
        model.insert(k, v);
    }
    for i in 0..overwrite {
        let (k, v) = (
            format!("/registry/{tag}/key{i:03}"),
            format!("new value {i}"),
        );
        let resp = client.put(k.clone(), v.clone(), None).await.map_err(err)?;
        revision = resp.header().map_or(revision, |h| h.revision());
        model.insert(k, v);
    }
    for i in keys - delete..keys {
        let k = format!("/registry/{tag}/key{i:03}");
        let resp = client.delete(k.clone(), None).await.map_err(err)?;
        revision = resp.header().map_or(revision, |h| h.revision());
        model.remove(&k);
    }
    Ok(revision)
}

/// What the flip sets off, watched until the copy Job exits.
async fn watch_the_flip(
    r: &mut Recorder,
    source: &Warden,
    pod: &Pod,
    source_store: &SnapshotStore,
    copy: &mut Child,
    copy_started: Instant,
    copy_log: &Path,
) -> Result<(), String> {
    let outage = r.report.options.source_store_outage;
    let started = Instant::now();
    let mut exited = None;
    loop {
        let code = healthz(source).await;
        if code == 503 && r.report.latencies.flip_to_source_503.is_none() {
            r.report.latencies.flip_to_source_503 = Some(r.since_flip());
            r.step("source /healthz 503: unready, clients kept away");
        } else if code == 200 && r.report.latencies.flip_to_source_503.is_some() {
            r.report.source_ready_again = true;
        }
        if pod.deaths() >= 1 && r.report.latencies.flip_to_source_killed.is_none() {
            r.report.latencies.flip_to_source_killed = Some(r.since_flip());
            r.step("source etcd killed by its sidecar (the kubelet starts it again, unready)");
        }
        if !outage
            && r.report.latencies.flip_to_final_snapshot.is_none()
            && let Some(f) = finals(source_store).await.first()
        {
            r.report.latencies.flip_to_final_snapshot = Some(r.since_flip());
            r.step(format!(
                "final snapshot in the source store: {} (revision {})",
                f.snap_name, f.last_revision
            ));
        }
        if exited.is_none()
            && let Ok(Some(status)) = copy.try_wait()
        {
            exited = Some(status);
            r.report.latencies.copy = Some(copy_started.elapsed());
            let log = std::fs::read_to_string(copy_log).unwrap_or_default();
            if !status.success() {
                return Err(format!(
                    "the copy job failed ({status}){}",
                    tail("the copy job's log", &log)
                ));
            }
            r.report.latencies.flip_to_copy_done = Some(r.since_flip());
            let summary = log
                .lines()
                .rfind(|l| l.starts_with("copied "))
                .unwrap_or("copy complete");
            let waited = if log.contains("NO FINAL SNAPSHOT") {
                "no final snapshot within the timeout, copied the latest snapshots"
            } else {
                "found the final snapshot"
            };
            r.step(format!("copy job done: {waited}; {summary}"));
        }
        let l = &r.report.latencies;
        let seen_all = l.flip_to_source_503.is_some()
            && l.flip_to_source_killed.is_some()
            && (outage || l.flip_to_final_snapshot.is_some());
        if seen_all && exited.is_some() {
            return Ok(());
        }
        if started.elapsed() > STEP_TIMEOUT {
            return Err(format!(
                "after {STEP_TIMEOUT:?}: 503 {:?}, etcd killed {:?}, final snapshot {:?}, copy exited {:?}{}{}",
                l.flip_to_source_503,
                l.flip_to_source_killed,
                l.flip_to_final_snapshot,
                exited,
                tail("the source sidecar's log", &source.log_text()),
                tail(
                    "the copy job's log",
                    &std::fs::read_to_string(copy_log).unwrap_or_default()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn scenario(options: Options, r: &mut Recorder) -> Result<(), String> {
    let outage = options.source_store_outage;
    let dns = DnsServer::start().await;
    dns.set_txt(RECORD, &[SOURCE_ID]).await;
    r.step(format!(
        "DNS server on {}: {RECORD} TXT \"{SOURCE_ID}\"",
        dns.addr()
    ));
    let mut backups = Backups::start(options.stores);
    r.step(format!(
        "stores: source {}, destination {}",
        backups.url(Side::Source),
        backups.url(Side::Destination)
    ));

    // The source seed.
    let pod = Pod::start().await;
    let (endpoint, source_data) = {
        let c = pod.etcd.lock().await;
        (c.members[0].client_url(), c.members[0].data_dir.clone())
    };
    let mut keys = vec![("etcd.endpoints".to_string(), endpoint.clone())];
    keys.extend(backups.keys(Side::Source, "store"));
    keys.extend(owner_keys(SOURCE_ID, &dns, &source_data));
    let source = start_warden(&keys);
    // Both seeds' readiness against the record, judged at the end (`support::timeline`).
    let ownership = timeline::Recorder::start(r.start, vec![probe(SOURCE_ID, &source)], Vec::new());
    let source_store = backups.store(Side::Source);
    let first_full = wait_for(|| async {
        if healthz(&source).await != 200 {
            return None;
        }
        let list = source_store.list().await.ok()?;
        list.into_iter().find(|s| s.kind == Kind::Full)
    })
    .await
    .ok_or_else(|| {
        format!(
            "the source sidecar never became Active with a full snapshot{}",
            tail("the source sidecar's log", &source.log_text())
        )
    })?;
    r.step(format!(
        "source: etcd on {endpoint}, sidecar Active as {SOURCE_ID}, first snapshot {}",
        first_full.snap_name
    ));

    let mut client = Client::connect([endpoint.as_str()], None)
        .await
        .map_err(|e| format!("connecting to the source etcd: {e}"))?;
    let mut expected = BTreeMap::new();
    let revision = write(&mut client, &mut expected, "demo", 100, 10, 5).await?;
    r.step(format!(
        "wrote 100 keys to the source, overwrote 10, deleted 5: {} keys at revision {revision}",
        expected.len()
    ));
    if outage {
        let reached = wait_for(|| async {
            let list = source_store.list().await.ok()?;
            list.last()
                .filter(|s| s.last_revision >= revision)
                .map(|s| s.snap_name.clone())
        })
        .await
        .ok_or_else(|| {
            format!(
                "no snapshot reached revision {revision}{}",
                tail("the source sidecar's log", &source.log_text())
            )
        })?;
        r.step(format!(
            "snapshots reach revision {revision}: last one {reached}"
        ));
        if let Some(s3) = backups.s3.as_mut() {
            s3.move_port();
        }
        r.step("source store unreachable for the source sidecar (S3 moved to another port)");
        let mut lost = BTreeMap::new();
        let last = write(&mut client, &mut lost, "unsnapshotted", 20, 0, 0).await?;
        r.step(format!(
            "wrote 20 more keys (revision {last}) that no snapshot can hold now"
        ));
        r.report.unsnapshotted = lost;
    }
    drop(client);
    r.report.expected = expected;
    r.report.expected_revision = revision;

    // The flip, and the copy Job deployed right after it (seed 001 steps 2 and 5).
    dns.set_txt(RECORD, &[DEST_ID]).await;
    r.flipped();
    r.step(format!("owner record flipped: {RECORD} TXT \"{DEST_ID}\""));
    let copy_log = backups.dir.path().join("copy.log");
    let log = std::fs::File::create(&copy_log).map_err(|e| format!("copy log: {e}"))?;
    let (src_url, dst_url) = (backups.url(Side::Source), backups.url(Side::Destination));
    let mut env = backups.keys(Side::Source, "source_store");
    env.extend(backups.keys(Side::Destination, "store"));
    let copy_started = Instant::now();
    let mut copy = Job(command()
        .args(["copy", "--source-store", &src_url, "--dest-store", &dst_url])
        .args([
            "--wait-for-final",
            "--final-timeout",
            options.final_timeout(),
        ])
        .args(["--poll-interval", "200ms"])
        .envs(env.iter().map(|(k, v)| (env_name(k), v)))
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| format!("copy log: {e}"))?)
        .stderr(log)
        .spawn()
        .map_err(|e| format!("starting the copy job: {e}"))?);
    r.step(format!(
        "copy job started: etcd-warden copy --wait-for-final --final-timeout {}",
        options.final_timeout()
    ));
    let watched = watch_the_flip(
        r,
        &source,
        &pod,
        &source_store,
        &mut copy.0,
        copy_started,
        &copy_log,
    )
    .await;
    drop(copy);
    watched?;

    // The source after the flip: still unready, and what its store holds.
    let source_store = backups.store(Side::Source);
    r.report.source_snapshots = source_store.list().await.unwrap_or_default();
    r.report.source_finals = finals(&source_store).await;
    r.report.source_ready_again |= healthz(&source).await == 200;
    let state = source
        .get("/status")
        .await
        .map(|(_, s)| s["owner"]["state"].as_str().unwrap_or("").to_string())
        .unwrap_or_default();

    // The destination seed: the sidecar restores the data directory, then etcd starts on it.
    let dest_dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let dest_data = dest_dir.path().join("data");
    let mut dest = EtcdMember::single(
        Release::V35,
        "dest",
        dest_data.clone(),
        dest_dir.path().join("etcd.log"),
    );
    let mut keys = vec![("etcd.endpoints".to_string(), dest.client_url())];
    keys.extend(backups.keys(Side::Destination, "store"));
    keys.extend(owner_keys(DEST_ID, &dns, &dest_data));
    keys.extend([
        ("restore.initialize".to_string(), "true".to_string()),
        ("restore.data_dir".into(), dest_data.display().to_string()),
        ("restore.name".into(), dest.name.clone()),
        (
            "restore.initial_advertise_peer_urls".into(),
            dest.peer_url(),
        ),
        (
            "restore.etcd_bin".into(),
            Release::V35.bin_dir().display().to_string(),
        ),
    ]);
    let restore_started = Instant::now();
    let dest_sidecar = start_warden(&keys);
    ownership.add_sidecar(probe(DEST_ID, &dest_sidecar));
    wait_for(|| async { dest_data.join("member/wal").is_dir().then_some(()) })
        .await
        .ok_or_else(|| {
            format!(
                "the destination sidecar did not restore {}{}",
                dest_data.display(),
                tail("the destination sidecar's log", &dest_sidecar.log_text())
            )
        })?;
    r.report.latencies.restore = Some(restore_started.elapsed());
    r.step(format!(
        "destination sidecar ({DEST_ID}, restore.initialize) restored its data directory from the copied snapshots in {}",
        secs(restore_started.elapsed())
    ));

    let etcd_started = Instant::now();
    dest.start();
    let url = dest.client_url();
    wait_for(|| async { member_healthy(&url).await.then_some(()) })
        .await
        .ok_or_else(|| {
            format!(
                "the destination etcd is not healthy{}",
                tail("its log", &dest.log())
            )
        })?;
    r.report.latencies.destination_etcd_start = Some(etcd_started.elapsed());
    r.report.latencies.flip_to_destination_etcd_ready = Some(r.since_flip());
    r.step(format!("destination etcd ready on {url}"));
    wait_for(|| async { (healthz(&dest_sidecar).await == 200).then_some(()) })
        .await
        .ok_or_else(|| {
            format!(
                "the destination sidecar never became ready{}",
                tail("the destination sidecar's log", &dest_sidecar.log_text())
            )
        })?;
    r.report.latencies.flip_to_destination_ready = Some(r.since_flip());
    r.step(format!(
        "destination sidecar Active as {DEST_ID}: /healthz 200"
    ));

    let mut client = Client::connect([url.as_str()], None)
        .await
        .map_err(|e| format!("connecting to the destination etcd: {e}"))?;
    let (restored, restored_revision) = dump(&mut client).await?;
    r.report.restored = restored;
    r.report.restored_revision = restored_revision;
    r.step(format!(
        "compared the destination's {} keys with the {} written",
        r.report.restored.len(),
        r.report.expected.len()
    ));

    ownership.stop();
    let t = ownership.timeline(&dns, RECORD);
    let found = timeline::judge(
        &t,
        &timeline::Bounds {
            interval: Duration::from_millis(300),
            settle: Duration::from_secs(1),
            kill_grace: Duration::from_secs(3),
        },
    );
    let detail = if found.is_empty() {
        timeline::summary(&t)
    } else {
        found
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    };
    r.check(
        "readiness follows the owner record: the source unready within owner.interval + grace \
         of the flip, never both seeds ready",
        found.is_empty(),
        detail,
    );
    judge(r, &state);
    Ok(())
}

/// A seed's sidecar as the ownership timeline polls it.
fn probe(seed: &'static str, w: &Warden) -> timeline::SidecarProbe {
    timeline::SidecarProbe {
        seed,
        member: 0,
        addr: format!("{}:{}", w.host, w.port)
            .parse()
            .unwrap_or_else(|_| ([127, 0, 0, 1], w.port).into()),
        incarnation: None,
    }
}

/// The checks, from what the report holds.
fn judge(r: &mut Recorder, source_state: &str) {
    let outage = r.report.options.source_store_outage;
    let rep = &r.report;
    let mut checks = Vec::new();

    let (missing, differing, extra) = compare(&rep.expected, &rep.restored);
    checks.push((
        "every key written is at the destination with its value",
        missing.is_empty() && differing.is_empty() && extra.is_empty(),
        format!(
            "{} expected, {} restored; missing {missing:?}, different {differing:?}, unexpected {extra:?}",
            rep.expected.len(),
            rep.restored.len()
        ),
    ));
    checks.push((
        "the destination is at the source's last snapshotted revision",
        rep.restored_revision == rep.expected_revision,
        format!(
            "destination revision {}, expected {}",
            rep.restored_revision, rep.expected_revision
        ),
    ));
    let finals: Vec<&str> = rep
        .source_finals
        .iter()
        .map(|s| s.snap_name.as_str())
        .collect();
    if outage {
        let leaked: Vec<&String> = rep
            .unsnapshotted
            .keys()
            .filter(|k| rep.restored.contains_key(*k))
            .collect();
        checks.push((
            "nothing written after the store was lost reaches the destination",
            leaked.is_empty() && !rep.unsnapshotted.is_empty(),
            format!(
                "{} such keys, {} at the destination",
                rep.unsnapshotted.len(),
                leaked.len()
            ),
        ));
        checks.push((
            "no final snapshot while the source cannot reach its store",
            finals.is_empty(),
            format!("final snapshots: {finals:?}"),
        ));
        let newest = rep.source_snapshots.iter().map(|s| s.last_revision).max();
        checks.push((
            "the source store holds nothing newer than the last successful snapshot",
            newest == Some(rep.expected_revision),
            format!(
                "newest snapshot revision {newest:?}, expected {}",
                rep.expected_revision
            ),
        ));
    } else {
        checks.push((
            "exactly one final full snapshot in the source store",
            finals.len() == 1 && rep.source_finals[0].snap_name.ends_with(".final"),
            format!("{finals:?}"),
        ));
        // Names keep whole seconds, so a delta ending at the same revision may sort after the
        // final snapshot: compare revisions, not list positions.
        let final_revision = rep.source_finals.first().map(|s| s.last_revision);
        let newer: Vec<&str> = rep
            .source_snapshots
            .iter()
            .filter(|s| Some(s.last_revision) > final_revision)
            .map(|s| s.snap_name.as_str())
            .collect();
        checks.push((
            "nothing in the source store is newer than the final snapshot",
            final_revision.is_some() && newer.is_empty(),
            format!("final at revision {final_revision:?}, newer: {newer:?}"),
        ));
    }
    checks.push((
        "the source stays unready (deactivated) after the flip",
        !rep.source_ready_again && source_state == "deactivated",
        format!(
            "ready again: {}, state {source_state:?}",
            rep.source_ready_again
        ),
    ));
    for (name, ok, detail) in checks {
        r.check(name, ok, detail);
    }
}

/// Keys missing at the destination, keys with another value, keys nobody wrote.
fn compare(
    expected: &BTreeMap<String, String>,
    got: &BTreeMap<String, String>,
) -> (Vec<String>, Vec<String>, Vec<String>) {
    let missing = expected
        .keys()
        .filter(|k| !got.contains_key(*k))
        .cloned()
        .collect();
    let differing = expected
        .iter()
        .filter(|(k, v)| got.get(*k).is_some_and(|g| g != *v))
        .map(|(k, _)| k.clone())
        .collect();
    let extra = got
        .keys()
        .filter(|k| !expected.contains_key(*k))
        .cloned()
        .collect();
    (missing, differing, extra)
}
