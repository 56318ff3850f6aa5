//! Shared-memory tensors (Triton's system shared-memory extension) through
//! the codec: inputs read from regions, outputs written into them.

use std::io::Write;
use std::path::PathBuf;

use super::regions::SharedRegions;
use super::*;

/// A `/dev/shm` object holding `bytes`, removed on drop.
struct Object {
    key: String,
    path: PathBuf,
}

impl Object {
    fn new(tag: &str, bytes: &[u8]) -> Object {
        let name = format!("ferrobatch-v2-regions-test-{}-{tag}", std::process::id());
        let path = PathBuf::from("/dev/shm").join(&name);
        let mut file = std::fs::File::create(&path).unwrap();
        file.write_all(bytes).unwrap();
        Object {
            key: format!("/{name}"),
            path,
        }
    }

    fn write_at(&self, at: usize, bytes: &[u8]) {
        let mut all = std::fs::read(&self.path).unwrap();
        all[at..at + bytes.len()].copy_from_slice(bytes);
        std::fs::write(&self.path, all).unwrap();
    }

    fn read(&self) -> Vec<u8> {
        std::fs::read(&self.path).unwrap()
    }
}

impl Drop for Object {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Outputs `y` (FP32), `z` (INT64) and `s` (BYTES), reading and writing
/// `regions`.
fn codec_with(regions: &SharedRegions) -> Codec {
    let outputs = [
        ("y", DType::Float32),
        ("z", DType::Int64),
        ("s", DType::Bytes),
    ]
    .map(|(name, dtype)| OutputSpec {
        name: name.into(),
        dtype,
    });
    Codec::new("m", outputs.into(), Limits::default()).with_regions(regions.clone())
}

/// A registry with region `r`: 64 bytes of `object`, from offset 16.
fn registered(object: &Object) -> SharedRegions {
    let regions = SharedRegions::new();
    regions.register("r", &object.key, 16, 64).unwrap();
    regions
}

fn error(codec: &Codec, body: &str) -> String {
    let e = codec.decode(body.as_bytes(), None).expect_err(body);
    assert_eq!(e.status(), 400, "{e}");
    e.to_string()
}

fn input(parameters: &str) -> String {
    format!(
        r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[1,2],"parameters":{parameters}}}]}}"#
    )
}

#[test]
fn a_json_input_is_read_from_its_region() {
    let mut bytes = vec![0u8; 128];
    bytes[16 + 8..16 + 16].copy_from_slice(&f32_bytes(&[1.5, -2.0]));
    let object = Object::new("fp32-in", &bytes);
    let c = codec_with(&registered(&object));
    let body = input(
        r#"{"shared_memory_region":"r","shared_memory_offset":8,"shared_memory_byte_size":8}"#,
    );
    let request = c.decode(body.as_bytes(), None).unwrap();
    assert_eq!(request.inputs[0].data, Data::Owned(f32_bytes(&[1.5, -2.0])));
    assert!(request.shared_memory);
    assert!(request.output_regions().is_empty());
    // The model's rule applies as for any input.
    let mut refuse = |_: &str, _: DType, _: &[u64]| Err(V2Error::Invalid("not this".into()));
    let e = c
        .decode_checked(body.as_bytes(), None, &mut refuse)
        .unwrap_err();
    assert_eq!(e.to_string(), "not this");
    // Without any region: no flag, nothing allocated for outputs.
    let plain = c.decode(
        br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]}]}"#,
        None,
    );
    assert!(!plain.unwrap().shared_memory);
}

