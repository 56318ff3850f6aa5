//! Access-restricted APIs (Triton's `--http-restricted-api` and
//! `--grpc-restricted-protocol`) on a running front-end: a request to a
//! restricted category is refused without its header, or with another value
//! (HTTP 403, gRPC UNAVAILABLE), and answered as before with it; other
//! categories are not asked for it. On a connection beyond `max_connections`
//! too, whose health checks are otherwise answered.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferrobatch_serve::grpc::pb;
use ferrobatch_serve::restrict::Protocol;
use ferrobatch_serve::{
    Config, Fallback, FallbackRequest, FallbackResponse, Frontend, Listen, Restrictions, Withdraw,
};
use tokio::sync::oneshot;

const TOKEN: &str = "triton-access-token";
const GRPC_TOKEN: &str = "triton-grpc-protocol-triton-access-token";
const HTTP_REFUSAL: &str =
    r#"{"error":"This API is restricted, expecting header 'Triton-Access-Token'"}"#;
const GRPC_REFUSAL: &str =
    "This protocol is restricted, expecting header 'triton-grpc-protocol-triton-access-token'";

/// Answers every HTTP request it is asked 200 "fallback" (gRPC's:
/// UNIMPLEMENTED, the default).
struct Answers;

impl Fallback for Answers {
    fn call(
        &self,
        _: FallbackRequest,
        answer: oneshot::Sender<FallbackResponse>,
    ) -> Option<Withdraw> {
        let _ = answer.send(FallbackResponse {
            status: 200,
            headers: Vec::new(),
            body: b"fallback".to_vec(),
        });
        None
    }
}

/// A front-end on free ports of 127.0.0.1, ready, with these groups.
fn start(http: &[&str], grpc: &[&str], max_connections: usize) -> Frontend {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let config = Config {
        http_restricted_api: Restrictions::parse(http, Protocol::Http).unwrap(),
        grpc_restricted_protocol: Restrictions::parse(grpc, Protocol::Grpc).unwrap(),
        max_connections,
        ..Config::default()
    };
    let listen = Listen {
        http: Some(any),
        grpc: Some(any),
        ..Listen::default()
    };
    let frontend = Frontend::start(listen, config, Arc::new(Answers)).unwrap();
    frontend.set_ready(true);
    frontend
}

/// The status and body of `GET path` with `headers`, on a connection of its
/// own (closed after it).
fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let (status, body, _) = exchange(&mut stream, path, headers, true);
    (status, body)
}

/// `GET path` on `stream`: the status, the body and whether the server
/// closes the connection; `close`: the client asks it to.
fn exchange(
    stream: &mut TcpStream,
    path: &str,
    headers: &[(&str, &str)],
    close: bool,
) -> (u16, String, bool) {
    let mut request = format!("GET {path} HTTP/1.1\r\nhost: test\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    if close {
        request.push_str("connection: close\r\n");
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).unwrap();
    // The head, then as many bytes of body as it declares.
    let mut read = Vec::new();
    let mut byte = [0u8; 1];
    while !read.ends_with(b"\r\n\r\n") {
        assert_eq!(stream.read(&mut byte).unwrap(), 1, "the head ended early");
        read.push(byte[0]);
    }
    let head = String::from_utf8(read).unwrap().to_ascii_lowercase();
    let status = head[9..12].parse().unwrap();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length: "))
        .map_or(0, |n| n.trim().parse().unwrap());
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).unwrap();
    let closes = head.contains("\r\nconnection: close\r\n");
    (status, String::from_utf8(body).unwrap(), closes)
}

