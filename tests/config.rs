//! Configuration layering and every error case, through the library and the binary.

use crate::support;

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use etcd_warden::config::{
    Compression, Config, ConfigError, GcPolicy, Override, Purpose, Secret, Sources, env_var_for,
};

fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn load(
    file: Option<&Path>,
    e: &[(&str, &str)],
    flags: &[(&str, &str)],
) -> Result<Config, ConfigError> {
    load_for(Purpose::Any, file, e, flags)
}

/// The error loading only `env` gives (no file, no flags).
fn env_error(env: &[(&str, &str)]) -> ConfigError {
    load(None, env, &[]).unwrap_err()
}

fn load_for(
    purpose: Purpose,
    file: Option<&Path>,
    e: &[(&str, &str)],
    flags: &[(&str, &str)],
) -> Result<Config, ConfigError> {
    let env = env(e);
    let overrides = flags
        .iter()
        .map(|(k, v)| Override::flag(k, *v, &format!("--{k}")))
        .collect();
    Config::load_for(
        &Sources {
            file,
            env: &env,
            overrides,
        },
        purpose,
    )
    .map(|(c, _)| c)
}

fn write(dir: &tempfile::TempDir, text: &str) -> std::path::PathBuf {
    let p = dir.path().join("config.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn example() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("config.example.toml")
}

#[test]
fn defaults_alone_are_valid() {
    let c = load(None, &[], &[]).unwrap();
    assert_eq!(c.etcd.endpoints, vec!["http://127.0.0.1:2379"]);
    assert_eq!(c.snapshot.delta_period, Duration::from_secs(20));
    assert_eq!(c.snapshot.compression, Compression::Gzip);
    assert_eq!(c.snapshot.gc_policy, GcPolicy::Exponential);
    assert!(
        c.owner.is_none(),
        "no [owner] section means no ownership checks"
    );
    assert_eq!(c.kill.grace, Duration::from_secs(30));
    assert!(
        c.defrag.schedule.is_none(),
        "defragmentation is off by default"
    );
    assert_eq!(c.defrag.timeout, Duration::from_secs(300));
    assert_eq!(c.defrag.min_free_fraction, 0.1);
    assert_eq!(
        c.defrag.check_interval, None,
        "the trigger is off by default"
    );
    assert_eq!(c.defrag.trigger_min_db_size, 100 << 20);
    assert_eq!(c.defrag.trigger_min_free_fraction, 0.45);
    assert_eq!(c.defrag.disable_file, None, "no kill switch by default");
    // From the environment: text, parsed as the file's values are.
    let c = load(
        None,
        &[
            ("ETCD_WARDEN_DEFRAG_SCHEDULE", "0 3 * * 0"),
            ("ETCD_WARDEN_DEFRAG_MIN_FREE_FRACTION", "0.25"),
        ],
        &[],
    )
    .unwrap();
    assert!(c.defrag.schedule.is_some());
    assert_eq!(c.defrag.min_free_fraction, 0.25);
    let c = load(
        None,
        &[
            ("ETCD_WARDEN_DEFRAG_CHECK_INTERVAL", "10m"),
            ("ETCD_WARDEN_DEFRAG_TRIGGER_MIN_DB_SIZE", "1GiB"),
            ("ETCD_WARDEN_DEFRAG_DISABLE_FILE", "/var/etcd/no-defrag"),
        ],
        &[],
    )
    .unwrap();
    assert_eq!(c.defrag.check_interval, Some(Duration::from_secs(600)));
    assert_eq!(c.defrag.trigger_min_db_size, 1 << 30);
    assert_eq!(
        c.defrag.disable_file.as_deref(),
        Some(Path::new("/var/etcd/no-defrag"))
    );
}

#[test]
fn the_example_file_loads_and_documents_every_key() {
    let c = load(Some(&example()), &[], &[]).unwrap();
    let owner = c.owner.expect("the example configures ownership");
    assert_eq!(owner.id, "seed-a");
    // Every key that the printed effective configuration has appears in the example.
    let (_, raw) = Config::load(&Sources {
        file: None,
        env: &env(&[]),
        overrides: vec![],
    })
    .unwrap();
    let printed: toml::Table = toml::to_string(&raw).unwrap().parse().unwrap();
    let example_text = std::fs::read_to_string(example()).unwrap();
    for (section, keys) in &printed {
        assert!(
            example_text.contains(&format!("[{section}]")),
            "section [{section}] undocumented"
        );
        for key in keys.as_table().unwrap().keys() {
            assert!(
                example_text.contains(&format!("{key} =")),
                "key {section}.{key} undocumented"
            );
        }
    }
}

#[test]
fn a_secondary_store_has_its_own_keys_and_only_store_has_one() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "[store]\nurl = \"file:///tmp/a\"\n[store.secondary]\nurl = \"s3://b/p\"\n\
         access_key_id = \"k\"\nmax_lag = \"2m\"\n",
    );
    let c = load(
        Some(&file),
        &[("ETCD_WARDEN_STORE_SECONDARY_SYNC_INTERVAL", "3s")],
        &[],
    )
    .unwrap();
    let s = c.secondary.expect("[store.secondary] is configured");
    assert_eq!(s.store.location.to_string(), "s3://b/p");
    assert_eq!(s.max_lag, Duration::from_secs(120));
    assert_eq!(s.sync_interval, Duration::from_secs(3));
    assert!(c.store.access_key_id.is_none(), "credentials are per store");
    assert!(load(None, &[], &[]).unwrap().secondary.is_none());

    let e = env_error(&[
        ("ETCD_WARDEN_STORE_SECONDARY_URL", "file:///tmp/b"),
        ("ETCD_WARDEN_STORE_SECONDARY_MAX_LAG", "soon"),
    ]);
    assert_eq!(e.key, "store.secondary.max_lag");
    assert!(
        e.origin.contains("ETCD_WARDEN_STORE_SECONDARY_MAX_LAG"),
        "{e}"
    );
    let e = env_error(&[("ETCD_WARDEN_STORE_MAX_LAG", "1m")]);
    assert_eq!(e.key, "store.max_lag");
    assert!(e.message.contains("[store.secondary]"), "{e}");
    let e = load(
        None,
        &[],
        &[
            ("source_store.url", "file:///tmp/c"),
            ("source_store.secondary.url", "file:///tmp/d"),
        ],
    )
    .unwrap_err();
    assert_eq!(e.key, "source_store.secondary");
    let e = env_error(&[("ETCD_WARDEN_STORE_SECONDARY_URL", "ftp://x")]);
    assert_eq!(e.key, "store.secondary.url");
}