#[test]
fn a_bytes_input_is_read_as_length_prefixed_elements() {
    let mut serialized = Vec::new();
    for element in [&b"hello"[..], b"", b"shm"] {
        crate::bytes::push(&mut serialized, element).unwrap();
    }
    let mut bytes = vec![0u8; 128];
    bytes[16..16 + serialized.len()].copy_from_slice(&serialized);
    let object = Object::new("bytes-in", &bytes);
    let c = codec_with(&registered(&object));
    let body = format!(
        r#"{{"inputs":[{{"name":"t","datatype":"BYTES","shape":[3],"parameters":{{"shared_memory_region":"r","shared_memory_byte_size":{}}}}}]}}"#,
        serialized.len()
    );
    let request = c.decode(body.as_bytes(), None).unwrap();
    assert_eq!(request.inputs[0].data, Data::Owned(serialized.clone()));
    // One element short of the shape's count: refused as raw bytes are.
    let body = format!(
        r#"{{"inputs":[{{"name":"t","datatype":"BYTES","shape":[4],"parameters":{{"shared_memory_region":"r","shared_memory_byte_size":{}}}}}]}}"#,
        serialized.len()
    );
    assert_eq!(
        error(&c, &body),
        "input 't': BYTES data holds 3 elements, the shape needs 4"
    );
}

#[test]
fn an_input_sets_exactly_one_of_data_binary_and_region() {
    let object = Object::new("one-of", &[0; 128]);
    let c = codec_with(&registered(&object));
    let head = "Input must set only one of the following fields: 'data', 'binary_data_size' in \
                'parameters', 'shared_memory_region' in 'parameters'. But";
    let none = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2]}]}"#;
    assert_eq!(error(&c, none), format!("{head} no field is set"));
    let both = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"data":[1,2],"parameters":{"shared_memory_region":"r","shared_memory_byte_size":8}}]}"#;
    assert_eq!(
        error(&c, both),
        format!("{head} set 'data' 'shared_memory_region'")
    );
    let all = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"data":[1,2],"parameters":{"binary_data_size":8,"shared_memory_region":"r","shared_memory_byte_size":8}}]}"#;
    assert_eq!(
        error(&c, all),
        format!("{head} set 'data' 'binary_data_size' 'shared_memory_region'")
    );
    let old = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"data":[1,2],"parameters":{"binary_data_size":8}}]}"#;
    assert_eq!(
        error(&c, old),
        format!("{head} set 'data' 'binary_data_size'")
    );
    // Data alone is still decoded.
    let data = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"data":[1,2]}]}"#;
    assert!(c.decode(data.as_bytes(), None).is_ok());
}

#[test]
fn unknown_regions_ranges_past_them_and_wrong_sizes_are_refused() {
    let object = Object::new("refused", &[0; 128]);
    let c = codec_with(&registered(&object));
    let e = error(
        &c,
        &input(r#"{"shared_memory_region":"nope","shared_memory_byte_size":8}"#),
    );
    assert_eq!(e, "Unable to find shared memory region: 'nope'");
    let e = error(
        &c,
        &input(
            r#"{"shared_memory_region":"r","shared_memory_offset":60,"shared_memory_byte_size":8}"#,
        ),
    );
    assert_eq!(
        e,
        "Invalid offset + byte size for shared memory region: 'r'"
    );
    let e = error(
        &c,
        &input(r#"{"shared_memory_region":"r","shared_memory_byte_size":4}"#),
    );
    assert_eq!(e, "input 'x': FP32 shape [1, 2] needs 8 bytes, got 4");
    // No byte size: 0 bytes, which the shape does not hold.
    let e = error(&c, &input(r#"{"shared_memory_region":"r"}"#));
    assert_eq!(e, "input 'x': FP32 shape [1, 2] needs 8 bytes, got 0");
    let e = error(&c, &input(r#"{"shared_memory_region":7}"#));
    assert_eq!(
        e,
        "Unable to parse 'shared_memory_region' of input 'x': expected a string, got 7"
    );
    for (field, value) in [
        ("shared_memory_offset", "-1"),
        ("shared_memory_offset", "1.5"),
        ("shared_memory_byte_size", "\"8\""),
    ] {
        let parameters = format!(r#"{{"shared_memory_region":"r","{field}":{value}}}"#);
        let e = error(&c, &input(&parameters));
        assert_eq!(
            e,
            format!(
                "Unable to parse '{field}' of input 'x': expected an integer >= 0, got {value}"
            )
        );
    }
}

#[test]
fn the_elements_bound_holds_before_a_region_is_read() {
    let object = Object::new("bound", &[0; 128]);
    let regions = registered(&object);
    let limits = Limits {
        max_body_size: 1 << 20,
        max_elements: 4,
    };
    let c = Codec::new("m", Vec::new(), limits).with_regions(regions);
    let body = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,5],"parameters":{"shared_memory_region":"r","shared_memory_byte_size":20}}]}"#;
    let e = c.decode(body.as_bytes(), None).unwrap_err();
    assert!(matches!(e, V2Error::TooManyElements { .. }), "{e}");
}

#[test]
fn without_regions_a_tensor_naming_one_is_refused_as_before() {
    let c = Codec::new(
        "m",
        vec![OutputSpec {
            name: "y".into(),
            dtype: DType::Float32,
        }],
        Limits::default(),
    );
    let e = error(&c, &input(r#"{"shared_memory_region":"r"}"#));
    assert_eq!(e, shared_memory_refused("input 'x'"));
    let body = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]}],"outputs":[{"name":"y","parameters":{"shared_memory_region":"r"}}]}"#;
    assert_eq!(error(&c, body), shared_memory_refused("output 'y'"));
    // Its old messages for data and binary_data_size stay.
    let both = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1],"parameters":{"binary_data_size":4}}]}"#;
    assert_eq!(
        error(&c, both),
        "input 'x' has both 'data' and 'binary_data_size'"
    );
}

