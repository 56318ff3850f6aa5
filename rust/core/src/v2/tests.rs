use std::borrow::Cow;

use proptest::prelude::*;

use super::*;

fn codec() -> Codec {
    Codec::new(
        "double",
        vec![
            OutputSpec {
                name: "y".into(),
                dtype: DType::Float32,
            },
            OutputSpec {
                name: "z".into(),
                dtype: DType::Int64,
            },
        ],
        Limits::default(),
    )
}

fn decode(body: &str) -> Result<InferRequest, V2Error> {
    codec().decode(body.as_bytes(), None)
}

fn error(body: &str) -> String {
    let e = decode(body).expect_err(body);
    assert_eq!(e.status(), 400, "{e}");
    e.to_string()
}

fn f32s(data: &Data) -> Vec<f32> {
    let Data::Owned(bytes) = data else {
        panic!("expected owned data")
    };
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn fp32_and_int_data_refuse_what_json_refuses_between_plain_numbers() {
    // Each bad spelling with plain numbers after it, so that a fused run
    // reading past it would find a whole document's worth of bytes, and a
    // shape counting it as one value.
    for bad in [
        "01", "-01", "1.", "-", "1e", "", ".5", "+2", "2.5x", "2.5 2.5", "1.5.5", "0x10", "1_0",
    ] {
        let data = format!("[1.5, {bad}, 7.25, 7.25, 7.25, 7.25]");
        let count = data.matches(',').count() + 1;
        let body = format!(
            r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[{count}],"data":{data}}}]}}"#
        );
        error(&body);
    }
    for bad in ["01", "-01", "-", "1e", "1.", "+2", "2x", "2 2", "0x10"] {
        let data = format!("[1, {bad}, 7, 7, 7, 7, 7, 7]");
        let count = data.matches(',').count() + 1;
        let body = format!(
            r#"{{"inputs":[{{"name":"x","datatype":"INT64","shape":[{count}],"data":{data}}}]}}"#
        );
        error(&body);
    }
    for data in ["[1.5 ,2.5]", "[1.5, 2.5 ]", "[ 1.5,\n2.5]", "[-0.0, 0]"] {
        let body =
            format!(r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[2],"data":{data}}}]}}"#);
        let got = f32s(&decode(&body).unwrap().inputs[0].data);
        assert_eq!(got.len(), 2, "{data}");
    }
    let body = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[-0.0, 0]}]}"#;
    let got = f32s(&decode(body).unwrap().inputs[0].data);
    assert_eq!(
        (got[0].to_bits(), got[1].to_bits()),
        ((-0.0f32).to_bits(), 0)
    );
}

#[test]
fn decodes_flat_and_nested_json_data() {
    for data in ["[1, 2.5, -3, 4e0]", "[[1, 2.5], [-3, 4e0]]"] {
        let body = format!(
            r#"{{"id":"r-1","inputs":[{{"name":"x","datatype":"FP32","shape":[2,2],"data":{data}}}]}}"#
        );
        let request = decode(&body).unwrap();
        assert_eq!(request.id.as_deref(), Some("r-1"));
        assert_eq!(request.inputs.len(), 1);
        assert_eq!(request.inputs[0].shape.as_slice(), [2, 2]);
        assert_eq!(f32s(&request.inputs[0].data), vec![1.0, 2.5, -3.0, 4.0]);
        assert_eq!(request.outputs, None);
        assert_eq!(request.timeout, None);
    }
}

#[test]
fn data_before_its_datatype_and_shape_is_decoded_once_they_are_known() {
    let request =
        decode(r#"{"inputs":[{"data":[1,2],"shape":[1,2],"name":"x","datatype":"INT16"}]}"#)
            .unwrap();
    assert_eq!(request.inputs[0].data, Data::Owned(vec![1, 0, 2, 0]));
}

#[test]
fn parameters_and_requested_outputs() {
    let body = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]}],
            "outputs":[{"name":"z"},{"name":"y","parameters":{"binary_data":false}}],
            "parameters":{"timeout":50000,"binary_data_output":true,"other":[1,{"a":null}]}}"#;
    let request = decode(body).unwrap();
    assert_eq!(request.timeout, Some(0.05));
    assert_eq!(
        request.parameters.clone().map(|span| &body[span]),
        Some(r#"{"timeout":50000,"binary_data_output":true,"other":[1,{"a":null}]}"#),
        "the object's text, for models that ask for it"
    );
    assert_eq!(request.priority, None);
    assert!(request.binary_data_output);
    assert_eq!(
        request.selected_outputs(&codec()).as_slice(),
        [(1, true), (0, false)]
    );
    // An empty list names none: every output, as with no list.
    let every =
        r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]}],"outputs":[]}"#;
    let every = decode(every).unwrap();
    assert_eq!(
        every.selected_outputs(&codec()).as_slice(),
        [(0, false), (1, false)]
    );
    for (timeout, expected) in [
        ("0", None),
        // Passed on: the batcher treats a timeout too long to represent as none.
        ("Infinity", Some(f64::INFINITY)),
        ("1e25", Some(1e19)),
        ("1", Some(1e-6)),
    ] {
        let body = format!(
            r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[1],"data":[1]}}],"parameters":{{"timeout":{timeout}}}}}"#
        );
        assert_eq!(decode(&body).unwrap().timeout, expected, "{timeout}");
    }
}

#[test]
fn the_priority_parameter_names_a_level_and_zero_the_default() {
    for (priority, expected) in [("2", Some(2)), ("0", None), ("null", None)] {
        let body = format!(
            r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[1],"data":[1]}}],"parameters":{{"priority":{priority}}}}}"#
        );
        assert_eq!(decode(&body).unwrap().priority, expected, "{priority}");
    }
}

