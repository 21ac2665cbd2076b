//! etcd-warden as a drop-in for etcd-backup-restore under etcd-druid: etcd-druid's exact
//! command lines (its StatefulSet's backup-restore container, its compaction Job and its copy Job,
//! from gardener/etcd-druid `internal/component/statefulset/builder.go`,
//! `internal/controller/compaction/reconciler.go` and
//! `internal/controller/etcdcopybackupstask/reconciler.go`, copied here as data) read into the
//! configuration they mean; and etcd-wrapper's request sequence against `etcdbrctl server`, whose
//! `/config` then starts a real etcd 3.5 that the sidecar backs up and, after the data is lost,
//! restores.
//!
//! Not checked here: etcd-wrapper itself (Go; its requests are replayed as its source makes
//! them), druid's controllers, TLS between them (no certificate issuer runs here), and a
//! multi-member cluster's `/config` (tests in `src/druid/etcd_config.rs` cover its rules).

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::Path;

use std::time::Duration;

use etcd_warden::config::{Config, Purpose, Sources};
use etcd_warden::etcd::process::{self, EtcdProcess};
use etcd_warden::etcdbrctl::translate;

use crate::support::etcd::{Release, member_healthy};
use crate::support::warden::{self, Warden};
use crate::support::{eventually, free_port};

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

/// The configuration an etcdbrctl command line means, with `vars` as the environment.
fn configured(line: &str, vars: &[(&str, &str)], purpose: Purpose) -> Config {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let env = |k: &str| vars.get(k).cloned();
    let t = translate(&words(line), &env).unwrap_or_else(|e| panic!("{line}: {e}"));
    let sources = Sources {
        file: None,
        env: &HashMap::<String, String>::new(),
        overrides: t.overrides,
    };
    Config::load_for(&sources, purpose)
        .unwrap_or_else(|e| panic!("{line}: {e}"))
        .0
}

/// druid's StatefulSet for an Etcd `etcd-main` in `shoot--p--c` with an S3 store, client TLS
/// and backup TLS, its defaults otherwise (`getBackupRestoreContainerCommandArgs`).
const STATEFULSET: &str = "server \
    --server-port=8080 \
    --enable-snapshot-lease-renewal=true \
    --full-snapshot-lease-name=etcd-main-full-snap \
    --delta-snapshot-lease-name=etcd-main-delta-snap \
    --storage-provider=S3 \
    --store-prefix=shoot--p--c--etcd-main \
    --schedule=0 */24 * * * \
    --delta-snapshot-period=5m0s \
    --delta-snapshot-memory-limit=104857600 \
    --garbage-collection-policy=LimitBased \
    --max-backups=7 \
    --garbage-collection-period=12h0m0s \
    --compress-snapshots=true \
    --compression-policy=gzip \
    --etcd-snapshot-timeout=15m0s \
    --defragmentation-schedule=0 3 * * * \
    --etcd-defrag-timeout=15m0s \
    --auto-compaction-mode=periodic \
    --auto-compaction-retention=30m \
    --cacert=/var/etcd/ssl/ca/ca.crt \
    --cert=/var/etcd/ssl/client/tls.crt \
    --key=/var/etcd/ssl/client/tls.key \
    --insecure-transport=false \
    --insecure-skip-tls-verify=false \
    --endpoints=https://etcd-main-local:2379 \
    --service-endpoints=https://etcd-main-client:2379 \
    --server-cert=/var/etcdbr/ssl/server/tls.crt \
    --server-key=/var/etcdbr/ssl/server/tls.key \
    --data-dir=/var/etcd/data/new.etcd \
    --restoration-temp-snapshots-dir=/var/etcd/data/restoration.temp \
    --snapstore-temp-directory=/var/etcd/data/temp \
    --etcd-connection-timeout=5m0s \
    --use-etcd-wrapper=true \
    --enable-member-lease-renewal=true \
    --k8s-heartbeat-duration=10s \
    --embedded-etcd-quota-bytes=8589934592";