/// A request for `outputs` (a JSON list) of input `x` = [1.0].
fn asking(outputs: &str) -> String {
    format!(
        r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[1],"data":[1]}}],"outputs":{outputs}}}"#
    )
}

#[test]
fn an_output_in_a_region_is_written_there_and_answered_without_data() {
    let object = Object::new("out", &[0; 128]);
    let c = codec_with(&registered(&object));
    let body = asking(
        r#"[{"name":"z"},{"name":"y","parameters":{"shared_memory_region":"r","shared_memory_offset":4,"shared_memory_byte_size":12,"binary_data":false}}]"#,
    );
    let request = c.decode(body.as_bytes(), None).unwrap();
    assert!(request.shared_memory);
    assert_eq!(
        request.selected_outputs(&c).as_slice(),
        [(1, false), (0, false)]
    );
    let regions = request.output_regions();
    assert_eq!(regions.len(), 2);
    assert!(regions[0].is_none());
    assert_eq!(regions[1].as_ref().map(|r| r.len()), Some(12));
    let y = f32_bytes(&[0.5, 4.0, -1.0]);
    let z: Vec<u8> = [7i64].iter().flat_map(|v| v.to_le_bytes()).collect();
    let outputs = [
        Output {
            index: 1,
            shape: &[1],
            data: &z,
            binary: false,
            classified: false,
        },
        Output {
            index: 0,
            shape: &[1, 3],
            data: &y,
            binary: false,
            classified: false,
        },
    ];
    let encoded = c.encode_with_regions(None, &outputs, &regions).unwrap();
    assert_eq!(encoded.header_length, None);
    assert_eq!(
        std::str::from_utf8(&encoded.body).unwrap(),
        r#"{"model_name":"m","model_version":"1","outputs":[{"name":"z","datatype":"INT64","shape":[1],"data":[7]},{"name":"y","datatype":"FP32","shape":[1,3]}]}"#
    );
    assert_eq!(&object.read()[16 + 4..16 + 16], &y[..]);
    // Binary outputs beside it: its bytes are not among theirs.
    let outputs = [
        Output {
            binary: true,
            ..outputs[0]
        },
        outputs[1],
    ];
    let encoded = c
        .encode_with_regions(Some("a"), &outputs, &regions)
        .unwrap();
    let length = encoded.header_length.unwrap();
    assert_eq!(&encoded.body[length..], &z[..]);
    let (header, binary) = c
        .encode_header_with_regions(Some("a"), &outputs, &regions, 0)
        .unwrap();
    assert_eq!((&header[..], binary), (&encoded.body[..length], z.len()));
}

