//! `etcd-warden-operator kube`'s configuration: the layers (defaults → file → environment →
//! flags), the example file, and errors that name the key.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_warden::config::{ConfigError, Override, Sources};
use etcd_warden::operator::kube::config::KubeConfig;

/// Every key of the operator's configuration.
const KEYS: &[&str] = &[
    "kubeconfig",
    "namespace",
    "machine_namespace",
    "machine_selector",
    "voters",
    "etcd_endpoints",
    "etcd_ca_file",
    "etcd_cert_file",
    "etcd_key_file",
    "peer_scheme",
    "peer_port",
    "identity",
    "lease",
    "guard_pdb",
    "guard_selector",
    "resync",
    "listen",
    "set_strategy",
];

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("config.operator.example.toml")
}

fn load(
    file: Option<&Path>,
    env: &[(&str, &str)],
    flags: &[(&str, &str)],
) -> Result<KubeConfig, ConfigError> {
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    KubeConfig::load(
        &Sources {
            file,
            env: &env,
            overrides: flags
                .iter()
                .map(|(k, v)| Override::flag(k, *v, &format!("--{}", k.replace('_', "-"))))
                .collect(),
        },
        Some("host-a".into()),
    )
}

/// A file `name` holding `text`, in a new temporary directory (returned too: the file is there
/// as long as it lives).
fn file_with(name: &str, text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(name);
    std::fs::write(&file, text).unwrap();
    (dir, file)
}
#[test]
fn the_example_loads_and_documents_every_key() {
    let c = load(Some(&example()), &[], &[]).unwrap();
    assert_eq!(c.settings.etcd_endpoints.len(), 3);
    assert_eq!(c.settings.spec.desired_voters, 3);
    assert_eq!(c.settings.namespace, "openshift-etcd");
    assert_eq!(
        c.settings.machines.selector,
        etcd_warden::operator::kube::machine_resource::CONTROL_PLANE_SELECTOR
    );
    assert_eq!(c.settings.timing.interval, Duration::from_secs(5));
    assert_eq!(c.listen.to_string(), "0.0.0.0:8080");
    assert_eq!(c.settings.identity, "host-a");
    assert!(c.settings.etcd_tls.is_none());
    let text = std::fs::read_to_string(example()).unwrap();
    for key in KEYS {
        assert!(
            text.contains(&format!("\n{key} =")) || text.contains(&format!("# {key} =")),
            "{key} undocumented"
        );
    }
    // KEYS is every key: a file setting each one loads (an unknown one would be refused).
    let (dir, pem) = file_with("x.pem", "x");
    let pem = pem.display().to_string();
    let all: String = KEYS
        .iter()
        .map(|k| {
            let v = match *k {
                "voters" => "5".to_owned(),
                "peer_port" => "2381".to_owned(),
                "etcd_endpoints" => "[\"https://e:2379\"]".to_owned(),
                "listen" => "\"127.0.0.1:0\"".to_owned(),
                "resync" => "\"1s\"".to_owned(),
                "peer_scheme" => "\"http\"".to_owned(),
                "guard_selector" => "\"a=b\"".to_owned(),
                "set_strategy" => "\"rolling-update\"".to_owned(),
                k if k.ends_with("_file") => format!("{pem:?}"),
                k => format!("\"{k}-value\""),
            };
            format!("{k} = {v}\n")
        })
        .collect();
    let file = dir.path().join("all.toml");
    std::fs::write(&file, all).unwrap();
    let c = load(Some(&file), &[], &[]).unwrap();
    assert_eq!(c.settings.spec.desired_voters, 5);
    assert_eq!(c.settings.identity, "identity-value");
    assert_eq!(c.settings.lease_name, "lease-value");
    assert_eq!(c.settings.guard.name, "guard_pdb-value");
    assert!(c.settings.etcd_tls.is_some());
    assert_eq!(c.kubeconfig.unwrap(), PathBuf::from("kubeconfig-value"));
}

