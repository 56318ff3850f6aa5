//! A `ModelInferRequest` read where it lies: its strings borrowed from the
//! received message and its raw contents slices of it, with no message
//! built (prost's decode owned every string, shape and list: eight
//! allocations for a one-input call, a third of a call's). Both gRPC
//! front-ends read requests through [`InferRequest`]: the native one
//! decodes its unary calls' messages into it ([`InferRequest::decode`]);
//! a stream's messages, which tonic decodes, and the Python servicer's are
//! viewed as one ([`InferRequest::of`]).
//!
//! The decoding is prost's for the fields ferrobatch reads (prost's own
//! wire primitives; each parameter map and typed contents decoded by
//! prost): the last of a repeated string wins, lists append, a field with
//! the wrong wire type or a string that is not UTF-8 is refused, unknown
//! fields are skipped.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::LazyLock;

use bytes::Bytes;
use prost::encoding::{decode_key, decode_varint, skip_field, DecodeContext, WireType};
use prost::DecodeError;
use smallvec::SmallVec;

use super::pb::model_infer_request::InferInputTensor;
use super::pb::{InferParameter, InferTensorContents, ModelInferRequest};

/// A request's or an output's parameters, as prost decodes them (empty:
/// no allocation).
pub type Parameters = HashMap<String, InferParameter>;

/// What a message without parameters reads as: shared, as making an empty
/// map per field (its hasher's keys) took a tenth of a decode.
fn no_parameters() -> Cow<'static, Parameters> {
    static NONE: LazyLock<Parameters> = LazyLock::new(Parameters::new);
    Cow::Borrowed(&NONE)
}

/// One `ModelInferRequest`, its fields as ferrobatch reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct InferRequest<'a> {
    pub model_name: &'a str,
    pub model_version: &'a str,
    pub id: &'a str,
    pub parameters: Cow<'a, Parameters>,
    pub inputs: SmallVec<[Input<'a>; 2]>,
    pub outputs: SmallVec<[Output<'a>; 2]>,
    /// As the submission's input owners hold them (one inline).
    pub raw_input_contents: SmallVec<[Bytes; 1]>,
}

/// One `InferInputTensor`.
#[derive(Debug, Clone, PartialEq)]
pub struct Input<'a> {
    pub name: &'a str,
    pub datatype: &'a str,
    pub shape: SmallVec<[i64; 4]>,
    pub parameters: Cow<'a, Parameters>,
    pub contents: Option<Typed<'a>>,
}

/// An input's typed contents: the prost message's, or decoded from the
/// message (boxed: most requests send raw contents, and an input is moved
/// as it is read).
#[derive(Debug, Clone)]
pub enum Typed<'a> {
    Borrowed(&'a InferTensorContents),
    Decoded(Box<InferTensorContents>),
}

/// The same contents, wherever they are.
impl PartialEq for Typed<'_> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::ops::Deref for Typed<'_> {
    type Target = InferTensorContents;

    fn deref(&self) -> &InferTensorContents {
        match self {
            Typed::Borrowed(contents) => contents,
            Typed::Decoded(contents) => contents,
        }
    }
}

/// One `InferRequestedOutputTensor`.
#[derive(Debug, Clone, PartialEq)]
pub struct Output<'a> {
    pub name: &'a str,
    pub parameters: Cow<'a, Parameters>,
}

/// Bytes that are not a `ModelInferRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(Cow<'static, str>);

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Malformed {}

impl From<DecodeError> for Malformed {
    fn from(e: DecodeError) -> Malformed {
        // What went wrong, without prost's "failed to decode" heading: the
        // callers say what failed to decode.
        let text = e.to_string();
        let told = text.strip_prefix("failed to decode Protobuf message: ");
        Malformed(Cow::Owned(told.map_or_else(|| text.clone(), str::to_owned)))
    }
}

