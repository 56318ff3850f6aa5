//! Triton's generate extension (`POST .../generate` and `.../generate_stream`):
//! a flat JSON object in and out, for text models (LLMs).
//!
//! A generate request is turned into a v2 JSON inference request
//! ([`infer_request`]), which then takes the path every inference takes (the
//! model's codec, its queue, its counting); the answer is written flat from
//! the outputs' rows ([`Codec::encode_generate`](super::Codec::encode_generate),
//! on every front-end). The rules are Triton's (its `extension_generate.md`
//! and HTTP server):
//!
//! - each key of the request, and of its `"parameters"` object, that names a
//!   model input is that input: a scalar or a flat array, spread over the
//!   input's shape (the fixed dimensions take their share first, the
//!   innermost variable one the rest, any other variable one is 1);
//! - any other key is a request parameter: a string, a number or a bool,
//!   passed on as sent;
//! - `"id"` (a string) is the request's id, which the answer echoes;
//! - the answer carries `model_name`, `model_version`, `id` (when the
//!   request had one) and each output (but the [`RESERVED`] names): its one
//!   element, or its elements as a flat array, as the v2 answer spells them.
//!
//! Values are copied as their JSON text, never converted here: the codec
//! reads them as it reads any request's `data` (and refuses them as it does).

use std::ops::Range;

use super::error::{Clipped, V2Error};
use super::json::{Kind, Parser, SyntaxError};
use super::write_json_string;

/// The content type of a `generate_stream` answer: Server-Sent Events.
pub const EVENT_STREAM: &str = "text/event-stream; charset=utf-8";

/// What `generate` answers when a decoupled model does not send exactly one
/// response (Triton's words; a 400).
pub const ONE_RESPONSE: &str =
    "generate expects model to produce exactly 1 response, use generate \
                                stream for model that generates various number of responses";

/// The key of a generate request whose object's keys map the same way.
const PARAMETERS: &str = "parameters";

/// Request parameters a generate request does not pass on: its answer is
/// always JSON.
const NOT_PASSED: &[&str] = &["binary_data_output"];

/// A model input as a generate request fills it: the model metadata's name,
/// v2 datatype and shape (`-1` for a variable dimension, the batch one
/// included).
#[derive(Debug, Clone, Copy)]
pub struct GenerateInput<'a> {
    pub name: &'a str,
    pub datatype: &'a str,
    pub shape: &'a [i64],
}

fn syntax(e: SyntaxError) -> V2Error {
    V2Error::Json {
        message: e.message,
        offset: e.offset,
    }
}

fn invalid(message: String) -> V2Error {
    V2Error::Invalid(message)
}

/// The v2 JSON inference request that the generate request `body` stands
/// for, for a model whose inputs are `inputs`. An empty body is an empty
/// object (which names no input: refused).
pub fn infer_request(body: &[u8], inputs: &[GenerateInput<'_>]) -> Result<Vec<u8>, V2Error> {
    let empty = body.iter().all(u8::is_ascii_whitespace);
    let document: &[u8] = if empty { b"{}" } else { body };
    let mut p = Parser::new(document);
    if p.peek_kind().map_err(syntax)? != Kind::Object {
        return Err(invalid("a generate request is a JSON object".into()));
    }
    p.begin_object().map_err(syntax)?;
    let mut read = Read {
        inputs,
        tensors: vec![None; inputs.len()],
        parameters: Vec::new(),
    };
    let mut id = None;
    let mut first = true;
    while let Some(key) = p.next_key(&mut first).map_err(syntax)? {
        match key.as_ref() {
            "id" => {
                if p.peek_kind().map_err(syntax)? != Kind::String {
                    return Err(invalid("Unable to parse 'id': it must be a string".into()));
                }
                id = Some(p.string().map_err(syntax)?);
            }
            PARAMETERS => {
                if inputs.iter().any(|i| i.name == PARAMETERS) {
                    return Err(invalid(
                        "Keyword 'parameters' for nested schema also given as input tensor name"
                            .into(),
                    ));
                }
                if p.peek_kind().map_err(syntax)? != Kind::Object {
                    return Err(invalid(
                        "Expected JSON object for keyword: 'parameters'".into(),
                    ));
                }
                p.begin_object().map_err(syntax)?;
                let mut first = true;
                while let Some(key) = p.next_key(&mut first).map_err(syntax)? {
                    read.take(key.as_ref(), &mut p)?;
                }
            }
            key => read.take(key, &mut p)?,
        }
    }
    p.end().map_err(syntax)?;
    read.request(document, id.as_deref())
}

/// What a generate request gave, as ranges of its document.
struct Read<'i, 'a> {
    inputs: &'i [GenerateInput<'a>],
    /// Each input's value, index-aligned with `inputs`.
    tensors: Vec<Option<TensorValue>>,
    /// Parameters in the order given; a key given again keeps its last value.
    parameters: Vec<(String, Range<usize>)>,
}

