//! A `ModelInfer` answer written straight from a request's rows: the bytes
//! prost writes for the equivalent [`ModelInferResponse`](super::pb::ModelInferResponse),
//! in one buffer, without building the message (its strings, shape
//! vectors and raw-content buffers were ten allocations and a second copy
//! of the rows per call). The model's worker writes it as it cuts the rows
//! from the batch, as it writes HTTP's answers.
//!
//! The fields, in prost's order (proto3: an empty string or list is left
//! out, as prost leaves it out):
//! `model_name` (1), `model_version` (2), `id` (3), `outputs` (5: `name`
//! 1, `datatype` 2, packed `shape` 3), `raw_output_contents` (6).

use bytes::BufMut;
use ferrobatch_core::v2::{self, MODEL_VERSION};
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};

use super::PREFIX;
use crate::replies::Failure;

/// One output of an answer: its index in the codec's outputs, its shape
/// (the request's rows first) and its bytes.
#[derive(Debug, Clone, Copy)]
pub struct OutputRows<'a> {
    pub index: usize,
    pub shape: &'a [u64],
    pub data: &'a [u8],
    /// Its top classes: BYTES, whatever the output's datatype.
    pub classified: bool,
}

/// A dimension as protobuf's `int64` carries it (a larger one is clamped,
/// as no tensor has one).
fn dim(d: u64) -> u64 {
    d.min(i64::MAX as u64)
}

/// The length of a length-delimited field of `len` bytes, key included.
fn delimited_len(tag: u32, len: usize) -> usize {
    key_len(tag)
        .saturating_add(encoded_len_varint(len as u64))
        .saturating_add(len)
}

/// A string field, left out when empty.
fn string_len(tag: u32, text: &str) -> usize {
    if text.is_empty() {
        0
    } else {
        delimited_len(tag, text.len())
    }
}

fn put_delimited(tag: u32, bytes: &[u8], out: &mut impl BufMut) {
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(bytes.len() as u64, out);
    out.put_slice(bytes);
}

fn put_string(tag: u32, text: &str, out: &mut impl BufMut) {
    if !text.is_empty() {
        put_delimited(tag, text.as_bytes(), out);
    }
}

/// An answer's outputs as the codec describes them, with the lengths
/// encoding them takes.
pub struct InferResponse<'a> {
    model_name: &'a str,
    id: &'a str,
    outputs: &'a [OutputRows<'a>],
    codec: &'a v2::Codec,
    len: usize,
}