#[test]
fn binary_inputs_are_ranges_of_the_body() {
    let header = br#"{"inputs":[{"name":"a","datatype":"FP32","shape":[1,2],"parameters":{"binary_data_size":8}},{"name":"b","datatype":"BOOL","shape":[2],"parameters":{"binary_data_size":2}}]}"#;
    let mut body = header.to_vec();
    body.extend_from_slice(&1f32.to_le_bytes());
    body.extend_from_slice(&2f32.to_le_bytes());
    body.extend_from_slice(&[1, 0]);
    let length = header.len().to_string();
    let request = codec().decode(&body, Some(&length)).unwrap();
    let start = header.len();
    assert_eq!(request.inputs[0].data, Data::Body(start..start + 8));
    assert_eq!(request.inputs[1].data, Data::Body(start + 8..start + 10));

    *body.last_mut().unwrap() = 2;
    let e = codec().decode(&body, Some(&length)).unwrap_err();
    assert_eq!(e.to_string(), "input 'b': BOOL bytes must be 0 or 1");
}

#[test]
fn binary_errors_say_what_is_wrong() {
    let header = br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[2,4],"parameters":{"binary_data_size":16}}]}"#;
    let mut body = header.to_vec();
    body.extend_from_slice(&[0; 16]);
    let length = header.len().to_string();
    let e = codec()
        .decode(&body, Some(&length))
        .unwrap_err()
        .to_string();
    assert_eq!(e, "input 'x': FP32 shape [2, 4] needs 32 bytes, got 16");
    body.extend_from_slice(&[0; 4]);
    let e = codec()
        .decode(&body, Some(&length))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("add up to 16 bytes, but 20 binary bytes follow"),
        "{e}"
    );
    let e = codec().decode(&body, Some("abc")).unwrap_err().to_string();
    assert!(
        e.starts_with("Inference-Header-Content-Length must be 0.."),
        "{e}"
    );
    let e = codec().decode(&body, Some("99999")).unwrap_err();
    assert!(matches!(e, V2Error::HeaderLength { .. }));
    let header = br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"parameters":{"binary_data_size":32}}]}"#;
    let mut body = header.to_vec();
    body.extend_from_slice(&[0; 16]);
    let e = codec()
        .decode(&body, Some(&header.len().to_string()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("runs past the end of the body (16 binary bytes left)"),
        "{e}"
    );
}

