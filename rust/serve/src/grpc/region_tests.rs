//! Shared-memory tensors (Triton's system shared-memory extension) on the
//! native front-end: gRPC requests read with regions, and whole requests,
//! gRPC and HTTP, answered into regions by a model's reply table.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use ferrobatch_core::bytes::BytesLimits;
use ferrobatch_core::v2::{Codec, OutputSpec};
use ferrobatch_core::{
    Batcher, BatcherConfig, DispatchRule, InputSpec, KeyRules, Priorities, Readiness,
    ResponseCache, SharedCache, SlotBuffer, Worker,
};

use super::pb::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use super::*;
use crate::replies::{Column, Replies, Reply};

/// A `/dev/shm` object holding `bytes`, removed on drop.
struct Object {
    key: String,
    path: PathBuf,
}

impl Object {
    fn new(tag: &str, bytes: &[u8]) -> Object {
        let name = format!("ferrobatch-serve-regions-test-{}-{tag}", std::process::id());
        let path = PathBuf::from("/dev/shm").join(&name);
        let mut file = std::fs::File::create(&path).unwrap();
        file.write_all(bytes).unwrap();
        Object {
            key: format!("/{name}"),
            path,
        }
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

fn i64_bytes(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Region `r`: 64 bytes of an object whose bytes 0..8 are FP32 [1.5, 2.5],
/// from offset 0.
fn region(tag: &str) -> (Object, SharedRegions) {
    let mut bytes = vec![0u8; 64];
    bytes[..8].copy_from_slice(&f32_bytes(&[1.5, 2.5]));
    let object = Object::new(tag, &bytes);
    let regions = SharedRegions::new();
    regions.register("r", &object.key, 0, 64).unwrap();
    (object, regions)
}

/// Outputs `y` (FP32) and `z` (INT64).
fn codec(regions: Option<&SharedRegions>) -> Codec {
    let outputs = [("y", DType::Float32), ("z", DType::Int64)].map(|(name, dtype)| OutputSpec {
        name: name.into(),
        dtype,
    });
    let codec = Codec::new("m", outputs.into(), Limits::default());
    match regions {
        Some(regions) => codec.with_regions(regions.clone()),
        None => codec,
    }
}

fn parameters(pairs: &[(&str, ParameterChoice)]) -> HashMap<String, InferParameter> {
    pairs
        .iter()
        .map(|(name, choice)| {
            let parameter = InferParameter {
                parameter_choice: Some(choice.clone()),
            };
            (name.to_string(), parameter)
        })
        .collect()
}

fn string(text: &str) -> ParameterChoice {
    ParameterChoice::StringParam(text.into())
}

fn int(v: i64) -> ParameterChoice {
    ParameterChoice::Int64Param(v)
}

/// Input `name`, FP32 of `shape`, in region `r` from `offset`, `size` bytes.
fn shm_input(name: &str, shape: &[i64], offset: i64, size: i64) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: "FP32".into(),
        shape: shape.to_vec(),
        parameters: parameters(&[
            (v2::SHARED_MEMORY_REGION, string("r")),
            (v2::SHARED_MEMORY_OFFSET, int(offset)),
            (v2::SHARED_MEMORY_BYTE_SIZE, int(size)),
        ]),
        contents: None,
    }
}

fn plain_input(name: &str, datatype: &str, shape: &[i64]) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape: shape.to_vec(),
        ..Default::default()
    }
}

/// Output `name`, in region `r` from `offset`, `size` bytes.
fn shm_output(name: &str, offset: i64, size: i64) -> InferRequestedOutputTensor {
    InferRequestedOutputTensor {
        name: name.into(),
        parameters: parameters(&[
            (v2::SHARED_MEMORY_REGION, string("r")),
            (v2::SHARED_MEMORY_OFFSET, int(offset)),
            (v2::SHARED_MEMORY_BYTE_SIZE, int(size)),
        ]),
    }
}

fn plain_output(name: &str) -> InferRequestedOutputTensor {
    InferRequestedOutputTensor {
        name: name.into(),
        parameters: HashMap::new(),
    }
}