#[test]
fn a_bytes_output_is_written_in_its_wire_form() {
    let object = Object::new("bytes-out", &[0; 128]);
    let c = codec_with(&registered(&object));
    let body = asking(
        r#"[{"name":"s","parameters":{"shared_memory_region":"r","shared_memory_byte_size":64}}]"#,
    );
    let request = c.decode(body.as_bytes(), None).unwrap();
    let mut serialized = Vec::new();
    for element in [&b"ab"[..], b"xyz"] {
        crate::bytes::push(&mut serialized, element).unwrap();
    }
    let outputs = [Output {
        index: 2,
        shape: &[2],
        data: &serialized,
        binary: false,
        classified: false,
    }];
    let encoded = c
        .encode_with_regions(None, &outputs, &request.output_regions())
        .unwrap();
    assert!(std::str::from_utf8(&encoded.body)
        .unwrap()
        .ends_with(r#"{"name":"s","datatype":"BYTES","shape":[2]}]}"#));
    assert_eq!(&object.read()[16..16 + serialized.len()], &serialized[..]);
}

#[test]
fn an_output_too_large_for_its_region_is_the_clients_400() {
    let object = Object::new("small", &[0; 128]);
    let c = codec_with(&registered(&object));
    let body = asking(
        r#"[{"name":"z","parameters":{"shared_memory_region":"r","shared_memory_byte_size":4}},{"name":"y","parameters":{"shared_memory_region":"r","shared_memory_offset":32,"shared_memory_byte_size":8}}]"#,
    );
    let request = c.decode(body.as_bytes(), None).unwrap();
    let z: Vec<u8> = [7i64].iter().flat_map(|v| v.to_le_bytes()).collect();
    let y = f32_bytes(&[3.0, 3.0]);
    let outputs = [
        Output {
            index: 1,
            shape: &[1],
            data: &z,
            binary: false,
            classified: false,
        },
        Output {
            index: 0,
            shape: &[2],
            data: &y,
            binary: false,
            classified: false,
        },
    ];
    let e = c
        .encode_with_regions(None, &outputs, &request.output_regions())
        .unwrap_err();
    assert_eq!(e.status(), 400);
    assert_eq!(
        e.to_string(),
        "shared memory size specified with the request for output 'z' (4 bytes) should be at \
         least 8 bytes to hold the results"
    );
    assert_eq!(object.read(), vec![0; 128], "nothing was written");
}

#[test]
fn an_output_region_is_checked_as_the_request_is_decoded() {
    let object = Object::new("out-checks", &[0; 128]);
    let c = codec_with(&registered(&object));
    let cases = [
        (
            r#"{"shared_memory_region":"r","shared_memory_byte_size":4,"binary_data":true}"#,
            "Output can't set both 'shared_memory_region' and 'binary_data'",
        ),
        (
            r#"{"shared_memory_region":"r","shared_memory_byte_size":4,"classification":2}"#,
            "Output can't set both 'shared_memory_region' and 'classification'",
        ),
        (
            r#"{"shared_memory_region":"gone","shared_memory_byte_size":4}"#,
            "Unable to find shared memory region: 'gone'",
        ),
        (
            r#"{"shared_memory_region":"r","shared_memory_byte_size":65}"#,
            "Invalid offset + byte size for shared memory region: 'r'",
        ),
        (
            r#"{"shared_memory_region":"r","shared_memory_byte_size":-4}"#,
            "Unable to parse 'shared_memory_byte_size' of output 'y': expected an integer >= 0, got -4",
        ),
        (
            r#"{"shared_memory_region":["r"],"shared_memory_byte_size":4}"#,
            r#"Unable to parse 'shared_memory_region' of output 'y': expected a string, got ["r"]"#,
        ),
    ];
    for (parameters, expected) in cases {
        let body = asking(&format!(r#"[{{"name":"y","parameters":{parameters}}}]"#));
        assert_eq!(error(&c, &body), expected, "{parameters}");
    }
    // Classification alone is asked for, not a region.
    let body = asking(r#"[{"name":"y","parameters":{"classification":2}}]"#);
    let request = c.decode(body.as_bytes(), None).unwrap();
    assert_eq!(request.output_classes(), [Some(2)]);
    assert!(request.output_regions().is_empty() && !request.shared_memory);
    // binary_data false (as tritonclient sends it) and the request's default are fine.
    let body = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]}],"outputs":[{"name":"y","parameters":{"shared_memory_region":"r","shared_memory_byte_size":4,"binary_data":false}}],"parameters":{"binary_data_output":true}}"#;
    let request = c.decode(body.as_bytes(), None).unwrap();
    assert_eq!(request.selected_outputs(&c).as_slice(), [(0, false)]);
}

#[test]
fn a_header_naming_a_region_is_read_again_on_every_request() {
    let mut bytes = vec![0u8; 128];
    bytes[16..24].copy_from_slice(&f32_bytes(&[1.0, 2.0]));
    let object = Object::new("memo", &bytes);
    let c = codec_with(&registered(&object));
    let header = br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"parameters":{"shared_memory_region":"r","shared_memory_byte_size":8}},{"name":"b","datatype":"BOOL","shape":[1],"parameters":{"binary_data_size":1}}]}"#;
    let mut body = header.to_vec();
    body.push(1);
    let length = header.len().to_string();
    let mut memo = HeaderMemo::new();
    let mut accept = |_: &str, _: DType, _: &[u64]| Ok(());
    let first = c
        .decode_remembered(&mut memo, &body, Some(&length), &mut accept)
        .unwrap()
        .into_owned();
    assert_eq!(first.inputs[0].data, Data::Owned(f32_bytes(&[1.0, 2.0])));
    assert!(memo.is_empty(), "not remembered");
    object.write_at(16, &f32_bytes(&[5.0, 6.0]));
    let second = c
        .decode_remembered(&mut memo, &body, Some(&length), &mut accept)
        .unwrap();
    assert!(matches!(second, std::borrow::Cow::Owned(_)));
    assert_eq!(second.inputs[0].data, Data::Owned(f32_bytes(&[5.0, 6.0])));
    assert_eq!(
        second.inputs[1].data,
        Data::Body(header.len()..header.len() + 1)
    );
    // Unregistered meanwhile: refused, not answered from the memo.
    c.regions().unwrap().unregister("r");
    let e = c
        .decode_remembered(&mut memo, &body, Some(&length), &mut accept)
        .unwrap_err();
    assert_eq!(e.to_string(), "Unable to find shared memory region: 'r'");
}

