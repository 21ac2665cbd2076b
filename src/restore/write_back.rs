//! Write-back while a file is still being written: a thread syncs the file's data each time
//! another [`SYNC_EVERY`] bytes have been written, so the disk writes the fetched database while
//! the next part is still being decompressed, and the sync that makes the restore durable finds
//! little left to write (it was ~1.3 s for a 1 GiB database, all of it after the fetch).
//!
//! The writer never waits for the thread: a sync asked for while one runs is merged into it.

use std::fs::File;
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

/// Bytes written between two syncs.
pub(super) const SYNC_EVERY: u64 = 64 << 20;

/// The syncing thread of one file.
pub(super) struct WriteBack {
    ask: Option<SyncSender<()>>,
    thread: Option<JoinHandle<std::io::Result<()>>>,
    /// Bytes written when the last sync was asked for.
    asked_at: u64,
}

impl WriteBack {
    /// Starts syncing `file` (through its own handle) as it grows.
    pub(super) fn start(file: &File) -> std::io::Result<WriteBack> {
        let file = file.try_clone()?;
        let (ask, asked) = sync_channel::<()>(1);
        let thread = std::thread::Builder::new()
            .name("write-back".into())
            .spawn(move || {
                while asked.recv().is_ok() {
                    file.sync_data()?;
                }
                Ok(())
            })?;
        Ok(WriteBack {
            ask: Some(ask),
            thread: Some(thread),
            asked_at: 0,
        })
    }

    /// `written` bytes are in the file now: asks for a sync if [`SYNC_EVERY`] more were written
    /// since the last one was asked for.
    pub(super) fn wrote(&mut self, written: u64) {
        if written < self.asked_at + SYNC_EVERY {
            return;
        }
        self.asked_at = written;
        if let Some(ask) = &self.ask {
            match ask.try_send(()) {
                // Full: a sync is pending and will cover these bytes too. Disconnected: the
                // thread failed; `finish` reports why.
                Ok(()) | Err(TrySendError::Full(())) | Err(TrySendError::Disconnected(())) => {}
            }
        }
    }

    /// Waits for the syncs asked for; the first error of any of them. The caller still syncs
    /// the whole file to make it durable: this only spreads the work.
    pub(super) fn finish(mut self) -> std::io::Result<()> {
        drop(self.ask.take());
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(std::io::Error::other("the write-back thread panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for WriteBack {
    /// On an early return the thread ends after its current sync; nobody waits for it.
    fn drop(&mut self) {
        drop(self.ask.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn syncs_are_asked_for_every_so_many_bytes_and_merged_while_one_runs() {
        let dir = tempfile::tempdir().unwrap();
        let mut file = File::create(dir.path().join("f")).unwrap();
        let mut wb = WriteBack::start(&file).unwrap();
        let block = vec![1u8; 1 << 20];
        let mut written = 0u64;
        for _ in 0..((3 * SYNC_EVERY) >> 20) + 1 {
            file.write_all(&block).unwrap();
            written += block.len() as u64;
            wb.wrote(written);
        }
        assert_eq!(wb.asked_at, 3 * SYNC_EVERY, "asked at each multiple");
        wb.finish().unwrap();
    }
}