#[test]
fn layers_apply_in_order_defaults_file_env_flags() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "[snapshot]\ndelta_period = \"10s\"\ngc_period = \"2m\"\nmax_backups = 3\n[kill]\ngrace = \"5s\"\n",
    );
    let c = load(
        Some(&file),
        &[
            ("ETCD_WARDEN_SNAPSHOT_DELTA_PERIOD", "15s"),
            ("ETCD_WARDEN_KILL_GRACE", "7s"),
        ],
        &[("kill.grace", "9s")],
    )
    .unwrap();
    assert_eq!(
        c.snapshot.gc_period,
        Duration::from_secs(120),
        "file over default"
    );
    assert_eq!(
        c.snapshot.delta_period,
        Duration::from_secs(15),
        "env over file"
    );
    assert_eq!(c.kill.grace, Duration::from_secs(9), "flag over env");
    assert_eq!(
        c.snapshot.schedule.pattern.to_string(),
        "0 */1 * * *",
        "default kept"
    );
}

#[test]
fn environment_text_is_parsed_into_each_keys_type() {
    // A list (several endpoints are refused with [owner], so parsed without it).
    let c = load(
        None,
        &[(
            "ETCD_WARDEN_ETCD_ENDPOINTS",
            "http://10.0.0.1:2379, http://10.0.0.2:2379",
        )],
        &[],
    )
    .unwrap();
    assert_eq!(
        c.etcd.endpoints,
        vec!["http://10.0.0.1:2379", "http://10.0.0.2:2379"]
    );
    let c = load(
        None,
        &[
            ("ETCD_WARDEN_STORE_PATH_STYLE", "false"),
            ("ETCD_WARDEN_SNAPSHOT_GC_POLICY", "LimitBased"),
            ("ETCD_WARDEN_SNAPSHOT_MAX_BACKUPS", "4"),
            ("ETCD_WARDEN_OWNER_NAME", "owner.example"),
            ("ETCD_WARDEN_OWNER_ID", "12345"),
            ("ETCD_WARDEN_OWNER_NAMESERVERS", "[\"127.0.0.1:5353\"]"),
        ],
        &[],
    )
    .unwrap();
    assert!(!c.store.path_style);
    assert_eq!(
        c.snapshot.gc_policy,
        GcPolicy::LimitBased { max_backups: 4 }
    );
    let owner = c.owner.unwrap();
    assert_eq!(owner.id, "12345", "a numeric-looking ID stays text");
    assert_eq!(owner.nameservers, vec!["127.0.0.1:5353".parse().unwrap()]);
    assert_eq!(
        owner.interval,
        Duration::from_secs(30),
        "section defaults fill in"
    );
}

#[test]
fn secrets_come_from_a_value_or_a_file_never_both() {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, "s3cr3t\n").unwrap();
    let path = secret_file.to_str().unwrap();
    let c = load(
        None,
        &[("ETCD_WARDEN_STORE_SECRET_ACCESS_KEY_FILE", path)],
        &[],
    )
    .unwrap();
    let secret = c.store.secret_access_key.unwrap();
    assert_eq!(secret, Secret::File(secret_file.clone()));
    assert_eq!(secret.read().unwrap(), "s3cr3t", "trailing newline trimmed");
    assert!(!format!("{secret:?}").contains("s3cr3t"));

    let c = load(None, &[("ETCD_WARDEN_SERVER_TOKEN", "tok")], &[]).unwrap();
    assert_eq!(format!("{:?}", c.server.token.unwrap()), "<redacted>");

    let e = env_error(&[
        ("ETCD_WARDEN_STORE_SECRET_ACCESS_KEY", "x"),
        ("ETCD_WARDEN_STORE_SECRET_ACCESS_KEY_FILE", path),
    ]);
    assert_eq!(e.key, "store.secret_access_key");
    assert!(e.message.contains("both"), "{e}");

    let e = env_error(&[("ETCD_WARDEN_ETCD_PASSWORD_FILE", "/nonexistent/pw")]);
    assert_eq!(e.key, "etcd.password_file");
}