#[test]
fn druids_statefulset_flags_are_serve_with_the_equivalent_settings() {
    // druid's schedules hold spaces: one argument each, as the container's args list has them.
    let line = STATEFULSET
        .replace("0 */24 * * *", "0_*/24_*_*_*")
        .replace("0 3 * * *", "0_3_*_*_*");
    let mut args = words(&line);
    for a in &mut args {
        *a = a.replace('_', " ");
    }
    let vars: HashMap<String, String> = [
        ("POD_NAME", "etcd-main-0"),
        ("POD_NAMESPACE", "shoot--p--c"),
        ("STORAGE_CONTAINER", "backups-bucket"),
        ("AWS_APPLICATION_CREDENTIALS", "/nonexistent/etcd-backup"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let env = |k: &str| vars.get(k).cloned();
    let t = translate(&args, &env).unwrap();
    let files = tempfile::tempdir().unwrap();
    // The TLS files must exist for validation; point the keys at stand-ins.
    let mut overrides = t.overrides.clone();
    for o in &mut overrides {
        if o.value.starts_with("/var/etcd/ssl") || o.value.starts_with("/var/etcdbr/ssl") {
            let stand_in = files.path().join(o.key.replace('.', "_"));
            std::fs::write(&stand_in, "x").unwrap();
            o.value = stand_in.display().to_string();
        }
    }
    let sources = Sources {
        file: None,
        env: &HashMap::<String, String>::new(),
        overrides,
    };
    let c = Config::load_for(&sources, Purpose::Serve).unwrap().0;
    assert_eq!(c.server.listen.to_string(), "0.0.0.0:8080");
    assert!(c.server.tls.is_some());
    assert!(c.server.unauthenticated_snapshots);
    assert_eq!(
        c.store.location.to_string(),
        "s3://backups-bucket/shoot--p--c--etcd-main"
    );
    assert!(!c.store.path_style, "etcd-backup-restore's S3 default");
    let s = &c.snapshot;
    assert_eq!(s.delta_period, Duration::from_secs(300));
    assert_eq!(s.delta_memory_limit, 104_857_600);
    assert_eq!(s.gc_period, Duration::from_secs(12 * 3600));
    assert_eq!(s.timeout, Duration::from_secs(900));
    assert_eq!(
        format!("{:?}", s.gc_policy),
        "LimitBased { max_backups: 7 }"
    );
    assert_eq!(format!("{:?}", s.compression), "Gzip");
    assert_eq!(c.defrag.timeout, Duration::from_secs(900));
    assert_eq!(c.etcd.endpoints, ["https://etcd-main-local:2379"]);
    assert_eq!(c.etcd.request_timeout, Duration::from_secs(300));
    assert!(c.etcd.tls.is_some());
    assert_eq!(
        c.restore.cluster.as_ref().map(|e| e.endpoints.clone()),
        Some(vec!["https://etcd-main-client:2379".to_string()])
    );
    assert_eq!(
        c.restore.data_dir.as_deref(),
        Some(Path::new("/var/etcd/data/new.etcd"))
    );
    let d = c.druid.as_ref().expect("[druid] set by etcdbrctl server");
    assert_eq!(d.pod_name.as_deref(), Some("etcd-main-0"));
    assert_eq!(d.pod_namespace.as_deref(), Some("shoot--p--c"));
    assert_eq!(d.etcd_config, Path::new("/var/etcd/config/etcd.conf.yaml"));
    assert!(d.member_lease && d.snapshot_leases);
    assert_eq!(d.heartbeat, Duration::from_secs(10));
    assert_eq!(d.full_snapshot_lease, "etcd-main-full-snap");
    assert_eq!(d.delta_snapshot_lease, "etcd-main-delta-snap");
    // What has no counterpart is named, not dropped silently.
    let ignored: Vec<&str> = t.ignored.iter().map(|i| i.flag.as_str()).collect();
    for flag in [
        "--auto-compaction-mode",
        "--embedded-etcd-quota-bytes",
        "--restoration-temp-snapshots-dir",
        "--snapstore-temp-directory",
        "--use-etcd-wrapper",
        "--insecure-transport",
    ] {
        assert!(ignored.contains(&flag), "{flag} not reported: {ignored:?}");
    }
}

#[test]
fn druids_compaction_and_copy_jobs_are_compact_and_copy() {
    let home = tempfile::tempdir().unwrap();
    let home_s = home.path().display().to_string();
    // getCompactionJobArgs, Local provider (druid passes the container as a flag here too).
    let compact = "compact \
        --data-dir=/var/etcd/data/compaction.etcd \
        --restoration-temp-snapshots-dir=/var/etcd/data/compaction.restoration.temp \
        --snapstore-temp-directory=/var/etcd/data/tmp \
        --metrics-scrape-wait-duration=1m0s \
        --enable-snapshot-lease-renewal=true \
        --full-snapshot-lease-name=etcd-main-full-snap \
        --delta-snapshot-lease-name=etcd-main-delta-snap \
        --embedded-etcd-quota-bytes=8589934592 \
        --etcd-defrag-timeout=8m0s \
        --etcd-snapshot-timeout=30m0s \
        --storage-provider=Local \
        --store-prefix=etcd-main \
        --store-container=local-bucket";
    let c = configured(
        compact,
        &[
            ("HOME", &home_s),
            ("POD_NAME", "etcd-main-compactor-x"),
            ("POD_NAMESPACE", "shoot"),
        ],
        Purpose::Any,
    );
    assert_eq!(
        c.store.location.to_string(),
        format!("file://{home_s}/local-bucket/etcd-main")
    );
    assert_eq!(c.snapshot.timeout, Duration::from_secs(1800));
    assert_eq!(c.defrag.timeout, Duration::from_secs(480));
    // createJobArgs of EtcdCopyBackupsTask: target then source, then the selection.
    let copy = "copy \
        --snapstore-temp-directory=/home/nonroot/data/tmp \
        --storage-provider=Local --store-prefix=dst-prefix --store-container=dst \
        --source-storage-provider=Local --source-store-prefix=src-prefix \
        --source-store-container=src \
        --max-backup-age=7 --max-backups-to-copy=3 \
        --wait-for-final-snapshot=true --wait-for-final-snapshot-timeout=10m0s";
    let c = configured(copy, &[("HOME", &home_s)], Purpose::Copy);
    assert_eq!(
        c.store.location.to_string(),
        format!("file://{home_s}/dst/dst-prefix")
    );
    assert_eq!(
        c.source_store.as_ref().map(|s| s.location.to_string()),
        Some(format!("file://{home_s}/src/src-prefix"))
    );
    assert!(c.copy.wait_for_final);
    // etcd-backup-restore's wait: the newest snapshot a final, druid's requested one included.
    assert!(c.copy.druid_final);
    assert_eq!(c.copy.final_timeout, Duration::from_secs(600));
    assert_eq!(c.copy.max_backups, 3);
    assert_eq!(c.copy.max_age, Some(Duration::from_secs(7 * 86_400)));
}

/// etcd-backup-restore's secondary-store flags on a `server` command line (S3 primary, S3
/// secondary with its own `SECONDARY_` Secret): `[store.secondary]` is what they say.
#[test]
fn server_with_secondary_flags_configures_store_secondary() {
    let creds = tempfile::tempdir().unwrap();
    for (name, value) in [
        ("region", "eu-west-3"),
        ("accessKeyID", "DR-ID"),
        ("secretAccessKey", "dr-secret"),
        ("s3ForcePathStyle", "true"),
    ] {
        std::fs::write(creds.path().join(name), value).unwrap();
    }
    let creds_s = creds.path().display().to_string();
    let line = "server --storage-provider=S3 --store-prefix=shoot--p--c--etcd-main \
        --enable-snapshot-lease-renewal=false \
        --secondary-backup-sync-enabled=true --secondary-storage-provider=S3 \
        --secondary-store-container=dr-bucket --secondary-store-prefix=dr/etcd-main \
        --secondary-store-endpoint-override=http://127.0.0.1:9000 \
        --secondary-backup-sync-period=30m0s";
    let c = configured(
        line,
        &[
            ("STORAGE_CONTAINER", "backups-bucket"),
            ("SECONDARY_AWS_APPLICATION_CREDENTIALS", &creds_s),
            ("ETCD_WARDEN_SERVER_TOKEN", "t"),
        ],
        Purpose::Any,
    );
    assert_eq!(
        c.store.location.to_string(),
        "s3://backups-bucket/shoot--p--c--etcd-main"
    );
    let s = c.secondary.as_ref().expect("[store.secondary] configured");
    assert_eq!(s.store.location.to_string(), "s3://dr-bucket/dr/etcd-main");
    assert_eq!(s.store.region.as_deref(), Some("eu-west-3"));
    assert_eq!(s.store.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
    assert!(s.store.allow_http && s.store.path_style);
    assert_eq!(s.sync_interval, Duration::from_secs(1800));
    assert_eq!(s.max_lag, Duration::from_secs(3600));
    // Without the switch, as etcd-backup-restore: no secondary.
    let off = line.replace(
        "--secondary-backup-sync-enabled=true",
        "--secondary-backup-sync-enabled=false",
    );
    let c = configured(
        &off,
        &[
            ("STORAGE_CONTAINER", "backups-bucket"),
            ("SECONDARY_AWS_APPLICATION_CREDENTIALS", &creds_s),
        ],
        Purpose::Any,
    );
    assert!(c.secondary.is_none());
}

#[test]
fn an_invalid_secondary_combination_exits_64_naming_the_flag() {
    let on = "--secondary-backup-sync-enabled=true";
    for (extra, named) in [
        (vec![on], "--secondary-storage-provider"),
        (
            vec![on, "--secondary-storage-provider=S3"],
            "--secondary-store-container",
        ),
        (
            vec![on, "--secondary-storage-provider=Local"],
            "--secondary-store-container",
        ),
        (
            vec![
                on,
                "--secondary-storage-provider=Local",
                "--secondary-store-container=dr",
                "--secondary-backup-sync-period=soon",
            ],
            "--secondary-backup-sync-period",
        ),
    ] {
        let out = crate::support::warden::command()
            .arg0("etcdbrctl")
            .args(["server", "--storage-provider=Local"])
            .args(&extra)
            .env("HOME", "/tmp")
            .env("POD_NAME", "p")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{extra:?}: {err}");
        assert!(err.contains(named), "{extra:?}: {err}");
    }
}

#[test]
fn the_druid_page_names_every_flag() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/etcd-druid.md"))
            .unwrap();
    let missing: Vec<&str> = etcd_warden::etcdbrctl::flags::FLAGS
        .iter()
        .map(|f| f.name)
        .filter(|n| !doc.contains(&format!("| `--{n}`")))
        .collect();
    assert!(missing.is_empty(), "docs/etcd-druid.md lacks {missing:?}");
}

#[test]
fn anything_else_exits_64_naming_it() {
    for (args, named) in [
        (vec!["server", "--no-such-flag=1"], "--no-such-flag"),
        (vec!["copy", "--server-port=1"], "--server-port"),
        (vec!["version"], "\"version\""),
        (
            vec!["server", "--storage-provider=Swift", "--store-container=c"],
            "Swift",
        ),
        (
            vec![
                "server",
                "--storage-provider=Local",
                "--compression-policy=lzw",
            ],
            "lzw",
        ),
    ] {
        let out = crate::support::warden::command()
            .arg0("etcdbrctl")
            .args(&args)
            .env("HOME", "/tmp")
            .env("POD_NAME", "p")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {err}");
        assert!(err.contains(named), "{args:?}: {err}");
    }
    // Under its own name, the binary is etcd-warden as before.
    let out = crate::support::warden::command()
        .arg("server")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "clap's usage error for an unknown subcommand"
    );
}

/// etcd started as etcd-wrapper starts it: from the configuration `/config` served, by
/// `etcd::process` (killed on drop).
struct Etcd {
    _process: EtcdProcess,
}

impl Etcd {
    fn start(config: &Path, client_url: &str, log: &Path) -> Etcd {
        let process = process::spawn_config_file(
            Release::V35.binaries(),
            MEMBER,
            config,
            client_url,
            Some(log),
        )
        .unwrap_or_else(|e| panic!("start etcd: {e}"));
        Etcd { _process: process }
    }
}

/// How etcd-wrapper reaches the sidecar: `http://` or, with the sidecar's TLS, `https://` with
/// the CA and no client certificate.
#[derive(Clone)]
struct Wrapper {
    base: String,
    http: reqwest::Client,
}

impl Wrapper {
    fn plain(w: &Warden) -> Wrapper {
        Wrapper {
            base: w.url(""),
            http: reqwest::Client::new(),
        }
    }

    /// A plain-text GET, as etcd-wrapper's client makes it: (status, body).
    async fn get(&self, w: &Warden, path: &str) -> (u16, String) {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}\n{}", w.log_text()));
        (r.status().as_u16(), r.text().await.unwrap())
    }
}