/// The message's fields (`model_infer_request`'s tags).
mod tag {
    pub const MODEL_NAME: u32 = 1;
    pub const MODEL_VERSION: u32 = 2;
    pub const ID: u32 = 3;
    pub const PARAMETERS: u32 = 4;
    pub const INPUTS: u32 = 5;
    pub const OUTPUTS: u32 = 6;
    pub const RAW_INPUT_CONTENTS: u32 = 7;
    /// `InferInputTensor`'s.
    pub const INPUT_NAME: u32 = 1;
    pub const INPUT_DATATYPE: u32 = 2;
    pub const INPUT_SHAPE: u32 = 3;
    pub const INPUT_PARAMETERS: u32 = 4;
    pub const INPUT_CONTENTS: u32 = 5;
    /// `InferRequestedOutputTensor`'s.
    pub const OUTPUT_NAME: u32 = 1;
    pub const OUTPUT_PARAMETERS: u32 = 2;
}

fn wire_type(found: WireType, expected: WireType, field: &'static str) -> Result<(), Malformed> {
    if found == expected {
        Ok(())
    } else {
        Err(Malformed(Cow::Owned(format!(
            "invalid wire type for {field}: {found:?} (expected {expected:?})"
        ))))
    }
}

/// The next length-delimited field's bytes, `buf` moved past them.
fn delimited<'a>(buf: &mut &'a [u8]) -> Result<&'a [u8], Malformed> {
    let len = decode_varint(buf)?;
    let len = usize::try_from(len)
        .ok()
        .filter(|&len| len <= buf.len())
        .ok_or(Malformed(Cow::Borrowed("buffer underflow")))?;
    let (field, rest) = buf.split_at(len);
    *buf = rest;
    Ok(field)
}

fn string<'a>(
    buf: &mut &'a [u8],
    found: WireType,
    field: &'static str,
) -> Result<&'a str, Malformed> {
    wire_type(found, WireType::LengthDelimited, field)?;
    std::str::from_utf8(delimited(buf)?).map_err(|_| {
        Malformed(Cow::Owned(format!(
            "invalid string value for {field}: data is not UTF-8 encoded"
        )))
    })
}

/// A map field's one entry, merged into `map` (prost's map decoding).
fn parameter(
    buf: &mut &[u8],
    found: WireType,
    map: &mut Cow<'_, Parameters>,
    field: &'static str,
) -> Result<(), Malformed> {
    wire_type(found, WireType::LengthDelimited, field)?;
    prost::encoding::hash_map::merge(
        prost::encoding::string::merge,
        prost::encoding::message::merge,
        map.to_mut(),
        buf,
        DecodeContext::default(),
    )?;
    Ok(())
}