#[test]
fn a_restricted_http_api_is_refused_without_its_header_and_answered_with_it() {
    let frontend = start(&["health,statistics:Triton-Access-Token=abc"], &[], 10);
    let addr = frontend.local_addr().unwrap();
    for path in ["/v2/health/live", "/v2/models/stats", "/v2/models/m/ready"] {
        for wrong in [
            &[][..],
            &[(TOKEN, "ab")],
            &[(TOKEN, "ABC")],
            &[("x", "abc")],
        ] {
            let refused = get(addr, path, wrong);
            assert_eq!(refused, (403, HTTP_REFUSAL.to_owned()), "{path} {wrong:?}");
        }
    }
    // With it, in any case of its name: answered as before (natively, or by
    // the fallback).
    let with = [("TRITON-Access-Token", "abc")];
    assert_eq!(get(addr, "/v2/health/live", &with), (200, String::new()));
    assert_eq!(get(addr, "/v2/health/ready", &with), (200, String::new()));
    let fallback = (200, "fallback".to_owned());
    assert_eq!(get(addr, "/v2/models/stats", &with), fallback);
    assert_eq!(get(addr, "/v2/models/stats?x=1", &with), fallback);
    // Other categories, and paths of none, need no header.
    assert_eq!(get(addr, "/v2/models/m/config", &[]), fallback);
    assert_eq!(get(addr, "/metrics", &[]), fallback);
    assert_eq!(get(addr, "/v2", &[]), fallback);
}

#[test]
fn no_group_restricts_no_http_api() {
    let frontend = start(&[], &[], 10);
    let addr = frontend.local_addr().unwrap();
    assert_eq!(get(addr, "/v2/health/live", &[]), (200, String::new()));
    let fallback = (200, "fallback".to_owned());
    assert_eq!(get(addr, "/v2/models/stats", &[]), fallback);
}

#[test]
fn a_restricted_health_check_beyond_max_connections_needs_its_header_too() {
    let frontend = start(&["health:Triton-Access-Token=abc"], &[], 1);
    let addr = frontend.local_addr().unwrap();
    // The one connection of the pool, held open.
    let mut pooled = TcpStream::connect(addr).unwrap();
    pooled
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let (status, _, closes) = exchange(&mut pooled, "/metrics", &[], false);
    assert_eq!((status, closes), (200, false));
    // Each further connection answers one probe, then closes.
    let (status, body) = get(addr, "/v2/health/live", &[]);
    assert_eq!((status, body.as_str()), (403, HTTP_REFUSAL));
    let (status, body) = get(addr, "/v2/health/live", &[(TOKEN, "nope")]);
    assert_eq!((status, body.as_str()), (403, HTTP_REFUSAL));
    assert_eq!(
        get(addr, "/v2/health/live", &[(TOKEN, "abc")]),
        (200, String::new())
    );
    // What a probe connection never answers, it still refuses as before.
    let (status, body) = get(addr, "/metrics", &[(TOKEN, "abc")]);
    assert_eq!(status, 503, "{body}");
    drop(pooled);
}

/// A gRPC client of one HTTP/2 connection (h2, on a runtime of its own).
struct Client {
    runtime: tokio::runtime::Runtime,
    send: h2::client::SendRequest<Bytes>,
}

impl Client {
    fn connect(addr: SocketAddr) -> Client {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let send = runtime.block_on(async {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (send, connection) = h2::client::handshake(tcp).await.unwrap();
            tokio::spawn(connection);
            send
        });
        Client { runtime, send }
    }

    /// The status of a call to `method` sending `messages` (each framed)
    /// with `metadata`: the trailers' (or the head's, trailers-only).
    fn call(
        &mut self,
        method: &str,
        metadata: &[(&str, &str)],
        messages: &[Vec<u8>],
    ) -> tonic::Status {
        let mut request = hyper::Request::builder()
            .method("POST")
            .uri(format!(
                "http://test/inference.GRPCInferenceService/{method}"
            ))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        for (name, value) in metadata {
            request = request.header(*name, *value);
        }
        let request = request.body(()).unwrap();
        self.runtime.block_on(async {
            let send = self.send.clone().ready().await.unwrap();
            let mut send = send;
            let (response, mut body) = send.send_request(request, false).unwrap();
            let mut framed = Vec::new();
            for message in messages {
                framed.push(0);
                framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
                framed.extend_from_slice(message);
            }
            body.send_data(Bytes::from(framed), true).unwrap();
            let response = tokio::time::timeout(Duration::from_secs(10), response)
                .await
                .expect("an answer in time")
                .unwrap();
            if let Some(status) = tonic::Status::from_header_map(response.headers()) {
                return status; // trailers-only
            }
            let mut body = response.into_body();
            while let Some(data) = body.data().await {
                let data = data.unwrap();
                let _ = body.flow_control().release_capacity(data.len());
            }
            let trailers = body.trailers().await.unwrap().expect("trailers");
            tonic::Status::from_header_map(&trailers).expect("a grpc-status")
        })
    }
}