/// `message` read by the gRPC infer rules for a model of `codec`.
fn read(message: &ModelInferRequest, codec: &Codec) -> Result<InferCall, Failure> {
    let wire = Bytes::from(prost::Message::encode_to_vec(message));
    let mut request = InferRequest::decode(&wire).unwrap();
    let mut accept = |_: &str, _: DType, _: &[u64]| Ok(());
    read_infer_call(&mut request, codec, None, &[], false, &mut accept)
}

fn refusal(message: &ModelInferRequest, codec: &Codec) -> String {
    match read(message, codec) {
        Ok(_) => panic!("read"),
        Err(failure) => {
            assert_eq!(failure.status, 400, "{}", failure.message);
            failure.message
        }
    }
}

fn infer(inputs: Vec<InferInputTensor>, raw: Vec<Bytes>) -> ModelInferRequest {
    ModelInferRequest {
        model_name: "m".into(),
        inputs,
        raw_input_contents: raw,
        ..Default::default()
    }
}

#[test]
fn raw_contents_hold_the_inputs_not_in_shared_memory_in_order() {
    let (_object, regions) = region("grpc-mix");
    let c = codec(Some(&regions));
    let inputs = vec![
        plain_input("a", "INT64", &[1]),
        shm_input("x", &[1, 2], 0, 8),
        plain_input("b", "BOOL", &[2]),
    ];
    let raw = vec![Bytes::from(i64_bytes(&[9])), Bytes::from_static(&[1, 0])];
    let call = read(&infer(inputs.clone(), raw.clone()), &c).unwrap();
    assert!(call.meta.uncached);
    assert!(call.regions.is_empty());
    assert_eq!(call.owners.shared.as_slice(), raw.as_slice());
    let sources: Vec<&Source> = call.tensors.iter().map(|(.., s)| s).collect();
    assert_eq!(
        sources,
        [
            &Source::Shared {
                buffer: 0,
                range: 0..8
            },
            &Source::Decoded(0),
            &Source::Shared {
                buffer: 1,
                range: 0..2
            },
        ]
    );
    assert_eq!(call.owners.decoded, vec![f32_bytes(&[1.5, 2.5])]);
    // One per input, as without shared memory: one too many.
    let three = vec![raw[0].clone(), Bytes::from(vec![0u8; 8]), raw[1].clone()];
    assert_eq!(
        refusal(&infer(inputs.clone(), three), &c),
        "raw_input_contents has 3 entries but the request has 2 inputs not in shared memory; \
         give one per such input, in order"
    );
    // Every input in shared memory: no raw contents at all.
    let call = read(&infer(vec![shm_input("x", &[1, 2], 0, 8)], Vec::new()), &c).unwrap();
    assert_eq!(call.owners.decoded, vec![f32_bytes(&[1.5, 2.5])]);
    // A plain request: neither flagged nor changed.
    let call = read(
        &infer(vec![plain_input("a", "INT64", &[1])], vec![raw[0].clone()]),
        &c,
    );
    assert!(!call.unwrap().meta.uncached);
}

