//! The operator: a pure planner for quorum-safe member replacement, its executor, and backends.