fn encoded(message: impl prost::Message) -> Vec<u8> {
    message.encode_to_vec()
}

#[test]
fn a_restricted_grpc_protocol_is_refused_without_its_header_and_answered_with_it() {
    let frontend = start(
        &[],
        &["health,inference,statistics:Triton-Access-Token=abc"],
        10,
    );
    let mut client = Client::connect(frontend.grpc_addr().unwrap());
    let live = encoded(pb::ServerLiveRequest {});
    let infer = encoded(pb::ModelInferRequest {
        model_name: "m".into(),
        ..Default::default()
    });
    let stats = encoded(pb::ModelStatisticsRequest::default());
    let no_message: &[Vec<u8>] = &[];
    let calls = [
        ("ServerLive", std::slice::from_ref(&live)),  // tonic's
        ("ModelInfer", std::slice::from_ref(&infer)), // answered without tonic
        ("ModelStreamInfer", no_message),             // the stream
        ("ModelStatistics", std::slice::from_ref(&stats)), // the fallback's
    ];
    for (method, messages) in calls {
        for wrong in [&[][..], &[(GRPC_TOKEN, "ab")], &[(TOKEN, "abc")]] {
            let refused = client.call(method, wrong, messages);
            assert_eq!(
                refused.code(),
                tonic::Code::Unavailable,
                "{method} {wrong:?}"
            );
            assert_eq!(refused.message(), GRPC_REFUSAL, "{method} {wrong:?}");
        }
    }
    // With it: answered as before.
    let with = [(GRPC_TOKEN, "abc")];
    assert_eq!(
        client.call("ServerLive", &with, &[live]).code(),
        tonic::Code::Ok
    );
    let unknown = client.call("ModelInfer", &with, &[infer]);
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
    let stream = client.call("ModelStreamInfer", &with, no_message);
    assert_eq!(stream.code(), tonic::Code::Ok, "{stream:?}");
    let stats = client.call("ModelStatistics", &with, &[stats]);
    assert_eq!(stats.code(), tonic::Code::Unimplemented, "{stats:?}");
    // Other categories need no header.
    let metadata = encoded(pb::ServerMetadataRequest {});
    let answered = client.call("ServerMetadata", &[], &[metadata]);
    assert_eq!(answered.code(), tonic::Code::Ok, "{answered:?}");
}

#[test]
fn a_restricted_grpc_health_check_beyond_max_connections_needs_its_header_too() {
    let frontend = start(&[], &["health:Triton-Access-Token=abc"], 1);
    let addr = frontend.grpc_addr().unwrap();
    let live = encoded(pb::ServerLiveRequest {});
    // The one connection of the pool, held open.
    let mut pooled = Client::connect(addr);
    let metadata = encoded(pb::ServerMetadataRequest {});
    assert_eq!(
        pooled.call("ServerMetadata", &[], &[metadata]).code(),
        tonic::Code::Ok
    );
    // Each further connection answers one probe, then closes.
    let refused = Client::connect(addr).call("ServerLive", &[], std::slice::from_ref(&live));
    assert_eq!(
        (refused.code(), refused.message()),
        (tonic::Code::Unavailable, GRPC_REFUSAL)
    );
    let with = [(GRPC_TOKEN, "abc")];
    let answered = Client::connect(addr).call("ServerLive", &with, &[live]);
    assert_eq!(answered.code(), tonic::Code::Ok, "{answered:?}");
    drop(pooled);
}