#[test]
fn flags_win_over_the_environment_which_wins_over_the_file() {
    let (_dir, file) = file_with(
        "c.toml",
        "etcd_endpoints = [\"http://f:2379\"]\nresync = \"7s\"\nlease = \"from-file\"\nnamespace = \"ns-file\"\n",
    );
    let c = load(
        Some(&file),
        &[
            ("ETCD_WARDEN_OPERATOR_RESYNC", "8s"),
            ("ETCD_WARDEN_OPERATOR_LEASE", "from-env"),
            ("ETCD_WARDEN_OPERATOR_API", "127.0.0.1:1"),
            ("POD_NAME", "pod-1"),
        ],
        &[("resync", "9s")],
    )
    .unwrap();
    assert_eq!(c.settings.timing.interval, Duration::from_secs(9));
    assert_eq!(c.settings.lease_name, "from-env");
    assert_eq!(c.settings.namespace, "ns-file");
    assert_eq!(c.settings.guard.namespace, "ns-file");
    assert_eq!(c.settings.etcd_endpoints, ["http://f:2379"]);
    assert_eq!(
        c.settings.identity, "pod-1",
        "$POD_NAME before the host name"
    );
    // A list from the environment.
    let c = load(
        None,
        &[(
            "ETCD_WARDEN_OPERATOR_ETCD_ENDPOINTS",
            "http://a:2379, http://b:2379",
        )],
        &[],
    )
    .unwrap();
    assert_eq!(
        c.settings.etcd_endpoints,
        ["http://a:2379", "http://b:2379"]
    );
}

#[test]
fn unknown_keys_and_bad_values_are_refused_naming_the_key() {
    let (_dir, file) = file_with("c.toml", "etcd_endpoints = \"http://e:2379\"\nvoter = 3\n");
    let e = load(Some(&file), &[], &[]).unwrap_err();
    assert_eq!(e.key, "voter", "{e}");
    assert!(e.to_string().contains("unknown key"), "{e}");

    let ok = [("ETCD_WARDEN_OPERATOR_ETCD_ENDPOINTS", "http://e:2379")];
    let e = load(
        None,
        &[ok[0], ("ETCD_WARDEN_OPERATOR_LEASE_NAME", "x")],
        &[],
    )
    .unwrap_err();
    assert_eq!(e.key, "lease_name", "{e}");
    assert!(e.origin.contains("ETCD_WARDEN_OPERATOR_LEASE_NAME"), "{e}");

    let cases: &[(&str, &str, &str)] = &[
        ("voters", "4", "voters"),
        ("voters", "three", "voters"),
        ("peer_port", "70000", "peer_port"),
        ("peer_scheme", "ftp", "peer_scheme"),
        ("resync", "soon", "resync"),
        ("resync", "0s", "resync"),
        ("listen", "localhost", "listen"),
        ("guard_selector", "app", "guard_selector"),
        ("etcd_endpoints", "e:2379", "etcd_endpoints[0]"),
        ("etcd_cert_file", "/nonexistent/cert.pem", "etcd_cert_file"),
        ("namespace", " ", "namespace"),
    ];
    for (key, value, named) in cases {
        let e = load(None, &ok, &[(key, value)]).unwrap_err();
        assert_eq!(&e.key, named, "{key}={value}: {e}");
        assert!(
            e.origin.contains(&format!("--{}", key.replace('_', "-"))),
            "{key}={value}: {e}"
        );
    }
    // A certificate without its key.
    let (_dir, pem) = file_with("c.pem", "x");
    let e = load(None, &ok, &[("etcd_cert_file", pem.to_str().unwrap())]).unwrap_err();
    assert_eq!(e.key, "etcd_key_file", "{e}");
    // No endpoints at all.
    let e = load(None, &[], &[]).unwrap_err();
    assert_eq!(e.key, "etcd_endpoints", "{e}");
}