#[test]
fn with_owner_only_one_etcd_endpoint_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let owner = "[owner]\nname = \"owner.example\"\nid = \"seed-a\"\n";
    let two = "[etcd]\nendpoints = [\"http://127.0.0.1:2379\", \"http://10.0.0.2:2379\"]\n";
    let e = load(Some(&write(&dir, &format!("{two}{owner}"))), &[], &[]).unwrap_err();
    assert_eq!(e.key, "etcd.endpoints");
    for words in [
        "2 endpoints",
        "10.0.0.2:2379",
        "[owner]",
        "this pod's own member",
    ] {
        assert!(e.to_string().contains(words), "{words:?} missing: {e}");
    }
    // From the environment too, and the error says where the value came from.
    let e = load(
        Some(&write(&dir, owner)),
        &[(
            "ETCD_WARDEN_ETCD_ENDPOINTS",
            "http://127.0.0.1:2379,http://10.0.0.2:2379",
        )],
        &[],
    )
    .unwrap_err();
    assert_eq!(e.key, "etcd.endpoints");
    assert!(e.to_string().contains("ETCD_WARDEN_ETCD_ENDPOINTS"), "{e}");
    // One endpoint with [owner], or several without it, are fine.
    let one = "[etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\n";
    assert!(load(Some(&write(&dir, &format!("{one}{owner}"))), &[], &[]).is_ok());
    assert!(load(Some(&write(&dir, two)), &[], &[]).is_ok());
}

