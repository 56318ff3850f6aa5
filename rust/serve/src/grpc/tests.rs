use std::collections::HashMap;

use ferrobatch_core::v2::{Codec, OutputSpec};

use super::pb::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use super::*;

/// [`super::decode_inputs`] of prost's inputs, read as both front-ends
/// read them ([`InferRequest::of`]).
fn decode_inputs(
    inputs: &[InferInputTensor],
    raw: Vec<Bytes>,
    limits: Limits,
    check: InputCheck<'_>,
) -> Result<Decoded, Failure> {
    let mut request = ModelInferRequest {
        inputs: inputs.to_vec(),
        raw_input_contents: raw,
        ..Default::default()
    };
    let read = InferRequest::of(&mut request);
    super::decode_inputs(
        &read.inputs,
        read.raw_input_contents,
        limits,
        None,
        "m",
        check,
    )
}

/// [`super::requested_outputs`] of a prost request.
fn requested_outputs(
    request: &ModelInferRequest,
    codec: &Codec,
) -> Result<PerTensor<usize>, Failure> {
    let mut request = request.clone();
    let read = InferRequest::of(&mut request);

    super::requested_outputs(&read, codec).map(|(outputs, _, _)| outputs)
}

fn input(name: &str, datatype: &str, shape: &[i64]) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape: shape.to_vec(),
        parameters: HashMap::new(),
        contents: None,
    }
}

fn typed(mut tensor: InferInputTensor, contents: InferTensorContents) -> InferInputTensor {
    tensor.contents = Some(contents);
    tensor
}

/// A model that takes any input.
fn any_input(_: &str, _: DType, _: &[u64]) -> Result<(), Failure> {
    Ok(())
}

fn message(result: Result<Decoded, Failure>) -> String {
    match result {
        Ok(_) => panic!("decoded"),
        Err(failure) => {
            assert_eq!(failure.status, 400, "{}", failure.message);
            failure.message
        }
    }
}

#[test]
fn grpc_timeout_header_has_eight_digits_at_most_and_a_unit() {
    let ms = Duration::from_millis;
    assert_eq!(parse_grpc_timeout("50m"), Some(ms(50)));
    assert_eq!(
        parse_grpc_timeout("49999u"),
        Some(Duration::from_micros(49_999))
    );
    assert_eq!(parse_grpc_timeout("7S"), Some(ms(7000)));
    assert_eq!(parse_grpc_timeout("2M"), Some(ms(120_000)));
    assert_eq!(parse_grpc_timeout("1H"), Some(ms(3_600_000)));
    assert_eq!(
        parse_grpc_timeout("99999999n"),
        Some(Duration::from_nanos(99_999_999))
    );
    for bad in ["", "m", "123456789m", "5", "5x", "-5m", "5 m", "+5m", "5é"] {
        assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
    }
}

#[test]
fn the_smaller_of_the_timeout_parameter_and_the_calls_deadline_wins() {
    let us = |v: i64| {
        HashMap::from([(
            "timeout".to_owned(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::Int64Param(v)),
            },
        )])
    };
    let none = HashMap::new();
    let call = Some(Duration::from_millis(20));
    assert_eq!(timeout(&none, None), Ok(None));
    assert_eq!(timeout(&us(0), None), Ok(None));
    assert_eq!(timeout(&us(50_000), None), Ok(Some(0.05)));
    assert_eq!(timeout(&us(50_000), call), Ok(Some(0.02)));
    assert_eq!(timeout(&us(5_000), call), Ok(Some(0.005)));
    assert_eq!(timeout(&none, call), Ok(Some(0.02)));
    let refused = "parameter 'timeout' must be an int64 of microseconds >= 0";
    assert_eq!(timeout(&us(-1), None).unwrap_err().message, refused);
    let text = HashMap::from([(
        "timeout".to_owned(),
        InferParameter {
            parameter_choice: Some(ParameterChoice::StringParam("5".into())),
        },
    )]);
    assert_eq!(timeout(&text, None).unwrap_err().message, refused);
}