impl<'a> InferResponse<'a> {
    /// The answer to request `id` of `model_name` with `outputs`.
    pub fn new(
        codec: &'a v2::Codec,
        model_name: &'a str,
        id: &'a str,
        outputs: &'a [OutputRows<'a>],
    ) -> InferResponse<'a> {
        let mut response = InferResponse {
            model_name,
            id,
            outputs,
            codec,
            len: 0,
        };
        let mut len = string_len(1, model_name)
            .saturating_add(string_len(2, MODEL_VERSION))
            .saturating_add(string_len(3, id));
        for output in outputs {
            len = len
                .saturating_add(delimited_len(5, response.tensor_len(output)))
                .saturating_add(delimited_len(6, output.data.len()));
        }
        response.len = len;
        response
    }

    /// The message's length, without a gRPC prefix.
    pub fn encoded_len(&self) -> usize {
        self.len
    }

    /// The output's name and v2 datatype (empty for an index the codec
    /// does not have, which the rows never carry).
    fn described(&self, output: &OutputRows<'_>) -> (&'a str, &'static str) {
        self.codec
            .outputs()
            .get(output.index)
            .map_or(("", ""), |spec| {
                let dtype = if output.classified {
                    ferrobatch_core::DType::Bytes
                } else {
                    spec.dtype
                };
                (spec.name.as_str(), dtype.v2_name())
            })
    }

    fn shape_len(output: &OutputRows<'_>) -> usize {
        output
            .shape
            .iter()
            .fold(0usize, |n, &d| n.saturating_add(encoded_len_varint(dim(d))))
    }

    /// An `InferOutputTensor`'s length.
    fn tensor_len(&self, output: &OutputRows<'_>) -> usize {
        let (name, datatype) = self.described(output);
        let shape = Self::shape_len(output);
        let packed = if output.shape.is_empty() {
            0
        } else {
            delimited_len(3, shape)
        };
        string_len(1, name)
            .saturating_add(string_len(2, datatype))
            .saturating_add(packed)
    }

    /// Writes the message into `out`, which must have room for
    /// [`InferResponse::encoded_len`] bytes (a `Vec` grows).
    pub fn encode(&self, out: &mut impl BufMut) {
        put_string(1, self.model_name, out);
        put_string(2, MODEL_VERSION, out);
        put_string(3, self.id, out);
        for output in self.outputs {
            let (name, datatype) = self.described(output);
            encode_key(5, WireType::LengthDelimited, out);
            encode_varint(self.tensor_len(output) as u64, out);
            put_string(1, name, out);
            put_string(2, datatype, out);
            if !output.shape.is_empty() {
                encode_key(3, WireType::LengthDelimited, out);
                encode_varint(Self::shape_len(output) as u64, out);
                for &d in output.shape {
                    encode_varint(dim(d), out);
                }
            }
        }
        for output in self.outputs {
            put_delimited(6, output.data, out);
        }
    }

    /// The message as a unary call's one gRPC message: its 5-byte prefix
    /// (uncompressed, the length) and the message, in a buffer of exactly
    /// that length. A 500 past the 4 GiB a gRPC message can say.
    pub fn framed(&self) -> Result<Vec<u8>, Failure> {
        let length = u32::try_from(self.len).map_err(|_| {
            Failure::new(
                500,
                format!(
                    "the response of {} bytes is over the 4 GiB a gRPC message can carry",
                    self.len
                ),
            )
        })?;
        let mut framed = Vec::with_capacity(PREFIX.saturating_add(self.len));
        framed.push(0);
        framed.extend_from_slice(&length.to_be_bytes());
        self.encode(&mut framed);
        Ok(framed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::described_outputs;
    use crate::grpc::pb::ModelInferResponse;
    use crate::replies::RawOutput;
    use bytes::Bytes;
    use ferrobatch_core::v2::{Limits, OutputSpec};
    use ferrobatch_core::DType;
    use proptest::prelude::*;

    fn codec(outputs: &[(&str, DType)]) -> v2::Codec {
        let specs = outputs
            .iter()
            .map(|&(name, dtype)| OutputSpec {
                name: name.to_owned(),
                dtype,
            })
            .collect();
        v2::Codec::new("m", specs, Limits::default())
    }

    /// The message prost writes for the same answer, built as a message
    /// (as a stream's responses are: [`described_outputs`]).
    fn by_prost(
        codec: &v2::Codec,
        model_name: &str,
        id: &str,
        outputs: &[OutputRows<'_>],
    ) -> Vec<u8> {
        let rows = outputs
            .iter()
            .map(|o| RawOutput {
                index: o.index,
                shape: o.shape.iter().copied().collect(),
                data: Bytes::copy_from_slice(o.data),
                classified: false,
            })
            .collect();
        let (described, raw) = described_outputs(codec, rows);
        let message = ModelInferResponse {
            model_name: model_name.to_owned(),
            model_version: MODEL_VERSION.to_owned(),
            id: id.to_owned(),
            parameters: Default::default(),
            outputs: described,
            raw_output_contents: raw,
        };
        prost::Message::encode_to_vec(&message)
    }

    fn written(
        codec: &v2::Codec,
        model_name: &str,
        id: &str,
        outputs: &[OutputRows<'_>],
    ) -> Vec<u8> {
        let response = InferResponse::new(codec, model_name, id, outputs);
        let mut out = Vec::new();
        response.encode(&mut out);
        assert_eq!(
            out.len(),
            response.encoded_len(),
            "encoded_len is what encode writes"
        );
        out
    }

    #[test]
    fn an_answer_is_what_prost_writes_for_it_byte_for_byte() {
        let codec = codec(&[
            ("y", DType::Float32),
            ("text", DType::Bytes),
            ("é", DType::Int64),
        ]);
        let floats = [0x3fu8; 1024];
        let cases: Vec<(&str, &str, Vec<OutputRows<'_>>)> = vec![
            (
                "identity",
                "",
                vec![OutputRows {
                    index: 0,
                    shape: &[1, 256],
                    data: &floats,
                    classified: false,
                }],
            ),
            (
                "m",
                "request-7",
                vec![
                    OutputRows {
                        index: 1,
                        shape: &[2, 1],
                        data: b"\x01\x00\x00\x00a\x00\x00\x00\x00",
                        classified: false,
                    },
                    OutputRows {
                        index: 0,
                        shape: &[2, 128],
                        data: &floats,
                        classified: false,
                    },
                    OutputRows {
                        index: 2,
                        shape: &[],
                        data: &[],
                        classified: false,
                    },
                ],
            ),
            // A dimension past i64 (clamped, as prost's conversion clamps it), an
            // index the codec lacks (no name, no datatype), an empty output.
            (
                "m",
                "x",
                vec![
                    OutputRows {
                        index: 0,
                        shape: &[u64::MAX, 0],
                        data: &[],
                        classified: false,
                    },
                    OutputRows {
                        index: 9,
                        shape: &[3],
                        data: b"abc",
                        classified: false,
                    },
                ],
            ),
            ("", "", vec![]),
        ];
        for (model_name, id, outputs) in cases {
            assert_eq!(
                written(&codec, model_name, id, &outputs),
                by_prost(&codec, model_name, id, &outputs),
                "{model_name} {id} {outputs:?}"
            );
        }
    }

    #[test]
    fn a_framed_answer_is_its_prefix_and_message_in_a_buffer_of_exactly_that_length() {
        let codec = codec(&[("y", DType::Float32)]);
        let data = [7u8; 12];
        let outputs = [OutputRows {
            index: 0,
            shape: &[1, 3],
            data: &data,
            classified: false,
        }];
        let response = InferResponse::new(&codec, "m", "id", &outputs);
        let framed = response.framed().expect("a small answer frames");
        assert_eq!(
            framed.len(),
            framed.capacity(),
            "a Bytes takes it without a copy"
        );
        assert_eq!(framed[0], 0, "uncompressed");
        let length = u32::from_be_bytes([framed[1], framed[2], framed[3], framed[4]]) as usize;
        assert_eq!(length, framed.len() - PREFIX);
        assert_eq!(framed[PREFIX..], by_prost(&codec, "m", "id", &outputs)[..]);
        let decoded: ModelInferResponse =
            prost::Message::decode(&framed[PREFIX..]).expect("prost reads it back");
        assert_eq!(
            decoded.raw_output_contents,
            vec![Bytes::copy_from_slice(&data)]
        );
        assert_eq!(decoded.outputs[0].shape, vec![1, 3]);
    }

    proptest! {
        #[test]
        fn any_answer_is_what_prost_writes_for_it(
            model_name in "\\PC{0,12}",
            id in "\\PC{0,40}",
            outputs in proptest::collection::vec(
                (0usize..4, proptest::collection::vec(any::<u64>(), 0..5), proptest::collection::vec(any::<u8>(), 0..300)),
                0..5,
            ),
        ) {
            let codec = codec(&[("a", DType::Float32), ("bb", DType::Bytes), ("ccc", DType::UInt8)]);
            let rows: Vec<OutputRows<'_>> = outputs
                .iter()
                .map(|(index, shape, data)| OutputRows { index: *index, shape, data, classified: false })
                .collect();
            prop_assert_eq!(
                written(&codec, &model_name, &id, &rows),
                by_prost(&codec, &model_name, &id, &rows)
            );
        }
    }
}
