//! The v2 codec on the serving benchmark's request (`{"x": FP32[1, 256]}`)
//! and its response (`y`: FP32[1, 256]): decoding JSON and binary bodies,
//! encoding JSON and binary responses, beside the reference
//! `serde_json::from_slice` of the same JSON body into a `Value` tree (what
//! a generic JSON parser costs before any tensor is built), and Triton's
//! generate extension on the same tensors (`codec/generate`: the request
//! turned into the v2 one, the answer written flat). Reported
//! in bytes/s of body.
//!
//! Run: `cargo bench --bench codec`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ferrobatch_core::v2::generate::{self, GenerateInput};
use ferrobatch_core::v2::{Codec, Limits, Output, OutputSpec};
use ferrobatch_core::DType;

const WIDTH: usize = 256;

fn values() -> Vec<f32> {
    // Typical activations: not round numbers, so formatting does real work.
    (0..WIDTH).map(|i| (i as f32 * 0.37).sin() * 3.1).collect()
}

/// The request's JSON body, its floats spelt shortest for `f32` (about 9
/// digits), or, `widened`, as a Python client spells them (`float` of each
/// `f32`, shortest for `f64`: 17 significant digits, beyond the 15-digit
/// fast path of a float parser).
fn json_body(values: &[f32], widened: bool) -> Vec<u8> {
    let data: Vec<String> = values
        .iter()
        .map(|&v| {
            if widened {
                format!("{}", f64::from(v))
            } else {
                format!("{v}")
            }
        })
        .collect();
    format!(
        r#"{{"id":"bench","inputs":[{{"name":"x","datatype":"FP32","shape":[1,{WIDTH}],"data":[{}]}}],"outputs":[{{"name":"y","parameters":{{"binary_data":false}}}}]}}"#,
        data.join(",")
    )
    .into_bytes()
}

fn binary_body(values: &[f32]) -> (Vec<u8>, String) {
    let header = format!(
        r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[1,{WIDTH}],"parameters":{{"binary_data_size":{}}}}}],"outputs":[{{"name":"y","parameters":{{"binary_data":true}}}}]}}"#,
        WIDTH * 4
    );
    let mut body = header.clone().into_bytes();
    body.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    (body, header.len().to_string())
}

fn bench_codec(c: &mut Criterion) {
    let codec = Codec::new(
        "mlp",
        vec![OutputSpec {
            name: "y".into(),
            dtype: DType::Float32,
        }],
        Limits::default(),
    );
    let values = values();
    let json = json_body(&values, false);
    let json17 = json_body(&values, true);
    let (binary, header_length) = binary_body(&values);
    let out: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let shape = [1u64, WIDTH as u64];

    let mut group = c.benchmark_group("codec/decode");
    group.throughput(Throughput::Bytes(json.len() as u64));
    group.bench_function("json 256 x FP32", |b| {
        b.iter(|| black_box(codec.decode(black_box(&json), None).unwrap()))
    });
    group.throughput(Throughput::Bytes(json17.len() as u64));
    group.bench_function("json 256 x FP32, 17 digits", |b| {
        b.iter(|| black_box(codec.decode(black_box(&json17), None).unwrap()))
    });
    group.bench_function(
        "reference: serde_json::from_slice to Value, 17 digits",
        |b| {
            b.iter(|| {
                black_box(serde_json::from_slice::<serde_json::Value>(black_box(&json17)).unwrap())
            })
        },
    );
    group.throughput(Throughput::Bytes(json.len() as u64));
    group.bench_function("reference: serde_json::from_slice to Value", |b| {
        b.iter(|| black_box(serde_json::from_slice::<serde_json::Value>(black_box(&json)).unwrap()))
    });
    // Token ids, as a language model's INT64 input carries them over JSON.
    let ids: Vec<String> = (0..512).map(|i| ((i * 7919) % 32000).to_string()).collect();
    let tokens = format!(
        r#"{{"inputs":[{{"name":"x","datatype":"INT64","shape":[1,512],"data":[{}]}}]}}"#,
        ids.join(", ")
    )
    .into_bytes();
    group.throughput(Throughput::Bytes(tokens.len() as u64));
    group.bench_function("json 512 x INT64, token ids", |b| {
        b.iter(|| black_box(codec.decode(black_box(&tokens), None).unwrap()))
    });
    group.throughput(Throughput::Bytes(binary.len() as u64));
    group.bench_function("binary 256 x FP32", |b| {
        b.iter(|| {
            black_box(
                codec
                    .decode(black_box(&binary), Some(&header_length))
                    .unwrap(),
            )
        })
    });
    group.finish();

    let mut group = c.benchmark_group("codec/encode");
    for (name, binary) in [("json 256 x FP32", false), ("binary 256 x FP32", true)] {
        let outputs = [Output {
            index: 0,
            shape: &shape,
            data: &out,
            binary,
            classified: false,
        }];
        let size = codec.encode(Some("bench"), &outputs).unwrap().body.len();
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_function(name, |b| {
            b.iter(|| black_box(codec.encode(Some("bench"), black_box(&outputs)).unwrap()))
        });
    }
    group.finish();

    // Triton's generate extension on the same tensors: `{"x": [256 floats]}`
    // (17 digits, as Python's json writes them) to the v2 request it stands
    // for, and the answer written flat, `{..., "y": [...]}`; the whole
    // request's path beside the v2 JSON one above (decode, encode).
    let mut group = c.benchmark_group("codec/generate");
    let floats: Vec<String> = values
        .iter()
        .map(|&v| format!("{}", f64::from(v)))
        .collect();
    let request = format!(r#"{{"x":[{}]}}"#, floats.join(",")).into_bytes();
    let inputs = [GenerateInput {
        name: "x",
        datatype: "FP32",
        shape: &[-1, WIDTH as i64],
    }];
    let outputs = [Output {
        index: 0,
        shape: &shape,
        data: &out,
        binary: false,
        classified: false,
    }];
    let answer = codec.encode_generate(None, &outputs).unwrap();
    group.throughput(Throughput::Bytes(request.len() as u64));
    group.bench_function("request 256 x FP32, 17 digits, to v2", |b| {
        b.iter(|| black_box(generate::infer_request(black_box(&request), &inputs).unwrap()))
    });
    group.throughput(Throughput::Bytes(answer.len() as u64));
    group.bench_function("answer 256 x FP32 written in one pass", |b| {
        b.iter(|| black_box(codec.encode_generate(None, black_box(&outputs)).unwrap()))
    });
    group.throughput(Throughput::Bytes(request.len() as u64));
    group.bench_function("whole: request, decode, answer", |b| {
        b.iter(|| {
            let v2 = generate::infer_request(black_box(&request), &inputs).unwrap();
            black_box(codec.decode(&v2, None).unwrap());
            black_box(codec.encode_generate(None, black_box(&outputs)).unwrap())
        })
    });
    group.bench_function("reference: v2 JSON decode, encode", |b| {
        b.iter(|| {
            black_box(codec.decode(black_box(&json17), None).unwrap());
            black_box(codec.encode(None, black_box(&outputs)).unwrap())
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench_codec
}
criterion_main!(benches);
