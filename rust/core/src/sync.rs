//! The synchronization primitives of the structures loom checks (request
//! state, staging ring, doorbell): std's, or loom's in the tests of a `--cfg loom`
//! build (`make loom`; loom is a dev-dependency, so a `--cfg loom` build of
//! the library alone, as a dependent's, keeps std's).
//!
//! Loom's may only be created and used inside `loom::model`, so a
//! `--cfg loom` test build runs the `loom_` tests alone.

#[cfg(all(loom, test))]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicIsize, AtomicU8, AtomicUsize};
#[cfg(all(loom, test))]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};

#[cfg(not(all(loom, test)))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicIsize, AtomicU8, AtomicUsize};
#[cfg(not(all(loom, test)))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};