/// Each bad input is rejected naming its key (and where the value came from).
#[test]
fn every_error_names_its_key() {
    let dir = tempfile::tempdir().unwrap();
    // (what, file text, environment, key at fault, words the message must contain)
    type Case<'a> = (
        &'a str,
        Option<&'a str>,
        Vec<(&'a str, &'a str)>,
        &'a str,
        &'a str,
    );
    let cases: Vec<Case> = vec![
        (
            "rejoin endpoint not a URL",
            None,
            vec![("ETCD_WARDEN_RESTORE_CLUSTER_ENDPOINTS", "etcd-0:2379")],
            "restore.cluster_endpoints",
            "\"etcd-0:2379\"",
        ),
        (
            "rejoin endpoint not http",
            Some("[restore]\ncluster_endpoints = [\"unix:///run/etcd.sock\"]\n"),
            vec![],
            "restore.cluster_endpoints",
            "not http or https",
        ),
        (
            "rejoin with https peers",
            None,
            vec![
                (
                    "ETCD_WARDEN_RESTORE_CLUSTER_ENDPOINTS",
                    "http://10.0.0.1:2379",
                ),
                (
                    "ETCD_WARDEN_RESTORE_INITIAL_ADVERTISE_PEER_URLS",
                    "https://10.0.0.3:2380",
                ),
            ],
            "restore.peer_cert_file",
            "\"https://10.0.0.3:2380\"",
        ),
        (
            "zero rejoin timeout",
            Some("[restore]\nrejoin_timeout = \"0s\"\n"),
            vec![],
            "restore.rejoin_timeout",
            "",
        ),
        (
            "unknown key in file",
            Some("[snapshot]\ndelta_perod = \"1s\"\n"),
            vec![],
            "snapshot.delta_perod",
            "unknown key",
        ),
        (
            "unknown section",
            Some("[snapshots]\nschedule = \"x\"\n"),
            vec![],
            "snapshots",
            "unknown key",
        ),
        (
            "bad duration",
            Some("[owner]\nname=\"o\"\nid=\"i\"\ninterval = \"30 parsecs\"\n"),
            vec![],
            "owner.interval",
            "invalid duration",
        ),
        (
            "bad defrag cron",
            Some("[defrag]\nschedule = \"every sunday\"\n"),
            vec![],
            "defrag.schedule",
            "invalid cron expression",
        ),
        (
            "zero defrag timeout",
            Some("[defrag]\ntimeout = \"0s\"\n"),
            vec![],
            "defrag.timeout",
            "greater than zero",
        ),
        (
            "free fraction above 1",
            Some("[defrag]\nmin_free_fraction = 1.5\n"),
            vec![],
            "defrag.min_free_fraction",
            "between 0 and 1",
        ),
        (
            "trigger free fraction below 0",
            Some("[defrag]\ntrigger_min_free_fraction = -0.1\n"),
            vec![],
            "defrag.trigger_min_free_fraction",
            "between 0 and 1",
        ),
        (
            "trigger size not a size",
            Some("[defrag]\ntrigger_min_db_size = \"a lot\"\n"),
            vec![],
            "defrag.trigger_min_db_size",
            "",
        ),
        (
            "trigger interval not a duration",
            Some("[defrag]\ncheck_interval = \"often\"\n"),
            vec![],
            "defrag.check_interval",
            "invalid duration",
        ),
        (
            "free fraction not a number",
            None,
            vec![("ETCD_WARDEN_DEFRAG_MIN_FREE_FRACTION", "ten percent")],
            "defrag.min_free_fraction",
            "expected a number",
        ),
        (
            "duration as a number",
            Some("[kill]\ngrace = 30\n"),
            vec![],
            "kill.grace",
            "string",
        ),
        (
            "zero interval",
            Some("[owner]\nname=\"o\"\nid=\"i\"\ninterval = \"0s\"\n"),
            vec![],
            "owner.interval",
            "greater than zero",
        ),
        (
            "bad store URL",
            None,
            vec![("ETCD_WARDEN_STORE_URL", "ftp://host/x")],
            "store.url",
            "unknown scheme",
        ),
        (
            "store URL without bucket",
            None,
            vec![("ETCD_WARDEN_STORE_URL", "s3:///x")],
            "store.url",
            "no bucket",
        ),
        (
            "missing owner id",
            Some("[owner]\nname = \"owner.example\"\n"),
            vec![],
            "owner.id",
            "required",
        ),
        (
            "missing owner name",
            None,
            vec![("ETCD_WARDEN_OWNER_ID", "a")],
            "owner.name",
            "required",
        ),
        (
            "bad cron",
            Some("[snapshot]\nschedule = \"every hour\"\n"),
            vec![],
            "snapshot.schedule",
            "cron",
        ),
        (
            "bad endpoint",
            None,
            vec![("ETCD_WARDEN_ETCD_ENDPOINTS", "127.0.0.1:2379")],
            "etcd.endpoints",
            "not a URL",
        ),
        (
            "endpoint scheme",
            None,
            vec![("ETCD_WARDEN_ETCD_ENDPOINTS", "unix://x:1")],
            "etcd.endpoints",
            "scheme",
        ),
        (
            "no endpoints",
            Some("[etcd]\nendpoints = []\n"),
            vec![],
            "etcd.endpoints",
            "required",
        ),
        (
            "bad listen",
            None,
            vec![("ETCD_WARDEN_SERVER_LISTEN", "localhost")],
            "server.listen",
            "address",
        ),
        (
            "bad bool",
            None,
            vec![("ETCD_WARDEN_STORE_PATH_STYLE", "maybe")],
            "store.path_style",
            "true or false",
        ),
        (
            "bad number",
            None,
            vec![("ETCD_WARDEN_SNAPSHOT_MAX_BACKUPS", "-1")],
            "snapshot.max_backups",
            "whole number",
        ),
        (
            "bad size",
            None,
            vec![("ETCD_WARDEN_SNAPSHOT_DELTA_MEMORY_LIMIT", "10 parsecs")],
            "snapshot.delta_memory_limit",
            "unit",
        ),
        (
            "bad compression",
            None,
            vec![("ETCD_WARDEN_SNAPSHOT_COMPRESSION", "brotli")],
            "snapshot.compression",
            "gzip",
        ),
        (
            "compression level out of range",
            None,
            vec![("ETCD_WARDEN_SNAPSHOT_COMPRESSION_LEVEL", "12")],
            "snapshot.compression_level",
            "1 (fastest, the default) to 9",
        ),
        (
            "mark compacted without a bump",
            Some("[restore]\nmark_compacted = true\n"),
            vec![],
            "restore.mark_compacted",
            "needs restore.bump_revision",
        ),
        (
            "bad policy",
            None,
            vec![("ETCD_WARDEN_SNAPSHOT_GC_POLICY", "Forever")],
            "snapshot.gc_policy",
            "LimitBased",
        ),
        (
            "bad nameserver",
            None,
            vec![
                ("ETCD_WARDEN_OWNER_NAME", "o"),
                ("ETCD_WARDEN_OWNER_ID", "i"),
                ("ETCD_WARDEN_OWNER_NAMESERVERS", "dns.example"),
            ],
            "owner.nameservers",
            "IP address",
        ),
        (
            "empty server token in the file",
            Some("[server]\ntoken = \"\"\n"),
            vec![],
            "server.token",
            "is empty",
        ),
        (
            "empty server token from the environment",
            None,
            vec![("ETCD_WARDEN_SERVER_TOKEN", "")],
            "server.token",
            "is empty",
        ),
        (
            "long process name",
            None,
            vec![("ETCD_WARDEN_KILL_PROCESS_NAME", "a-very-long-process-name")],
            "kill.process_name",
            "15 bytes",
        ),
        (
            "unknown env var",
            None,
            vec![("ETCD_WARDEN_FOO_BAR", "1")],
            "ETCD_WARDEN_FOO_BAR",
            "unknown environment variable",
        ),
        (
            "unknown env key",
            None,
            vec![("ETCD_WARDEN_KILL_GRACEFUL", "1s")],
            "kill.graceful",
            "unknown key",
        ),
        (
            "half a client cert",
            None,
            vec![("ETCD_WARDEN_ETCD_CERT_FILE", "/etc/hostname")],
            "etcd.key_file",
            "other half",
        ),
        (
            "missing CA file",
            None,
            vec![("ETCD_WARDEN_ETCD_CA_FILE", "/nonexistent/ca.crt")],
            "etcd.ca_file",
            "does not exist",
        ),
        (
            "bad log format",
            None,
            vec![("ETCD_WARDEN_LOG_FORMAT", "xml")],
            "log.format",
            "json",
        ),
        (
            "not TOML",
            Some("[snapshot\n"),
            vec![],
            "config.toml",
            "not valid TOML",
        ),
        (
            "retention past chrono's range",
            None,
            vec![("ETCD_WARDEN_SNAPSHOT_DELTA_RETENTION", "1000000y")],
            "snapshot.delta_retention",
            "maximum of 100 years",
        ),
        (
            "max age past the bound",
            None,
            vec![("ETCD_WARDEN_COPY_MAX_AGE", "101y")],
            "copy.max_age",
            "maximum of 100 years",
        ),
        (
            "grace past the bound",
            Some("[kill]\ngrace = \"36526d\"\n"),
            vec![],
            "kill.grace",
            "maximum of 100 years",
        ),
    ];
    // What one subcommand requires (valid for the others).
    let for_subcommands: Vec<(Purpose, Case)> = vec![
        (
            Purpose::Copy,
            (
                "copy without a source store",
                None,
                vec![("ETCD_WARDEN_STORE_URL", "s3://new/p")],
                "source_store.url",
                "required for copy",
            ),
        ),
        (
            Purpose::Restore,
            (
                "restore without a data dir",
                None,
                vec![("ETCD_WARDEN_RESTORE_DATA_DIR", "")],
                "restore.data_dir",
                "required value missing",
            ),
        ),
        (
            Purpose::Serve,
            (
                "serve on every address without a token",
                None,
                vec![("ETCD_WARDEN_SERVER_LISTEN", "0.0.0.0:8080")],
                "server.token",
                "server.listen (from ETCD_WARDEN_SERVER_LISTEN) = \"0.0.0.0:8080\"",
            ),
        ),
        (
            Purpose::Serve,
            (
                "serve on every IPv6 address without a token",
                Some("[server]\nlisten = \"[::]:8080\"\n"),
                vec![],
                "server.token",
                "set server.token or server.token_file",
            ),
        ),
        (
            Purpose::Serve,
            (
                "serve on a pod IP without a token",
                None,
                vec![("ETCD_WARDEN_SERVER_LISTEN", "10.1.2.3:8080")],
                "server.token",
                "not a loopback address",
            ),
        ),
    ];
    let cases = cases
        .into_iter()
        .map(|c| (Purpose::Any, c))
        .chain(for_subcommands);
    for (purpose, (what, file, e, key, needle)) in cases {
        let path = file.map(|t| write(&dir, t));
        let err = load_for(purpose, path.as_deref(), &e, &[]).expect_err(what);
        assert!(
            err.key.ends_with(key),
            "{what}: key {:?}, want {key:?} ({err})",
            err.key
        );
        assert!(err.to_string().contains(needle), "{what}: {err}");
        assert_eq!(
            err.to_string().lines().count(),
            1,
            "{what}: one line: {err}"
        );
        // A value that came from the environment is traced back to its variable.
        if let Some((var, _)) = e.iter().find(|(v, _)| *v == env_var_for(&err.key)) {
            assert_eq!(err.origin, format!(" (from {var})"), "{what}: {err}");
        }
        if purpose != Purpose::Any {
            load(path.as_deref(), &e, &[])
                .unwrap_or_else(|e| panic!("{what}: only {purpose:?} requires it: {e}"));
        }
    }
}

