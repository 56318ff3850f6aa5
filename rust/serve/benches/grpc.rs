//! A `ModelInfer` call's protobuf work on the native gRPC front-end, for the
//! serving benchmark's request (`x`: FP32[1, 256] as raw contents, asking for
//! `y`, as tritonclient sends it) and its answer: decoding the message
//! (prost, raw contents as slices of the received bytes), reading it into a
//! submission (`read_infer_call`: inputs checked, requested outputs, priority,
//! deadline), and building and encoding the answer into a framed buffer.
//! Beside them, the reference: prost's decode alone, and prost's encode of an
//! answer already built. What these cost, against the 25–45 µs of server CPU
//! a gRPC request takes on one core (benches/README.md), is what a decoder
//! that skipped prost's owned strings could save.
//!
//! Run: `cargo bench -p ferrobatch-serve --bench grpc` (or `make bench`).

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use ferrobatch_core::v2::{Codec, Limits, OutputSpec};
use ferrobatch_core::DType;
use ferrobatch_serve::grpc::pb::model_infer_request::{
    InferInputTensor, InferRequestedOutputTensor,
};
use ferrobatch_serve::grpc::pb::ModelInferRequest;
use ferrobatch_serve::grpc::{infer_answer, read_infer_call};
use ferrobatch_serve::replies::RawOutput;
use ferrobatch_serve::Failure;

const WIDTH: u64 = 256;
/// gRPC's message prefix: a compressed flag and a big-endian u32 length.
const PREFIX: usize = 5;

fn request() -> Bytes {
    let message = ModelInferRequest {
        model_name: "identity".into(),
        inputs: vec![InferInputTensor {
            name: "x".into(),
            datatype: "FP32".into(),
            shape: vec![1, WIDTH as i64],
            ..Default::default()
        }],
        outputs: vec![InferRequestedOutputTensor {
            name: "y".into(),
            ..Default::default()
        }],
        raw_input_contents: vec![Bytes::from(vec![0x3f; WIDTH as usize * 4])],
        ..Default::default()
    };
    Bytes::from(prost::Message::encode_to_vec(&message))
}

fn bench_grpc(c: &mut Criterion) {
    let codec = Codec::new(
        "identity",
        vec![OutputSpec {
            name: "y".into(),
            dtype: DType::Float32,
        }],
        Limits::default(),
    );
    let wire = request();
    let decode = |wire: &Bytes| -> ModelInferRequest {
        prost::Message::decode(wire.clone()).expect("the bench's request decodes")
    };
    let mut accept = |_: &str, _: DType, _: &[u64]| -> Result<(), Failure> { Ok(()) };

    // The timed paths are the successful ones: checked once before timing.
    assert!(
        read_infer_call(&mut decode(&wire), &codec, None, &[], false, &mut accept).is_ok(),
        "the bench's request is read"
    );

    let mut group = c.benchmark_group("grpc/request");
    group.bench_function("reference: prost decode", |b| {
        b.iter(|| black_box(decode(black_box(&wire))))
    });
    group.bench_function("decode and read into a submission", |b| {
        b.iter(|| {
            let mut request = decode(black_box(&wire));
            black_box(read_infer_call(&mut request, &codec, None, &[], false, &mut accept).ok())
        })
    });
    group.finish();

    let data = Bytes::from(vec![0x3f; WIDTH as usize * 4]);
    let answer = |data: &Bytes| {
        let outputs = vec![RawOutput {
            index: 0,
            shape: [1, WIDTH].into_iter().collect(),
            data: data.clone(),
        }];
        infer_answer(&codec, "identity", "", outputs, None)
    };
    let built = answer(&data);
    let mut framed = vec![0u8; PREFIX + built.encoded_len()];
    built
        .encode(&mut framed[PREFIX..])
        .expect("the bench's answer encodes");
    let mut group = c.benchmark_group("grpc/answer");
    group.bench_function("reference: prost encode of a built answer", |b| {
        b.iter(|| {
            let mut framed = vec![0u8; PREFIX + built.encoded_len()];
            built.encode(&mut framed[PREFIX..]).ok();
            black_box(framed)
        })
    });
    group.bench_function("build, encode and frame", |b| {
        b.iter(|| {
            let answer = answer(black_box(&data));
            let mut framed = vec![0u8; PREFIX + answer.encoded_len()];
            answer.encode(&mut framed[PREFIX..]).ok();
            black_box(framed)
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench_grpc
}
criterion_main!(benches);
