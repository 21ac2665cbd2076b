//! Planted defects: the seam through which the robustness harness switches on a known defect at
//! run time, to show that the checker meant to catch it fires (docs/robustness.md, "Planted
//! defects"). `WARDEN_PLANT` names the defects, comma-separated; each is a few lines at the
//! defect's own place, behind `if plant::active("…")`.
//!
//! Only debug builds hold it (`cfg(debug_assertions)`: `cargo build`, `cargo test`). In a release
//! build [`active`] is a `const fn` answering false, so every planted branch is dead code the
//! compiler drops, and neither the variable's name nor any plant's name is in the binary
//! (`tests/plant.rs` checks `target/release/etcd-warden`). A name the seam does not know is
//! refused when a binary starts ([`check`]; exit 64), so a typo never reads as "the checker
//! missed the plant".

#[cfg(debug_assertions)]
mod planted {
    use std::sync::OnceLock;

    /// The variable that names the plants.
    pub const ENV: &str = "WARDEN_PLANT";

    /// Every plant, with the defect it plants (the harness's table says which checker must
    /// catch each).
    pub const PLANTS: &[(&str, &str)] = &[
        (
            "never-final",
            "the hand-off's taker never takes its final snapshot",
        ),
        (
            "delta-first-event-only",
            "the delta writer keeps only the first event of each revision",
        ),
        (
            "fresh-final-name",
            "each attempt at the final stores it under a fresh name (the first attempt's answer \
             reads as lost, and only the intent's name is looked for in the store)",
        ),
        ("ready-late", "readiness is cleared one second late"),
        (
            "latest-reclaimed-final",
            "/snapshot/latest reads the latest full snapshot's `.final` name as final, reclaimed \
             or not",
        ),
        ("delta-leak", "1 KiB leaked for every event a delta buffers"),
        (
            "remove-voter-first",
            "the operator removes the replaced voter before its learner is promoted",
        ),
        (
            "defrag-leader",
            "defragmentation defragments the leader without moving leadership first",
        ),
        (
            "drill-no-compare",
            "the restore drill compares etcd's answers with themselves, not with the chain",
        ),
        (
            "drop-delete-in-restore",
            "restore (written into the database) skips delete events",
        ),
        (
            "restore-alters-values",
            "restore (written into the database) appends a byte to every value a delta puts",
        ),
        (
            "ack-after-kill",
            "the sidecar reports etcd killed at deactivation and leaves it serving",
        ),
    ];

    /// A `WARDEN_PLANT` value naming a plant the seam does not know.
    #[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
    #[error("{ENV}={value:?}: unknown plant {unknown:?} (known: {})", known())]
    pub struct UnknownPlant {
        pub value: String,
        pub unknown: String,
    }

    fn known() -> String {
        PLANTS
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The plants a `WARDEN_PLANT` value names (empty names, from stray commas or spaces, are
    /// skipped); the first unknown name is an error.
    pub fn parse(value: &str) -> Result<Vec<&'static str>, UnknownPlant> {
        let mut out = Vec::new();
        for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match PLANTS.iter().find(|(n, _)| *n == name) {
                Some((n, _)) => out.push(*n),
                None => {
                    return Err(UnknownPlant {
                        value: value.to_string(),
                        unknown: name.to_string(),
                    });
                }
            }
        }
        Ok(out)
    }

    /// `WARDEN_PLANT`, read once per process.
    fn from_env() -> &'static Result<Vec<&'static str>, UnknownPlant> {
        static ACTIVE: OnceLock<Result<Vec<&'static str>, UnknownPlant>> = OnceLock::new();
        ACTIVE.get_or_init(|| parse(&std::env::var(ENV).unwrap_or_default()))
    }

    /// Whether the plant `name` is switched on. `name` must be one of [`PLANTS`] (a name in the
    /// code that is not is a bug of the plant, caught by the first test that reaches it).
    pub fn active(name: &str) -> bool {
        assert!(
            PLANTS.iter().any(|(n, _)| *n == name),
            "plant {name:?} is not in plant::PLANTS"
        );
        from_env().as_ref().is_ok_and(|v| v.contains(&name))
    }

    /// Refuses a `WARDEN_PLANT` that names an unknown plant. Silent otherwise: a Job's output
    /// (`ls --json`) must read as it does without plants.
    pub fn check() -> Result<(), UnknownPlant> {
        from_env().as_ref().map(|_| ()).map_err(Clone::clone)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_value_names_known_plants_and_an_unknown_one_is_refused_by_name() {
            assert_eq!(parse(""), Ok(vec![]));
            assert_eq!(
                parse(" never-final,,ready-late "),
                Ok(vec!["never-final", "ready-late"])
            );
            let e = parse("never-final,never_final").unwrap_err();
            assert_eq!(e.unknown, "never_final");
            let shown = e.to_string();
            assert!(
                shown.contains("WARDEN_PLANT=\"never-final,never_final\"")
                    && shown.contains("known: never-final, delta-first-event-only"),
                "{shown}"
            );
        }

        #[test]
        fn every_plant_has_a_distinct_name() {
            let mut names: Vec<&str> = PLANTS.iter().map(|(n, _)| *n).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), PLANTS.len());
            assert!(PLANTS.len() >= 10);
        }
    }
}

#[cfg(debug_assertions)]
pub use planted::{ENV, PLANTS, UnknownPlant, active, check, parse};

/// Whether this build holds the plants (debug builds only).
pub const COMPILED: bool = cfg!(debug_assertions);

/// A release build holds no plant: every planted branch is dead.
#[cfg(not(debug_assertions))]
pub const fn active(_name: &str) -> bool {
    false
}

/// A release build holds no plant, so there is nothing to refuse.
#[cfg(not(debug_assertions))]
pub fn check() -> Result<(), std::convert::Infallible> {
    Ok(())
}