/// Runs `serve` (`cmd`), which must exit within 20 s (killed and `failure` panicked with
/// otherwise); its exit status and standard error.
fn serve_refused(cmd: &mut Command, failure: &str) -> (std::process::ExitStatus, String) {
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{failure}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    (status, stderr)
}

fn warden() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_etcd-warden"));
    // The child must not see a developer's own settings.
    for (k, _) in std::env::vars() {
        if k.starts_with("ETCD_WARDEN_") || k.starts_with("AWS_") || k == "RUST_LOG" {
            c.env_remove(k);
        }
    }
    c
}

#[test]
fn config_command_prints_effective_config_with_secrets_redacted() {
    let out = support::cli::succeeds(
        warden()
            .args(["config", "--config"])
            .arg(example())
            .env("ETCD_WARDEN_STORE_SECRET_ACCESS_KEY", "do-not-print-me")
            .env("ETCD_WARDEN_STORE_ACCESS_KEY_ID", "AKIDEXAMPLE"),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains("do-not-print-me") && !stdout.contains("AKIDEXAMPLE"),
        "{stdout}"
    );
    assert!(stdout.contains("<redacted>"));
    assert!(stdout.contains("id = \"seed-a\""), "{stdout}");
    // What it prints loads again to the same thing.
    let dir = tempfile::tempdir().unwrap();
    let again = write(&dir, &stdout.replace("\"<redacted>\"", "\"x\""));
    load(Some(&again), &[], &[]).expect("printed configuration loads");
}

#[test]
fn config_command_exits_64_naming_a_misspelt_key() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(example())
        .unwrap()
        .replace("delta_period =", "delta_perod =");
    let file = write(&dir, &text);
    let out = warden()
        .args(["config", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("snapshot.delta_perod"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(out.stdout.is_empty());

    let out = warden()
        .arg("config")
        .env("ETCD_WARDEN_KILL_GRACE", "soon")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("kill.grace (from ETCD_WARDEN_KILL_GRACE)")
    );
}

#[test]
fn a_subcommand_missing_what_it_requires_exits_64_before_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("file://{}", dir.path().join("store").display());
    for (args, key) in [
        (vec!["restore", "--store", &store], "restore.data_dir"),
        (vec!["copy", "--dest-store", &store], "source_store.url"),
    ] {
        let out = warden().args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with(&format!("etcd-warden: invalid configuration: {key}")),
            "{args:?}: {stderr}"
        );
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    }
    assert!(
        !dir.path().join("store").exists(),
        "nothing ran: the store was not even created"
    );
}

#[test]
fn serve_needs_a_token_only_beyond_loopback() {
    let c = load_for(Purpose::Serve, None, &[], &[]).expect("embedded defaults serve");
    assert_eq!(c.server.listen, "127.0.0.1:8080".parse().unwrap());
    assert!(c.server.loopback_only() && c.server.token.is_none());
    for listen in [
        "127.0.0.1:0",
        "127.1.2.3:8080",
        "[::1]:8080",
        "[::ffff:127.0.0.1]:8080",
    ] {
        let c = load_for(
            Purpose::Serve,
            None,
            &[("ETCD_WARDEN_SERVER_LISTEN", listen)],
            &[],
        )
        .unwrap_or_else(|e| panic!("{listen}: {e}"));
        assert!(c.server.loopback_only(), "{listen}");
    }

    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "t\n").unwrap();
    let everywhere = ("ETCD_WARDEN_SERVER_LISTEN", "0.0.0.0:8080");
    for token in [
        ("ETCD_WARDEN_SERVER_TOKEN", "t"),
        (
            "ETCD_WARDEN_SERVER_TOKEN_FILE",
            token_file.to_str().unwrap(),
        ),
    ] {
        let c = load_for(Purpose::Serve, None, &[everywhere, token], &[])
            .unwrap_or_else(|e| panic!("{token:?}: {e}"));
        assert!(!c.server.loopback_only() && c.server.token.is_some());
    }
    // The subcommands that never bind the server do not need it.
    for purpose in [Purpose::Any, Purpose::Copy, Purpose::Restore] {
        let e = [
            everywhere,
            ("ETCD_WARDEN_SOURCE_STORE_URL", "s3://old/p"),
            ("ETCD_WARDEN_RESTORE_DATA_DIR", "/var/lib/etcd/data"),
        ];
        load_for(purpose, None, &e, &[]).unwrap_or_else(|e| panic!("{purpose:?}: {e}"));
    }
}

