//! A watch of one `u64` (a seqno, an epoch, a deadline): what
//! `tokio::sync::watch` does for a `u64`, in a quarter of the memory.
//!
//! Every shard replica keeps about eight of these (its WAL positions, what
//! readers may read, its lease, ...). A `tokio::sync::watch` channel takes
//! 360 bytes on the heap (its eight-way `BigNotify`), some 3 KiB per replica
//! and 30 MiB on a node with 10,000 of them; this one takes 80.
//!
//! The same contract as tokio's, for the methods walship uses: a receiver
//! sees the newest value; [`Receiver::changed`] returns once a value was
//! sent since the receiver last looked (and marks it seen), or fails once
//! the sender is gone; [`Receiver::wait_for`] returns the first value (the
//! current one included) a predicate accepts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;

struct Shared {
    /// The value and its version (bumped by every send that changes it, or
    /// by every `send_replace`), changed together.
    state: Mutex<(u64, u64)>,
    closed: AtomicBool,
    notify: Notify,
}

/// The sending half: dropping it closes the watch.
pub struct Sender {
    shared: Arc<Shared>,
}

/// A receiving half: the newest value, and whether it was seen.
#[derive(Clone)]
pub struct Receiver {
    shared: Arc<Shared>,
    seen: u64,
}

/// The sender is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the watch's sender is gone")]
pub struct Closed;

/// A borrowed value (a copy: `*watch.borrow()` reads as with tokio's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ref(u64);

impl std::ops::Deref for Ref {
    type Target = u64;
    fn deref(&self) -> &u64 {
        &self.0
    }
}

impl Sender {
    pub fn new(value: u64) -> Sender {
        Sender {
            shared: Arc::new(Shared {
                state: Mutex::new((value, 0)),
                closed: AtomicBool::new(false),
                notify: Notify::new(),
            }),
        }
    }

    /// A receiver that has seen the current value.
    pub fn subscribe(&self) -> Receiver {
        Receiver { shared: self.shared.clone(), seen: self.shared.state.lock().1 }
    }

    pub fn borrow(&self) -> Ref {
        Ref(self.shared.state.lock().0)
    }

    /// Lets `modify` change the value; receivers are told if it says it did.
    pub fn send_if_modified(&self, modify: impl FnOnce(&mut u64) -> bool) -> bool {
        let modified = {
            let mut state = self.shared.state.lock();
            let modified = modify(&mut state.0);
            if modified {
                state.1 += 1;
            }
            modified
        };
        if modified {
            self.shared.notify.notify_waiters();
        }
        modified
    }

    /// Lets `modify` change the value; receivers are told in any case.
    pub fn send_modify(&self, modify: impl FnOnce(&mut u64)) {
        self.send_if_modified(|v| {
            modify(v);
            true
        });
    }

    /// Sets the value, telling receivers even if it is the same; the old one.
    pub fn send_replace(&self, value: u64) -> u64 {
        let mut old = 0;
        self.send_modify(|v| old = std::mem::replace(v, value));
        old
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.notify.notify_waiters();
    }
}

impl Receiver {
    pub fn borrow(&self) -> Ref {
        Ref(self.shared.state.lock().0)
    }

    /// The newest value, marked seen.
    pub fn borrow_and_update(&mut self) -> Ref {
        let state = self.shared.state.lock();
        self.seen = state.1;
        Ref(state.0)
    }

    /// Waits until a value was sent since this receiver last looked, and
    /// marks it seen; fails once the sender is gone with nothing unseen.
    pub async fn changed(&mut self) -> Result<(), Closed> {
        loop {
            // Registered before looking, so a send in between wakes it.
            let notified = self.shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let version = self.shared.state.lock().1;
            if version != self.seen {
                self.seen = version;
                return Ok(());
            }
            if self.shared.closed.load(Ordering::Acquire) {
                return Err(Closed);
            }
            notified.await;
        }
    }

    /// Waits for a value `accept` takes (the current one first), marks it
    /// seen and returns it; fails once the sender is gone.
    pub async fn wait_for(&mut self, mut accept: impl FnMut(&u64) -> bool) -> Result<Ref, Closed> {
        loop {
            let notified = self.shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (value, version) = *self.shared.state.lock();
            self.seen = version;
            if accept(&value) {
                return Ok(Ref(value));
            }
            if self.shared.closed.load(Ordering::Acquire) {
                return Err(Closed);
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::{Context, Waker};

    use super::*;

    /// Whether `future` is still waiting after one poll.
    fn waits(future: impl Future) -> bool {
        let mut future = std::pin::pin!(future);
        future.as_mut().poll(&mut Context::from_waker(Waker::noop())).is_pending()
    }

    #[tokio::test]
    async fn a_receiver_sees_each_change_once_and_the_newest_value() {
        let tx = Sender::new(1);
        let mut rx = tx.subscribe();
        assert_eq!(*rx.borrow(), 1);
        // Nothing sent since it subscribed: changed() waits.
        assert!(waits(rx.changed()));
        assert!(tx.send_if_modified(|v| std::mem::replace(v, 5) != 5));
        assert!(!tx.send_if_modified(|v| std::mem::replace(v, 5) != 5), "the same value is no change");
        rx.changed().await.unwrap();
        assert_eq!(*rx.borrow_and_update(), 5);
        assert!(waits(rx.changed()));
        // send_replace tells receivers even of the same value.
        assert_eq!(tx.send_replace(5), 5);
        rx.changed().await.unwrap();
        tx.send_modify(|v| *v += 1);
        assert_eq!(*tx.borrow(), 6);
        rx.changed().await.unwrap();
        assert_eq!(*rx.borrow(), 6);
    }

    #[tokio::test]
    async fn a_waiting_receiver_is_woken_by_a_send_from_another_task() {
        let tx = Arc::new(Sender::new(0));
        let mut rx = tx.subscribe();
        let waiter = tokio::spawn(async move { *rx.wait_for(|&v| v >= 3).await.unwrap() });
        // One thread (the test runtime): each yield lets the waiter run
        // until it waits again.
        for v in 1..=3 {
            tokio::task::yield_now().await;
            assert!(!waiter.is_finished());
            tx.send_replace(v);
        }
        assert_eq!(waiter.await.unwrap(), 3);
        // Already true: returns at once.
        let mut rx = tx.subscribe();
        assert_eq!(*rx.wait_for(|&v| v == 3).await.unwrap(), 3);
    }

    #[tokio::test]
    async fn dropping_the_sender_ends_waits_after_what_was_unseen() {
        let tx = Sender::new(0);
        let mut rx = tx.subscribe();
        let mut other = tx.subscribe();
        tx.send_replace(1);
        drop(tx);
        // The last value sent is still news, then the watch is closed.
        rx.changed().await.unwrap();
        assert_eq!(rx.changed().await, Err(Closed));
        assert_eq!(*other.wait_for(|&v| v == 1).await.unwrap(), 1);
        assert_eq!(other.wait_for(|&v| v == 2).await, Err(Closed));
        let tx = Sender::new(0);
        let mut rx = tx.subscribe();
        let waiting = tokio::spawn(async move { rx.changed().await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "waiting before the sender goes");
        drop(tx);
        assert_eq!(waiting.await.unwrap(), Err(Closed));
    }

    #[test]
    fn it_is_a_quarter_of_a_tokio_watch() {
        // The Arc's allocation: two counters and `Shared`.
        assert!(std::mem::size_of::<Shared>() + 16 <= 100, "{}", std::mem::size_of::<Shared>());
    }
}
