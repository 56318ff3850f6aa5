//! A `ModelInfer` call's protobuf work on the native gRPC front-end, for the
//! serving benchmark's request (`x`: FP32[1, 256] as raw contents, asking for
//! `y`, as tritonclient sends it) and its answer: reading the message where
//! it lies (`InferRequest::decode`: strings borrowed, raw contents slices of
//! the received bytes), reading it into a submission (`read_infer_call`:
//! inputs checked, requested outputs, priority, deadline), and writing the
//! answer from its rows into a framed buffer (`InferResponse::framed`, as the
//! model's worker does). Beside them, the references: prost's decode alone
//! (how requests were decoded before) and with the read into a submission;
//! the answer built as a prost message
//! from the same rows, encoded and framed (how it was written before); and
//! prost's encode of that message already built. What these cost, against
//! the 25–45 µs of server CPU a gRPC request takes on one core
//! (benches/README.md), is what the protobuf work can still save.
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
use ferrobatch_serve::grpc::pb::model_infer_response::InferOutputTensor;
use ferrobatch_serve::grpc::pb::{ModelInferRequest, ModelInferResponse};
use ferrobatch_serve::grpc::read_infer_call;
use ferrobatch_serve::grpc::request::InferRequest;
use ferrobatch_serve::grpc::response::{InferResponse, OutputRows};
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

    let in_place = |wire: &Bytes| {
        InferRequest::decode(wire)
            .map(|r| r.inputs.len())
            .expect("the bench's request decodes")
    };
    // The timed paths are the successful ones: checked once before timing.
    let mut request = InferRequest::decode(&wire).expect("the bench's request decodes");
    assert!(
        read_infer_call(&mut request, &codec, None, &[], false, &mut accept).is_ok(),
        "the bench's request is read"
    );

    let mut group = c.benchmark_group("grpc/request");
    group.bench_function("reference: prost decode", |b| {
        b.iter(|| black_box(decode(black_box(&wire))))
    });
    group.bench_function("decoded in place", |b| {
        b.iter(|| black_box(in_place(black_box(&wire))))
    });
    group.bench_function("reference: prost decode, read into a submission", |b| {
        b.iter(|| {
            let mut owned = decode(black_box(&wire));
            let mut request = InferRequest::of(&mut owned);
            black_box(read_infer_call(&mut request, &codec, None, &[], false, &mut accept).ok())
        })
    });
    group.bench_function("decoded in place, read into a submission", |b| {
        b.iter(|| {
            let mut request = InferRequest::decode(black_box(&wire)).expect("decodes");
            black_box(read_infer_call(&mut request, &codec, None, &[], false, &mut accept).ok())
        })
    });
    group.finish();

    // The request's rows of the batch's output, as the worker cuts them.
    let rows = vec![0x3fu8; WIDTH as usize * 4];
    let shape = [1, WIDTH];
    let built = |rows: &[u8]| ModelInferResponse {
        model_name: "identity".to_owned(),
        model_version: "1".to_owned(),
        id: String::new(),
        parameters: Default::default(),
        outputs: vec![InferOutputTensor {
            name: "y".to_owned(),
            datatype: "FP32".to_owned(),
            shape: shape.iter().map(|&d| d as i64).collect(),
            parameters: Default::default(),
            contents: None,
        }],
        raw_output_contents: vec![Bytes::copy_from_slice(rows)],
    };
    let prost_framed = |message: &ModelInferResponse| {
        let length = prost::Message::encoded_len(message);
        let mut framed = Vec::with_capacity(PREFIX + length);
        framed.push(0);
        framed.extend_from_slice(&(length as u32).to_be_bytes());
        prost::Message::encode(message, &mut framed).expect("the bench's answer encodes");
        framed
    };
    let written = |rows: &[u8]| {
        let outputs = [OutputRows {
            index: 0,
            shape: &shape,
            data: rows,
            classified: false,
        }];
        InferResponse::new(&codec, "identity", "", &outputs)
            .framed()
            .expect("the bench's answer frames")
    };
    let message = built(&rows);
    assert_eq!(
        written(&rows),
        prost_framed(&message),
        "the answer written is prost's, byte for byte"
    );
    let mut group = c.benchmark_group("grpc/answer");
    group.bench_function("reference: prost encode of a built answer", |b| {
        b.iter(|| black_box(prost_framed(black_box(&message))))
    });
    group.bench_function(
        "reference: built from the rows, prost encode, framed",
        |b| b.iter(|| black_box(prost_framed(&built(black_box(&rows))))),
    );
    group.bench_function("written from the rows, framed", |b| {
        b.iter(|| black_box(written(black_box(&rows))))
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