#[test]
fn shared_memory_parameters_are_read_as_triton_reads_them() {
    let (_object, regions) = region("grpc-params");
    let c = codec(Some(&regions));
    let with = |pairs: &[(&str, ParameterChoice)]| {
        let mut x = plain_input("x", "FP32", &[1, 2]);
        x.parameters = parameters(pairs);
        refusal(&infer(vec![x], Vec::new()), &c)
    };
    assert_eq!(
        with(&[(v2::SHARED_MEMORY_REGION, int(1))]),
        "invalid value type for 'shared_memory_region' parameter for tensor 'x', expected \
         string_param."
    );
    assert_eq!(
        with(&[(v2::SHARED_MEMORY_OFFSET, int(0))]),
        "'shared_memory_offset' can not be specified without 'shared_memory_region' parameter \
         for tensor 'x'"
    );
    assert_eq!(
        with(&[(v2::SHARED_MEMORY_BYTE_SIZE, int(8))]),
        "'shared_memory_byte_size' can not be specified without 'shared_memory_region' \
         parameter for tensor 'x'"
    );
    assert_eq!(
        with(&[(v2::SHARED_MEMORY_REGION, string("r"))]),
        "'shared_memory_byte_size' must be specified along with 'shared_memory_region' \
         parameter for tensor 'x'"
    );
    assert_eq!(
        with(&[
            (v2::SHARED_MEMORY_REGION, string("r")),
            (v2::SHARED_MEMORY_BYTE_SIZE, string("8"))
        ]),
        "invalid value type for 'shared_memory_byte_size' parameter for tensor 'x', expected \
         int64_param."
    );
    assert_eq!(
        with(&[
            (v2::SHARED_MEMORY_REGION, string("r")),
            (v2::SHARED_MEMORY_OFFSET, int(-8)),
            (v2::SHARED_MEMORY_BYTE_SIZE, int(8))
        ]),
        "invalid value for 'shared_memory_offset' parameter for tensor 'x', expected >= 0, got -8"
    );
    assert_eq!(
        with(&[
            (v2::SHARED_MEMORY_REGION, string("nope")),
            (v2::SHARED_MEMORY_BYTE_SIZE, int(8))
        ]),
        "Unable to find shared memory region: 'nope'"
    );
    assert_eq!(
        refusal(&infer(vec![shm_input("x", &[1, 2], 60, 8)], Vec::new()), &c),
        "Invalid offset + byte size for shared memory region: 'r'"
    );
    assert_eq!(
        refusal(&infer(vec![shm_input("x", &[1, 2], 0, 4)], Vec::new()), &c),
        "input 'x': FP32 shape [1, 2] needs 8 bytes, got 4"
    );
    let mut typed = shm_input("x", &[1, 2], 0, 8);
    typed.contents = Some(InferTensorContents {
        fp32_contents: vec![1.0, 2.0],
        ..Default::default()
    });
    assert_eq!(
        refusal(&infer(vec![typed], Vec::new()), &c),
        "unexpected 'content' provided when using shared memory for input tensor 'x' for \
         model 'm'"
    );
}

#[test]
fn outputs_in_shared_memory_are_resolved_as_the_request_is_read() {
    let (_object, regions) = region("grpc-outputs");
    let c = codec(Some(&regions));
    let mut message = infer(vec![shm_input("x", &[1, 2], 0, 8)], Vec::new());
    message.outputs = vec![plain_output("z"), shm_output("y", 16, 8)];
    let call = read(&message, &c).unwrap();
    assert_eq!(call.outputs.as_slice(), [1, 0]);
    assert_eq!(call.regions.len(), 2);
    assert!(call.regions[0].is_none());
    assert_eq!(call.regions[1].as_ref().map(|r| r.len()), Some(8));
    // In a region first: the others after it are `None`.
    message.outputs = vec![shm_output("y", 16, 8), plain_output("z")];
    let call = read(&message, &c).unwrap();
    assert_eq!(
        call.regions.iter().map(Option::is_some).collect::<Vec<_>>(),
        [true, false]
    );
    message.outputs = vec![shm_output("y", 60, 8)];
    assert_eq!(
        refusal(&message, &c),
        "Invalid offset + byte size for shared memory region: 'r'"
    );
    let mut classified = shm_output("y", 0, 8);
    classified.parameters.insert(
        "classification".into(),
        InferParameter {
            parameter_choice: Some(int(2)),
        },
    );
    message.outputs = vec![classified];
    assert_eq!(
        refusal(&message, &c),
        "output can't set both 'shared_memory_region' and 'classification'"
    );
}

#[test]
fn without_regions_a_tensor_naming_one_is_refused_as_before() {
    let c = codec(None);
    let message = infer(vec![shm_input("x", &[1, 2], 0, 8)], Vec::new());
    assert_eq!(
        refusal(&message, &c),
        v2::shared_memory_refused("input 'x'")
    );
    let mut message = infer(
        vec![plain_input("x", "FP32", &[1, 2])],
        vec![Bytes::from(f32_bytes(&[1.0, 2.0]))],
    );
    message.outputs = vec![shm_output("y", 0, 8)];
    assert_eq!(
        refusal(&message, &c),
        v2::shared_memory_refused("output 'y'")
    );
}

/// A model of one input `x` (FP32 [2] per row) and outputs `y`, `z`, with a
/// response cache; its staging memory is kept as long as it.
struct Served {
    model: ServedModel,
    cache: Arc<SharedCache>,
    _store: Vec<Vec<u8>>,
}

