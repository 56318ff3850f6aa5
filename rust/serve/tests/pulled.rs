//! A fallback answer whose body goes on in [`Chunks`]: the chunks are pulled
//! one at a time as the connection takes them (an empty one sends nothing:
//! it does not end a chunked body), the body ends when they do, and the chunks
//! are closed once however the response ends: at their end, or when the
//! client leaves mid-stream.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrobatch_serve::{
    Chunks, Config, Fallback, FallbackRequest, FallbackResponse, Frontend, Listen, Withdraw,
};
use tokio::sync::oneshot;

/// Chunks from a list, then (`endless`) "tick" forever; counts its pulls and closes.
struct Listed {
    chunks: Mutex<Vec<&'static [u8]>>,
    endless: bool,
    pulls: AtomicUsize,
    closes: AtomicUsize,
}

impl Chunks for Listed {
    fn next(&self, answer: oneshot::Sender<Option<Vec<u8>>>) -> Option<Withdraw> {
        self.pulls.fetch_add(1, Ordering::SeqCst);
        let mut chunks = self.chunks.lock().unwrap();
        let next = if chunks.is_empty() {
            self.endless.then(|| b"tick".to_vec())
        } else {
            Some(chunks.remove(0).to_vec())
        };
        let _ = answer.send(next);
        None
    }

    fn close(&self) {
        self.closes.fetch_add(1, Ordering::SeqCst);
    }
}

/// Answers every request 200 with `first`, then `chunks`.
struct Streams {
    first: &'static [u8],
    chunks: Arc<Listed>,
}

impl Fallback for Streams {
    fn call(
        &self,
        _: FallbackRequest,
        answer: oneshot::Sender<FallbackResponse>,
    ) -> Option<Withdraw> {
        let _ = answer.send(FallbackResponse {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            body: self.first.to_vec(),
            rest: Some(self.chunks.clone()),
        });
        None
    }
}

fn start(
    first: &'static [u8],
    chunks: Vec<&'static [u8]>,
    endless: bool,
) -> (Frontend, Arc<Listed>) {
    let listed = Arc::new(Listed {
        chunks: Mutex::new(chunks),
        endless,
        pulls: AtomicUsize::new(0),
        closes: AtomicUsize::new(0),
    });
    let listen = Listen {
        http: Some("127.0.0.1:0".parse::<SocketAddr>().unwrap()),
        ..Listen::default()
    };
    let fallback = Arc::new(Streams {
        first,
        chunks: listed.clone(),
    });
    let frontend = Frontend::start(listen, Config::default(), fallback).unwrap();
    frontend.set_ready(true);
    (frontend, listed)
}

fn request(addr: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let request = "POST /v2/models/m/generate_stream HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
    stream.write_all(request.as_bytes()).unwrap();
    stream
}

fn wait_for(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn the_chunks_follow_the_first_bytes_in_order_and_are_closed_at_their_end() {
    let (frontend, listed) = start(b"first;", vec![b"a;", b"", b"b;"], false);
    let mut stream = request(frontend.local_addr().unwrap());
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let head = head.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    assert!(!head.contains("content-length"), "{head}");
    // The chunked body, decoded: each chunk is `size\r\ndata\r\n`, then `0\r\n\r\n`.
    let mut decoded = String::new();
    let mut rest = body;
    loop {
        let (size, after) = rest.split_once("\r\n").unwrap();
        let size = usize::from_str_radix(size, 16).unwrap();
        if size == 0 {
            break;
        }
        decoded.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
    assert_eq!(decoded, "first;a;b;");
    // Three chunks and the end: four pulls, one after another; one close.
    assert_eq!(listed.pulls.load(Ordering::SeqCst), 4);
    wait_for("closed", || listed.closes.load(Ordering::SeqCst) == 1);
    frontend.stop(Duration::from_secs(5));
    assert_eq!(listed.closes.load(Ordering::SeqCst), 1);
}

#[test]
fn a_client_that_leaves_mid_stream_closes_the_chunks_and_pulls_stop() {
    let (frontend, listed) = start(b"", Vec::new(), true);
    let mut stream = request(frontend.local_addr().unwrap());
    let mut got = Vec::new();
    let mut buffer = [0u8; 4096];
    while got.windows(4).filter(|w| w == b"tick").count() < 3 {
        let n = stream.read(&mut buffer).unwrap();
        assert!(n > 0, "the stream ended early");
        got.extend_from_slice(&buffer[..n]);
    }
    drop(stream);
    wait_for("closed when the client left", || {
        listed.closes.load(Ordering::SeqCst) == 1
    });
    let pulls = listed.pulls.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        listed.pulls.load(Ordering::SeqCst),
        pulls,
        "pulled after the close"
    );
    frontend.stop(Duration::from_secs(5));
    assert_eq!(listed.closes.load(Ordering::SeqCst), 1);
}