impl<'a> InferRequest<'a> {
    /// Reads `message` (one `ModelInferRequest`, unprefixed); the raw
    /// contents are slices of it.
    pub fn decode(message: &'a Bytes) -> Result<InferRequest<'a>, Malformed> {
        let mut request = InferRequest {
            model_name: "",
            model_version: "",
            id: "",
            parameters: no_parameters(),
            inputs: SmallVec::new(),
            outputs: SmallVec::new(),
            raw_input_contents: SmallVec::new(),
        };
        let mut buf: &'a [u8] = message;
        while !buf.is_empty() {
            let (field, found) = decode_key(&mut buf)?;
            match field {
                tag::MODEL_NAME => request.model_name = string(&mut buf, found, "model_name")?,
                tag::MODEL_VERSION => {
                    request.model_version = string(&mut buf, found, "model_version")?;
                }
                tag::ID => request.id = string(&mut buf, found, "id")?,
                tag::PARAMETERS => {
                    parameter(&mut buf, found, &mut request.parameters, "parameters")?;
                }
                tag::INPUTS => {
                    wire_type(found, WireType::LengthDelimited, "inputs")?;
                    request.inputs.push(Input::decode(delimited(&mut buf)?)?);
                }
                tag::OUTPUTS => {
                    wire_type(found, WireType::LengthDelimited, "outputs")?;
                    request.outputs.push(Output::decode(delimited(&mut buf)?)?);
                }
                tag::RAW_INPUT_CONTENTS => {
                    wire_type(found, WireType::LengthDelimited, "raw_input_contents")?;
                    let raw = delimited(&mut buf)?;
                    request.raw_input_contents.push(message.slice_ref(raw));
                }
                _ => skip_field(found, field, &mut buf, DecodeContext::default())?,
            }
        }
        Ok(request)
    }

    /// `request` (decoded by prost), read as one; its raw contents move
    /// here.
    pub fn of(request: &'a mut ModelInferRequest) -> InferRequest<'a> {
        let raw_input_contents = std::mem::take(&mut request.raw_input_contents)
            .into_iter()
            .collect();
        InferRequest {
            model_name: &request.model_name,
            model_version: &request.model_version,
            id: &request.id,
            parameters: Cow::Borrowed(&request.parameters),
            inputs: request.inputs.iter().map(Input::of).collect(),
            outputs: request
                .outputs
                .iter()
                .map(|output| Output {
                    name: &output.name,
                    parameters: Cow::Borrowed(&output.parameters),
                })
                .collect(),
            raw_input_contents,
        }
    }
}

impl<'a> Input<'a> {
    fn decode(mut buf: &'a [u8]) -> Result<Input<'a>, Malformed> {
        let mut input = Input {
            name: "",
            datatype: "",
            shape: SmallVec::new(),
            parameters: no_parameters(),
            contents: None,
        };
        let mut contents: Option<Box<InferTensorContents>> = None;
        while !buf.is_empty() {
            let (field, found) = decode_key(&mut buf)?;
            match field {
                tag::INPUT_NAME => input.name = string(&mut buf, found, "inputs.name")?,
                tag::INPUT_DATATYPE => {
                    input.datatype = string(&mut buf, found, "inputs.datatype")?;
                }
                // Packed (as proto3 writes it) or one element at a time.
                tag::INPUT_SHAPE => match found {
                    WireType::LengthDelimited => {
                        let mut packed = delimited(&mut buf)?;
                        while !packed.is_empty() {
                            input.shape.push(decode_varint(&mut packed)? as i64);
                        }
                    }
                    WireType::Varint => input.shape.push(decode_varint(&mut buf)? as i64),
                    other => wire_type(other, WireType::LengthDelimited, "inputs.shape")?,
                },
                tag::INPUT_PARAMETERS => {
                    parameter(&mut buf, found, &mut input.parameters, "inputs.parameters")?;
                }
                tag::INPUT_CONTENTS => {
                    // Repeated, they merge: as prost merges an embedded message.
                    prost::encoding::message::merge(
                        found,
                        contents.get_or_insert_with(Box::default).as_mut(),
                        &mut buf,
                        DecodeContext::default(),
                    )?;
                }
                _ => skip_field(found, field, &mut buf, DecodeContext::default())?,
            }
        }
        input.contents = contents.map(Typed::Decoded);
        Ok(input)
    }

    fn of(input: &'a InferInputTensor) -> Input<'a> {
        Input {
            name: &input.name,
            datatype: &input.datatype,
            shape: input.shape.iter().copied().collect(),
            parameters: Cow::Borrowed(&input.parameters),
            contents: input.contents.as_ref().map(Typed::Borrowed),
        }
    }
}

impl<'a> Output<'a> {
    fn decode(mut buf: &'a [u8]) -> Result<Output<'a>, Malformed> {
        let mut output = Output {
            name: "",
            parameters: no_parameters(),
        };
        while !buf.is_empty() {
            let (field, found) = decode_key(&mut buf)?;
            match field {
                tag::OUTPUT_NAME => output.name = string(&mut buf, found, "outputs.name")?,
                tag::OUTPUT_PARAMETERS => {
                    parameter(
                        &mut buf,
                        found,
                        &mut output.parameters,
                        "outputs.parameters",
                    )?;
                }
                _ => skip_field(found, field, &mut buf, DecodeContext::default())?,
            }
        }
        Ok(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::pb::infer_parameter::ParameterChoice;
    use crate::grpc::pb::model_infer_request::InferRequestedOutputTensor;
    use proptest::prelude::*;

    /// Decodes `wire` both ways: both refuse it, or both read the same.
    fn agree(wire: &Bytes) {
        match <ModelInferRequest as prost::Message>::decode(wire.clone()) {
            Ok(mut request) => {
                let viewed = InferRequest::of(&mut request);
                let ours = InferRequest::decode(wire)
                    .unwrap_or_else(|e| panic!("prost reads it, this refused: {e}"));
                assert_eq!(ours, viewed);
            }
            Err(_) => {
                let ours = InferRequest::decode(wire);
                assert!(ours.is_err(), "prost refuses it, this read {ours:?}");
            }
        }
    }

    fn parameter(choice: ParameterChoice) -> InferParameter {
        InferParameter {
            parameter_choice: Some(choice),
        }
    }

    fn full() -> ModelInferRequest {
        ModelInferRequest {
            model_name: "identity".into(),
            model_version: "1".into(),
            id: "request-7".into(),
            parameters: [
                (
                    "timeout".to_owned(),
                    parameter(ParameterChoice::Int64Param(5)),
                ),
                (
                    "tag".to_owned(),
                    parameter(ParameterChoice::StringParam("é".into())),
                ),
            ]
            .into_iter()
            .collect(),
            inputs: vec![
                InferInputTensor {
                    name: "x".into(),
                    datatype: "FP32".into(),
                    shape: vec![1, 256, -1, i64::MAX, i64::MIN],
                    ..Default::default()
                },
                InferInputTensor {
                    name: "n".into(),
                    datatype: "INT64".into(),
                    shape: vec![2],
                    contents: Some(InferTensorContents {
                        int64_contents: vec![3, -4],
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ],
            outputs: vec![InferRequestedOutputTensor {
                name: "y".into(),
                parameters: [(
                    "classification".to_owned(),
                    parameter(ParameterChoice::Int64Param(2)),
                )]
                .into_iter()
                .collect(),
            }],
            raw_input_contents: vec![Bytes::from_static(&[1, 2, 3, 4]), Bytes::new()],
        }
    }

    fn wire(request: &ModelInferRequest) -> Bytes {
        Bytes::from(prost::Message::encode_to_vec(request))
    }

    #[test]
    fn reads_what_prost_reads() {
        agree(&wire(&full()));
        agree(&wire(&ModelInferRequest::default()));
        let message = wire(&full());
        let request = InferRequest::decode(&message).unwrap();
        assert_eq!(request.model_name, "identity");
        assert_eq!(
            request.inputs[0].shape.as_slice(),
            &[1, 256, -1, i64::MAX, i64::MIN]
        );
        assert_eq!(
            request.inputs[1]
                .contents
                .as_deref()
                .map(|c| c.int64_contents.clone()),
            Some(vec![3, -4])
        );
        assert!(request.outputs[0].parameters.contains_key("classification"));
    }

    #[test]
    fn raw_contents_are_slices_of_the_message() {
        let message = wire(&full());
        let request = InferRequest::decode(&message).unwrap();
        let raw = &request.raw_input_contents[0];
        assert_eq!(&raw[..], &[1, 2, 3, 4]);
        let inside = message.as_ptr_range();
        assert!(inside.contains(&raw.as_ptr()), "not a copy");
    }

    /// Encodings prost reads that proto3 writers other than prost send:
    /// an unpacked shape, a field repeated (the last string wins, contents
    /// merge), an unknown field, fields out of order.
    #[test]
    fn reads_other_writers_encodings() {
        use prost::encoding::{encode_key, encode_varint};
        let mut out = Vec::new();
        let string = |out: &mut Vec<u8>, tag: u32, text: &[u8]| {
            encode_key(tag, WireType::LengthDelimited, out);
            encode_varint(text.len() as u64, out);
            out.extend_from_slice(text);
        };
        let mut input = Vec::new();
        string(&mut input, 2, b"INT64");
        for d in [2_i64, -3] {
            encode_key(3, WireType::Varint, &mut input);
            encode_varint(d as u64, &mut input);
        }
        let contents = |values: &[i64]| {
            prost::Message::encode_to_vec(&InferTensorContents {
                int64_contents: values.to_vec(),
                ..Default::default()
            })
        };
        string(&mut input, 5, &contents(&[1]));
        string(&mut input, 5, &contents(&[2, 3]));
        string(&mut input, 1, b"first");
        string(&mut input, 1, b"n");
        encode_key(99, WireType::Varint, &mut out);
        encode_varint(7, &mut out);
        string(&mut out, 7, b"raw");
        string(&mut out, 5, &input);
        string(&mut out, 1, b"m");
        let message = Bytes::from(out);
        agree(&message);
        let request = InferRequest::decode(&message).unwrap();
        assert_eq!(request.inputs[0].name, "n");
        assert_eq!(request.inputs[0].shape.as_slice(), &[2, -3]);
        assert_eq!(
            request.inputs[0]
                .contents
                .as_deref()
                .map(|c| c.int64_contents.clone()),
            Some(vec![1, 2, 3])
        );
    }

    #[test]
    fn refuses_what_prost_refuses() {
        let message = wire(&full());
        // Every prefix that cuts a field short.
        for end in 0..message.len() {
            agree(&message.slice(..end));
        }
        // Every byte with each of the eight low-bit patterns: at a key, each
        // wire type, the field's and the others.
        for at in 0..message.len() {
            for low in 0..8 {
                let mut damaged = message.to_vec();
                damaged[at] = damaged[at] & !7 | low;
                agree(&Bytes::from(damaged));
            }
        }
        // A string that is not UTF-8; a string with a varint's wire type.
        let not_utf8 = Bytes::from_static(&[0x0a, 0x02, 0xff, 0xfe]);
        assert!(InferRequest::decode(&not_utf8)
            .unwrap_err()
            .to_string()
            .contains("UTF-8"));
        agree(&not_utf8);
        agree(&Bytes::from_static(&[0x08, 0x01]));
        // A length past the message.
        agree(&Bytes::from_static(&[0x2a, 0x7f, 0x0a]));
    }

    fn name() -> impl Strategy<Value = String> {
        prop_oneof![Just(String::new()), "[a-zé_0-9]{1,12}"]
    }

    fn parameters() -> impl Strategy<Value = Parameters> {
        proptest::collection::hash_map(
            name(),
            prop_oneof![
                any::<i64>().prop_map(ParameterChoice::Int64Param),
                any::<bool>().prop_map(ParameterChoice::BoolParam),
                name().prop_map(ParameterChoice::StringParam),
            ]
            .prop_map(parameter),
            0..3,
        )
    }

    fn input() -> impl Strategy<Value = InferInputTensor> {
        (
            name(),
            name(),
            proptest::collection::vec(any::<i64>(), 0..6),
            parameters(),
            proptest::option::of(proptest::collection::vec(-1e6_f32..1e6, 0..4)),
        )
            .prop_map(
                |(name, datatype, shape, parameters, fp32)| InferInputTensor {
                    name,
                    datatype,
                    shape,
                    parameters,
                    contents: fp32.map(|fp32_contents| InferTensorContents {
                        fp32_contents,
                        ..Default::default()
                    }),
                },
            )
    }

    fn request() -> impl Strategy<Value = ModelInferRequest> {
        (
            (name(), name(), name(), parameters()),
            proptest::collection::vec(input(), 0..4),
            proptest::collection::vec(
                (name(), parameters())
                    .prop_map(|(name, parameters)| InferRequestedOutputTensor { name, parameters }),
                0..3,
            ),
            proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..16), 0..4),
        )
            .prop_map(
                |((model_name, model_version, id, parameters), inputs, outputs, raw)| {
                    ModelInferRequest {
                        model_name,
                        model_version,
                        id,
                        parameters,
                        inputs,
                        outputs,
                        raw_input_contents: raw.into_iter().map(Bytes::from).collect(),
                    }
                },
            )
    }

    proptest! {
        #[test]
        fn any_request_reads_as_prost_reads_it(request in request()) {
            agree(&wire(&request));
        }

        /// Damaged messages: both refuse, or both read the same.
        #[test]
        fn any_damage_reads_as_prost_reads_it(
            request in request(),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let mut bytes = wire(&request).to_vec();
            if !bytes.is_empty() {
                let i = at.index(bytes.len());
                bytes[i] = byte;
            }
            agree(&Bytes::from(bytes));
        }
    }
}
