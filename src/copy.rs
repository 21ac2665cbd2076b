//! The copy job: wait for the source's final snapshot, then copy snapshots between stores.