#[test]
fn raw_contents_are_checked_and_kept_as_they_are() {
    let inputs = [input("x", "FP32", &[2, 2]), input("b", "BOOL", &[1])];
    let raw = vec![Bytes::from(vec![0u8; 16]), Bytes::from_static(&[1])];
    let decoded = decode_inputs(&inputs, raw.clone(), Limits::default(), &mut any_input).unwrap();
    assert_eq!(decoded.owners.shared.as_slice(), raw.as_slice());
    assert!(decoded.owners.decoded.is_empty());
    let sources: Vec<&Source> = decoded.tensors.iter().map(|(.., s)| s).collect();
    assert_eq!(
        sources,
        [
            &Source::Shared {
                buffer: 0,
                range: 0..16
            },
            &Source::Shared {
                buffer: 1,
                range: 0..1
            }
        ]
    );
    assert_eq!(decoded.tensors[0].0, DType::Float32);
    assert_eq!(decoded.tensors[0].1.as_slice(), [2, 2]);

    let short = vec![Bytes::from(vec![0u8; 12]), Bytes::from_static(&[1])];
    let got = message(decode_inputs(
        &inputs,
        short,
        Limits::default(),
        &mut any_input,
    ));
    assert_eq!(got, "input 'x': FP32 shape [2, 2] needs 16 bytes, got 12");
    let not_bool = vec![Bytes::from(vec![0u8; 16]), Bytes::from_static(&[2])];
    let got = message(decode_inputs(
        &inputs,
        not_bool,
        Limits::default(),
        &mut any_input,
    ));
    assert_eq!(got, "input 'b': BOOL bytes must be 0 or 1");
    let one = vec![Bytes::from(vec![0u8; 16])];
    let got = message(decode_inputs(
        &inputs,
        one,
        Limits::default(),
        &mut any_input,
    ));
    assert_eq!(
        got,
        "raw_input_contents has 1 entries but the request has 2 inputs; give one per input, in order"
    );
}

#[test]
fn typed_contents_are_converted_once_with_the_codecs_messages() {
    let x = typed(
        input("x", "FP32", &[1, 3]),
        InferTensorContents {
            fp32_contents: vec![1.5, -2.0, 0.25],
            // Another kind's field is not read.
            int_contents: vec![7],
            ..Default::default()
        },
    );
    let n = typed(
        input("n", "INT8", &[2]),
        InferTensorContents {
            int_contents: vec![-128, 127],
            ..Default::default()
        },
    );
    let decoded = decode_inputs(
        &[x.clone(), n],
        Vec::new(),
        Limits::default(),
        &mut any_input,
    )
    .unwrap();
    let floats: Vec<u8> = [1.5f32, -2.0, 0.25]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(decoded.owners.decoded, vec![floats, vec![0x80, 0x7f]]);
    assert_eq!(decoded.tensors[1].2, Source::Decoded(1));

    let wide = typed(
        input("n", "INT8", &[1]),
        InferTensorContents {
            int_contents: vec![300],
            ..Default::default()
        },
    );
    let got = message(decode_inputs(
        &[wide],
        Vec::new(),
        Limits::default(),
        &mut any_input,
    ));
    assert_eq!(
        got,
        "input 'n': data is not valid INT8: 300 is out of range"
    );
    let few = typed(
        input("x", "FP64", &[2, 2]),
        InferTensorContents {
            fp64_contents: vec![1.0; 3],
            ..Default::default()
        },
    );
    let got = message(decode_inputs(
        &[few],
        Vec::new(),
        Limits::default(),
        &mut any_input,
    ));
    assert_eq!(got, "input 'x': shape [2, 2] needs 4 values, got 3");
    let absent = input("x", "UINT64", &[1]);
    let got = message(decode_inputs(
        &[absent],
        Vec::new(),
        Limits::default(),
        &mut any_input,
    ));
    assert_eq!(got, "input 'x': shape [1] needs 1 values, got 0");
    let fp16 = input("h", "FP16", &[1]);
    let got = message(decode_inputs(
        &[fp16],
        Vec::new(),
        Limits::default(),
        &mut any_input,
    ));
    assert_eq!(
        got,
        "input 'h': FP16 data must be sent in raw_input_contents"
    );
    let both = vec![Bytes::from(vec![0u8; 12])];
    let got = message(decode_inputs(&[x], both, Limits::default(), &mut any_input));
    assert_eq!(got, "input 'x' has both contents and raw_input_contents");
}

