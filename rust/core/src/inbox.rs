//! `Inbox<T>`: where a batch's outcome waits for the owner of its sink, with
//! the one-wake-up-per-drain rule.
//!
//! Producers (worker threads) `post`; one consumer (the sink's owner, e.g. an
//! event loop) `drain`s everything posted since its last drain. Invariant:
//! `armed` is true from the post that found the inbox unarmed until the drain
//! that takes the posts; only that post asks for a wake-up. So a busy owner
//! is woken once however many batches land before it drains, and no post is
//! ever left undrained: a post either finds `armed` set (and the drain that
//! is due takes it) or sets it and wakes the owner.

use std::sync::Mutex;

/// Posted items of one sink, and whether a wake-up is already due.
#[derive(Debug)]
pub struct Inbox<T> {
    state: Mutex<State<T>>,
}

#[derive(Debug)]
struct State<T> {
    posts: Vec<T>,
    armed: bool,
}

impl<T> Default for Inbox<T> {
    fn default() -> Self {
        Inbox {
            state: Mutex::new(State {
                posts: Vec::new(),
                armed: false,
            }),
        }
    }
}

impl<T> Inbox<T> {
    /// Posts `item`. True when the caller must wake the owner (this post
    /// armed the inbox); false when a wake-up is already due.
    pub fn post(&self, item: T) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.posts.push(item);
        !std::mem::replace(&mut state.armed, true)
    }

    /// Takes everything posted so far and disarms: the next post wakes again.
    pub fn drain(&self) -> Vec<T> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.armed = false;
        std::mem::take(&mut state.posts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn one_wake_up_per_drain_however_many_posts() {
        let inbox = Inbox::default();
        assert!(inbox.post(1));
        assert!(!inbox.post(2));
        assert!(!inbox.post(3));
        assert_eq!(inbox.drain(), vec![1, 2, 3]);
        assert!(inbox.post(4), "a post after a drain wakes again");
        assert_eq!(inbox.drain(), vec![4]);
        assert!(inbox.drain().is_empty());
    }

    /// Producers race a draining consumer: every post is drained exactly
    /// once, and wake-ups never exceed drains that found something, plus one.
    #[test]
    fn no_post_is_lost_under_concurrent_posts_and_drains() {
        const PER_THREAD: usize = if cfg!(miri) { 50 } else { 20_000 };
        let inbox = Arc::new(Inbox::default());
        let wakes = Arc::new(AtomicUsize::new(0));
        let producers: Vec<_> = (0..3)
            .map(|t| {
                let (inbox, wakes) = (inbox.clone(), wakes.clone());
                std::thread::spawn(move || {
                    for i in 0..PER_THREAD {
                        if inbox.post(t * PER_THREAD + i) {
                            wakes.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        let mut seen = Vec::new();
        let mut drains = 0;
        while producers.iter().any(|p| !p.is_finished()) {
            let got = inbox.drain();
            drains += usize::from(!got.is_empty());
            seen.extend(got);
        }
        for p in producers {
            p.join().unwrap();
        }
        seen.extend(inbox.drain());
        seen.sort_unstable();
        assert_eq!(seen, (0..3 * PER_THREAD).collect::<Vec<_>>());
        assert!(wakes.load(Ordering::Relaxed) <= drains + 2);
    }
}