fn served(regions: &SharedRegions) -> Served {
    let mut store: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; 4 * 8]).collect();
    let slots = store
        .iter_mut()
        // SAFETY: `store` moves into `Served`, dropped after the batcher's user.
        .map(|v| vec![unsafe { SlotBuffer::new(v.as_mut_ptr(), v.len()) }])
        .collect();
    let config = BatcherConfig {
        rule: DispatchRule::new(4, Duration::ZERO, 1, vec![]).unwrap(),
        row_nbytes: vec![8],
        max_queue_size: 16,
        workers: 1,
        readiness: Readiness::OnPush,
        layouts: Vec::new(),
        max_batch_elements: None,
        bytes_limits: BytesLimits::default(),
        priorities: Priorities::NONE,
        default_priority: None,
    };
    let cache: Arc<SharedCache> = Arc::new(ResponseCache::new(1 << 20));
    let link = Some((cache.clone(), cache.namespace(), KeyRules::default()));
    let batcher = Arc::new(
        Batcher::new(config, slots)
            .unwrap()
            .with_response_cache(link),
    );
    let replies = Arc::new(Replies::new(codec(Some(regions)), batcher));
    let spec = InputSpec::new("x", DType::Float32, vec![2]).unwrap();
    Served {
        model: ServedModel::new("m", vec![spec], replies),
        cache,
        _store: store,
    }
}

impl Served {
    /// Runs the one queued request as a model answering `y` = [[0.5, 4.0,
    /// -1.0]], `z` = [[7]] would: the reply and whether its batch kept a
    /// cache key for it.
    fn run(&self, submitted: Submitted) -> (Reply, bool) {
        let replies = self.model.replies();
        let batch = replies.batcher().next_batch(&mut Worker::new()).unwrap();
        let keyed = batch.cache_keys.iter().any(Option::is_some);
        let routes: Vec<_> = batch
            .routes
            .groups
            .iter()
            .flat_map(|(_, r)| r.clone())
            .collect();
        let y = f32_bytes(&[0.5, 4.0, -1.0]);
        let z = i64_bytes(&[7]);
        let columns = [
            Column {
                shape: &[1, 3],
                data: &y,
                rows: None,
            },
            Column {
                shape: &[1, 1],
                data: &z,
                rows: None,
            },
        ];
        replies.deliver(&routes, &columns, &[]);
        let mut reply = submitted.reply;
        (reply.try_recv().unwrap(), keyed)
    }

    /// Submits `message` as a `ModelInfer` call.
    fn submit_grpc(&self, message: &ModelInferRequest) -> Submitted {
        let wire = Bytes::from(prost::Message::encode_to_vec(message));
        let mut request = InferRequest::decode(&wire).unwrap();
        let model_name = self.model.name.clone();
        submit(
            &self.model,
            &mut request,
            None,
            &[],
            |outputs, regions, classes| ResponsePlan::Message {
                model_name,
                id: "1".into(),
                outputs,
                regions,
                classes,
            },
        )
        .unwrap()
    }
}

#[test]
fn a_model_infer_answer_writes_outputs_into_their_regions() {
    let (object, regions) = region("e2e-grpc");
    let served = served(&regions);
    let mut message = infer(vec![shm_input("x", &[1, 2], 0, 8)], Vec::new());
    message.outputs = vec![shm_output("y", 16, 12), plain_output("z")];
    let (reply, keyed) = served.run(served.submit_grpc(&message));
    assert!(!keyed, "a request naming a region is never cached");
    let Ok(Answer::Message(framed)) = reply else {
        panic!("{reply:?}")
    };
    let answer: ModelInferResponse = prost::Message::decode(&framed[PREFIX..]).unwrap();
    let names: Vec<&str> = answer.outputs.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["y", "z"]);
    assert_eq!(answer.outputs[0].shape, vec![1, 3]);
    assert_eq!(answer.outputs[0].datatype, "FP32");
    // Every output has its entry: the one in a region an empty one.
    assert_eq!(answer.raw_output_contents.len(), 2);
    assert!(answer.raw_output_contents[0].is_empty());
    assert_eq!(answer.raw_output_contents[1], i64_bytes(&[7]));
    assert_eq!(&object.read()[16..28], &f32_bytes(&[0.5, 4.0, -1.0])[..]);

    // The same inputs without regions: keyed for the cache, as before.
    let mut plain = infer(
        vec![plain_input("x", "FP32", &[1, 2])],
        vec![Bytes::from(f32_bytes(&[1.5, 2.5]))],
    );
    plain.outputs = vec![plain_output("y")];
    let (reply, keyed) = served.run(served.submit_grpc(&plain));
    assert!(keyed);
    assert!(matches!(reply, Ok(Answer::Message(_))));
    assert_eq!(served.cache.counts().entries, 0, "kept by the binding only");
}

