//! One-shot runs of the binaries: the output of a command that must succeed, and JSON logs.

use std::process::{Command, Output};

use serde_json::Value;

/// Runs `command`, failing the test with what it printed unless it succeeds.
pub fn succeeds(command: &mut Command) -> Output {
    let out = command.output().expect("run the command");
    assert!(
        out.status.success(),
        "{command:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Checks a run exited with `code`; returns its stderr.
pub fn exited(out: &Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    stderr
}

/// A `restore` that fell back past `skipped` (a full snapshot failing verification): it exited 3
/// and named it. Returns its stdout.
pub fn fell_back_past(out: &Output, skipped: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stdout}{stderr}");
    assert!(
        stdout.contains(&format!("skipped full snapshot {skipped}")),
        "{stdout}"
    );
    stdout
}

/// What a run printed: its stdout, then its stderr.
pub fn printed(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The lines of a log that are JSON objects.
pub fn json_lines(log: &str) -> Vec<Value> {
    log.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The span named `name` around a JSON log line, if the line is inside one.
pub fn span<'a>(line: &'a Value, name: &str) -> Option<&'a Value> {
    line["spans"].as_array()?.iter().find(|s| s["name"] == name)
}
