//! The planted defects' table (docs/robustness.md, "Planted defects"): for each plant of
//! `etcd_warden::plant`, the checker that must catch it, in one place. The runner
//! (`robustness::plants`) plays a short soak per plant with the plant switched on and stops as
//! soon as one of the plant's checkers fires.

/// One plant and what must catch it.
#[derive(Debug, Clone, Copy)]
pub struct Expect {
    /// The plant's name (`WARDEN_PLANT`).
    pub plant: &'static str,
    /// The violation kinds that catch it: the first is the one issue #53 names, the others are
    /// checkers that catch the same defect another way (on this branch already).
    pub checkers: &'static [&'static str],
    /// `Some(part)`: none of `checkers` is on this branch yet; #53's part `part` builds it in
    /// another branch. The runner plays such a plant when asked and reports it, but an uncaught
    /// pending plant does not fail the run. After the merge: set it to `None` and check that
    /// the runner catches it.
    pub pending: Option<&'static str>,
    /// The plants switched on together (`WARDEN_PLANT`'s value) when the plant does harm only
    /// beside another defect (`None`: the plant alone). A drill that compares nothing passes a
    /// good restore as it should; it is caught passing a bad one (`restore-alters-values`: a
    /// restore that fails its revision check, as `drop-delete-in-restore`'s often does, fails
    /// the drill before any comparison).
    pub with: Option<&'static str>,
    /// The defect is in code the harness runs in its own process (the operator lane): the plant
    /// is switched on there too, not only in the sidecars and Jobs.
    pub in_process: bool,
    /// The soak's length: a plant caught at a hand-off stops at the first one; one caught by an
    /// end-of-run checker needs the whole run.
    pub minutes: f64,
}

impl Expect {
    /// `WARDEN_PLANT`'s value for the plant's run.
    pub fn switched_on(&self) -> &'static str {
        self.with.unwrap_or(self.plant)
    }
}

/// Every plant, in the order the runner plays them.
pub const EXPECT: &[Expect] = &[
    Expect {
        plant: "fresh-final-name",
        checkers: &["two-finals"],
        pending: None,
        with: None,
        in_process: false,
        minutes: 2.0,
    },
    Expect {
        plant: "latest-reclaimed-final",
        checkers: &["readers-disagree", "reclaimed-read-as-final"],
        pending: None,
        with: None,
        in_process: false,
        minutes: 2.5,
    },
    Expect {
        // A hand-off's destination is restored from its final, a full snapshot: no delta, no
        // delete to skip. The drill Jobs restore chains with deltas.
        plant: "drop-delete-in-restore",
        checkers: &["destination-mismatch", "delta-history", "restored", "drill"],
        pending: None,
        with: None,
        in_process: false,
        minutes: 2.0,
    },
    Expect {
        // Only deltas' puts are altered, so a destination restored from its final (a full
        // snapshot) is not; drill Jobs restore chains with deltas.
        plant: "restore-alters-values",
        checkers: &["drill", "delta-history"],
        pending: None,
        with: None,
        in_process: false,
        minutes: 2.0,
    },
    Expect {
        plant: "ack-after-kill",
        checkers: &[
            "etcd-serving-after-deactivation",
            "ack-after-final",
            "lost-write",
        ],
        pending: None,
        with: None,
        in_process: false,
        minutes: 2.0,
    },
    Expect {
        plant: "ready-late",
        checkers: &["ready-after-record", "ready-after-deactivation"],
        pending: None,
        with: None,
        in_process: false,
        minutes: 2.0,
    },
    Expect {
        plant: "never-final",
        checkers: &["handoff-unsettled"],
        pending: None,
        with: None,
        in_process: false,
        minutes: 2.0,
    },
    Expect {
        plant: "delta-first-event-only",
        checkers: &["delta-history"],
        pending: None,
        with: None,
        in_process: false,
        minutes: 2.0,
    },
    Expect {
        plant: "delta-leak",
        checkers: &["leaked"],
        pending: None,
        with: None,
        in_process: false,
        minutes: 2.0,
    },
    Expect {
        plant: "remove-voter-first",
        checkers: &["voter-removed-early"],
        pending: None,
        with: None,
        in_process: true,
        minutes: 2.0,
    },
    Expect {
        plant: "defrag-leader",
        checkers: &["leader-defragmented"],
        pending: None,
        with: None,
        in_process: false,
        minutes: 2.0,
    },
    Expect {
        plant: "drill-no-compare",
        checkers: &["drill-compared-nothing"],
        pending: None,
        with: Some("drill-no-compare,restore-alters-values"),
        in_process: false,
        minutes: 2.0,
    },
];

/// The plants CI plays (`PLANTS=ci`): all of them together take longer than CI's 30 minutes
/// leave, so CI plays one plant of each of the three promises (the hand-off settles with one
/// final, the final is one object, no write is acknowledged past the final) and the rest are
/// played by hand (`PLANTS=all`, docs/robustness.md records the last such run).
pub const CI: &[&str] = &["never-final", "fresh-final-name", "ack-after-kill"];