#[test]
fn serve_beyond_loopback_without_a_token_exits_64_and_config_still_prints() {
    let (status, stderr) = serve_refused(
        warden()
            .arg("serve")
            .env("ETCD_WARDEN_SERVER_LISTEN", "0.0.0.0:0"),
        "serve started without a token on 0.0.0.0",
    );
    assert_eq!(status.code(), Some(64), "{stderr}");
    assert!(
        stderr.starts_with(
            "etcd-warden: invalid configuration: server.token: required when \
             server.listen (from ETCD_WARDEN_SERVER_LISTEN) = \"0.0.0.0:0\""
        ),
        "{stderr}"
    );
    assert!(stderr.contains("server.token_file"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");

    support::cli::succeeds(
        warden()
            .arg("config")
            .env("ETCD_WARDEN_SERVER_LISTEN", "0.0.0.0:0"),
    );
}

/// An empty bearer token matches no request yet passed for "a token is set", even beyond
/// loopback: `serve` refuses it at start, naming the key.
#[test]
fn an_empty_server_token_exits_64_naming_the_key() {
    let (status, stderr) = serve_refused(
        warden()
            .arg("serve")
            .env("ETCD_WARDEN_SERVER_LISTEN", "0.0.0.0:0")
            .env("ETCD_WARDEN_SERVER_TOKEN", ""),
        "serve started with an empty token",
    );
    assert_eq!(status.code(), Some(64), "{stderr}");
    assert!(
        stderr.starts_with(
            "etcd-warden: invalid configuration: server.token (from ETCD_WARDEN_SERVER_TOKEN): \
             is empty"
        ),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
}

#[test]
fn a_max_age_past_the_bound_exits_64_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let url = |name: &str| format!("file://{}", dir.path().join(name).display());
    let out = warden()
        .args([
            "copy",
            "--source-store",
            &url("src"),
            "--dest-store",
            &url("dst"),
        ])
        .args(["--max-age", "1000000y"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("copy.max_age (from --max-age): \"1000000y\" is longer than the maximum"),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
}

#[test]
fn help_and_version_work() {
    let out = warden().arg("--version").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("etcd-warden "));
    let out = warden().arg("--help").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("config"));
}

/// `[encryption]`: keys parsed and key files read at load, each error naming its key; the
/// section's absence encrypts nothing.
#[test]
fn encryption_keys_are_checked_at_load_naming_the_key_at_fault() {
    let dir = tempfile::tempdir().unwrap();
    let plain = load(None, &[], &[]).unwrap();
    assert!(!plain.encryption.encrypts() && plain.encryption.identities.is_empty());

    let id = age::x25519::Identity::generate();
    let public = id.to_public().to_string();
    let recipients = dir.path().join("recipients.txt");
    std::fs::write(&recipients, format!("# team\n{public}\n")).unwrap();
    let c = load(
        None,
        &[
            (
                "ETCD_WARDEN_ENCRYPTION_RECIPIENTS",
                &format!("{public}, {public}"),
            ),
            (
                "ETCD_WARDEN_ENCRYPTION_RECIPIENTS_FILES",
                recipients.to_str().unwrap(),
            ),
        ],
        &[],
    )
    .unwrap();
    assert!(c.encryption.encrypts());
    assert_eq!(c.encryption.load_recipients().unwrap().len(), 3);

    let e = env_error(&[(
        "ETCD_WARDEN_ENCRYPTION_RECIPIENTS",
        &format!("{public},age1typo"),
    )]);
    assert_eq!(e.key, "encryption.recipients[1]");
    assert!(
        e.origin.contains("ETCD_WARDEN_ENCRYPTION_RECIPIENTS"),
        "{e}"
    );
    assert!(e.message.contains("age1typo"), "{e}");

    let e = env_error(&[("ETCD_WARDEN_ENCRYPTION_IDENTITIES", "/nonexistent/key.txt")]);
    assert_eq!(e.key, "encryption.identities[0]");

    // A public key where the private key belongs: named by file and line, never echoed.
    let wrong = dir.path().join("identity.txt");
    std::fs::write(&wrong, format!("{public}\n")).unwrap();
    let e = env_error(&[("ETCD_WARDEN_ENCRYPTION_IDENTITIES", wrong.to_str().unwrap())]);
    assert_eq!(e.key, "encryption.identities");
    assert!(
        e.message.contains("identity.txt:1") && e.message.contains("private key"),
        "{e}"
    );

    let file = dir.path().join("c.toml");
    std::fs::write(&file, "[encryption]\n").unwrap();
    let e = load(Some(&file), &[], &[]).unwrap_err();
    assert_eq!(e.key, "encryption");
    assert!(e.message.contains("empty"), "{e}");
    std::fs::write(&file, "[encryption]\nrecipient = \"x\"\n").unwrap();
    let e = load(Some(&file), &[], &[]).unwrap_err();
    assert_eq!(e.key, "encryption.recipient");
}

/// A private key pasted where a public key or a key file's path belongs is refused without
/// being repeated, in the error and in `etcd-warden config`'s printout.
#[test]
fn a_private_key_pasted_into_the_encryption_keys_is_never_echoed() {
    let id = age::x25519::Identity::generate();
    let secret = age::secrecy::ExposeSecret::expose_secret(&id.to_string()).to_string();
    let tail = &secret[20..40];
    for var in [
        "ETCD_WARDEN_ENCRYPTION_RECIPIENTS",
        "ETCD_WARDEN_ENCRYPTION_IDENTITIES",
        "ETCD_WARDEN_ENCRYPTION_RECIPIENTS_FILES",
    ] {
        // Lower case too: Bech32 is case-insensitive, and so is the check.
        for pasted in [secret.clone(), secret.to_lowercase()] {
            let e = env_error(&[(var, &pasted)]);
            let shown = format!("{e} {e:?}");
            assert!(
                !shown.to_uppercase().contains(&tail.to_uppercase()),
                "{var}: {shown}"
            );
            assert!(shown.contains("not shown"), "{var}: {shown}");
        }
    }
    // `config` prints the layered configuration; a pasted key is redacted there as well
    // (an identity file path is kept, so this one is valid to load only as far as printing).
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.toml");
    std::fs::write(
        &file,
        format!("[encryption]\nrecipients = [{:?}]\n", secret),
    )
    .unwrap();
    let out = warden()
        .args(["--config", file.to_str().unwrap(), "config"])
        .output()
        .unwrap();
    let all = support::cli::printed(&out);
    assert!(!all.contains(tail), "{all}");
}

/// `restore.max_delta_size` follows `snapshot.delta_memory_limit` unless set; both read bounds
/// are refused when they could hold nothing, naming the key.
#[test]
fn read_limits_default_from_the_delta_memory_limit_and_are_validated() {
    use etcd_warden::config::ReadLimits;
    let c = load(None, &[], &[]).unwrap();
    assert_eq!(c.restore.read_limits, ReadLimits::default());
    assert_eq!(c.restore.read_limits.max_delta_size, (4 * 100 + 64) << 20);
    assert_eq!(c.restore.read_limits.max_inflation_ratio, 250);
    let c = load(
        None,
        &[("ETCD_WARDEN_SNAPSHOT_DELTA_MEMORY_LIMIT", "1GiB")],
        &[],
    )
    .unwrap();
    assert_eq!(c.restore.read_limits.max_delta_size, (4 << 30) + (64 << 20));
    let c = load(
        None,
        &[
            ("ETCD_WARDEN_RESTORE_MAX_DELTA_SIZE", "3MiB"),
            ("ETCD_WARDEN_RESTORE_MAX_INFLATION_RATIO", "40"),
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        (
            c.restore.read_limits.max_delta_size,
            c.restore.read_limits.max_inflation_ratio
        ),
        (3 << 20, 40)
    );
    for (var, key) in [
        (
            "ETCD_WARDEN_RESTORE_MAX_DELTA_SIZE",
            "restore.max_delta_size",
        ),
        (
            "ETCD_WARDEN_RESTORE_MAX_INFLATION_RATIO",
            "restore.max_inflation_ratio",
        ),
    ] {
        let e = env_error(&[(var, "0")]);
        assert_eq!(e.key, key, "{e}");
    }
}

/// `quorum-restore`'s `--lost-for` and `--probe-interval` are `[quorum_restore]` keys too:
/// defaults, file, environment and flags in that order, and a bad value names its key.
#[test]
fn quorum_restore_timings_are_keys_with_defaults_and_layers() {
    let c = load(None, &[], &[]).unwrap();
    assert_eq!(c.quorum_restore.lost_for, Duration::from_secs(300));
    assert_eq!(c.quorum_restore.probe_interval, Duration::from_secs(5));
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "[quorum_restore]\nlost_for = \"10m\"\nprobe_interval = \"2s\"\n",
    );
    let c = load(
        Some(&file),
        &[("ETCD_WARDEN_QUORUM_RESTORE_PROBE_INTERVAL", "1s")],
        &[("quorum_restore.lost_for", "0s")],
    )
    .unwrap();
    assert_eq!(c.quorum_restore.lost_for, Duration::ZERO);
    assert_eq!(c.quorum_restore.probe_interval, Duration::from_secs(1));
    let e = env_error(&[("ETCD_WARDEN_QUORUM_RESTORE_PROBE_INTERVAL", "0s")]).to_string();
    assert!(e.contains("quorum_restore.probe_interval"), "{e}");
    let e = env_error(&[("ETCD_WARDEN_QUORUM_RESTORE_LOST_FOR", "soon")]).to_string();
    assert!(e.contains("quorum_restore.lost_for"), "{e}");
}

#[test]
fn quorum_restore_lost_for_from_a_flag_is_checked_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = warden()
        .args(["quorum-restore", "--data-dir"])
        .arg(dir.path().join("data"))
        .args(["--lost-for", "soon"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("quorum_restore.lost_for (from --lost-for)"),
        "{stderr}"
    );
}

/// `restore.peer_*`: the rejoining member's peer certificate, both halves or neither, a CA with
/// client certificates required (the default), and required with `https://` peer URLs only.
#[test]
fn the_peer_certificate_of_a_rejoin_is_complete_or_refused_naming_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = |n: &str| {
        let p = dir.path().join(n);
        std::fs::write(&p, "pem").unwrap();
        p.display().to_string()
    };
    let (cert, key, ca) = (file("peer.crt"), file("peer.key"), file("ca.crt"));
    let https = [
        (
            "ETCD_WARDEN_RESTORE_CLUSTER_ENDPOINTS",
            "https://10.0.0.1:2379",
        ),
        (
            "ETCD_WARDEN_RESTORE_INITIAL_ADVERTISE_PEER_URLS",
            "https://10.0.0.3:2380",
        ),
    ];
    let with = |extra: &[(&'static str, &str)]| {
        let mut e: Vec<(&str, &str)> = https.to_vec();
        e.extend(extra.iter().map(|(k, v)| (*k, *v)));
        load(None, &e, &[])
    };
    let refused = |extra: &[(&'static str, &str)], key: &str, words: &str| {
        let e = with(extra).unwrap_err();
        assert_eq!(e.key, key, "{e}");
        assert!(e.to_string().contains(words), "{e}");
    };
    refused(&[], "restore.peer_cert_file", "https://10.0.0.3:2380");
    refused(
        &[("ETCD_WARDEN_RESTORE_PEER_CERT_FILE", &cert)],
        "restore.peer_key_file",
        "required",
    );
    refused(
        &[("ETCD_WARDEN_RESTORE_PEER_KEY_FILE", &key)],
        "restore.peer_cert_file",
        "required",
    );
    refused(
        &[("ETCD_WARDEN_RESTORE_PEER_CA_FILE", &ca)],
        "restore.peer_cert_file",
        "required",
    );
    let pair = [
        ("ETCD_WARDEN_RESTORE_PEER_CERT_FILE", cert.as_str()),
        ("ETCD_WARDEN_RESTORE_PEER_KEY_FILE", key.as_str()),
    ];
    refused(&pair, "restore.peer_ca_file", "peer_client_cert_auth");
    refused(
        &[
            (
                "ETCD_WARDEN_RESTORE_PEER_CERT_FILE",
                "/nonexistent/peer.crt",
            ),
            ("ETCD_WARDEN_RESTORE_PEER_KEY_FILE", &key),
        ],
        "restore.peer_cert_file",
        "does not exist",
    );
    let mut all = pair.to_vec();
    all.push(("ETCD_WARDEN_RESTORE_PEER_CA_FILE", &ca));
    let tls = with(&all).unwrap().restore.peer_tls.unwrap();
    assert_eq!(tls.cert_file, Path::new(&cert));
    assert_eq!(tls.key_file, Path::new(&key));
    assert_eq!(tls.ca_file.as_deref(), Some(Path::new(&ca)));
    assert!(
        tls.client_cert_auth,
        "client certificates required by default"
    );
    // Without client certificates from the other members, no CA is needed.
    let mut open = pair.to_vec();
    open.push(("ETCD_WARDEN_RESTORE_PEER_CLIENT_CERT_AUTH", "false"));
    let tls = with(&open).unwrap().restore.peer_tls.unwrap();
    assert!(!tls.client_cert_auth && tls.ca_file.is_none());
    // Plain peers need none, and none is the default.
    assert_eq!(load(None, &[], &[]).unwrap().restore.peer_tls, None);
}

/// `[kubernetes]` (issue 57): off unless present; present, its required keys and the owner's
/// form are checked by name, and the environment sets it as any other section.
#[test]
fn the_kubernetes_section_names_what_is_missing_or_malformed() {
    assert!(load(None, &[], &[]).unwrap().kubernetes.is_none());
    let env = [
        ("ETCD_WARDEN_KUBERNETES_NAMESPACE", "etcd"),
        ("ETCD_WARDEN_KUBERNETES_OWNER", "etcd-main"),
        ("ETCD_WARDEN_KUBERNETES_POD", "etcd-main-0"),
        ("ETCD_WARDEN_KUBERNETES_INVENTORY_INTERVAL", "5s"),
    ];
    let k = load(None, &env, &[])
        .unwrap()
        .kubernetes
        .expect("the section");
    assert_eq!(
        (k.namespace.as_str(), k.owner.as_str(), k.pod.as_str()),
        ("etcd", "etcd-main", "etcd-main-0")
    );
    assert_eq!(k.inventory_interval, Duration::from_secs(5));
    assert_eq!(k.request_timeout, Duration::from_secs(10));
    assert!(k.inventory && k.events && k.pod_uid.is_none() && k.kubeconfig.is_none());
    let e = load(None, &env[..2], &[]).unwrap_err().to_string();
    assert!(
        e.contains("kubernetes.pod") && e.contains("required"),
        "{e}"
    );
    let bad = [
        env[0],
        ("ETCD_WARDEN_KUBERNETES_OWNER", "Etcd_Main"),
        env[2],
    ];
    let e = load(None, &bad, &[]).unwrap_err().to_string();
    assert!(
        e.contains("kubernetes.owner") && e.contains("Etcd_Main"),
        "{e}"
    );
    let zero = [
        env[0],
        env[1],
        env[2],
        ("ETCD_WARDEN_KUBERNETES_INVENTORY_INTERVAL", "0s"),
    ];
    let e = load(None, &zero, &[]).unwrap_err().to_string();
    assert!(e.contains("kubernetes.inventory_interval"), "{e}");
}