#[test]
fn headers_names_and_sizes_are_refused_before_any_data_is_read() {
    let limits = Limits {
        max_body_size: 1 << 20,
        max_elements: 10,
    };
    let got = message(decode_inputs(&[], Vec::new(), limits, &mut any_input));
    assert_eq!(got, "the request has no inputs");
    let got = message(decode_inputs(
        &[input("s", "BYTES", &[1])],
        Vec::new(),
        limits,
        &mut any_input,
    ));
    assert_eq!(got, "input 's': shape [1] needs 1 values, got 0");
    let got = message(decode_inputs(
        &[input("x", "FP32", &[-1, 2])],
        Vec::new(),
        limits,
        &mut any_input,
    ));
    assert!(got.contains("non-negative integers"), "{got}");
    let twice = [input("x", "INT32", &[1]), input("x", "INT32", &[1])];
    let raw = vec![Bytes::from(vec![0u8; 4]), Bytes::from(vec![0u8; 4])];
    assert_eq!(
        message(decode_inputs(&twice, raw, limits, &mut any_input)),
        "input 'x' is given twice"
    );
    // The limit is on all inputs together, named as configured.
    let big = [input("a", "INT8", &[6]), input("b", "INT8", &[6])];
    let raw = vec![Bytes::from(vec![0u8; 6]), Bytes::from(vec![0u8; 6])];
    let got = message(decode_inputs(&big, raw, limits, &mut any_input));
    assert_eq!(
        got,
        "input 'b': shape [6] is over the limit of 10 elements per request"
    );
    let huge = [input("x", "FP32", &[1, 1 << 40])];
    let got = message(decode_inputs(
        &huge,
        vec![Bytes::new()],
        limits,
        &mut any_input,
    ));
    assert!(got.contains("over the limit of 10 elements"), "{got}");
}

#[test]
fn requested_outputs_are_named_outputs_of_the_model() {
    let codec = Codec::new(
        "m",
        vec![
            OutputSpec {
                name: "y".into(),
                dtype: DType::Float32,
            },
            OutputSpec {
                name: "n".into(),
                dtype: DType::Int64,
            },
        ],
        Limits::default(),
    );
    let mut request = ModelInferRequest::default();
    assert_eq!(
        requested_outputs(&request, &codec),
        Ok([0, 1].into_iter().collect())
    );
    let wanted = |name: &str| InferRequestedOutputTensor {
        name: name.into(),
        parameters: HashMap::new(),
    };
    request.outputs = vec![wanted("n")];
    assert_eq!(
        requested_outputs(&request, &codec),
        Ok([1].into_iter().collect())
    );
    request.outputs = vec![wanted("n"), wanted("q")];
    let refused = requested_outputs(&request, &codec).unwrap_err();
    assert_eq!(
        refused.message,
        "unknown output 'q' for model 'm'; outputs: y, n"
    );
    // Each entry is answered in full: a repeat would multiply the reply.
    request.outputs = vec![wanted("y"), wanted("n"), wanted("y")];
    let refused = requested_outputs(&request, &codec).unwrap_err();
    assert_eq!(
        (refused.status, refused.message.as_str()),
        (400, "output 'y' is asked for twice")
    );
    let mut classified = wanted("y");
    classified
        .parameters
        .insert("classification".into(), InferParameter::default());
    request.outputs = vec![classified];
    let refused = requested_outputs(&request, &codec).unwrap_err();
    assert_eq!(
        refused.message,
        "invalid value type for 'classification' parameter, expected int64_param"
    );
    let count = |n: i64| InferParameter {
        parameter_choice: Some(ParameterChoice::Int64Param(n)),
    };
    request.outputs[0]
        .parameters
        .insert("classification".into(), count(0));
    let refused = requested_outputs(&request, &codec).unwrap_err();
    assert_eq!(
        (refused.status, refused.message.as_str()),
        (
            400,
            "invalid value for 'classification' parameter, expected >= 0"
        )
    );
    // A count: answered as that many classes; the others as they are.
    request.outputs[0]
        .parameters
        .insert("classification".into(), count(3));
    request.outputs.insert(0, wanted("n"));
    let mut read_from = request.clone();
    let read = InferRequest::of(&mut read_from);
    let (outputs, _, classes) = super::requested_outputs(&read, &codec).unwrap();
    assert_eq!(
        (&outputs[..], &classes[..]),
        (&[1, 0][..], &[None, Some(3)][..])
    );
}