impl Read<'_, '_> {
    /// Reads `key`'s value (next in `p`): an input's, or a parameter's.
    fn take(&mut self, key: &str, p: &mut Parser<'_>) -> Result<(), V2Error> {
        let Some(index) = self.inputs.iter().position(|i| i.name == key) else {
            let kind = p.peek_kind().map_err(syntax)?;
            if !matches!(kind, Kind::String | Kind::Number | Kind::Bool) {
                return Err(invalid(format!(
                    "parameter '{}' has invalid type. It should be either 'int', 'bool', or 'string'.",
                    Clipped(key)
                )));
            }
            let value = p.skip_value().map_err(syntax)?;
            if !NOT_PASSED.contains(&key) {
                self.parameters.retain(|(k, _)| k != key);
                self.parameters.push((key.to_owned(), value));
            }
            return Ok(());
        };
        if self.tensors[index].is_some() {
            return Err(invalid(format!(
                "input '{}' is given more than once",
                Clipped(key)
            )));
        }
        self.tensors[index] = Some(tensor_value(p, key)?);
        Ok(())
    }

    /// The v2 request: `{"id", "inputs": [...], "parameters": {...}}`.
    fn request(&self, document: &[u8], id: Option<&str>) -> Result<Vec<u8>, V2Error> {
        if self.tensors.iter().all(Option::is_none) {
            let names: Vec<String> = self
                .inputs
                .iter()
                .map(|i| format!("'{}'", Clipped(i.name)))
                .collect();
            return Err(invalid(format!(
                "a generate request names none of the model's inputs ({}): its keys are parameters",
                names.join(", ")
            )));
        }
        let mut out = Vec::with_capacity(document.len().saturating_add(128));
        out.push(b'{');
        if let Some(id) = id {
            out.extend_from_slice(b"\"id\":");
            write_json_string(&mut out, id);
            out.push(b',');
        }
        out.extend_from_slice(b"\"inputs\":[");
        let given = self.inputs.iter().zip(&self.tensors);
        for (n, (input, value)) in given
            .filter_map(|(i, v)| Some((i, v.as_ref()?)))
            .enumerate()
        {
            if n > 0 {
                out.push(b',');
            }
            let shape = spread(input, value.elements)?;
            out.extend_from_slice(b"{\"name\":");
            write_json_string(&mut out, input.name);
            out.extend_from_slice(b",\"datatype\":");
            write_json_string(&mut out, input.datatype);
            out.extend_from_slice(b",\"shape\":[");
            for (k, d) in shape.iter().enumerate() {
                if k > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(itoa::Buffer::new().format(*d).as_bytes());
            }
            out.extend_from_slice(b"],\"data\":");
            let text = &document[value.text.clone()];
            if value.is_array {
                out.extend_from_slice(text);
            } else {
                out.push(b'[');
                out.extend_from_slice(text);
                out.push(b']');
            }
            out.push(b'}');
        }
        out.push(b']');
        if !self.parameters.is_empty() {
            out.extend_from_slice(b",\"parameters\":{");
            for (n, (key, value)) in self.parameters.iter().enumerate() {
                if n > 0 {
                    out.push(b',');
                }
                write_json_string(&mut out, key);
                out.push(b':');
                out.extend_from_slice(&document[value.clone()]);
            }
            out.push(b'}');
        }
        out.push(b'}');
        Ok(out)
    }
}

/// An input's value in a generate request.
#[derive(Debug, Clone)]
struct TensorValue {
    /// Its text in the request.
    text: Range<usize>,
    /// Its elements (a scalar: 1).
    elements: usize,
    is_array: bool,
}

