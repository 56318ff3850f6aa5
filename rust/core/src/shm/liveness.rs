//! Whether a peer process still runs, by a signal that cannot lie.
//!
//! `kill(pid, 0)` succeeds for a zombie (a server that died and that its
//! parent has not reaped yet) and for whatever process got the pid next.
//! A [`Peer`] is instead a pidfd, readable once the process has exited,
//! zombie or not, opened for the very process whose start time the
//! segment recorded: a recycled pid has another start time, so it is
//! never taken for the peer. Where pidfds are missing (Linux before 5.3),
//! each check reads the state and start time from `/proc/<pid>/stat`.

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// When process `pid` started (clock ticks since boot, field 22 of
/// `/proc/<pid>/stat`), if it exists and has not exited (a zombie has).
pub fn start_time(pid: u32) -> Option<u64> {
    if pid == 0 {
        return None;
    }
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ...`: comm may hold anything, so fields are
    // counted from its closing parenthesis (the last one).
    let close = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(stat.get(close + 1..)?).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?;
    if matches!(state, "Z" | "X" | "x") {
        return None;
    }
    // Field 3 is the state; the start time is field 22.
    fields.nth(18)?.parse().ok()
}

/// A process watched for its exit (see the module docs).
#[derive(Debug)]
pub struct Peer {
    pid: u32,
    start: u64,
    /// The pidfd, when the kernel has them.
    pidfd: Option<OwnedFd>,
    /// Seen gone once: gone for good.
    gone: AtomicBool,
}

impl Peer {
    /// Watches process `pid`, which started at `start` (as [`start_time`]
    /// gives it). A process that is gone already, or is another than the
    /// one that started then, is a peer that is not alive.
    pub fn watch(pid: u32, start: u64) -> Peer {
        let pidfd = open_pidfd(pid);
        // After the pidfd is open: if the pid's process is the one that
        // started at `start` now, the pidfd was opened on it too (it held
        // the pid from before the open until this check).
        let gone = pid == 0 || start_time(pid) != Some(start);
        Peer {
            pid,
            start,
            pidfd,
            gone: AtomicBool::new(gone),
        }
    }

    /// This process, as its peers see it: `(pid, start time)`.
    pub fn me() -> (u32, u64) {
        let pid = std::process::id();
        (pid, start_time(pid).unwrap_or(0))
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn start(&self) -> u64 {
        self.start
    }

    /// True while the process runs (a zombie does not).
    pub fn is_alive(&self) -> bool {
        if self.gone.load(Ordering::Relaxed) {
            return false;
        }
        let alive = match &self.pidfd {
            Some(fd) => !exited(fd),
            None => start_time(self.pid) == Some(self.start),
        };
        if !alive {
            self.gone.store(true, Ordering::Relaxed);
        }
        alive
    }
}

#[cfg(target_os = "linux")]
fn open_pidfd(pid: u32) -> Option<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).ok().filter(|&p| p > 0)?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = i32::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(not(target_os = "linux"))]
fn open_pidfd(_pid: u32) -> Option<OwnedFd> {
    None
}

/// A pidfd polls readable once its process has exited.
fn exited(fd: &OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    let mut poll = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, a zero timeout: poll only reports.
    let ready = unsafe { libc::poll(&mut poll, 1, 0) };
    ready > 0 && poll.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
}

#[cfg(all(test, not(miri), not(loom)))]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::{Duration, Instant};

    #[test]
    fn this_process_is_alive_and_a_made_up_one_is_not() {
        let (pid, start) = Peer::me();
        assert!(start > 0);
        assert!(Peer::watch(pid, start).is_alive());
        assert!(
            !Peer::watch(pid, start + 1).is_alive(),
            "another start time: a recycled pid"
        );
        assert!(!Peer::watch(0, 0).is_alive());
        assert!(!Peer::watch(1 << 30, 1).is_alive());
    }

    /// The case `kill(pid, 0)` gets wrong: a child that exited and is not
    /// reaped yet is a zombie, and dead.
    #[test]
    fn an_unreaped_zombie_is_not_alive() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        let peer = Peer::watch(pid, start_time(pid).unwrap());
        assert!(peer.is_alive());
        // SAFETY: kill sends SIGKILL to our own child; we do not wait on it yet.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
        let until = Instant::now() + Duration::from_secs(5);
        while peer.is_alive() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        // SAFETY: as above: signal 0 only checks the pid.
        assert_eq!(unsafe { libc::kill(pid as i32, 0) }, 0, "still a zombie");
        assert!(!peer.is_alive(), "a zombie counts as dead");
        child.wait().unwrap();
    }
}
