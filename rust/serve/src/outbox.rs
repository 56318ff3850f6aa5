//! A connection's writes, gathered while its task runs and sent once the
//! task's poll ends.
//!
//! Why: h2 hands a DATA frame of 256 bytes or more to the socket on its own
//! (it chains the payload instead of copying it) and flushes before it
//! buffers the next frame. A gRPC reply (HEADERS, a DATA frame of 1 KiB,
//! trailers) so cost two `writev` calls and two TCP segments, where the
//! bare echo costs one. The [`Outbox`] takes every write of a poll into one
//! buffer, and [`Sending`] hands it to the socket when the connection's
//! future returns: one syscall per poll, however many frames and streams.
//!
//! HTTP/1.1 needs no gathering: hyper hands a response's head and body to
//! one vectored write. Its writes go to the socket at once
//! ([`Outbox::poll_write_through`]), without a copy of the body.
//!
//! Invariant: bytes accepted by [`Outbox::poll_write_vectored`] reach the
//! socket before any later write, and before shutdown; a poll never ends
//! with bytes held unless the socket is full (its readiness then wakes the
//! connection's task) or has failed (the error is returned to the next
//! write, flush or shutdown).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use tokio::net::tcp::OwnedWriteHalf;

/// Bytes held at most before a write goes to the socket at once: replies
/// above it (a large tensor) are written as they come, without a copy.
const HELD: usize = 64 * 1024;

/// The buffer an idle connection keeps at most: one that grew past it
/// (many replies in one poll) is let go once sent.
const KEPT: usize = 16 * 1024;

/// The write side of one connection, shared by its I/O object (inside
/// hyper) and the future that drives it ([`Sending`]): both run on the
/// connection's task, so its lock is never contended.
pub(crate) struct Outbox {
    state: Mutex<State>,
}

struct State {
    socket: OwnedWriteHalf,
    held: Vec<u8>,
    /// Bytes of `held` already written.
    sent: usize,
    /// A failed send at the end of a poll, for the next write to return.
    failed: Option<io::Error>,
}