#[test]
fn malformed_requests_have_clear_messages() {
    let x = r#"{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}"#;
    let cases: Vec<(String, &str)> = vec![
        (r#"{"inputs": ["#.into(), "malformed JSON in the request"),
        ("[1, 2]".into(), "the request must be a JSON object"),
        (r#"{"inputs": []}"#.into(), "non-empty 'inputs' list"),
        (
            "[".repeat(100_000) + &"]".repeat(100_000),
            "nested too deep",
        ),
        (
            format!(r#"{{"inputs": {}}}"#, "[".repeat(5000) + &"]".repeat(5000)),
            "nested too deep",
        ),
        (
            format!(
                r#"{{"inputs":[{}]}}"#,
                x.replace(r#""FP32""#, r#"["FP32"]"#)
            ),
            "input 'x': 'datatype' must be a string, got [\"FP32\"]",
        ),
        (
            format!(r#"{{"inputs":[{}]}}"#, x.replace(r#""x""#, r#"["x"]"#)),
            "every tensor needs a non-empty 'name', got [\"x\"]",
        ),
        (
            format!(r#"{{"inputs":[{}]}}"#, x.replace("[1,4]", r#""1,4""#)),
            "input 'x': 'shape' must be a list of non-negative integers, got \"1,4\"",
        ),
        (
            format!(r#"{{"inputs":[{}]}}"#, x.replace("[1,4]", "[-1,4]")),
            "'shape' must be a list of non-negative integers",
        ),
        (
            format!(r#"{{"inputs":[{}]}}"#, x.replace("[1,2,3,4]", r#""1234""#)),
            "input 'x': 'data' must be a JSON array",
        ),
        (
            format!(
                r#"{{"inputs":[{}]}}"#,
                x.replace("[1,2,3,4]", r#"[{"a":1},2,3,4]"#)
            ),
            "input 'x': data is not valid FP32: expected numbers, got an object {\"a\":1}",
        ),
        (
            format!(r#"{{"inputs":[{}]}}"#, x.replace("[1,2,3,4]", "[1,2,3]")),
            "input 'x': shape [1, 4] needs 4 values, got 3",
        ),
        (
            format!(r#"{{"inputs":[{}]}}"#, x.replace("FP32", "FP8")),
            "input 'x': unknown datatype 'FP8'; expected one of BOOL, INT8",
        ),
        (
            format!(r#"{{"inputs":[{}]}}"#, x.replace("FP32", "BYTES")),
            "input 'x': BYTES data must be strings, got 1",
        ),
        (
            format!(
                r#"{{"inputs":[{}]}}"#,
                x.replace("FP32", "BYTES")
                    .replace("[1,2,3,4]", r#"["a",true,"c","d"]"#)
            ),
            "input 'x': BYTES data must be strings, got true",
        ),
        (
            format!(r#"{{"inputs":[{x},{x}]}}"#),
            "input 'x' is given twice",
        ),
        (
            format!(r#"{{"inputs":[{x}],"outputs":[{{"name":"q"}}]}}"#),
            "unknown output 'q' for model 'double'; outputs: y, z",
        ),
        (
            format!(
                r#"{{"inputs":[{x}],"outputs":[{{"name":"z"}},{{"name":"y"}},{{"name":"z"}}]}}"#
            ),
            "output 'z' is asked for twice",
        ),
        (
            format!(r#"{{"inputs":[{x}],"outputs":["y"]}}"#),
            "every entry of 'outputs' must be an object with a string 'name'",
        ),
        (
            format!(r#"{{"inputs":[{x}],"parameters":{{"timeout":"soon"}}}}"#),
            "parameter 'timeout' must be microseconds >= 0, got \"soon\"",
        ),
        (
            format!(r#"{{"inputs":[{x}],"parameters":{{"timeout":-1}}}}"#),
            "parameter 'timeout' must be microseconds >= 0, got -1",
        ),
        (
            format!(r#"{{"inputs":[{x}],"parameters":{{"priority":1.5}}}}"#),
            "parameter 'priority' must be an integer >= 0, got 1.5",
        ),
        (
            format!(r#"{{"inputs":[{x}],"parameters":{{"priority":"high"}}}}"#),
            "parameter 'priority' must be an integer >= 0, got \"high\"",
        ),
        (
            format!(r#"{{"inputs":[{}],"id":{{}}}}"#, x.replace("4]}", "NaN]}")),
            "'id' must be a string",
        ),
        (
            format!(r#"{{"inputs":[{x}],"id":7}}"#),
            "'id' must be a string",
        ),
        (
            format!(
                r#"{{"inputs":[{}]}}"#,
                x.replace(r#""data":[1,2,3,4]"#, r#""x":1"#)
            ),
            "input 'x' has neither 'data' nor 'binary_data_size'",
        ),
        (
            format!(
                r#"{{"inputs":[{}]}}"#,
                x.replace("}", r#","parameters":{"binary_data_size":16}}"#)
            ),
            "input 'x' has both 'data' and 'binary_data_size'",
        ),
        (
            format!(
                r#"{{"inputs":[{}]}}"#,
                x.replace("}", r#","parameters":{"binary_data_size":"8"}}"#)
            ),
            "input 'x': binary_data_size must be an int >= 0",
        ),
        (
            format!(
                r#"{{"inputs":[{x}],"outputs":[{{"name":"y","parameters":{{"classification":-3}}}}]}}"#
            ),
            "output 'y': 'classification' must be an integer >= 0",
        ),
        (r#"{"inputs":[1]} x"#.into(), "extra data"),
        ("{\"inputs\":[\"\u{1}\"]}".into(), "control character"),
    ];
    for (body, message) in cases {
        let got = error(&body);
        assert!(got.contains(message), "{body:.80}: {got}");
    }
}

#[test]
fn element_types_and_ranges() {
    let one = |datatype: &str, data: &str| {
        decode(&format!(
            r#"{{"inputs":[{{"name":"x","datatype":"{datatype}","shape":[2],"data":{data}}}]}}"#
        ))
    };
    let owned = |r: Result<InferRequest, V2Error>| match r.unwrap().inputs.remove(0).data {
        Data::Owned(v) => v,
        Data::Body(_) => panic!(),
    };
    assert_eq!(owned(one("BOOL", "[true,false]")), vec![1, 0]);
    assert_eq!(owned(one("UINT8", "[255,true]")), vec![255, 1]);
    assert_eq!(owned(one("INT8", "[-128,3.0]")), vec![0x80, 3]);
    assert_eq!(
        owned(one("UINT64", "[18446744073709551615,0]")),
        [u64::MAX.to_le_bytes(), [0; 8]].concat()
    );
    assert_eq!(
        owned(one("BF16", "[1.5,-2]")),
        [0x3FC0u16.to_le_bytes(), 0xC000u16.to_le_bytes()].concat()
    );
    assert_eq!(
        owned(one("FP16", "[1.5,65504]")),
        [0x3E00u16.to_le_bytes(), 0x7BFFu16.to_le_bytes()].concat()
    );
    let e = one("BOOL", "[1,0]").unwrap_err().to_string();
    assert_eq!(e, "input 'x': BOOL data must be true or false");
    let e = one("UINT8", "[256,0]").unwrap_err().to_string();
    assert_eq!(e, "input 'x': data is not valid UINT8: 256 is out of range");
    let e = one("INT32", "[1.5,0]").unwrap_err().to_string();
    assert_eq!(
        e,
        "input 'x': data is not valid INT32: 1.5 is not an integer"
    );
    let e = one("INT64", "[NaN,0]").unwrap_err().to_string();
    assert_eq!(
        e,
        "input 'x': data is not valid INT64: NaN is not an integer"
    );
    let e = one("FP32", r#"["a",0]"#).unwrap_err().to_string();
    assert_eq!(
        e,
        "input 'x': data is not valid FP32: expected numbers, got a string 'a'"
    );
}

#[test]
fn a_huge_declared_shape_is_refused_before_allocating() {
    let body =
        r#"{"inputs":[{"name":"x","datatype":"FP64","shape":[1,1000000000000],"data":[1]}]}"#;
    let e = decode(body).unwrap_err();
    assert!(matches!(e, V2Error::TooManyElements { .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "input 'x': shape [1, 1000000000000] is over the limit of 67108864 elements per request"
    );
    // Overflowing products too.
    let body = r#"{"inputs":[{"name":"x","datatype":"FP64","shape":[4294967296,4294967296,16],"data":[1]}]}"#;
    assert!(matches!(
        decode(body).unwrap_err(),
        V2Error::TooManyElements { .. }
    ));
    let body = r#"{"inputs":[{"name":"x","datatype":"FP64","shape":[99999999999999999999999],"data":[1]}]}"#;
    assert!(matches!(
        decode(body).unwrap_err(),
        V2Error::TooManyElements { .. }
    ));
    // Within the limit but more values than the JSON can hold.
    let body = r#"{"inputs":[{"name":"x","datatype":"FP64","shape":[1000000],"data":[1]}]}"#;
    assert!(decode(body)
        .unwrap_err()
        .to_string()
        .contains("more than the request's JSON holds"));
    // The limit counts all inputs together.
    let small = Codec::new(
        "m",
        vec![],
        Limits {
            max_body_size: 1 << 20,
            max_elements: 5,
        },
    );
    let input =
        |n: &str| format!(r#"{{"name":"{n}","datatype":"INT8","shape":[3],"data":[1,2,3]}}"#);
    let body = format!(r#"{{"inputs":[{}]}}"#, input("a"));
    assert!(small.decode(body.as_bytes(), None).is_ok());
    let body = format!(r#"{{"inputs":[{},{}]}}"#, input("a"), input("b"));
    assert!(matches!(
        small.decode(body.as_bytes(), None).unwrap_err(),
        V2Error::TooManyElements { limit: 5, .. }
    ));
}

#[test]
fn a_body_over_the_limit_is_413() {
    let small = Codec::new(
        "m",
        vec![],
        Limits {
            max_body_size: 16,
            max_elements: 5,
        },
    );
    let e = small.decode(&[b' '; 17], None).unwrap_err();
    assert_eq!(e.status(), 413);
    assert_eq!(
        e.to_string(),
        "request body of 17 bytes is over the limit of 16 bytes"
    );
}

#[test]
fn encodes_json_with_shortest_floats_and_binary_with_header_length() {
    let c = codec();
    let y: Vec<u8> = [0.1f32, 2.0, f32::NAN, -f32::INFINITY]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let z: Vec<u8> = [i64::MIN, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
    let json = c
        .encode(
            Some("r\"1"),
            &[
                Output {
                    index: 0,
                    shape: &[2, 2],
                    data: &y,
                    binary: false,
                    classified: false,
                },
                Output {
                    index: 1,
                    shape: &[2],
                    data: &z,
                    binary: false,
                    classified: false,
                },
            ],
        )
        .unwrap();
    assert_eq!(json.header_length, None);
    assert_eq!(
        std::str::from_utf8(&json.body).unwrap(),
        r#"{"model_name":"double","model_version":"1","id":"r\"1","outputs":[{"name":"y","datatype":"FP32","shape":[2,2],"data":[0.1,2.0,NaN,-Infinity]},{"name":"z","datatype":"INT64","shape":[2],"data":[-9223372036854775808,7]}]}"#
    );
    let binary = c
        .encode(
            None,
            &[Output {
                index: 1,
                shape: &[2],
                data: &z,
                binary: true,
                classified: false,
            }],
        )
        .unwrap();
    let length = binary.header_length.unwrap();
    assert_eq!(
        std::str::from_utf8(&binary.body[..length]).unwrap(),
        r#"{"model_name":"double","model_version":"1","outputs":[{"name":"z","datatype":"INT64","shape":[2],"parameters":{"binary_data_size":16}}]}"#
    );
    assert_eq!(&binary.body[length..], &z[..]);
    let e = c
        .encode(
            None,
            &[Output {
                index: 0,
                shape: &[3],
                data: &y,
                binary: true,
                classified: false,
            }],
        )
        .unwrap_err();
    assert_eq!(e.status(), 500);
}

// -- properties -----------------------------------------------------------------------------

/// Little-endian bytes of `count` elements of `dtype` that survive a JSON
/// trip exactly (finite floats; BOOL 0/1).
fn elements(dtype: DType, count: usize) -> impl Strategy<Value = Vec<u8>> {
    let size = dtype.itemsize();
    proptest::collection::vec(any::<u64>(), count).prop_map(move |words| {
        let mut out = Vec::with_capacity(count * size);
        for w in words {
            let bytes = w.to_le_bytes();
            match dtype {
                DType::Bool => out.push((w & 1) as u8),
                DType::Float16 => {
                    let v = half::f16::from_bits(w as u16);
                    let v = if v.is_finite() {
                        v
                    } else {
                        half::f16::from_f32(1.0)
                    };
                    out.extend_from_slice(&v.to_le_bytes());
                }
                DType::BFloat16 => {
                    let v = half::bf16::from_bits(w as u16);
                    let v = if v.is_finite() {
                        v
                    } else {
                        half::bf16::from_f32(1.0)
                    };
                    out.extend_from_slice(&v.to_le_bytes());
                }
                DType::Float32 => {
                    let v = f32::from_bits(w as u32);
                    let v = if v.is_finite() { v } else { 0.5 };
                    out.extend_from_slice(&v.to_le_bytes());
                }
                DType::Float64 => {
                    let v = f64::from_bits(w);
                    let v = if v.is_finite() { v } else { -0.25 };
                    out.extend_from_slice(&v.to_le_bytes());
                }
                _ => out.extend_from_slice(&bytes[..size]),
            }
        }
        out
    })
}

fn tensor() -> impl Strategy<Value = (DType, Vec<u64>, Vec<u8>)> {
    (
        proptest::sample::select(DType::ALL.to_vec()),
        proptest::collection::vec(0u64..4, 0..4),
    )
        .prop_flat_map(|(dtype, shape)| {
            let count = shape.iter().product::<u64>() as usize;
            (Just(dtype), Just(shape), elements(dtype, count))
        })
}

/// A request document for the encoded response body (as a client would
/// send back what it received).
/// A binary request: `header`, then `binary`; its header length as sent.
fn binary_request(header: &[u8], binary: &[u8]) -> (Vec<u8>, String) {
    let mut body = header.to_vec();
    body.extend_from_slice(binary);
    (body, header.len().to_string())
}

#[test]
fn a_remembered_header_decodes_as_a_fresh_one_without_being_read() {
    let header = br#"{"inputs":[{"name":"a","datatype":"FP32","shape":[1,2],"parameters":{"binary_data_size":8}},{"name":"b","datatype":"BOOL","shape":[2],"parameters":{"binary_data_size":2}}],"outputs":[{"name":"z","parameters":{"binary_data":true}}],"parameters":{"timeout":2}}"#;
    let c = codec();
    let mut memo = HeaderMemo::new();
    let mut checked = 0;
    let mut check = |_: &str, _: DType, _: &[u64]| {
        checked += 1;
        Ok(())
    };
    let (body, length) = binary_request(header, &[0, 0, 128, 63, 0, 0, 0, 64, 1, 0]);
    let first = c
        .decode_remembered(&mut memo, &body, Some(&length), &mut check)
        .unwrap();
    assert!(matches!(first, Cow::Owned(_)), "a new header is decoded");
    let first = first.into_owned();
    assert_eq!(first, c.decode(&body, Some(&length)).unwrap());
    let (body, _) = binary_request(header, &[9, 9, 9, 9, 8, 8, 8, 8, 0, 1]);
    let again = c
        .decode_remembered(&mut memo, &body, Some(&length), &mut check)
        .unwrap();
    assert_eq!(*again, c.decode(&body, Some(&length)).unwrap());
    assert_eq!(*again, first);
    assert!(
        matches!(again, Cow::Borrowed(_)),
        "a remembered one is lent"
    );
    assert_eq!(checked, 2, "the second request's header was read again");
    assert_eq!(memo.len(), 1);
}

#[test]
fn a_remembered_header_still_checks_the_bytes_after_it() {
    let header = br#"{"inputs":[{"name":"b","datatype":"BOOL","shape":[2],"parameters":{"binary_data_size":2}}]}"#;
    let c = codec();
    let mut memo = HeaderMemo::new();
    let mut check = |_: &str, _: DType, _: &[u64]| Ok(());
    let (body, length) = binary_request(header, &[1, 0]);
    c.decode_remembered(&mut memo, &body, Some(&length), &mut check)
        .unwrap();
    let (body, _) = binary_request(header, &[1, 2]);
    let e = c
        .decode_remembered(&mut memo, &body, Some(&length), &mut check)
        .unwrap_err();
    assert_eq!(e.to_string(), "input 'b': BOOL bytes must be 0 or 1");
    // Same header, more bytes after it: the sizes no longer add up.
    let (body, _) = binary_request(header, &[1, 0, 0]);
    let e = c
        .decode_remembered(&mut memo, &body, Some(&length), &mut check)
        .unwrap_err();
    assert!(e.to_string().contains("add up to 2 bytes, but 3"), "{e}");
    assert_eq!(memo.len(), 1);
}

#[test]
fn only_headers_that_decoded_are_remembered_and_only_a_few() {
    let c = codec();
    let mut memo = HeaderMemo::new();
    let mut refusals = 0;
    let mut refuse = |_: &str, _: DType, _: &[u64]| {
        refusals += 1;
        Err(V2Error::Invalid("refused".into()))
    };
    let header = br#"{"inputs":[{"name":"a","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":4}}]}"#;
    let (body, length) = binary_request(header, &[0; 4]);
    for _ in 0..2 {
        let e = c
            .decode_remembered(&mut memo, &body, Some(&length), &mut refuse)
            .unwrap_err();
        assert_eq!(e.to_string(), "refused");
    }
    assert_eq!((refusals, memo.len()), (2, 0));
    // Bodies without a header length (all JSON) are decoded each time.
    let json = br#"{"inputs":[{"name":"a","datatype":"FP32","shape":[1],"data":[1]}]}"#;
    let mut accept = |_: &str, _: DType, _: &[u64]| Ok(());
    c.decode_remembered(&mut memo, json, None, &mut accept)
        .unwrap();
    assert!(memo.is_empty());
    for rows in 1..=REMEMBERED_HEADERS + 3 {
        let header = format!(
            r#"{{"inputs":[{{"name":"a","datatype":"FP32","shape":[{rows}],"parameters":{{"binary_data_size":{}}}}}]}}"#,
            rows * 4
        );
        let (body, length) = binary_request(header.as_bytes(), &vec![0; rows * 4]);
        let request = c
            .decode_remembered(&mut memo, &body, Some(&length), &mut accept)
            .unwrap();
        assert_eq!(request.inputs[0].shape.as_slice(), [rows as u64]);
        assert!(memo.len() <= REMEMBERED_HEADERS);
    }
    let long = format!(
        r#"{{"id":"{}","inputs":[{{"name":"a","datatype":"FP32","shape":[1],"parameters":{{"binary_data_size":4}}}}]}}"#,
        "i".repeat(MAX_REMEMBERED_HEADER)
    );
    let (body, length) = binary_request(long.as_bytes(), &[0; 4]);
    let mut memo = HeaderMemo::new();
    c.decode_remembered(&mut memo, &body, Some(&length), &mut accept)
        .unwrap();
    assert!(memo.is_empty());
}

fn as_request(body: &[u8], header_length: Option<usize>) -> (Vec<u8>, Option<String>) {
    let header = &body[..header_length.unwrap_or(body.len())];
    let text = std::str::from_utf8(header).unwrap();
    let rewritten = text.replacen("\"outputs\":[", "\"inputs\":[", 1);
    let mut out = rewritten.into_bytes();
    let length = header_length.map(|_| out.len().to_string());
    out.extend_from_slice(&body[header.len()..]);
    (out, length)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn encode_then_decode_round_trips(t in tensor(), binary in any::<bool>(), id in proptest::option::of(".{0,8}")) {
        let (dtype, shape, data) = t;
        let c = Codec::new("m", vec![OutputSpec { name: "t".into(), dtype }], Limits::default());
        let encoded = c.encode(id.as_deref(), &[Output { index: 0, shape: &shape, data: &data, binary, classified: false }]).unwrap();
        prop_assert_eq!(encoded.header_length.is_some(), binary);
        let (request, length) = as_request(&encoded.body, encoded.header_length);
        let decoded = c.decode(&request, length.as_deref()).unwrap();
        prop_assert_eq!(decoded.id, id);
        prop_assert_eq!(decoded.inputs.len(), 1);
        let input = &decoded.inputs[0];
        prop_assert_eq!(input.dtype, dtype);
        prop_assert_eq!(input.shape.as_slice(), shape.as_slice());
        let bytes = match &input.data {
            Data::Owned(v) => v.as_slice(),
            Data::Body(r) => &request[r.clone()],
        };
        // -0.0 and 0.0 print alike only if the formatter drops the sign: it must not.
        prop_assert_eq!(bytes, data.as_slice());
    }

    #[test]
    fn a_binary_response_is_allocated_at_its_exact_length(
        id in proptest::option::of("(.|\n|\u{1}|\\\\|\"){0,12}"),
        shapes in proptest::collection::vec(proptest::collection::vec(0u64..=12, 0..=3), 1..=3),
        binary in proptest::collection::vec(any::<bool>(), 3),
    ) {
        let specs = (0..shapes.len())
            .map(|i| OutputSpec { name: format!("out_{i}"), dtype: DType::Int64 })
            .collect();
        let c = Codec::new("m", specs, Limits::default());
        let data: Vec<Vec<u8>> = shapes
            .iter()
            .map(|s| vec![7u8; s.iter().product::<u64>() as usize * 8])
            .collect();
        let outputs: Vec<Output<'_>> = shapes
            .iter()
            .zip(&data)
            .enumerate()
            .map(|(index, (shape, data))| Output { index, shape, data, binary: binary[index] , classified: false})
            .collect();
        let encoded = c.encode(id.as_deref(), &outputs).unwrap();
        if outputs.iter().all(|o| o.binary) {
            // No spare room: `Bytes::from` takes the buffer as it is.
            prop_assert_eq!(encoded.body.len(), encoded.body.capacity());
        }
    }

    #[test]
    fn integer_data_decodes_every_spelling_as_its_value(
        dtype in proptest::sample::select(vec![
            DType::Int8, DType::Int16, DType::Int32, DType::Int64,
            DType::UInt8, DType::UInt16, DType::UInt32, DType::UInt64,
        ]),
        numbers in proptest::collection::vec(
            (
                any::<bool>(),
                "(0|[1-9][0-9]{0,2}|[1-9][0-9]{0,19})",
                proptest::sample::select(vec!["", "", "", ".0", "e0", "E1", ".5"]),
                "(,|, |,\n  | ,|\t,\t)",
            ),
            1..40,
        ),
    ) {
        // Plain integers (the fused run) beside the spellings the general
        // scan takes: integral fractions and exponents (accepted), a
        // fraction (refused), 16 to 20 digits; out of the type's range
        // (refused, whichever path read it).
        let (lowest, highest): (i128, i128) = match dtype {
            DType::Int8 => (i8::MIN.into(), i8::MAX.into()),
            DType::Int16 => (i16::MIN.into(), i16::MAX.into()),
            DType::Int32 => (i32::MIN.into(), i32::MAX.into()),
            DType::Int64 => (i64::MIN.into(), i64::MAX.into()),
            DType::UInt8 => (0, u8::MAX.into()),
            DType::UInt16 => (0, u16::MAX.into()),
            DType::UInt32 => (0, u32::MAX.into()),
            _ => (0, u64::MAX.into()),
        };
        let mut data = String::from("[");
        let mut expected: Option<Vec<i128>> = Some(Vec::new());
        for (i, (negative, digits, suffix, separator)) in numbers.iter().enumerate() {
            if i > 0 {
                data += separator;
            }
            let text = format!("{}{digits}{suffix}", if *negative { "-" } else { "" });
            data += &text;
            // A plain integer is read exactly; another spelling goes through
            // its nearest f64, as Python's json and numpy take it.
            let nearest = text.parse::<f64>().unwrap();
            let value: i128 = if suffix.is_empty() { text.parse().unwrap() } else { nearest as i128 };
            if nearest.fract() != 0.0 || value < lowest || value > highest {
                expected = None;
            } else if let Some(values) = expected.as_mut() {
                values.push(value);
            }
        }
        data += "]";
        let body = format!(
            r#"{{"inputs":[{{"name":"x","datatype":"{}","shape":[{}],"data":{data}}}]}}"#,
            dtype.v2_name(),
            numbers.len()
        );
        match expected {
            None => prop_assert!(decode(&body).is_err(), "{}", data),
            Some(values) => {
                let request = decode(&body).unwrap();
                let Data::Owned(bytes) = &request.inputs[0].data else { panic!("owned data") };
                let size = dtype.itemsize();
                let got: Vec<i128> = bytes
                    .chunks_exact(size)
                    .map(|b| {
                        let mut wide = [0u8; 16];
                        wide[..size].copy_from_slice(b);
                        let signed = matches!(dtype, DType::Int8 | DType::Int16 | DType::Int32 | DType::Int64);
                        if signed && b[size - 1] & 0x80 != 0 {
                            wide[size..].fill(0xff);
                        }
                        i128::from_le_bytes(wide)
                    })
                    .collect();
                prop_assert_eq!(got, values, "{}", data);
            }
        }
    }

    #[test]
    fn numbers_parse_as_rust_parses_them(
        negative in any::<bool>(),
        int in "(0|[1-9][0-9]{0,20})",
        frac in proptest::option::of("0{0,10}[0-9]{1,20}"),
        exp in proptest::option::of(-330i32..330),
    ) {
        let mut text = format!("{}{int}", if negative { "-" } else { "" });
        if let Some(f) = frac {
            text += &format!(".{f}");
        }
        if let Some(e) = exp {
            text += &format!("e{e}");
        }
        let mut p = json::Parser::new(text.as_bytes());
        let n = p.number().unwrap();
        prop_assert!(p.end().is_ok());
        let expected: f64 = text.parse().unwrap();
        prop_assert_eq!(n.to_f64().to_bits(), expected.to_bits(), "{}", text);
    }

    #[test]
    fn f32s_are_the_nearest_to_the_nearest_f64(
        negative in any::<bool>(),
        int in "(0|[1-9][0-9]{0,20})",
        frac in proptest::option::of("0{0,10}[0-9]{1,20}"),
        exp in proptest::option::of(-50i32..50),
    ) {
        let mut text = format!("{}{int}", if negative { "-" } else { "" });
        if let Some(f) = frac {
            text += &format!(".{f}");
        }
        if let Some(e) = exp {
            text += &format!("e{e}");
        }
        let n = json::Parser::new(text.as_bytes()).number().unwrap();
        let expected = text.parse::<f64>().unwrap() as f32;
        prop_assert_eq!(n.to_f32().to_bits(), expected.to_bits(), "{}", text);
    }

    #[test]
    fn f32s_near_a_rounding_midpoint_are_the_nearest_to_the_nearest_f64(
        bits in 1u32..0x7f7f_ffff,
        digits in 8usize..22,
        nudge in -3i64..=3,
    ) {
        // The exact midpoint between two adjacent f32s, spelt with `digits`
        // significant digits and its last digit nudged: the cases where
        // a shortcut could round the other way.
        let (a, b) = (f32::from_bits(bits), f32::from_bits(bits + 1));
        let midpoint = (f64::from(a) + f64::from(b)) / 2.0;
        let spelt = format!("{:.*e}", digits - 1, midpoint);
        let (digits_part, exponent) = spelt.split_once('e').unwrap();
        let mantissa: i128 = digits_part.replace('.', "").parse().unwrap();
        let text = format!("{}e{}", mantissa + i128::from(nudge), exponent.parse::<i64>().unwrap() - (digits as i64 - 1));
        let n = json::Parser::new(text.as_bytes()).number().unwrap();
        let expected = text.parse::<f64>().unwrap() as f32;
        prop_assert_eq!(n.to_f32().to_bits(), expected.to_bits(), "{}", text);
    }

    #[test]
    fn fp32_data_decodes_each_number_as_rust_parses_it(
        numbers in proptest::collection::vec(
            (
                any::<bool>(),
                "(0|[1-9][0-9]{0,20})",
                proptest::option::of("0{0,6}[0-9]{1,20}"),
                proptest::option::of(-50i32..50),
                "[ \t\n]{0,2}",
            ),
            1..40,
        ),
        nested in any::<bool>(),
    ) {
        // FP32 data takes a fused scan-and-convert path; its values must be
        // what the generic path (and Rust's parser) gives, whatever the
        // spelling, and the literals and odd spellings must fall back to it.
        let texts: Vec<String> = numbers
            .iter()
            .enumerate()
            .map(|(i, (negative, int, frac, exp, _))| match i % 11 {
                7 => "NaN".into(),
                9 => if *negative { "-Infinity".into() } else { "Infinity".into() },
                _ => {
                    let mut text = format!("{}{int}", if *negative { "-" } else { "" });
                    if let Some(f) = frac {
                        text += &format!(".{f}");
                    }
                    if let Some(e) = exp {
                        text += &format!("{}{e}", if e % 2 == 0 { "e" } else { "E" });
                    }
                    text
                }
            })
            .collect();
        let spaced: Vec<String> = texts.iter().zip(&numbers).map(|(t, n)| format!("{}{t}{}", n.4, n.4)).collect();
        let data = if nested {
            spaced.iter().map(|t| format!("[{t}]")).collect::<Vec<_>>().join(",")
        } else {
            spaced.join(",")
        };
        let body = format!(
            r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[{}],"data":[{data}]}}]}}"#,
            texts.len()
        );
        let request = decode(&body).unwrap();
        let expected: Vec<u32> = texts
            .iter()
            .map(|t| match t.as_str() {
                "NaN" => f32::NAN.to_bits(),
                "Infinity" => f32::INFINITY.to_bits(),
                "-Infinity" => f32::NEG_INFINITY.to_bits(),
                t => (t.parse::<f64>().unwrap() as f32).to_bits(),
            })
            .collect();
        let got: Vec<u32> = f32s(&request.inputs[0].data).iter().map(|v| v.to_bits()).collect();
        prop_assert_eq!(got, expected, "{}", body);
    }

    #[test]
    fn a_widened_f32_comes_back_as_itself(bits in any::<u32>()) {
        let v = f32::from_bits(bits);
        let v = if v.is_finite() { v } else { f32::from_bits(bits ^ 0x4000_0000) }; // inf, NaN: another exponent
        let text = format!("{}", f64::from(v));
        let n = json::Parser::new(text.as_bytes()).number().unwrap();
        prop_assert_eq!(n.to_f32().to_bits(), v.to_bits(), "{}", text);
    }

    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..256), split in proptest::option::of(0usize..300)) {
        let length = split.map(|n| n.to_string());
        let _ = codec().decode(&body, length.as_deref());
    }

    #[test]
    fn json_like_text_never_panics(body in r#"[\[\]{}",:0-9a-zNIE. \-]{0,200}"#) {
        let _ = codec().decode(body.as_bytes(), None);
    }

    #[test]
    fn mutated_requests_never_panic(pos in 0usize..200, byte in any::<u8>()) {
        let mut body = br#"{"id":"a","inputs":[{"name":"x","datatype":"FP16","shape":[2,2],"data":[[1,2],[3,4.5e3]],"parameters":{"q":1}},{"name":"b","datatype":"UINT8","shape":[1],"data":[true]}],"outputs":[{"name":"y","parameters":{"binary_data":true}}],"parameters":{"timeout":12}}"#.to_vec();
        let at = pos % body.len();
        body[at] = byte;
        let _ = codec().decode(&body, None);
    }

    #[test]
    fn declared_shapes_never_allocate_past_the_limit(dims in proptest::collection::vec(any::<u64>(), 1..4)) {
        let limits = Limits { max_body_size: 1 << 20, max_elements: 1000 };
        let c = Codec::new("m", vec![], limits);
        let shape: Vec<String> = dims.iter().map(u64::to_string).collect();
        let body = format!(
            r#"{{"inputs":[{{"name":"x","datatype":"FP64","shape":[{}],"parameters":{{"binary_data_size":8}}}}]}}"#,
            shape.join(",")
        );
        let count = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if let Err(e) = c.decode(body.as_bytes(), None) {
            if count.map_or(true, |n| n > 1000) {
                prop_assert!(matches!(e, V2Error::TooManyElements { .. }), "{}", e);
            }
        }
    }
}

/// `json::leading_digits` one byte at a time.
fn leading_digits_slowly(bytes: [u8; 8]) -> (u64, usize) {
    let count = bytes.iter().take_while(|b| b.is_ascii_digit()).count();
    let value = bytes[..count]
        .iter()
        .fold(0, |v, &d| v * 10 + u64::from(d - b'0'));
    (value, count)
}

proptest! {
    #[test]
    fn leading_digits_are_read_as_one_at_a_time(
        digits in "[0-9]{0,8}",
        rest in proptest::collection::vec(any::<u8>(), 8),
    ) {
        let mut bytes = [0u8; 8];
        let spelt: Vec<u8> = digits.bytes().chain(rest).take(8).collect();
        bytes.copy_from_slice(&spelt);
        prop_assert_eq!(json::leading_digits(bytes), leading_digits_slowly(bytes));
    }
}

#[test]
fn eight_digits_read_as_their_number() {
    for text in ["00000000", "12345678", "99999999", "10000001", "00000009"] {
        let spelt = format!("1{text}");
        let n = json::Parser::new(spelt.as_bytes()).number().unwrap();
        assert_eq!(n.to_f64(), spelt.parse::<f64>().unwrap(), "{text}");
    }
    for text in [
        "0.1257302165031433,",
        "-0.13210485875606537]",
        "1.3040000200271606 ",
    ] {
        let n = json::Parser::new(text.as_bytes()).number().unwrap();
        let expected = text[..text.len() - 1].parse::<f64>().unwrap();
        assert_eq!(n.to_f64(), expected, "{text}");
    }
    for text in ["1234567/", "1234567:", "12345 78", "1234567a"] {
        let mut p = json::Parser::new(text.as_bytes());
        let n = p.number().unwrap();
        assert!(p.end().is_err() || n.text().len() == text.len(), "{text}");
    }
}

#[test]
fn output_bits_are_the_indices_and_nothing_past_bit_63() {
    assert_eq!(output_bits([0, 2]), 0b101);
    assert_eq!(output_bits([63]), 1 << 63);
    assert_eq!(output_bits(std::iter::empty()), 0);
    assert_eq!(output_bits([1, 64]), 0); // not said: every output
}

#[test]
fn an_output_asked_for_as_classes_is_decoded_and_answered_as_bytes() {
    let c = codec();
    let x = r#"{"name":"x","datatype":"FP32","shape":[1],"data":[1]}"#;
    let asking = |outputs: &str| format!(r#"{{"inputs":[{x}],"outputs":{outputs}}}"#);
    let request = decode(&asking(
        r#"[{"name":"z"},{"name":"y","parameters":{"classification":2,"binary_data":true}}]"#,
    ))
    .unwrap();
    assert_eq!(request.output_classes(), [None, Some(2)]);
    // 0 asks for none (Triton's reading); none asked: nothing allocated.
    let request = decode(&asking(
        r#"[{"name":"y","parameters":{"classification":0}}]"#,
    ))
    .unwrap();
    assert!(request.output_classes().is_empty());
    assert!(decode(&format!(r#"{{"inputs":[{x}]}}"#))
        .unwrap()
        .output_classes()
        .is_empty());
    // A datatype that cannot be ranked is refused before the model runs.
    let bools = Codec::new(
        "b",
        vec![OutputSpec {
            name: "flags".into(),
            dtype: DType::Bool,
        }],
        Limits::default(),
    );
    let e = bools
        .decode(
            asking(r#"[{"name":"flags","parameters":{"classification":1}}]"#).as_bytes(),
            None,
        )
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "output 'flags': class result not available for output due to unsupported type 'BOOL'"
    );
    // Answered: BYTES of shape [rows, k], in JSON or as binary data.
    let y: Vec<u8> = [1.1f32, 3.3, 0.5, 2.4]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let (shape, classes) = c.classify(0, 2, &[1, 4], &y).unwrap();
    for binary in [false, true] {
        let output = Output {
            index: 0,
            shape: &shape,
            data: &classes,
            binary,
            classified: true,
        };
        let encoded = c.encode(None, &[output]).unwrap();
        let header = &encoded.body[..encoded.header_length.unwrap_or(encoded.body.len())];
        let expected = if binary {
            format!(
                r#"{{"model_name":"double","model_version":"1","outputs":[{{"name":"y","datatype":"BYTES","shape":[1,2],"parameters":{{"binary_data_size":{}}}}}]}}"#,
                classes.len()
            )
        } else {
            r#"{"model_name":"double","model_version":"1","outputs":[{"name":"y","datatype":"BYTES","shape":[1,2],"data":["3.300000:1","2.400000:3"]}]}"#.to_owned()
        };
        assert_eq!(std::str::from_utf8(header).unwrap(), expected);
        assert_eq!(
            &encoded.body[header.len()..],
            if binary { &classes[..] } else { &[] }
        );
    }
}
