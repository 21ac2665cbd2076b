//! Copy progress: counters shared with the streams being copied, a log line every few seconds,
//! and a one-line bar on stderr when stderr is a terminal.
//!
//! The bar is drawn with `\r` over itself and cleared before each log line and at the end, so
//! the log stays readable in a terminal; when stderr is a file or a pipe (a Job's log) only the
//! log lines are written. [`render`] is pure, so what the bar shows is tested without a
//! terminal.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Widest bar drawn, in cells: a wider one shows no more.
const MAX_BAR: usize = 40;
/// Narrowest bar worth drawing; below it the numbers are shown alone.
const MIN_BAR: usize = 5;
/// Terminal width when `COLUMNS` does not say.
const DEFAULT_WIDTH: usize = 80;
const MIB: f64 = 1048576.0;

/// Where a copy stands, as the bar and the log show it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Counts {
    /// Objects copied.
    pub objects: u64,
    /// Objects to copy.
    pub total_objects: u64,
    /// Bytes read from the source so far.
    pub bytes: u64,
    /// Bytes to copy (the listed sizes).
    pub total_bytes: u64,
    /// Since the copy started.
    pub elapsed: Duration,
}

impl Counts {
    /// Done, from 0.0 to 1.0: by bytes, or by objects when there are no bytes to copy; nothing
    /// to do is done. Clamped, since an object that grew while copied can exceed its listing.
    pub fn fraction(&self) -> f64 {
        let f = if self.total_bytes > 0 {
            self.bytes as f64 / self.total_bytes as f64
        } else if self.total_objects > 0 {
            self.objects as f64 / self.total_objects as f64
        } else {
            1.0
        };
        f.clamp(0.0, 1.0)
    }

    /// Mean rate since the start, MiB/s; 0 before any time has passed (not infinity).
    pub fn mib_per_second(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs < 0.001 {
            0.0
        } else {
            self.bytes as f64 / MIB / secs
        }
    }
}

/// The bar's line for a terminal `width` cells wide: percentage, objects, MiB, rate, then a
/// bar in the space left (at most `MAX_BAR` cells). Never wider than `width`: on a narrow
/// terminal the bar goes first, then the end of the numbers.
pub fn render(c: &Counts, width: usize) -> String {
    let fraction = c.fraction();
    let text = format!(
        "{:3.0}% {}/{} objects  {:.1}/{:.1} MiB  {:.1} MiB/s",
        // Floor, so 100% means done, not 99.6%.
        (fraction * 100.0).floor(),
        c.objects,
        c.total_objects,
        c.bytes as f64 / MIB,
        c.total_bytes as f64 / MIB,
        c.mib_per_second(),
    );
    // " [" + bar + "]"
    let room = width.saturating_sub(text.len() + 3);
    if room < MIN_BAR {
        return text.chars().take(width).collect();
    }
    let cells = room.min(MAX_BAR);
    let filled = ((fraction * cells as f64).floor() as usize).min(cells);
    format!(
        "{text} [{}{}]",
        "#".repeat(filled),
        "-".repeat(cells - filled)
    )
}

/// Counters for the progress log and bar.
pub(crate) struct Progress {
    started: Instant,
    pub(crate) total_objects: usize,
    pub(crate) total_bytes: u64,
    pub(crate) objects: AtomicU64,
    /// Shared with the streams being copied.
    pub(crate) bytes: Arc<AtomicU64>,
}

impl Progress {
    pub(crate) fn new(total_objects: usize, total_bytes: u64) -> Self {
        Self {
            started: Instant::now(),
            total_objects,
            total_bytes,
            objects: AtomicU64::new(0),
            bytes: Arc::new(AtomicU64::new(0)),
        }
    }

    pub(crate) fn counts(&self) -> Counts {
        Counts {
            objects: self.objects.load(Ordering::Relaxed),
            total_objects: self.total_objects as u64,
            bytes: self.bytes.load(Ordering::Relaxed),
            total_bytes: self.total_bytes,
            elapsed: self.started.elapsed(),
        }
    }

    pub(crate) fn log(&self) {
        let c = self.counts();
        tracing::info!(
            objects = c.objects,
            objects_total = c.total_objects,
            mib = format!("{:.1}", c.bytes as f64 / MIB),
            mib_total = format!("{:.1}", c.total_bytes as f64 / MIB),
            mib_per_second = format!("{:.1}", c.mib_per_second()),
            "copy progress"
        );
    }
}

/// The bar on stderr, present only when stderr is a terminal.
pub(crate) struct Bar {
    width: usize,
    drawn: bool,
}