/// The plants `PLANTS` selects: `all` (or unset) for every one whose checker is on this branch
/// (a pending one's run could only time out), `every` for all of them, `ci` for [`CI`], else
/// comma-separated names; an unknown name is an error.
pub fn select(value: Option<&str>) -> Result<Vec<Expect>, String> {
    let value = value.map(str::trim).unwrap_or("all");
    if value == "ci" {
        return select(Some(&CI.join(",")));
    }
    if value.is_empty() || value == "all" {
        return Ok(EXPECT
            .iter()
            .filter(|e| e.pending.is_none())
            .copied()
            .collect());
    }
    if value == "every" {
        return Ok(EXPECT.to_vec());
    }
    value
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| {
            EXPECT
                .iter()
                .find(|e| e.plant == n)
                .copied()
                .ok_or_else(|| format!("PLANTS: unknown plant {n:?}"))
        })
        .collect()
}

/// What one plant's run found.
#[derive(Debug, Clone, PartialEq)]
pub struct Caught {
    pub plant: String,
    /// The checker that fired first among the plant's, and when (seconds from the run's start).
    pub fired: Option<(String, f64)>,
    /// Every kind the run found, for the table.
    pub kinds: Vec<String>,
}

/// The line a plant's run prints for the runner: `PLANT-RESULT <plant> <kind|-> <seconds|-> <kinds>`.
pub fn result_line(c: &Caught) -> String {
    let (kind, secs) = match &c.fired {
        Some((k, s)) => (k.clone(), format!("{s:.0}")),
        None => ("-".into(), "-".into()),
    };
    let kinds = if c.kinds.is_empty() {
        "-".to_string()
    } else {
        c.kinds.join(",")
    };
    format!("PLANT-RESULT {} {kind} {secs} {kinds}", c.plant)
}

/// The result line of [`result_line`] in a run's output, if there is one.
pub fn parse_result(output: &str) -> Option<Caught> {
    let line = output
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("PLANT-RESULT "))?;
    let mut f = line.split_whitespace();
    let plant = f.next()?.to_string();
    let kind = f.next()?;
    let secs = f.next()?;
    let kinds = f.next().unwrap_or("-");
    let fired = match (kind, secs.parse::<f64>()) {
        ("-", _) | (_, Err(_)) => None,
        (k, Ok(s)) => Some((k.to_string(), s)),
    };
    Some(Caught {
        plant,
        fired,
        kinds: if kinds == "-" {
            Vec::new()
        } else {
            kinds.split(',').map(String::from).collect()
        },
    })
}

/// The first of `e`'s checkers that fired (by time), from what a run found.
pub fn caught_by(
    e: &Expect,
    fired: &std::collections::BTreeMap<&'static str, std::time::Duration>,
) -> Option<(String, f64)> {
    e.checkers
        .iter()
        .filter_map(|k| fired.get(k).map(|d| (k.to_string(), d.as_secs_f64())))
        .min_by(|a, b| a.1.total_cmp(&b.1))
}

#[cfg(test)]
mod tests {
    // Each test names what it uses: the benches compile this file without its tests.

    #[cfg(debug_assertions)]
    #[test]
    fn every_plant_of_the_seam_has_one_entry_and_the_table_no_other() {
        use super::EXPECT;
        let mut table: Vec<&str> = EXPECT.iter().map(|e| e.plant).collect();
        table.sort_unstable();
        let mut seam: Vec<&str> = etcd_warden::plant::PLANTS.iter().map(|(n, _)| *n).collect();
        seam.sort_unstable();
        assert_eq!(table, seam);
        assert!(EXPECT.iter().all(|e| !e.checkers.is_empty()));
    }

    #[test]
    fn a_selection_names_known_plants_only() {
        use super::{EXPECT, select};
        assert_eq!(select(Some("every")).unwrap().len(), EXPECT.len());
        let ci: Vec<&str> = select(Some("ci"))
            .unwrap()
            .iter()
            .map(|e| e.plant)
            .collect();
        assert_eq!(ci, super::CI);
        assert!(
            select(Some("ci"))
                .unwrap()
                .iter()
                .all(|e| e.pending.is_none()),
            "CI plays only plants whose checkers are here"
        );
        let all = select(None).unwrap();
        assert!(!all.is_empty() && all.iter().all(|e| e.pending.is_none()));
        let two = select(Some("ready-late, never-final")).unwrap();
        assert_eq!(
            two.iter().map(|e| e.plant).collect::<Vec<_>>(),
            ["ready-late", "never-final"]
        );
        assert!(
            select(Some("ready-late,nope"))
                .unwrap_err()
                .contains("\"nope\"")
        );
    }

    #[test]
    fn the_result_line_reads_back_and_the_earliest_checker_is_the_catch() {
        use super::{Caught, EXPECT, caught_by, parse_result, result_line};
        use std::collections::BTreeMap;
        use std::time::Duration;
        let e = EXPECT.iter().find(|e| e.plant == "ack-after-kill").unwrap();
        let fired = BTreeMap::from([
            ("lost-write", Duration::from_secs(90)),
            ("ack-after-final", Duration::from_secs(80)),
            ("history", Duration::from_secs(10)),
        ]);
        let c = Caught {
            plant: e.plant.into(),
            fired: caught_by(e, &fired),
            kinds: fired.keys().map(|k| k.to_string()).collect(),
        };
        assert_eq!(c.fired, Some(("ack-after-final".into(), 80.0)));
        let shown = format!("noise\n{}\nmore noise\n", result_line(&c));
        assert_eq!(parse_result(&shown), Some(c));
        let none = Caught {
            plant: "ready-late".into(),
            fired: caught_by(e, &BTreeMap::from([("history", Duration::ZERO)])),
            kinds: vec![],
        };
        assert_eq!(none.fired, None);
        assert_eq!(parse_result(&result_line(&none)), Some(none));
    }
}