/// etcd-wrapper's `initializer.Run` through `via`: status; `start` while `New`; until
/// `Successful`; then `/config`. Returns the configuration.
async fn wrapper_initializes_via(via: &Wrapper, w: &Warden, mode: &str) -> String {
    let mut seen = Vec::new();
    let started = std::time::Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "never Successful: {seen:?}\n{}",
            w.log_text()
        );
        let (code, body) = via.get(w, "/initialization/status").await;
        assert_eq!(code, 200);
        if seen.last() != Some(&body) {
            seen.push(body.clone());
        }
        match body.as_str() {
            "Successful" => break,
            "New" => {
                let (code, body) = via
                    .get(w, &format!("/initialization/start?mode={mode}"))
                    .await;
                assert_eq!((code, body.as_str()), (200, ""));
            }
            "Progress" => {}
            other => panic!("unexpected status {other:?}\n{}", w.log_text()),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(seen.first().map(String::as_str), Some("New"));
    // Read once, the outcome is gone.
    assert_eq!(via.get(w, "/initialization/status").await.1, "New");
    let (code, config) = via.get(w, "/config").await;
    assert_eq!(code, 200, "{config}");
    config
}

/// One druid pod's worth of files on loopback: etcd's configuration as druid writes it for a
/// one-member Etcd, a Local store under `$HOME`, and `etcdbrctl server`'s arguments and
/// environment.
struct Pod {
    root: tempfile::TempDir,
    home: std::path::PathBuf,
    data_dir: std::path::PathBuf,
    client_url: String,
    peer_url: String,
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
}