/// A request of input `x`, FP32 of `shape` (its elements 0, 1, ...), asking
/// for `outputs` (a JSON list).
fn asking_rows(shape: &[u64], outputs: &str) -> String {
    let count: u64 = shape.iter().product();
    let data: Vec<String> = (0..count).map(|v| v.to_string()).collect();
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!(
        r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[{}],"data":[{}]}}],"outputs":{outputs}}}"#,
        dims.join(","),
        data.join(",")
    )
}

/// Output `name` in region `r`, `size` bytes from `offset`.
fn in_region(name: &str, offset: usize, size: usize) -> String {
    format!(
        r#"{{"name":"{name}","parameters":{{"shared_memory_region":"r","shared_memory_offset":{offset},"shared_memory_byte_size":{size}}}}}"#
    )
}

fn too_small(output: &str, have: usize, need: usize) -> String {
    format!(
        "shared memory size specified with the request for output '{output}' ({have} bytes) \
         should be at least {need} bytes to hold the results"
    )
}

#[test]
fn an_output_of_known_size_too_large_for_its_region_is_refused_as_decoded() {
    let object = Object::new("known-size", &[0; 128]);
    // y: 3 FP32 a row, z: 1 INT64 a row, s: BYTES (its size the model's).
    let c = codec_with(&registered(&object)).with_output_row_bytes(vec![Some(12), Some(8), None]);
    assert_eq!(c.output_row_bytes(), [Some(12), Some(8), None]);
    for rows in [1usize, 3] {
        let shape = [rows as u64, 2];
        let body = asking_rows(&shape, &format!("[{}]", in_region("y", 0, 12 * rows - 1)));
        assert_eq!(error(&c, &body), too_small("y", 12 * rows - 1, 12 * rows));
        // Exactly large enough: decoded, and written as before.
        let body = asking_rows(&shape, &format!("[{}]", in_region("y", 0, 12 * rows)));
        let request = c.decode(body.as_bytes(), None).unwrap();
        let regions = request.output_regions();
        assert_eq!(regions[0].as_ref().map(|r| r.len()), Some(12 * rows));
        // One too small among others: refused, named.
        let outputs = format!(
            "[{},{{\"name\":\"y\"}},{}]",
            in_region("s", 0, 0),
            in_region("z", 16, 8 * rows - 1)
        );
        assert_eq!(
            error(&c, &asking_rows(&shape, &outputs)),
            too_small("z", 8 * rows - 1, 8 * rows)
        );
    }
    // The rows are the first input's first dimension, wherever its bytes are.
    let mut bytes = vec![0u8; 128];
    bytes[16..16 + 8].copy_from_slice(&f32_bytes(&[1.0, 2.0]));
    let object = Object::new("known-size-in", &bytes);
    let c = codec_with(&registered(&object)).with_output_row_bytes(vec![Some(12), Some(8), None]);
    let body = format!(
        r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[2,1],"parameters":{{"shared_memory_region":"r","shared_memory_byte_size":8}}}}],"outputs":[{}]}}"#,
        in_region("z", 32, 15)
    );
    assert_eq!(error(&c, &body), too_small("z", 15, 16));
}