impl Bar {
    /// A bar if stderr is a terminal; `None` for a file or a pipe, where `\r` redraws would
    /// only fill the log with partial lines.
    pub(crate) fn for_stderr() -> Option<Bar> {
        if !std::io::stderr().is_terminal() {
            return None;
        }
        // COLUMNS when the shell exports it; the bar is cosmetic, so no terminal ioctl for it.
        let width = std::env::var("COLUMNS")
            .ok()
            .and_then(|c| c.trim().parse::<usize>().ok())
            .filter(|&w| w > 0)
            .unwrap_or(DEFAULT_WIDTH);
        // One cell short: writing the last column makes some terminals wrap.
        Some(Bar {
            width: width - 1,
            drawn: false,
        })
    }

    pub(crate) fn draw(&mut self, counts: &Counts) {
        // A failed write to the terminal is no reason to fail or slow the copy: ignored.
        let _ = write!(
            std::io::stderr().lock(),
            "\r{}\x1b[K",
            render(counts, self.width)
        );
        self.drawn = true;
    }

    /// Erases the bar so that a log line starts on a clean line.
    pub(crate) fn clear(&mut self) {
        if self.drawn {
            let _ = write!(std::io::stderr().lock(), "\r\x1b[K");
            self.drawn = false;
        }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(objects: u64, total_objects: u64, mib: f64, total_mib: f64, secs: f64) -> Counts {
        Counts {
            objects,
            total_objects,
            bytes: (mib * MIB) as u64,
            total_bytes: (total_mib * MIB) as u64,
            elapsed: Duration::from_secs_f64(secs),
        }
    }

    fn bar_of(line: &str) -> &str {
        let open = line.rfind('[').expect("a bar");
        &line[open + 1..line.len() - 1]
    }

    /// The line for `c` at `width`, checked to start with `prefix`.
    fn rendered(c: Counts, width: usize, prefix: &str) -> String {
        let line = render(&c, width);
        assert!(line.starts_with(prefix), "{line}");
        line
    }

    #[test]
    fn the_bar_follows_the_bytes_and_the_count_the_objects() {
        let start = counts(0, 50, 0.0, 886.0, 0.0);
        // 25% of the bytes but 40/50 objects; the rate is the mean.
        let part_way = counts(40, 50, 221.5, 886.0, 3.0);
        let done = counts(50, 50, 886.0, 886.0, 4.0);
        // An object that grew while copied: more bytes than listed still shows 100%.
        let grown = counts(50, 50, 900.0, 886.0, 4.0);
        // (counts, width, how the line starts, quarters of the bar filled)
        let cases = [
            (
                start,
                100,
                "  0% 0/50 objects  0.0/886.0 MiB  0.0 MiB/s [",
                0,
            ),
            (
                part_way,
                80,
                " 25% 40/50 objects  221.5/886.0 MiB  73.8 MiB/s [",
                1,
            ),
            (done, 200, "100% 50/50", 4),
            (grown, 200, "100% ", 4),
        ];
        for (c, width, prefix, quarters) in cases {
            let line = rendered(c, width, prefix);
            assert!(line.len() <= width, "{line}");
            let bar = bar_of(&line);
            assert!(bar.chars().all(|c| c == '#' || c == '-'), "{line}");
            let filled = bar.chars().filter(|&c| c == '#').count();
            assert_eq!(filled, bar.len() * quarters / 4, "{line}");
        }
        assert_eq!(
            render(&part_way, 80).len(),
            80,
            "the bar takes the room left"
        );
        assert_eq!(
            bar_of(&render(&done, 200)).len(),
            MAX_BAR,
            "and never overflows"
        );
    }

    #[test]
    fn zero_bytes_to_copy_counts_objects_and_nothing_to_do_is_done() {
        rendered(
            counts(1, 4, 0.0, 0.0, 1.0),
            80,
            " 25% 1/4 objects  0.0/0.0 MiB",
        );
        rendered(counts(0, 0, 0.0, 0.0, 0.0), 80, "100% 0/0 objects");
    }

    #[test]
    fn a_narrow_terminal_drops_the_bar_then_cuts_the_line() {
        let c = counts(3, 50, 10.0, 886.0, 1.0);
        let full = render(&c, 200);
        let numbers = &full[..full.rfind(" [").expect("a bar")];
        // Too little room for a bar: the numbers alone.
        let line = render(&c, numbers.len() + 3 + MIN_BAR - 1);
        assert_eq!(line, numbers);
        // The smallest bar that fits.
        let line = render(&c, numbers.len() + 3 + MIN_BAR);
        assert_eq!(bar_of(&line).len(), MIN_BAR, "{line}");
        // Narrower than the numbers: cut to the width.
        assert_eq!(render(&c, 10), &numbers[..10]);
        assert_eq!(render(&c, 0), "");
    }
}