/// Reads input `name`'s value (next in `p`) in one pass: a scalar or a flat
/// array; a nested array, an object or null is refused.
fn tensor_value(p: &mut Parser<'_>, name: &str) -> Result<TensorValue, V2Error> {
    let flat = || {
        invalid(format!(
            "input '{}' of a generate request is a scalar or a flat array",
            Clipped(name)
        ))
    };
    let scalar = |kind: Kind| matches!(kind, Kind::String | Kind::Number | Kind::Bool);
    let kind = p.peek_kind().map_err(syntax)?;
    if kind != Kind::Array {
        if !scalar(kind) {
            return Err(flat());
        }
        let text = p.skip_value().map_err(syntax)?;
        return Ok(TensorValue {
            text,
            elements: 1,
            is_array: false,
        });
    }
    let start = p.offset();
    p.begin_array().map_err(syntax)?;
    let mut elements = 0usize;
    let mut first = true;
    while p.next_element(&mut first).map_err(syntax)? {
        match p.peek_kind().map_err(syntax)? {
            // Its text is copied as it is and read strictly by the codec.
            Kind::Number => p.skip_number_text().map(drop),
            kind if scalar(kind) => p.skip_value().map(drop),
            _ => return Err(flat()),
        }
        .map_err(syntax)?;
        elements += 1; // at most the document's length: no overflow
    }
    Ok(TensorValue {
        text: start..p.offset(),
        elements,
        is_array: true,
    })
}

/// The shape `elements` take in `input`: its fixed dimensions first, the
/// innermost variable one takes the rest, any other variable one is 1.
fn spread(input: &GenerateInput<'_>, elements: usize) -> Result<Vec<u64>, V2Error> {
    let cannot = || {
        invalid(format!(
            "The schema can not convert input '{}' to tensor with proper shape",
            Clipped(input.name)
        ))
    };
    let mut left = u64::try_from(elements).map_err(|_| cannot())?;
    for &d in input.shape {
        if d == -1 {
            continue;
        }
        let d = u64::try_from(d).map_err(|_| cannot())?;
        match left.checked_rem(d) {
            Some(0) => left /= d,
            None if left == 0 => {} // a zero dimension holds no elements
            _ => return Err(cannot()),
        }
    }
    let mut shape: Vec<u64> = input
        .shape
        .iter()
        .map(|&d| u64::try_from(d).unwrap_or(1))
        .collect();
    match input.shape.iter().rposition(|&d| d == -1) {
        Some(innermost) => shape[innermost] = left,
        None if left != 1 && elements > 0 => return Err(cannot()),
        None => {}
    }
    Ok(shape)
}

/// The keys of a generate answer that are not outputs: an output of one of
/// these names is left out, as Triton's reserved keys win.
pub const RESERVED: [&str; 3] = ["id", "model_name", "model_version"];

/// `document` as one Server-Sent Event (`data: ...` and a blank line).
pub fn event(document: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(document.len().saturating_add(8));
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(document);
    out.extend_from_slice(b"\n\n");
    out
}