#[test]
fn without_batching_the_known_size_is_the_whole_outputs() {
    let object = Object::new("known-size-whole", &[0; 128]);
    let c = codec_with(&registered(&object))
        .without_batching()
        .with_output_row_bytes(vec![Some(12), Some(8), None]);
    // No batch dimension: x's first dimension is no count of rows.
    let body = asking_rows(&[3, 2], &format!("[{}]", in_region("y", 0, 11)));
    assert_eq!(error(&c, &body), too_small("y", 11, 12));
    let body = asking_rows(&[3, 2], &format!("[{}]", in_region("y", 0, 12)));
    assert!(c.decode(body.as_bytes(), None).is_ok());
}

#[test]
fn an_output_of_unknown_size_is_checked_when_written() {
    let object = Object::new("unknown-size", &[0; 128]);
    let c = codec_with(&registered(&object)).with_output_row_bytes(vec![Some(12), Some(8), None]);
    let body = asking_rows(&[1], &format!("[{}]", in_region("s", 0, 4)));
    let request = c.decode(body.as_bytes(), None).unwrap();
    let mut serialized = Vec::new();
    crate::bytes::push(&mut serialized, b"ab").unwrap();
    let outputs = [Output {
        index: 2,
        shape: &[1],
        data: &serialized,
        binary: false,
        classified: false,
    }];
    let e = c
        .encode_with_regions(None, &outputs, &request.output_regions())
        .unwrap_err();
    assert_eq!(e.status(), 400);
    assert_eq!(e.to_string(), too_small("s", 4, 6));
    // Without row sizes (the default), nothing is checked as decoded.
    let c = codec_with(c.regions().unwrap());
    assert!(c.output_row_bytes().is_empty());
    let body = asking_rows(&[1], &format!("[{}]", in_region("y", 0, 1)));
    assert!(c.decode(body.as_bytes(), None).is_ok());
}