const MEMBER: &str = "etcd-test-0";

impl Pod {
    fn new(extra_args: &str) -> Pod {
        let root = tempfile::tempdir().unwrap();
        let home = root.path().join("home");
        std::fs::create_dir_all(home.join("bucket")).unwrap();
        let data_dir = root.path().join("data/new.etcd");
        let (client_port, peer_port) = (free_port(), free_port());
        let client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd_conf = root.path().join("etcd.conf.yaml");
        std::fs::write(
            &etcd_conf,
            format!(
                "name: etcd-config\n\
                 data-dir: {data}\n\
                 snapshot-count: 10000\n\
                 quota-backend-bytes: 8589934592\n\
                 initial-cluster-token: etcd-cluster\n\
                 initial-cluster-state: new\n\
                 initial-cluster: {MEMBER}={peer_url}\n\
                 listen-peer-urls: {peer_url}\n\
                 listen-client-urls: {client_url}\n\
                 initial-advertise-peer-urls:\n  {MEMBER}:\n  - {peer_url}\n\
                 advertise-client-urls:\n  {MEMBER}:\n  - {client_url}\n\
                 next-cluster-version-compatible: true\n",
                data = data_dir.display()
            ),
        )
        .unwrap();
        let mut args = words(&format!(
            "--storage-provider=Local --store-prefix=etcd-test --delta-snapshot-period=1s \
             --endpoints={client_url} --service-endpoints={client_url} --data-dir={} \
             --restoration-temp-snapshots-dir={}/restoration.temp --use-etcd-wrapper=true \
             --embedded-etcd-quota-bytes=8589934592 --etcd-snapshot-timeout=1m0s {extra_args}",
            data_dir.display(),
            root.path().display()
        ));
        // A cron schedule is one argument, spaces and all.
        args.push("--schedule=0 0 1 1 *".into());
        let env = vec![
            ("HOME", home.display().to_string()),
            ("STORAGE_CONTAINER", "bucket".to_string()),
            ("POD_NAME", MEMBER.to_string()),
            ("POD_NAMESPACE", "test".to_string()),
            ("ETCD_CONF", etcd_conf.display().to_string()),
            (
                "ETCD_WARDEN_RESTORE_ETCD_BIN",
                Release::V35.bin_dir().display().to_string(),
            ),
        ];
        Pod {
            root,
            home,
            data_dir,
            client_url,
            peer_url,
            args,
            env,
        }
    }

    fn sidecar(&self) -> Warden {
        let env: Vec<(&str, String)> = self.env.iter().map(|(k, v)| (*k, v.clone())).collect();
        Warden::start_etcdbrctl(&self.args, &env)
    }

    /// etcd-wrapper's sequence, then etcd started from the `/config` served.
    async fn start_etcd(&self, w: &Warden, mode: &str, log: &str) -> Etcd {
        self.start_etcd_via(&Wrapper::plain(w), w, mode, log).await
    }