/// The event that ends a `generate_stream` that failed after its first
/// response: `{"error": message}`.
pub fn error_event(message: &str) -> Vec<u8> {
    let mut document = b"{\"error\":".to_vec();
    write_json_string(&mut document, message);
    document.push(b'}');
    event(&document)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: GenerateInput<'static> = GenerateInput {
        name: "text_input",
        datatype: "BYTES",
        shape: &[-1, 1],
    };
    const BUDGET: GenerateInput<'static> = GenerateInput {
        name: "max_tokens",
        datatype: "INT32",
        shape: &[-1, 1],
    };

    fn request(body: &str, inputs: &[GenerateInput<'_>]) -> Result<String, V2Error> {
        infer_request(body.as_bytes(), inputs).map(|r| String::from_utf8(r).unwrap())
    }

    #[test]
    fn keys_naming_inputs_are_inputs_and_the_rest_parameters_passed_as_sent() {
        let body = r#"{"id": "42", "text_input": "hi", "parameters": {"max_tokens": 5, "temperature": 0.10000000000000001, "stream": false}, "top_k": 3}"#;
        let v2 = request(body, &[TEXT, BUDGET]).unwrap();
        assert_eq!(
            v2,
            concat!(
                r#"{"id":"42","inputs":["#,
                r#"{"name":"text_input","datatype":"BYTES","shape":[1,1],"data":["hi"]},"#,
                r#"{"name":"max_tokens","datatype":"INT32","shape":[1,1],"data":[5]}],"#,
                r#""parameters":{"temperature":0.10000000000000001,"stream":false,"top_k":3}}"#
            )
        );
        // The v2 request is valid JSON, the id echoed, escapes kept.
        let v2 = request(r#"{"id": "a\"b", "text_input": "x\ny"}"#, &[TEXT]).unwrap();
        let parsed: serde_json::Value = serde_json::from_str(&v2).unwrap();
        assert_eq!(parsed["id"], "a\"b");
        assert_eq!(parsed["inputs"][0]["data"][0], "x\ny");
    }

    #[test]
    fn elements_spread_over_the_shape_as_triton_spreads_them() {
        let tokens = GenerateInput {
            name: "tokens",
            datatype: "INT64",
            shape: &[-1, -1],
        };
        let v2 = request(r#"{"tokens": [1, 2, 3]}"#, &[tokens]).unwrap();
        assert!(v2.contains(r#""shape":[1,3],"data":[1, 2, 3]"#), "{v2}");
        let pairs = GenerateInput {
            name: "pairs",
            datatype: "FP32",
            shape: &[-1, 2],
        };
        assert!(request(r#"{"pairs": [1, 2, 3, 4]}"#, &[pairs])
            .unwrap()
            .contains(r#""shape":[2,2]"#));
        let err = request(r#"{"pairs": [1, 2, 3]}"#, &[pairs]).unwrap_err();
        assert!(
            err.to_string().contains("can not convert input 'pairs'"),
            "{err}"
        );
        let fixed = GenerateInput {
            name: "f",
            datatype: "FP32",
            shape: &[3],
        };
        assert!(request(r#"{"f": [1, 2, 3]}"#, &[fixed])
            .unwrap()
            .contains(r#""shape":[3]"#));
        assert!(request(r#"{"f": [1, 2]}"#, &[fixed]).is_err());
        let empty = GenerateInput {
            name: "e",
            datatype: "FP32",
            shape: &[-1, 0],
        };
        assert!(request(r#"{"e": []}"#, &[empty])
            .unwrap()
            .contains(r#""shape":[0,0]"#));
    }

    #[test]
    fn what_triton_refuses_is_refused_with_its_words() {
        let cases = [
            ("[1]", "a JSON object"),
            (r#"{"text_input": "a", "id": 7}"#, "Unable to parse 'id'"),
            (
                r#"{"text_input": "a", "x": [1]}"#,
                "parameter 'x' has invalid type",
            ),
            (
                r#"{"text_input": "a", "x": null}"#,
                "parameter 'x' has invalid type",
            ),
            (
                r#"{"text_input": "a", "x": {}}"#,
                "parameter 'x' has invalid type",
            ),
            (
                r#"{"text_input": "a", "parameters": []}"#,
                "Expected JSON object",
            ),
            (
                r#"{"text_input": "a", "parameters": {"text_input": "b"}}"#,
                "more than once",
            ),
            (
                r#"{"text_input": ["a", ["b"]]}"#,
                "a scalar or a flat array",
            ),
            (r#"{"text_input": {"a": 1}}"#, "a scalar or a flat array"),
            (r#"{"text_input": null}"#, "a scalar or a flat array"),
            (
                r#"{"text": "a"}"#,
                "names none of the model's inputs ('text_input')",
            ),
            ("", "names none"),
            (r#"{"text_input": "a""#, "malformed JSON"),
        ];
        for (body, words) in cases {
            let err = request(body, &[TEXT]).unwrap_err();
            assert_eq!(err.status(), 400, "{body}");
            assert!(err.to_string().contains(words), "{body}: {err}");
        }
        let parameters = GenerateInput {
            name: "parameters",
            datatype: "BYTES",
            shape: &[-1, 1],
        };
        let err = request(r#"{"parameters": {}}"#, &[parameters]).unwrap_err();
        assert!(err.to_string().contains("nested schema"), "{err}");
    }

    #[test]
    fn binary_data_output_is_not_passed_on_and_a_parameter_given_twice_keeps_its_last_value() {
        let v2 = request(
            r#"{"text_input": "a", "binary_data_output": true, "t": 1, "parameters": {"t": 2}}"#,
            &[TEXT],
        )
        .unwrap();
        assert!(v2.ends_with(r#""parameters":{"t":2}}"#), "{v2}");
        assert!(!v2.contains("binary_data_output"), "{v2}");
    }

    #[test]
    fn an_answer_is_each_output_flat_after_the_reserved_keys() {
        use crate::v2::{Codec, Limits, Output, OutputSpec};
        use crate::DType;
        let spec = |name: &str, dtype| OutputSpec {
            name: name.into(),
            dtype,
        };
        let codec = Codec::new(
            "m\"odel",
            vec![
                spec("text_output", DType::Bytes),
                spec("ends", DType::Int64),
                spec("none", DType::Int64),
                spec("model_name", DType::Bytes),
                spec("probs", DType::Float32),
                spec("flag", DType::Bool),
                spec("half", DType::Float16),
            ],
            Limits::default(),
        );
        let text = [2u8, 0, 0, 0, b'H', b'I'];
        let ends: Vec<u8> = [3i64, -9].iter().flat_map(|v| v.to_le_bytes()).collect();
        let probs: Vec<u8> = [0.1f32, f32::NAN, 2.5, -0.0, f32::INFINITY, 1e-8]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let half = half::f16::from_f32(0.3).to_le_bytes();
        let output = |index, shape: &'static [u64], data| Output {
            index,
            shape,
            data,
            binary: index % 2 == 0, // asked as binary or not: JSON here whatever
            classified: false,
        };
        let outputs = [
            output(0, &[1, 1], &text),
            output(1, &[1, 2], &ends),
            output(2, &[1, 0], &[]),
            output(3, &[1, 1], &text), // a reserved key wins: left out
            output(4, &[2, 3], &probs),
            output(5, &[1], &[1]),
            output(6, &[1, 1], &half),
        ];
        let written = |id| String::from_utf8(codec.encode_generate(id, &outputs).unwrap()).unwrap();
        let flat = concat!(
            r#""text_output":"HI","ends":[3,-9],"none":[],"#,
            r#""probs":[0.1,NaN,2.5,-0.0,Infinity,1e-8],"flag":true,"half":0.30004883}"#
        );
        let head = r#"{"model_name":"m\"odel","model_version":"1","#;
        assert_eq!(written(None), format!("{head}{flat}"));
        assert_eq!(
            written(Some("4\"2")),
            format!(r#"{head}"id":"4\"2",{flat}"#)
        );
        // Each value spelt as the v2 answer spells it.
        let json: Vec<Output<'_>> = outputs
            .iter()
            .map(|o| Output {
                binary: false,
                ..*o
            })
            .collect();
        let v2 = String::from_utf8(codec.encode(None, &json).unwrap().body).unwrap();
        assert!(
            v2.contains(r#""data":[0.1,NaN,2.5,-0.0,Infinity,1e-8]"#),
            "{v2}"
        );
        assert!(v2.contains(r#""data":[0.30004883]"#), "{v2}");
        assert_eq!(event(b"{}"), b"data: {}\n\n");
        // An output its bytes do not fill fails as encode fails, a 500.
        let short = [output(1, &[1, 3], &ends)];
        assert_eq!(
            codec.encode_generate(None, &short).unwrap_err().status(),
            500
        );
    }

    #[test]
    fn numbers_are_counted_unread_and_read_strictly_once_by_the_codec() {
        use crate::v2::{Codec, Limits};
        let x = GenerateInput {
            name: "x",
            datatype: "FP32",
            shape: &[-1, -1],
        };
        let codec = Codec::new("m", Vec::new(), Limits::default());
        // Python's spellings, the literals included, pass as sent.
        let v2 = request(r#"{"x": [1, -2.5e-3, NaN, -Infinity, 1E+2]}"#, &[x]).unwrap();
        assert!(
            v2.contains(r#""shape":[1,5],"data":[1, -2.5e-3, NaN, -Infinity, 1E+2]"#),
            "{v2}"
        );
        assert!(codec.decode(v2.as_bytes(), None).is_ok());
        // What is no number is counted as one here, then refused by the
        // codec as any v2 request's would be: a 400.
        for bad in ["[1.2.3]", "[1, -]", "[0x10]", "[Nope]", "[1e]"] {
            let v2 = request(&format!(r#"{{"x": {bad}}}"#), &[x]).unwrap();
            let refused = codec.decode(v2.as_bytes(), None).unwrap_err();
            assert_eq!(refused.status(), 400, "{bad}: {refused}");
        }
        // What breaks the array is refused here.
        for bad in ["[1 2]", "[1,]", "[1", "[,1]"] {
            let refused = request(&format!(r#"{{"x": {bad}}}"#), &[x]).unwrap_err();
            assert_eq!(refused.status(), 400, "{bad}: {refused}");
        }
    }

    #[test]
    fn a_failed_stream_ends_with_an_error_event_its_message_escaped() {
        assert_eq!(
            error_event("model 'm' failed: \"x\"\n"),
            b"data: {\"error\":\"model 'm' failed: \\\"x\\\"\\n\"}\n\n".to_vec()
        );
    }
}
