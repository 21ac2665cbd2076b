//! What every binary does first: make this process non-dumpable, so that another process of
//! the same UID cannot read its secrets through `/proc`.
//!
//! The sidecar shares its UID with etcd on purpose (it must be allowed to kill etcd), and with
//! `shareProcessNamespace` every process of that UID would otherwise read `/proc/<sidecar>/environ`
//! (the store's secret key, the API token given as variables), `/proc/<sidecar>/mem` and
//! `/proc/<sidecar>/root/` (the files it mounts). A non-dumpable process's `/proc` entries are
//! owned by root and guarded by the ptrace check, which only CAP_SYS_PTRACE passes; the process
//! itself still reads its own `/proc/self/*` (status, fds, environ: the kernel exempts the
//! process's own thread group), and it still reads another process's `/proc/<pid>/` (finding
//! etcd: the check is on the process read, not the reader). Children are dumpable again after
//! `exec`, as the kernel resets the flag there. No core dump is written either, which would
//! hold the same secrets.

/// Why the process could not be hardened.
#[derive(Debug, thiserror::Error)]
pub enum HardeningError {
    /// `prctl(PR_SET_DUMPABLE, 0)` failed.
    #[error(
        "cannot make this process non-dumpable (prctl PR_SET_DUMPABLE): {0}; another process of its UID could read its secrets from /proc"
    )]
    Dumpable(nix::Error),
}

/// Makes this process non-dumpable; called before any secret is read (configuration, files,
/// the environment's credentials), and fails closed when the kernel refuses.
pub fn forbid_inspection() -> Result<(), HardeningError> {
    nix::sys::prctl::set_dumpable(false).map_err(HardeningError::Dumpable)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process still reads its own /proc entries once non-dumpable. Set in the test process
    /// itself: the flag only narrows who else may look at it.
    #[test]
    fn a_non_dumpable_process_still_reads_its_own_proc() {
        forbid_inspection().unwrap();
        assert!(!nix::sys::prctl::get_dumpable().unwrap());
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        assert!(status.contains("VmHWM"), "{status}");
        assert!(std::fs::read_dir("/proc/self/fd").unwrap().count() > 0);
        std::fs::read("/proc/self/environ").unwrap();
    }
}
