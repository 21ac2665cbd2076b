//! Ownership: owner DNS lookups, the pure ownership protocol, the hand-off across members, and the
//! watchdog that acts on them.
//!
//! - [`resolve`]: the owner TXT record looked up and classified.
//! - [`protocol`]: the state machine, a pure transition function.
//! - [`handoff`]: fence markers, the hand-off record and the pure "who takes the final, when".
//! - [`watchdog`]: the loop that observes, steps the protocol and acts through its traits.
//! - [`guard`]: ownership for controllers: a token per stretch of ownership, cancelled when it ends.
//! - [`production`]: those traits over DNS, `/proc`, etcd, the store and the snapshot actor.

pub mod guard;
pub mod handoff;
pub mod metrics;
pub mod production;
pub mod protocol;
pub mod resolve;
pub mod watchdog;
