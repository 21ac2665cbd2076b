//! What the snapshot actor may do right now, as the ownership protocol decides it.
//!
//! The watchdog owns the sender; the snapshot actor and the HTTP API hold receivers. Changing the
//! gate is a plain `watch` send: it never waits for the actor, so the ownership watchdog can close
//! it and kill etcd at once, while the actor drops whatever operation the new gate forbids.

use serde::Serialize;

/// Which snapshots are allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Gate {
    /// No owner verdict yet, or the owner record is unresolvable: nothing is taken.
    Closed,
    /// This sidecar owns etcd (or no ownership checks are configured): regular snapshots and
    /// requested full and delta snapshots; never a final one.
    Open,
    /// Ownership was lost: the hand-off's final full snapshot and nothing else, so the final
    /// stays the latest snapshot in the store.
    Final,
}

/// What a snapshot operation is, for the gate's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// A scheduled full snapshot, a delta, or retention.
    Regular,
    /// A full or delta snapshot someone asked for (HTTP).
    Requested,
    /// The hand-off's final full snapshot.
    Final,
}

impl Gate {
    /// Whether `op` may start (or go on) under this gate.
    pub fn allows(self, op: Operation) -> bool {
        matches!(
            (self, op),
            (Gate::Open, Operation::Regular | Operation::Requested)
                | (Gate::Final, Operation::Final)
        )
    }

    /// Why `op` is refused under this gate, for error messages.
    pub fn refusal(self, op: Operation) -> &'static str {
        match (self, op) {
            (Gate::Final, _) => {
                "ownership was lost: only the hand-off's final snapshot is taken, so it stays the latest"
            }
            (_, Operation::Final) => {
                "a final snapshot is only taken after ownership is lost (Deactivated)"
            }
            (Gate::Closed, _) => "not the owner yet, or the owner record is unresolvable",
            (Gate::Open, _) => "allowed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_gate_allows_exactly_its_operations() {
        use Operation::*;
        let table = [
            (Gate::Closed, [false, false, false]),
            (Gate::Open, [true, true, false]),
            (Gate::Final, [false, false, true]),
        ];
        for (gate, expected) in table {
            let got = [Regular, Requested, Final].map(|op| gate.allows(op));
            assert_eq!(got, expected, "{gate:?}");
        }
    }
}
