//! `tracing` setup: human-readable or JSON lines on stderr, filtered by a level directive.

use crate::config::{LogConfig, LogFormat};
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `RUST_LOG`, when set, wins over the configured level so a
/// developer can turn one module up without editing configuration.
pub fn init(log: &LogConfig) {
    let filter = EnvFilter::try_from_env("RUST_LOG").unwrap_or_else(|_| EnvFilter::new(&log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    // try_init: a second call (tests, or an early init for config errors) keeps the first.
    let _ = match log.format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
    };
}