    async fn start_etcd_via(&self, via: &Wrapper, w: &Warden, mode: &str, log: &str) -> Etcd {
        let config = wrapper_initializes_via(via, w, mode).await;
        let served: serde_yaml::Value = serde_yaml::from_str(&config).unwrap();
        assert_eq!(served["name"].as_str(), Some(MEMBER));
        assert_eq!(served["initial-cluster-state"].as_str(), Some("new"));
        assert_eq!(
            served["advertise-client-urls"].as_str(),
            Some(self.client_url.as_str())
        );
        let path = self.root.path().join("served.yaml");
        std::fs::write(&path, &config).unwrap();
        let log = self.root.path().join(log);
        let etcd = Etcd::start(&path, &self.client_url, &log);
        assert!(
            eventually(Duration::from_secs(30), || member_healthy(&self.client_url)).await,
            "etcd from /config did not start: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        etcd
    }

    async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.client_url.as_str()], None)
            .await
            .unwrap()
    }

    /// The store's object names.
    fn stored(&self) -> Vec<String> {
        std::fs::read_dir(self.home.join("bucket/etcd-test/v2"))
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn etcd_wrappers_sequence_starts_an_etcd_that_is_backed_up_and_restored() {
    let pod = Pod::new("");
    let mut w = pod.sidecar();
    w.wait_up().await;
    // First start: nothing in the store, no data directory: etcd starts fresh.
    let etcd = pod.start_etcd(&w, "full", "etcd.log").await;
    let mut client = pod.client().await;
    for i in 0..50 {
        client
            .put(format!("k{i:02}"), format!("v{i}"), None)
            .await
            .unwrap();
    }

    // druid's triggers: 200 with etcd-backup-restore's Snapshot JSON.
    let http = reqwest::Client::new();
    let full = eventually(Duration::from_secs(30), || async {
        match http.get(w.url("/snapshot/full")).send().await {
            Ok(r) => r.status() == 200,
            Err(_) => false,
        }
    })
    .await;
    assert!(
        full,
        "GET /snapshot/full never answered 200\n{}",
        w.log_text()
    );
    client.put("after-full", "x", None).await.unwrap();
    // The delta watch starts once the full snapshot is in: 409 until then.
    let mut answer = (0, serde_json::Value::Null);
    for _ in 0..100 {
        // druid's on-demand snapshot task POSTs and takes nothing but 200.
        let r = http.post(w.url("/snapshot/delta")).send().await.unwrap();
        let code = r.status().as_u16();
        let text = r.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!("POST /snapshot/delta {code}: {e}: {text}\n{}", w.log_text())
        });
        answer = (code, body);
        if answer.0 != 409 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (code, body) = answer;
    assert_eq!(code, 200, "{body}\n{}", w.log_text());
    if !body.is_null() {
        for field in [
            "snapName",
            "kind",
            "lastRevision",
            "snapDir",
            "isChunk",
            "immutabilityExpriyTime",
        ] {
            assert!(body.get(field).is_some(), "{field} missing in {body}");
        }
    }
    // druid's on-demand final (`isFinal`, before hibernation), POSTed without a token: 200 and
    // a full snapshot taken now, named final as etcd-backup-restore names it, marked druid's
    // before its upload; no reader takes it for a hand-off's final.
    client.put("before-final", "x", None).await.unwrap();
    let r = http
        .post(w.url("/snapshot/full?final=true"))
        .send()
        .await
        .unwrap();
    let code = r.status().as_u16();
    let text = r.text().await.unwrap();
    let fin: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "POST /snapshot/full?final=true {code}: {e}: {text}\n{}",
            w.log_text()
        )
    });
    assert_eq!(code, 200, "{fin}\n{}", w.log_text());
    let name = fin["snapName"].as_str().unwrap().to_string();
    assert!(name.ends_with(".final") && fin["isFinal"] == true, "{fin}");
    let rev = client
        .get("before-final", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    assert!(
        fin["lastRevision"].as_i64().unwrap() >= rev,
        "{fin} misses revision {rev}"
    );
    assert!(
        pod.stored().contains(&name),
        "{name} not stored: {:?}\n{}",
        pod.stored(),
        w.log_text()
    );
    let marker = pod
        .home
        .join("bucket/etcd-test/etcd-warden/requested-final")
        .join(&name);
    assert!(
        marker.exists(),
        "no requested-final marker at {}",
        marker.display()
    );
    let latest: serde_json::Value = http
        .get(w.url("/snapshot/latest"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        latest["fullSnapshot"]["snapName"],
        name.as_str(),
        "{latest}"
    );
    assert_eq!(
        latest["fullSnapshot"]["isFinal"], false,
        "no hand-off's final: {latest}"
    );
    // druid's copy task (EtcdCopyBackupsTask's Job arguments, etcd-warden's image): its wait
    // for the final ends at druid's requested final, as etcd-backup-restore's does; it copies
    // it without the `.final` suffix, as etcd-backup-restore does.
    let started = std::time::Instant::now();
    // The test process's ETCD_WARDEN_* left out, as a Job's environment holds none of them.
    let copy = warden::command_of(&warden::binary())
        .arg0("etcdbrctl")
        .args(words(
            "copy --storage-provider=Local --store-container=dst --store-prefix=etcd-copy              --source-storage-provider=Local --source-store-container=bucket              --source-store-prefix=etcd-test --max-backups-to-copy=-1              --wait-for-final-snapshot=true --wait-for-final-snapshot-timeout=2m0s",
        ))
        .env("HOME", &pod.home)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&copy.stderr);
    assert!(copy.status.success(), "etcdbrctl copy failed: {log}");
    assert!(
        started.elapsed() < Duration::from_secs(60) && log.contains("final snapshot found"),
        "the copy did not find druid's final (took {:?}): {log}",
        started.elapsed()
    );
    let copied: Vec<String> = std::fs::read_dir(pod.home.join("dst/etcd-copy/v2"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let plain = name.strip_suffix(".final").unwrap();
    assert!(
        copied.iter().any(|n| n == plain),
        "{plain} not in {copied:?}"
    );
    // Deltas go on after it, as after etcd-backup-restore's.
    let after = client
        .put("after-final", "x", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    // The delta with the last write is stored (the schedule may have taken it first).
    let stored = eventually(Duration::from_secs(20), || async {
        pod.stored().iter().any(|n| {
            let mut parts = n.strip_prefix("Incr-").unwrap_or_default().split('-');
            parts.nth(1).and_then(|last| last.parse::<i64>().ok()) >= Some(after)
        })
    })
    .await;
    assert!(
        stored,
        "no delta reaching revision {after} in the Local store: {:?}\n{}",
        pod.stored(),
        w.log_text()
    );

    // The data is lost; the pod restarts (sidecar and etcd); etcd-wrapper initializes again.
    drop(client);
    drop(etcd);
    w.kill();
    std::fs::remove_dir_all(&pod.data_dir).unwrap();
    let w = pod.sidecar();
    w.wait_up().await;
    let _etcd = pod.start_etcd(&w, "sanity", "etcd2.log").await;
    let mut client = pod.client().await;
    let all = client
        .get("", Some(etcd_client::GetOptions::new().with_all_keys()))
        .await
        .unwrap();
    let keys: Vec<String> = all
        .kvs()
        .iter()
        .map(|kv| kv.key_str().unwrap().to_string())
        .collect();
    assert_eq!(keys.len(), 53, "{keys:?}\n{}", w.log_text());
    for key in ["after-full", "before-final", "after-final"] {
        assert!(keys.contains(&key.to_string()), "{key} missing: {keys:?}");
    }
    let members = client.member_list().await.unwrap();
    assert_eq!(members.members().len(), 1);
    assert_eq!(members.members()[0].name(), MEMBER);
    assert_eq!(
        members.members()[0].peer_urls(),
        std::slice::from_ref(&pod.peer_url),
        "restored with the member's own peer URL: nothing to repair"
    );
}

/// etcd-backup-restore's secondary flags on a real pod: a Local primary and a Local secondary
/// under `$HOME`; the full snapshot the sidecar takes of a real etcd reaches the secondary, and
/// byte for byte.
#[tokio::test(flavor = "multi_thread")]
async fn a_snapshot_reaches_the_secondary_the_flags_name() {
    let pod = Pod::new(
        "--secondary-backup-sync-enabled=true --secondary-storage-provider=Local \
         --secondary-store-container=mirror --secondary-store-prefix=etcd-test \
         --secondary-backup-sync-period=1s",
    );
    let w = pod.sidecar();
    w.wait_up().await;
    let _etcd = pod.start_etcd(&w, "full", "etcd.log").await;
    let mut client = pod.client().await;
    for i in 0..20 {
        client.put(format!("k{i}"), "v", None).await.unwrap();
    }
    let http = reqwest::Client::new();
    let full = eventually(Duration::from_secs(30), || async {
        match http.get(w.url("/snapshot/full")).send().await {
            Ok(r) => r.status() == 200,
            Err(_) => false,
        }
    })
    .await;
    assert!(full, "GET /snapshot/full never 200\n{}", w.log_text());
    let primary = pod.home.join("bucket/etcd-test/v2");
    let mirror = pod.home.join("mirror/etcd-test/v2");
    let fulls = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("Full-"))
            .collect()
    };
    let copied = eventually(Duration::from_secs(60), || {
        let (p, m) = (fulls(&primary), fulls(&mirror));
        let ok = !p.is_empty() && p.iter().all(|n| m.contains(n));
        async move { ok }
    })
    .await;
    assert!(
        copied,
        "primary {:?}, secondary {:?}\n{}",
        fulls(&primary),
        fulls(&mirror),
        w.log_text()
    );
    for name in fulls(&primary) {
        assert_eq!(
            std::fs::read(primary.join(&name)).unwrap(),
            std::fs::read(mirror.join(&name)).unwrap(),
            "{name}"
        );
    }
}

/// Who the binaries' requests come from in the API-server double's log: they send no user
/// header (the test's own client does).
const ANONYMOUS: &str = "";

/// The Leases druid reads, against the API-server double, with every request checked against
/// druid's Role (deploy/druid). The double checks resourceVersions as the API server does; it
/// does not run druid's controllers that read the Leases.
#[tokio::test(flavor = "multi_thread")]
async fn the_leases_druid_reads_are_renewed_with_etcd_backup_restores_values() {
    use k8s_openapi::api::coordination::v1::Lease;
    let api_server = crate::support::apiserver::ApiServer::start().await;
    let leases: kube::Api<Lease> =
        kube::Api::namespaced(api_server.client_as("test-setup"), "test");
    // druid creates every Lease; the sidecar only patches them.
    for name in [MEMBER, "etcd-test-full-snap", "etcd-test-delta-snap"] {
        let lease: Lease = serde_json::from_value(serde_json::json!({
            "metadata": { "name": name, "namespace": "test" },
            "spec": {}
        }))
        .unwrap();
        leases.create(&Default::default(), &lease).await.unwrap();
    }
    let mut pod = Pod::new(
        "--enable-member-lease-renewal=true --k8s-heartbeat-duration=500ms \
         --enable-snapshot-lease-renewal=true --full-snapshot-lease-name=etcd-test-full-snap \
         --delta-snapshot-lease-name=etcd-test-delta-snap",
    );
    let kubeconfig = pod.root.path().join("kubeconfig");
    api_server.write_kubeconfig(&kubeconfig, "test");
    pod.env
        .push(("KUBECONFIG", kubeconfig.display().to_string()));
    let mut w = pod.sidecar();
    w.wait_up().await;
    let _etcd = pod.start_etcd(&w, "full", "etcd.log").await;
    let mut client = pod.client().await;
    let status = client.status().await.unwrap();
    let header = status.header().unwrap();
    let holder = |name: &'static str| {
        let leases = leases.clone();
        async move {
            let l = leases.get(name).await.ok()?;
            let spec = l.spec?;
            Some((
                spec.holder_identity?,
                spec.renew_time?.0,
                l.metadata.annotations,
            ))
        }
    };
    // The member Lease: "<member>:<cluster>:Leader" in lowercase hex, plain peer URLs.
    let want = format!("{:x}:{:x}:Leader", header.member_id(), header.cluster_id());
    let renewed = eventually(Duration::from_secs(20), || async {
        holder(MEMBER).await.is_some_and(|(h, _, _)| h == want)
    })
    .await;
    assert!(
        renewed,
        "member Lease {:?}\n{}",
        holder(MEMBER).await,
        w.log_text()
    );
    let (_, first, annotations) = holder(MEMBER).await.unwrap();
    assert_eq!(
        annotations
            .unwrap_or_default()
            .get("member.etcd.gardener.cloud/tls-enabled"),
        Some(&"false".to_string())
    );
    let again = eventually(Duration::from_secs(10), || async {
        holder(MEMBER).await.is_some_and(|(_, t, _)| t > first)
    })
    .await;
    assert!(again, "the member Lease is renewed every heartbeat");

    // The snapshot Leases follow the store: the full one holds its last revision and creation
    // time, the delta one the newest delta's revision (renewed on every pass even when idle).
    for i in 0..20 {
        client.put(format!("k{i}"), "v", None).await.unwrap();
    }
    let http = reqwest::Client::new();
    let full: serde_json::Value = loop {
        let r = http.get(w.url("/snapshot/full")).send().await.unwrap();
        if r.status() == 200 {
            break r.json().await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let full_rev = full["lastRevision"].as_i64().unwrap();
    let full_lease = eventually(Duration::from_secs(20), || async {
        holder("etcd-test-full-snap")
            .await
            .is_some_and(|(h, _, _)| h == full_rev.to_string())
    })
    .await;
    assert!(
        full_lease,
        "full Lease {:?}\n{}",
        holder("etcd-test-full-snap").await,
        w.log_text()
    );
    let (_, renew, _) = holder("etcd-test-full-snap").await.unwrap();
    assert_eq!(renew.to_string(), full["createdOn"].as_str().unwrap());
    client.put("after-full", "x", None).await.unwrap();
    let last = crate::support::etcd::revision(&mut client, "after-full").await;
    let delta_lease = eventually(Duration::from_secs(20), || async {
        holder("etcd-test-delta-snap")
            .await
            .is_some_and(|(h, _, _)| h.parse::<i64>().unwrap_or(0) >= last)
    })
    .await;
    assert!(
        delta_lease,
        "delta Lease {:?}\n{}",
        holder("etcd-test-delta-snap").await,
        w.log_text()
    );
    let (_, before, _) = holder("etcd-test-delta-snap").await.unwrap();
    let idle_renewal = eventually(Duration::from_secs(10), || async {
        holder("etcd-test-delta-snap")
            .await
            .is_some_and(|(_, t, _)| t > before)
    })
    .await;
    assert!(idle_renewal, "the delta Lease is renewed while idle");
    // druid's compaction Job: the compacted full snapshot's revision goes into the full Lease
    // (the sidecar stopped, so the Job's write is the only one).
    w.kill();
    let work = pod.root.path().join("compaction.etcd");
    let out = crate::support::warden::command()
        .arg0("etcdbrctl")
        .args([
            "compact".to_string(),
            format!("--data-dir={}", work.display()),
            "--storage-provider=Local".into(),
            "--store-prefix=etcd-test".into(),
            "--enable-snapshot-lease-renewal=true".into(),
            "--full-snapshot-lease-name=etcd-test-full-snap".into(),
            "--delta-snapshot-lease-name=etcd-test-delta-snap".into(),
        ])
        .envs(pod.env.iter().map(|(k, v)| (*k, v.as_str())))
        .env_remove("POD_NAME")
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (held, _, _) = holder("etcd-test-full-snap").await.unwrap();
    assert!(
        held.parse::<i64>().unwrap() >= last,
        "full Lease {held} after compaction to at least {last}: {printed}"
    );
    assert!(
        printed.contains(&format!("Lease etcd-test-full-snap: revision {held}")),
        "{printed}"
    );

    // Every request the sidecar and the Job made is one druid's Role allows (deploy/druid,
    // moved to this test's namespace): get and patch, never create. The test's own creates
    // came through another client.
    let role = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/druid/role.yaml"),
    )
    .unwrap()
    .replace("namespace: etcd", "namespace: test")
    .replace("name: etcd-main", "name: etcd-test");
    let role_file = pod.root.path().join("role.yaml");
    std::fs::write(&role_file, role).unwrap();
    let policy = crate::support::rbac::Policy::load(&[&role_file]);
    let made: Vec<String> = api_server
        .requests_of(ANONYMOUS)
        .into_iter()
        .filter(|r| r.contains("/leases"))
        .collect();
    assert!(made.iter().any(|r| r.starts_with("PATCH")), "{made:?}");
    let denied = policy.denied(("test", "etcd-test"), &made);
    assert!(denied.is_empty(), "druid's Role denies {denied:#?}");
}

/// The snapshot triggers over mutual TLS (`--server-cert`, `--server-key`, and a client CA in
/// `ETCD_WARDEN_SERVER_TLS_CLIENT_CA_FILE`, etcd-warden's key): etcd-wrapper, which presents no
/// certificate, still initializes over TLS; a caller with a certificate from the CA gets 200; one
/// without is refused 401; one from another CA fails the handshake. Not checked: druid's own
/// client (its compaction controller presents no certificate, so with a client CA configured its
/// trigger is refused; docs/etcd-druid.md says so).
#[tokio::test(flavor = "multi_thread")]
async fn with_a_client_ca_the_triggers_need_a_certificate_and_the_wrapper_none() {
    let (certs, other) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    crate::support::tls::make_certs(certs.path());
    crate::support::tls::make_certs(other.path());
    let c = certs.path();
    let mut pod = Pod::new(&format!(
        "--server-cert={} --server-key={}",
        c.join("server.pem").display(),
        c.join("server.key").display()
    ));
    pod.env.push((
        "ETCD_WARDEN_SERVER_TLS_CLIENT_CA_FILE",
        c.join("ca.pem").display().to_string(),
    ));
    let w = pod.sidecar();
    let ca = reqwest::Certificate::from_pem(&std::fs::read(c.join("ca.pem")).unwrap()).unwrap();
    let https = |identity: Option<&Path>| {
        let mut b = reqwest::Client::builder()
            .add_root_certificate(ca.clone())
            .timeout(Duration::from_secs(30));
        if let Some(dir) = identity {
            let mut pem = std::fs::read(dir.join("client.pem")).unwrap();
            pem.extend(std::fs::read(dir.join("client.key")).unwrap());
            b = b.identity(reqwest::Identity::from_pem(&pem).unwrap());
        }
        b.build().unwrap()
    };
    let base = format!("https://127.0.0.1:{}", w.port);
    let wrapper = Wrapper {
        base: base.clone(),
        http: https(None),
    };
    let up = eventually(Duration::from_secs(20), || async {
        wrapper
            .http
            .get(format!("{base}/livez"))
            .send()
            .await
            .is_ok()
    })
    .await;
    assert!(up, "no HTTPS\n{}", w.log_text());
    let _etcd = pod.start_etcd_via(&wrapper, &w, "full", "etcd.log").await;

    let trigger = |client: reqwest::Client| {
        let url = format!("{base}/snapshot/full");
        async move {
            client
                .get(url)
                .send()
                .await
                .map(|r| r.status().as_u16())
                .map_err(|e| format!("{e:?}"))
        }
    };
    let ok = eventually(Duration::from_secs(30), || async {
        trigger(https(Some(c))).await == Ok(200)
    })
    .await;
    assert!(
        ok,
        "a certificate from the CA: {:?}\n{}",
        trigger(https(Some(c))).await,
        w.log_text()
    );
    assert_eq!(trigger(https(None)).await, Ok(401), "no certificate");
    assert!(
        trigger(https(Some(other.path()))).await.is_err(),
        "another CA's certificate must fail the handshake"
    );
}

/// A follower's sidecar under `[druid]` forwards druid's snapshot triggers to the leader's
/// sidecar, found as etcd-backup-restore finds it (the leader's client URL's host, this
/// sidecar's port), and after the leader dies to the new leader's. Three real etcd members on
/// their own loopback addresses (127.0.0.11–13, one client port, one sidecar port, as pods of a
/// StatefulSet); the sidecars share a file store. Not checked: HTTPS between sidecars (the unit
/// tests of `druid::forward` cover the URL it builds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followers_sidecar_forwards_triggers_to_the_leaders_and_follows_a_new_leader() {
    use crate::support::hosts::{self, Hosts};
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("etcd")).unwrap();
    let etcd = Hosts::new(dir.path().join("etcd"), None);
    let members = etcd.start_cluster(3).await;
    let port = hosts::common_port();
    let store = format!("file://{}", dir.path().join("store").display());
    let etcd_conf = dir.path().join("etcd.conf.yaml");
    std::fs::write(&etcd_conf, "name: unused\n").unwrap();
    let mut sidecars: Vec<Warden> = members
        .iter()
        .map(|(name, ip)| {
            Warden::start(&[
                ("server.listen", format!("{ip}:{port}")),
                ("etcd.endpoints", etcd.client_url(ip)),
                ("store.url", store.clone()),
                ("druid.pod_name", name.clone()),
                ("druid.etcd_config", etcd_conf.display().to_string()),
            ])
        })
        .collect();
    for w in &sidecars {
        w.wait_up().await;
    }
    let leader_of = async |etcd: &Hosts, alive: &[usize]| -> usize {
        let urls: Vec<String> = alive
            .iter()
            .map(|i| etcd.client_url(&members[*i].1))
            .collect();
        hosts::eventually("a leader", Duration::from_secs(30), async || {
            let mut c = hosts::client(&urls, None).await?;
            let leader = c.status().await.ok()?.leader();
            let list = c.member_list().await.ok()?;
            let name = list
                .members()
                .iter()
                .find(|m| m.id() == leader)?
                .name()
                .to_owned();
            alive.iter().copied().find(|i| members[*i].0 == name)
        })
        .await
    };
    let http = reqwest::Client::new();
    // A full snapshot asked of a follower is the leader's; so is a delta (a follower has none).
    let trigger = async |follower: &Warden, path: &str| -> (u16, serde_json::Value) {
        let mut last = (0, serde_json::Value::Null);
        for _ in 0..100 {
            let r = http.post(follower.url(path)).send().await.unwrap();
            last = (r.status().as_u16(), r.json().await.unwrap_or_default());
            if last.0 != 409 && last.0 != 503 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        last
    };
    let alive = vec![0, 1, 2];
    let leader = leader_of(&etcd, &alive).await;
    let follower = (leader + 1) % 3;
    // The snapshot a trigger answers with, and whose log names it.
    let taken_by = |body: &serde_json::Value, w: &Warden| {
        body["snapName"]
            .as_str()
            .is_some_and(|name| w.log_text().contains(name))
    };
    for path in ["/snapshot/full", "/snapshot/delta"] {
        let (code, body) = trigger(&sidecars[follower], path).await;
        assert_eq!(code, 200, "{path} on a follower: {body}");
        if path == "/snapshot/full" {
            assert!(
                taken_by(&body, &sidecars[leader]) && !taken_by(&body, &sidecars[follower]),
                "{body} is not the leader's:\n{}",
                sidecars[leader].log_text()
            );
        }
    }
    assert!(
        sidecars[follower]
            .log_text()
            .contains("forwarded to the leader's sidecar"),
        "{}",
        sidecars[follower].log_text()
    );
    assert!(
        !sidecars[follower]
            .log_text()
            .contains("full snapshot stored"),
        "the follower took the snapshot itself:\n{}",
        sidecars[follower].log_text()
    );

    // The leader dies: the next trigger goes to the new leader's sidecar.
    etcd.kill(&members[leader].0);
    sidecars[leader].kill();
    let alive: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
    let new_leader = leader_of(&etcd, &alive).await;
    let follower = alive.iter().copied().find(|i| *i != new_leader).unwrap();
    let (code, body) = trigger(&sidecars[follower], "/snapshot/full").await;
    assert_eq!(code, 200, "after the leader's death: {body}");
    assert!(
        taken_by(&body, &sidecars[new_leader]) && !taken_by(&body, &sidecars[follower]),
        "{body} is not the new leader's:\n{}",
        sidecars[new_leader].log_text()
    );
}