#[test]
fn the_binary_exits_64_naming_the_key() {
    let (_dir, file) = file_with(
        "c.toml",
        "etcd_endpoints = [\"http://e:2379\"]\nresinc = \"5s\"\n",
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_etcd-warden-operator"))
        .args(["kube", "--config"])
        .arg(&file)
        .env_remove("ETCD_WARDEN_OPERATOR_CONFIG")
        .output()
        .unwrap();
    let stderr = crate::support::cli::exited(&out, 64);
    assert!(
        stderr.contains("resinc") && stderr.contains("unknown key"),
        "{stderr}"
    );
}

/// The `[owner]` section is the sidecar's, validated by the same code; the environment reaches
/// it as `ETCD_WARDEN_OPERATOR_OWNER_<KEY>` while every other key stays top-level.
#[test]
fn the_owner_section_is_the_sidecars_and_the_environment_reaches_it() {
    let (_dir, file) = file_with(
        "operator.toml",
        "etcd_endpoints = [\"https://e:2379\"]\n[owner]\nname = \"owner.example.com\"\n\
         id = \"seed-a\"\nnameservers = [\"127.0.0.1:5353\"]\ninterval = \"2s\"\n",
    );
    let c = load(
        Some(&file),
        &[
            ("ETCD_WARDEN_OPERATOR_OWNER_FAILURE_THRESHOLD", "4"),
            ("ETCD_WARDEN_OPERATOR_RESYNC", "7s"),
        ],
        &[],
    )
    .unwrap();
    let owner = c.settings.owner.expect("an owner guard");
    assert_eq!(owner.timing.interval, Duration::from_secs(2));
    assert_eq!(owner.timing.failure_threshold, 4);
    assert_eq!(c.settings.timing.interval, Duration::from_secs(7));
    // Without the section there is no guard.
    let plain = load(
        None,
        &[("ETCD_WARDEN_OPERATOR_ETCD_ENDPOINTS", "https://e:2379")],
        &[],
    );
    assert!(plain.unwrap().settings.owner.is_none());

    for (env, key) in [
        (("ETCD_WARDEN_OPERATOR_OWNER_ID", " "), "owner.id"),
        (("ETCD_WARDEN_OPERATOR_OWNER_NAME", "a..b"), "owner.name"),
        (
            ("ETCD_WARDEN_OPERATOR_OWNER_NAMESERVERS", "dns.example"),
            "owner.nameservers",
        ),
        (
            ("ETCD_WARDEN_OPERATOR_OWNER_INTERVAL", "0s"),
            "owner.interval",
        ),
        (("ETCD_WARDEN_OPERATOR_OWNER_COLOUR", "red"), "colour"),
    ] {
        let e = load(Some(&file), &[env], &[]).expect_err(key).to_string();
        assert!(e.contains(key), "{key}: {e}");
        assert!(e.contains(env.0) || key == "colour", "{e} names its origin");
    }
}

#[test]
fn set_strategy_orders_the_quorum_operator_for_the_control_plane_set() {
    use etcd_warden::operator::quorum::plan::Replacement;
    let ep = ("ETCD_WARDEN_OPERATOR_ETCD_ENDPOINTS", "https://e:2379");
    let replacement =
        |v: &str| load(None, &[ep], &[("set_strategy", v)]).map(|c| c.settings.spec.replacement);
    assert_eq!(replacement("RollingUpdate").unwrap(), Replacement::Surge);
    assert_eq!(replacement("recreate").unwrap(), Replacement::ShrinkFirst);
    assert_eq!(replacement("on-delete").unwrap(), Replacement::OnDeletion);
    let unset = load(None, &[ep], &[]).unwrap();
    assert_eq!(unset.settings.spec.replacement, Replacement::OnDeletion);
    let e = replacement("Rolling").unwrap_err().to_string();
    assert!(
        e.contains("set_strategy") && e.contains("--set-strategy"),
        "{e}"
    );
}