impl Outbox {
    pub(crate) fn new(socket: OwnedWriteHalf) -> Arc<Outbox> {
        Arc::new(Outbox {
            state: Mutex::new(State {
                socket,
                held: Vec::new(),
                sent: 0,
                failed: None,
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `bufs` into the held bytes; past [`HELD`], sends what is held
    /// first, and a write as large as [`HELD`] goes straight to the socket.
    pub(crate) fn poll_write_vectored(
        &self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut state = self.state();
        state.take_failure()?;
        let len = bufs.iter().fold(0usize, |n, b| n.saturating_add(b.len()));
        if len >= HELD {
            return state.poll_write_through(cx, bufs);
        }
        if state.held.len().saturating_add(len) > HELD {
            std::task::ready!(state.poll_send(cx))?;
        }
        for buf in bufs {
            state.held.extend_from_slice(buf);
        }
        Poll::Ready(Ok(len))
    }

    /// Writes `bufs` to the socket now, after anything held.
    pub(crate) fn poll_write_through(
        &self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut state = self.state();
        state.take_failure()?;
        state.poll_write_through(cx, bufs)
    }

    /// Sends what is held (hyper's flush: the bytes go at the latest when
    /// the poll ends, see [`Sending`]). Returns a failure kept from then.
    pub(crate) fn poll_flush(&self) -> Poll<io::Result<()>> {
        self.state().take_failure()?;
        Poll::Ready(Ok(()))
    }

    /// Sends what is held, then shuts the write side down.
    pub(crate) fn poll_shutdown(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut state = self.state();
        state.take_failure()?;
        std::task::ready!(state.poll_send(cx))?;
        Pin::new(&mut state.socket).poll_shutdown(cx)
    }

    /// The end of a poll: sends what is held. A full socket keeps the rest
    /// (its readiness wakes the task); a failure is kept for hyper's next
    /// write, and the task woken so that it comes.
    fn send_held(&self, cx: &mut Context<'_>) {
        let mut state = self.state();
        if state.failed.is_some() {
            return;
        }
        if let Poll::Ready(Err(e)) = state.poll_send(cx) {
            state.failed = Some(e);
            cx.waker().wake_by_ref();
        }
    }
}

impl State {
    fn take_failure(&mut self) -> io::Result<()> {
        match self.failed.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Writes `bufs` to the socket, once the held bytes are sent.
    fn poll_write_through(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        std::task::ready!(self.poll_send(cx))?;
        Pin::new(&mut self.socket).poll_write_vectored(cx, bufs)
    }

    /// Writes the held bytes until none are left or the socket is full.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.held.len() {
            let rest = &self.held[self.sent..];
            let n = std::task::ready!(Pin::new(&mut self.socket).poll_write(cx, rest))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent = self.sent.saturating_add(n);
        }
        if self.held.capacity() > KEPT {
            self.held = Vec::new();
        } else {
            self.held.clear();
        }
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

/// A connection's future that sends its [`Outbox`] each time it has been
/// polled.
pub(crate) struct Sending<'a, F> {
    pub(crate) connection: Pin<&'a mut F>,
    pub(crate) outbox: &'a Outbox,
}

impl<F: Future> Future for Sending<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let polled = self.connection.as_mut().poll(cx);
        self.outbox.send_held(cx);
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::{TcpListener, TcpStream};

    /// An outbox on one end of a loopback connection, and the other end.
    async fn pair() -> (Arc<Outbox>, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let near = TcpStream::connect(listener.local_addr().unwrap());
        let (near, far) = tokio::join!(near, listener.accept());
        let (_, writer) = near.unwrap().into_split();
        (Outbox::new(writer), far.unwrap().0)
    }

    /// `connection` run to its end as the server runs it, sending `outbox`
    /// after each poll.
    async fn driven<F: Future>(outbox: &Outbox, connection: F) -> F::Output {
        let mut connection = std::pin::pin!(connection);
        Sending {
            connection: connection.as_mut(),
            outbox,
        }
        .await
    }

    /// Writes `data` to `outbox` as hyper does: a write, then a flush.
    fn write(outbox: &Outbox, cx: &mut Context<'_>, data: &[u8]) {
        let n = outbox.poll_write_vectored(cx, &[io::IoSlice::new(data)]);
        assert!(matches!(n, Poll::Ready(Ok(n)) if n == data.len()));
        assert!(matches!(outbox.poll_flush(), Poll::Ready(Ok(()))));
    }

    #[tokio::test]
    async fn the_writes_of_one_poll_reach_the_socket_together_when_it_ends() {
        let (outbox, mut far) = pair().await;
        let mut polled = false;
        let connection = std::future::poll_fn(|cx| {
            if polled {
                return Poll::Ready(());
            }
            polled = true;
            write(&outbox, cx, b"headers+data ");
            write(&outbox, cx, b"trailers");
            // Loopback delivers a send at once: nothing was sent yet.
            let mut peek = [0u8; 64];
            assert!(
                far.try_read(&mut peek).is_err(),
                "a flush reached the socket"
            );
            cx.waker().wake_by_ref();
            Poll::Pending
        });
        driven(&outbox, connection).await;
        let mut got = [0u8; 21];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"headers+data trailers");
    }

    #[tokio::test]
    async fn large_writes_held_writes_and_a_full_socket_keep_their_order_and_shutdown_sends_the_rest(
    ) {
        let (outbox, mut far) = pair().await;
        // Small, medium and over-the-limit writes, far more than a socket
        // holds while the peer does not read yet.
        let mut expected = Vec::new();
        let mut writes = Vec::new();
        for i in 0..600u32 {
            let len = match i % 3 {
                0 => 7,
                1 => 1500,
                _ => HELD + 3,
            };
            let chunk: Vec<u8> = (0..len).map(|j| (i as usize * 31 + j) as u8).collect();
            expected.extend_from_slice(&chunk);
            writes.push(chunk);
        }
        let reader = tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            let mut got = Vec::new();
            far.read_to_end(&mut got).await.unwrap();
            got
        });
        let writer = outbox.clone();
        let (mut next, mut offset) = (0usize, 0usize);
        let connection = std::future::poll_fn(move |cx| {
            // A few writes per poll, as hyper makes them; pending on a full socket.
            for _ in 0..4 {
                let Some(chunk) = writes.get(next) else {
                    return match writer.poll_shutdown(cx) {
                        Poll::Ready(done) => Poll::Ready(done),
                        Poll::Pending => Poll::Pending,
                    };
                };
                match writer.poll_write_vectored(cx, &[io::IoSlice::new(&chunk[offset..])]) {
                    Poll::Ready(Ok(n)) => {
                        offset += n;
                        if offset == chunk.len() {
                            (next, offset) = (next + 1, 0);
                        }
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            cx.waker().wake_by_ref();
            Poll::Pending
        });
        driven(&outbox, connection).await.unwrap();
        let got = reader.await.unwrap();
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "bytes out of order");
    }

    #[tokio::test]
    async fn a_write_through_reaches_the_socket_at_once_after_what_was_held() {
        let (outbox, far) = pair().await;
        let mut polled = false;
        let connection = std::future::poll_fn(|cx| {
            if polled {
                return Poll::Ready(());
            }
            polled = true;
            write(&outbox, cx, b"held ");
            let through = outbox.poll_write_through(cx, &[io::IoSlice::new(b"through")]);
            assert!(matches!(through, Poll::Ready(Ok(7))));
            // Before the poll ends: both are on the wire, in order.
            let mut got = [0u8; 12];
            let mut n = 0;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            while n < got.len() {
                match far.try_read(&mut got[n..]) {
                    Ok(read) => n += read,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        assert!(std::time::Instant::now() < deadline, "not sent at once");
                        std::thread::yield_now();
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            assert_eq!(&got, b"held through");
            cx.waker().wake_by_ref();
            Poll::Pending
        });
        driven(&outbox, connection).await;
    }

    #[tokio::test]
    async fn a_send_that_fails_at_the_end_of_a_poll_fails_the_next_write() {
        let (outbox, far) = pair().await;
        drop(far); // the peer is gone: a send gets a reset, then a broken pipe
        let mut failed = None;
        for _ in 0..50 {
            let outcome = std::future::poll_fn(|cx| {
                if let Poll::Ready(Err(e)) =
                    outbox.poll_write_vectored(cx, &[io::IoSlice::new(b"x")])
                {
                    return Poll::Ready(Some(e));
                }
                Poll::Ready(None)
            });
            if let Some(e) = driven(&outbox, outcome).await {
                failed = Some(e);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(failed.is_some(), "writes to a closed peer never failed");
    }
}
