//! The alert rules of deploy/monitoring/prometheusrule.yaml under Prometheus' own tools: the
//! `PrometheusRule`'s spec is written out as a plain rules file, `promtool check rules` accepts
//! it, and `promtool test rules` passes the unit tests in tests/promtool/, whose input series
//! make every alert fire (each of its severities) and, elsewhere, must not. Every `runbook_url`
//! names a runbook heading of docs/operations.md.
//!
//! promtool comes with Debian's `prometheus` package (scripts/setup installs it); like every
//! server these tests need, a missing one fails the test saying what to install.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn promtool() -> PathBuf {
    let candidates: Vec<PathBuf> = support::on_path("promtool")
        .into_iter()
        .chain([PathBuf::from("/usr/bin/promtool")])
        .collect();
    support::require_bin(
        "promtool",
        &candidates,
        "apt-get install --no-install-recommends prometheus (or run scripts/setup)",
    )
}

/// The `PrometheusRule`'s `spec`: Prometheus' rule file format (`groups: …`).
fn rule_file() -> serde_yaml::Value {
    let path = repo().join("deploy/monitoring/prometheusrule.yaml");
    let rule: serde_yaml::Value =
        serde_yaml::from_str(&read(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    rule["spec"].clone()
}

/// The unit test files, tests/promtool/*.test.yaml, sorted.
fn unit_tests() -> Vec<PathBuf> {
    let dir = repo().join("tests/promtool");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.to_string_lossy().ends_with(".test.yaml"))
        .collect();
    files.sort();
    files
}

fn run(dir: &Path, args: &[&str]) {
    let out = Command::new(promtool())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "promtool {}: {}\n{}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn promtool_accepts_the_rules_and_passes_their_unit_tests() {
    let dir = tempfile::tempdir().expect("temp dir");
    let rules = serde_yaml::to_string(&rule_file()).expect("YAML");
    std::fs::write(dir.path().join("rules.yaml"), rules).expect("write rules.yaml");
    let mut names = Vec::new();
    for test in unit_tests() {
        let name = test
            .file_name()
            .expect("file name")
            .to_string_lossy()
            .into_owned();
        std::fs::copy(&test, dir.path().join(&name)).expect("copy the unit test");
        names.push(name);
    }
    assert!(!names.is_empty(), "no tests/promtool/*.test.yaml");
    run(dir.path(), &["check", "rules", "rules.yaml"]);
    let mut args = vec!["test", "rules"];
    args.extend(names.iter().map(String::as_str));
    run(dir.path(), &args);
}

/// What the unit tests leave untested: an alert (at one of its severities) that no test
/// expects to fire, or an alert no test expects to stay quiet.
fn untested(rules: &serde_yaml::Value, tests: &[serde_yaml::Value]) -> Vec<String> {
    // Alert name → severities expected to fire; names expected quiet at some time.
    let mut fired: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut quiet = BTreeSet::new();
    let cases = tests
        .iter()
        .flat_map(|t| t["tests"].as_sequence().into_iter().flatten())
        .flat_map(|t| t["alert_rule_test"].as_sequence().into_iter().flatten());
    for case in cases {
        let name = case["alertname"].as_str().unwrap_or_default().to_string();
        let expected = case["exp_alerts"]
            .as_sequence()
            .cloned()
            .unwrap_or_default();
        if expected.is_empty() {
            quiet.insert(name.clone());
        }
        for alert in expected {
            let severity = alert["exp_labels"]["severity"].as_str().unwrap_or_default();
            fired
                .entry(name.clone())
                .or_default()
                .insert(severity.to_string());
        }
    }
    let mut out = Vec::new();
    let alerts = rules["groups"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_sequence().into_iter().flatten())
        .filter_map(|r| Some((r["alert"].as_str()?, r["labels"]["severity"].as_str()?)));
    for (name, severity) in alerts {
        if !fired.get(name).is_some_and(|s| s.contains(severity)) {
            out.push(format!(
                "{name} (severity {severity}) never expected to fire"
            ));
        }
        let never_quiet = format!("{name} never expected to stay quiet");
        // Once per name, however many severities it has.
        if !quiet.contains(name) && !out.contains(&never_quiet) {
            out.push(never_quiet);
        }
    }
    out
}

fn parsed_unit_tests() -> Vec<serde_yaml::Value> {
    unit_tests()
        .iter()
        .map(|p| serde_yaml::from_str(&read(p)).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

#[test]
fn every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not() {
    let rules = rule_file();
    let problems = untested(&rules, &parsed_unit_tests());
    assert!(problems.is_empty(), "tests/promtool/: {problems:#?}");

    // The check bites: a rule no test mentions, and a severity no test fires.
    let mut more = rules.clone();
    let extra: serde_yaml::Value = serde_yaml::from_str(
        "{alert: EtcdUntested, expr: etcd_server_has_leader > 1, labels: {severity: info}}",
    )
    .expect("YAML");
    let mut higher = more["groups"][1]["rules"][0].clone();
    higher["labels"]["severity"] = "page".into();
    let group = more["groups"][1]["rules"]
        .as_sequence_mut()
        .expect("the etcd group's rules");
    group.push(extra);
    group.push(higher);
    let problems = untested(&more, &parsed_unit_tests());
    assert_eq!(
        problems,
        [
            "EtcdUntested (severity info) never expected to fire",
            "EtcdUntested never expected to stay quiet",
            "EtcdNoLeader (severity page) never expected to fire",
        ],
    );
}

/// GitHub's anchor for a heading: lower case, spaces to dashes, punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn every_runbook_url_names_a_runbook_in_the_operations_guide() {
    let doc = read(&repo().join("docs/operations.md"));
    let anchors: BTreeSet<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .map(anchor)
        .collect();
    let rules = rule_file();
    let etcd_group = rules["groups"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|g| g["name"] == "etcd")
        .expect("the etcd group");
    for rule in etcd_group["rules"].as_sequence().into_iter().flatten() {
        let alert = rule["alert"].as_str().expect("an alert");
        let url = rule["annotations"]["runbook_url"]
            .as_str()
            .unwrap_or_else(|| panic!("{alert}: no runbook_url"));
        let (page, fragment) = url
            .split_once('#')
            .unwrap_or_else(|| panic!("{alert}: {url} has no anchor"));
        assert_eq!(page, "docs/operations.md", "{alert}: {url}");
        assert_eq!(
            fragment,
            anchor(alert),
            "{alert}: its runbook is the heading named after it"
        );
        assert!(
            anchors.contains(fragment),
            "{alert}: docs/operations.md has no heading ### {alert}"
        );
    }
    assert_eq!(
        anchor("What each state means (for on-call)"),
        "what-each-state-means-for-on-call"
    );
}