#[test]
fn an_output_too_large_for_its_region_fails_its_request_as_the_clients_mistake() {
    let (object, regions) = region("e2e-small");
    let served = served(&regions);
    let mut message = infer(vec![shm_input("x", &[1, 2], 0, 8)], Vec::new());
    message.outputs = vec![shm_output("z", 40, 8), shm_output("y", 16, 8)];
    let before = object.read();
    let (reply, _) = served.run(served.submit_grpc(&message));
    let failure = reply.unwrap_err();
    assert_eq!(failure.status, 400);
    assert_eq!(
        failure.message,
        "shared memory size specified with the request for output 'y' (8 bytes) should be at \
         least 12 bytes to hold the results"
    );
    assert_eq!(object.read(), before, "no output was written");
    let mut totals = ferrobatch_core::Totals::default();
    served.model.replies().tally().add_to(&mut totals);
    let invalid = ferrobatch_core::Outcome::InvalidInput as usize;
    assert_eq!(totals.counts[invalid], 1, "counted as the client's mistake");
}

#[test]
fn a_streamed_request_writes_its_outputs_and_sends_them_empty() {
    let (object, regions) = region("e2e-stream");
    let served = served(&regions);
    let mut message = infer(vec![shm_input("x", &[1, 2], 0, 8)], Vec::new());
    message.outputs = vec![plain_output("z"), shm_output("y", 32, 12)];
    let wire = Bytes::from(prost::Message::encode_to_vec(&message));
    let mut request = InferRequest::decode(&wire).unwrap();
    let submitted = submit(
        &served.model,
        &mut request,
        None,
        &[],
        |outputs, regions, classes| ResponsePlan::Raw {
            outputs,
            regions,
            classes,
        },
    )
    .unwrap();
    let (reply, _) = served.run(submitted);
    let Ok(Answer::Raw(outputs)) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(outputs.len(), 2);
    assert_eq!(outputs[0].data, Bytes::from(i64_bytes(&[7])));
    assert!(outputs[1].data.is_empty());
    assert_eq!(outputs[1].shape.as_slice(), [1, 3]);
    let (described, raw) = described_outputs(served.model.replies().codec(), outputs);
    assert_eq!(described.len(), 2);
    assert_eq!(raw.len(), 2);
    assert_eq!(&object.read()[32..44], &f32_bytes(&[0.5, 4.0, -1.0])[..]);

    // A decoupled model's part: the same.
    let (partial, mut parts) = mpsc::unbounded_channel();
    let mut request = InferRequest::decode(&wire).unwrap();
    let submitted = submit(
        &served.model,
        &mut request,
        None,
        &[],
        |outputs, regions, classes| ResponsePlan::Stream {
            outputs: Arc::from(outputs.as_slice()),
            regions: (!regions.is_empty()).then(|| Arc::from(regions)),
            classes: (!classes.is_empty()).then(|| Arc::from(classes)),
            partial,
            backlog: Backlog::new(1 << 20),
        },
    )
    .unwrap();
    let replies = served.model.replies();
    let batch = replies.batcher().next_batch(&mut Worker::new()).unwrap();
    let routes: Vec<_> = batch
        .routes
        .groups
        .iter()
        .flat_map(|(_, r)| r.clone())
        .collect();
    let y = f32_bytes(&[9.0, 8.0, 7.0]);
    let z = i64_bytes(&[1]);
    let columns = [
        Column {
            shape: &[1, 3],
            data: &y,
            rows: None,
        },
        Column {
            shape: &[1, 1],
            data: &z,
            rows: None,
        },
    ];
    assert_eq!(replies.stream(&routes, &columns), 1);
    let part = parts.try_recv().unwrap();
    assert_eq!(part[0].data, Bytes::from(z.clone()));
    assert!(part[1].data.is_empty());
    assert_eq!(&object.read()[32..44], &y[..]);
    replies.end_streams(&routes);
    let mut reply = submitted.reply;
    assert!(matches!(reply.try_recv().unwrap(), Ok(Answer::Raw(_))));
}

