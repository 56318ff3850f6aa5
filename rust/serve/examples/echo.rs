//! The ceiling of the serving bench: a bare hyper server on the same stack
//! as the native front-end (tokio, hyper-util's HTTP/1.1 + h2c builder), that
//! answers every request with its own body (and its
//! `Inference-Header-Content-Length`, `Content-Type`), no model, no batching.
//!
//!     cargo run --release -p ferrobatch-serve --example echo -- PORT [THREADS]

use std::convert::Infallible;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;

async fn echo(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut response = Response::new(Full::new(body));
    for name in ["content-type", "inference-header-content-length"] {
        if let Some(value) = parts.headers.get(name) {
            response.headers_mut().insert(name, value.clone());
        }
    }
    Ok(response)
}

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().and_then(|p| p.parse().ok()).unwrap_or(8000);
    let threads: usize = args.next().and_then(|t| t.parse().ok()).unwrap_or(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        println!("listening on 127.0.0.1:{port}");
        loop {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let builder = auto::Builder::new(TokioExecutor::new());
                let _ = builder
                    .serve_connection(TokioIo::new(stream), service_fn(echo))
                    .await;
            });
        }
    })
}