#[test]
fn failures_map_to_the_python_servicers_statuses() {
    let code = |status_code: u16| status(Failure::new(status_code, "m")).code();
    assert_eq!(code(400), Code::InvalidArgument);
    assert_eq!(code(503), Code::Unavailable);
    assert_eq!(code(504), Code::DeadlineExceeded);
    assert_eq!(code(500), Code::Internal);
    assert_eq!(code(413), Code::ResourceExhausted);
    assert_eq!(code(418), Code::Internal);
    assert_eq!(status(Failure::new(400, "why")).message(), "why");
}

#[test]
fn the_models_rule_refuses_an_input_before_its_data_is_converted() {
    // FP64 contents of 3 values for a shape of 2: converting would fail on
    // the count; the model's rule (FP32 only) is met first.
    let sent = [typed(
        input("x", "FP64", &[1, 2]),
        InferTensorContents {
            fp64_contents: vec![1.0, 2.0, 3.0],
            ..Default::default()
        },
    )];
    let mut checked = Vec::new();
    let mut fp32_only = |name: &str, dtype: DType, shape: &[u64]| {
        checked.push((name.to_owned(), shape.to_vec()));
        match dtype {
            DType::Float32 => Ok(()),
            other => Err(Failure::new(
                400,
                format!(
                    "input '{name}': expected dtype float32, got {}",
                    other.name()
                ),
            )),
        }
    };
    let got = message(decode_inputs(
        &sent,
        Vec::new(),
        Limits::default(),
        &mut fp32_only,
    ));
    assert_eq!(got, "input 'x': expected dtype float32, got float64");
    assert_eq!(checked, [("x".to_owned(), vec![1, 2])]);
}

#[test]
fn a_grpc_content_type_begins_with_application_grpc() {
    let is = |v: &str| is_grpc(Some(&HeaderValue::from_str(v).unwrap()));
    for ok in [
        "application/grpc",
        "application/grpc+proto",
        "application/grpc;charset=utf-8",
        "Application/GRPC",
    ] {
        assert!(is(ok), "{ok}");
    }
    for refused in [
        "application/grpcx",
        "application/json",
        "application/grp",
        "",
    ] {
        assert!(!is(refused), "{refused}");
    }
    assert!(!is_grpc(None));
}

/// hyper moves each HTTP/2 stream's future several times as it spawns it:
/// at 2.9 KiB (the request's head inside, tonic's call beside it) a
/// `ModelInfer` call took 1.1–1.25 × the server CPU it takes now (two A/Bs
/// in benches/README.md).
#[test]
fn a_model_infer_call_future_stays_small() {
    fn future_size<F: Fn(A) -> R, A, R>(_: F) -> usize {
        std::mem::size_of::<R>()
    }
    let size = future_size(super::ModelInferCall::answer);
    assert!(
        size <= 1024,
        "ModelInferCall::answer's future is {size} bytes"
    );
}

/// Each level's coding among those a call accepts, ranked as gRPC's own
/// servers rank them (the Python front-end's grpcio, checked against the
/// same table in tests/test_grpc_compression.py).
#[test]
fn a_response_is_coded_by_its_level_among_what_the_call_accepts() {
    use ResponseCompression::{High, Low, Medium, None as Plain};
    let accepts = |value: &'static str| HeaderValue::from_static(value);
    let both = accepts("identity,deflate,gzip");
    assert_eq!(Low.coding(Some(&both)), Some(Coding::Gzip));
    assert_eq!(Medium.coding(Some(&both)), Some(Coding::Deflate));
    assert_eq!(
        High.coding(Some(&accepts("gzip, deflate"))),
        Some(Coding::Deflate)
    );
    assert_eq!(
        High.coding(Some(&accepts("identity,GZIP"))),
        Some(Coding::Gzip)
    );
    assert_eq!(Low.coding(Some(&accepts("deflate"))), Some(Coding::Deflate));
    assert_eq!(Low.coding(Some(&accepts("identity,br"))), None);
    assert_eq!(Low.coding(None), None);
    assert_eq!(Plain.coding(Some(&both)), None);
    assert_eq!(ResponseCompression::named("medium"), Some(Medium));
    assert_eq!(ResponseCompression::named("max"), None);
}