#[test]
fn an_http_request_reads_and_writes_its_regions() {
    let (object, regions) = region("e2e-http");
    let served = served(&regions);
    let body = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"parameters":{"shared_memory_region":"r","shared_memory_byte_size":8}}],"outputs":[{"name":"y","parameters":{"shared_memory_region":"r","shared_memory_offset":20,"shared_memory_byte_size":12}},{"name":"z"}]}"#;
    let submitted = served
        .model
        .submit(Bytes::from_static(body.as_bytes()), None, &[])
        .unwrap();
    let (reply, keyed) = served.run(submitted);
    assert!(!keyed);
    let Ok(Answer::Encoded(encoded)) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(
        std::str::from_utf8(&encoded.body).unwrap(),
        r#"{"model_name":"m","model_version":"1","outputs":[{"name":"y","datatype":"FP32","shape":[1,3]},{"name":"z","datatype":"INT64","shape":[1,1],"data":[7]}]}"#
    );
    assert_eq!(&object.read()[20..32], &f32_bytes(&[0.5, 4.0, -1.0])[..]);
    // Too small a region: a 400, counted as the client's.
    let body = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"parameters":{"shared_memory_region":"r","shared_memory_byte_size":8}}],"outputs":[{"name":"y","parameters":{"shared_memory_region":"r","shared_memory_byte_size":4}}]}"#;
    let submitted = served
        .model
        .submit(Bytes::from_static(body.as_bytes()), None, &[])
        .unwrap();
    let (reply, _) = served.run(submitted);
    assert_eq!(reply.unwrap_err().status, 400);
}

#[test]
fn an_output_of_known_size_too_large_for_its_region_is_refused_as_read() {
    let (object, regions) = region("grpc-known-size");
    // y: 3 FP32 a row, z: 1 INT64 a row.
    let c = codec(Some(&regions)).with_output_row_bytes(vec![Some(12), Some(8)]);
    let too_small = |output: &str, have: usize, need: usize| {
        format!(
            "shared memory size specified with the request for output '{output}' ({have} \
             bytes) should be at least {need} bytes to hold the results"
        )
    };
    for rows in [1usize, 3] {
        let x = plain_input("x", "FP32", &[rows as i64, 1]);
        let raw = vec![Bytes::from(f32_bytes(&vec![1.0; rows]))];
        let mut message = infer(vec![x], raw);
        message.outputs = vec![plain_output("z"), shm_output("y", 0, 12 * rows as i64 - 1)];
        assert_eq!(
            refusal(&message, &c),
            too_small("y", 12 * rows - 1, 12 * rows)
        );
        message.outputs = vec![plain_output("z"), shm_output("y", 0, 12 * rows as i64)];
        let call = read(&message, &c).unwrap();
        assert_eq!(call.regions[1].as_ref().map(|r| r.len()), Some(12 * rows));
        message.outputs = vec![
            shm_output("y", 0, 36),
            shm_output("z", 40, 8 * rows as i64 - 1),
        ];
        assert_eq!(
            refusal(&message, &c),
            too_small("z", 8 * rows - 1, 8 * rows)
        );
    }
    // Rows from the first input, read from a region here.
    let mut message = infer(vec![shm_input("x", &[2, 1], 0, 8)], Vec::new());
    message.outputs = vec![shm_output("z", 16, 15)];
    assert_eq!(refusal(&message, &c), too_small("z", 15, 16));
    // Without batching: the whole output's size, whatever x's shape.
    let whole = codec(Some(&regions))
        .without_batching()
        .with_output_row_bytes(vec![Some(12), None]);
    message.outputs = vec![shm_output("y", 16, 11)];
    assert_eq!(refusal(&message, &whole), too_small("y", 11, 12));
    message.outputs = vec![shm_output("y", 16, 12), shm_output("z", 32, 1)];
    assert!(read(&message, &whole).is_ok(), "z's size is unknown");
    assert_eq!(object.read()[16..], [0u8; 48], "nothing was written");
}
