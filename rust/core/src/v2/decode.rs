//! Decoding one infer request: JSON, or a JSON header and binary tensors.

use crate::v2::{shape_text, Clipped};
use std::borrow::Cow;
use std::ops::Range;

use super::elements::Elements;
use super::error::{quote, short, V2Error};
use super::json::{Kind, Parser, SyntaxError};
use super::regions::{RegionRange, SharedRegions};
use super::{check_raw, checked_size, input_dtype, Codec};
use super::{SHARED_MEMORY_BYTE_SIZE, SHARED_MEMORY_OFFSET, SHARED_MEMORY_REGION};
use crate::DType;

/// A decoded infer request.
#[derive(Debug, Clone, PartialEq)]
pub struct InferRequest {
    /// The request's `id`, echoed in the response.
    pub id: Option<String>,
    /// The `timeout` parameter in seconds; `None`: no deadline (absent or
    /// 0). An infinite or huge one is passed on: the batcher treats one too
    /// long to represent as no deadline.
    pub timeout: Option<f64>,
    /// The `binary_data_output` parameter: the default of every output.
    pub binary_data_output: bool,
    /// The `priority` parameter (1: most urgent; 0 or absent: the default).
    pub priority: Option<u32>,
    /// Where the request's `parameters` object lies in the body (its JSON
    /// text, `timeout` and `priority` included), for models that ask for
    /// them: a range, so a request whose model does not ask copies nothing.
    pub parameters: Option<Range<usize>>,
    /// The inputs, in the request's order.
    pub inputs: crate::PerTensor<Input>,
    /// The outputs the request names (`None`: all, binary as
    /// `binary_data_output` says).
    pub outputs: Option<crate::PerTensor<RequestedOutput>>,
    /// Whether a tensor names a shared-memory region: its bytes change
    /// between requests with the same body, so such a request is never
    /// remembered ([`super::HeaderMemo`]) nor answered from a cache.
    pub shared_memory: bool,
}

impl InferRequest {
    /// The outputs to send: `(index in the codec's outputs, as binary)`.
    pub fn selected_outputs(&self, codec: &Codec) -> crate::PerTensor<(usize, bool)> {
        match &self.outputs {
            Some(outputs) => outputs.iter().map(|o| (o.index, o.binary)).collect(),
            None => (0..codec.outputs().len())
                .map(|i| (i, self.binary_data_output))
                .collect(),
        }
    }

    /// How many classes each of [`InferRequest::selected_outputs`] is
    /// answered with (`None`: its values). Empty, allocating nothing, when
    /// no output asks for classes.
    pub fn output_classes(&self) -> Vec<Option<u32>> {
        match &self.outputs {
            Some(outputs) if outputs.iter().any(|o| o.classes.is_some()) => {
                outputs.iter().map(|o| o.classes).collect()
            }
            _ => Vec::new(),
        }
    }

    /// Where each of [`InferRequest::selected_outputs`] goes: its
    /// shared-memory range, or `None` (in the response). Empty, allocating
    /// nothing, when no output names a region.
    pub fn output_regions(&self) -> Vec<Option<RegionRange>> {
        match &self.outputs {
            Some(outputs) if outputs.iter().any(|o| o.shared.is_some()) => {
                outputs.iter().map(|o| o.shared.clone()).collect()
            }
            _ => Vec::new(),
        }
    }
}

/// One input tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Input {
    pub name: String,
    pub dtype: DType,
    pub shape: Shape,
    pub data: Data,
}

/// A tensor's shape, inline for the few dimensions tensors have.
pub type Shape = smallvec::SmallVec<[u64; 6]>;

/// Where an input's little-endian bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Data {
    /// Decoded from JSON into a buffer of its own.
    Owned(Vec<u8>),
    /// A range of the request body (the binary extension), validated.
    Body(Range<usize>),
}

/// An output the request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestedOutput {
    /// Its index in [`Codec::outputs`].
    pub index: usize,
    /// Sent as binary data (never for one in shared memory).
    pub binary: bool,
    /// The shared-memory range its bytes go to (Triton's system
    /// shared-memory extension), resolved as the request is decoded.
    pub shared: Option<RegionRange>,
    /// Answered as its top classes, this many (Triton's classification
    /// extension, see [`super::classify`]); never with `shared`.
    pub classes: Option<u32>,
}

fn invalid(message: impl Into<String>) -> V2Error {
    V2Error::Invalid(message.into())
}

fn json_error(e: SyntaxError) -> V2Error {
    V2Error::Json {
        message: e.message,
        offset: e.offset,
    }
}

/// A field of an object as sent: absent, of the expected kind, or not (the
/// JSON text, quoted in the error).
enum Field<'a, T> {
    Missing,
    Got(T),
    Bad(&'a str),
    /// A shape with a dimension past u64 (its JSON text): too many elements.
    Huge(&'a str),
}

impl<'a, T> Field<'a, T> {
    fn shown(&self) -> String {
        match self {
            Field::Missing => "nothing".into(),
            Field::Got(_) => String::new(),
            Field::Bad(text) | Field::Huge(text) => short(text),
        }
    }
}

/// Where an input's `data` is, once its object is read.
enum DataField {
    Missing,
    /// Decoded as it was read (name, datatype and shape came first).
    Decoded(Vec<u8>),
    /// To decode once the whole object is read (it came first).
    Later(usize),
    /// Not an array: its JSON text.
    Bad,
}

/// Checks an input's name, datatype and shape (the caller's model's rule)
/// before its data is decoded.
pub type HeaderCheck<'c> = &'c mut dyn FnMut(&str, DType, &[u64]) -> Result<(), V2Error>;

struct Decoder<'a, 'c> {
    codec: &'c Codec,
    src: &'a [u8],
    p: Parser<'a>,
    /// Elements declared by the inputs so far.
    elements: usize,
    check: HeaderCheck<'c>,
    /// A tensor named a shared-memory region.
    shared_memory: bool,
}

impl Codec {
    /// Decodes one request body; `header_length` is the value of
    /// `Inference-Header-Content-Length` when the client sent one.
    pub fn decode(
        &self,
        body: &[u8],
        header_length: Option<&str>,
    ) -> Result<InferRequest, V2Error> {
        self.decode_checked(body, header_length, &mut |_, _, _| Ok(()))
    }

    /// [`Codec::decode`], with `check` called on each input's name,
    /// datatype and shape before its data is decoded (a model's inputs: a
    /// 60 MB FP64 array sent to an FP32 input is refused before a number of
    /// it is parsed).
    pub fn decode_checked(
        &self,
        body: &[u8],
        header_length: Option<&str>,
        check: HeaderCheck<'_>,
    ) -> Result<InferRequest, V2Error> {
        let header_end = self.header_end(body, header_length)?;
        self.decode_header(body, header_end, check)
    }

    /// Where the JSON header of `body` ends: all of it, or the
    /// `Inference-Header-Content-Length` the client sent (checked against
    /// the body, itself checked against the limit).
    pub(super) fn header_end(
        &self,
        body: &[u8],
        header_length: Option<&str>,
    ) -> Result<usize, V2Error> {
        let limit = self.limits().max_body_size;
        if body.len() > limit {
            return Err(V2Error::BodyTooLarge {
                size: body.len(),
                limit,
            });
        }
        match header_length {
            None => Ok(body.len()),
            Some(text) => match text.trim().parse::<usize>() {
                Ok(n) if n <= body.len() => Ok(n),
                _ => Err(V2Error::HeaderLength {
                    got: text.to_owned(),
                    body: body.len(),
                }),
            },
        }
    }

    /// Decodes `body` whose JSON header is `body[..header_end]`.
    pub(super) fn decode_header(
        &self,
        body: &[u8],
        header_end: usize,
        check: HeaderCheck<'_>,
    ) -> Result<InferRequest, V2Error> {
        let Some(header) = body.get(..header_end) else {
            return Err(V2Error::HeaderLength {
                got: header_end.to_string(),
                body: body.len(),
            });
        };
        let mut decoder = Decoder {
            codec: self,
            src: header,
            p: Parser::new(header),
            elements: 0,
            check,
            shared_memory: false,
        };
        match decoder
            .request(header_end, body.len())
            .and_then(|r| r.check_binary(body).map(|()| r))
        {
            Ok(request) => Ok(request),
            // A malformed document is reported as such, whatever the first
            // problem met while reading it (as a parse-then-check decoder does).
            Err(e @ V2Error::Invalid(_)) | Err(e @ V2Error::TooManyElements { .. }) => {
                let mut check = Parser::new(header);
                match check.skip_value().and_then(|_| check.end()) {
                    Err(syntax) => Err(json_error(syntax)),
                    Ok(()) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }
}

impl<'a> Decoder<'a, '_> {
    fn text(&self, range: Range<usize>) -> &'a str {
        std::str::from_utf8(&self.src[range]).unwrap_or("(not UTF-8)")
    }

    /// Skips the next value, returning its JSON text.
    fn skip(&mut self) -> Result<&'a str, V2Error> {
        let range = self.p.skip_value().map_err(json_error)?;
        Ok(self.text(range))
    }

    /// A string field, or its text when it is another kind (null: missing).
    fn string_field(&mut self) -> Result<Field<'a, Cow<'a, str>>, V2Error> {
        match self.p.peek_kind().map_err(json_error)? {
            Kind::String => Ok(Field::Got(self.p.string().map_err(json_error)?)),
            Kind::Null => {
                self.p.null();
                Ok(Field::Missing)
            }
            _ => Ok(Field::Bad(self.skip()?)),
        }
    }

    /// Consumes `{` of an object field, or returns false for `null`; any
    /// other value is skipped and `error` returned.
    fn object_or_null(&mut self, error: impl FnOnce() -> V2Error) -> Result<bool, V2Error> {
        match self.p.peek_kind().map_err(json_error)? {
            Kind::Object => {
                self.p.begin_object().map_err(json_error)?;
                Ok(true)
            }
            Kind::Null => {
                self.p.null();
                Ok(false)
            }
            _ => {
                self.skip()?;
                Err(error())
            }
        }
    }

    fn next_key(&mut self, first: &mut bool) -> Result<Option<Cow<'a, str>>, V2Error> {
        self.p.next_key(first).map_err(json_error)
    }

    fn request(&mut self, header_end: usize, body_end: usize) -> Result<InferRequest, V2Error> {
        if self.p.peek_kind().map_err(json_error)? != Kind::Object {
            self.skip()?;
            self.p.end().map_err(json_error)?;
            return Err(invalid("the request must be a JSON object"));
        }
        self.p.begin_object().map_err(json_error)?;
        let mut id = None;
        let mut timeout = None;
        let mut priority = None;
        let mut parameters = None;
        let mut binary_default = None;
        let mut inputs: Option<crate::PerTensor<Pending>> = None;
        let mut outputs: Option<crate::PerTensor<Selected>> = None;
        let mut first = true;
        while let Some(key) = self.next_key(&mut first)? {
            match &*key {
                "id" => match self.string_field()? {
                    Field::Got(text) => id = Some(text.into_owned()),
                    Field::Missing => id = None,
                    Field::Bad(_) | Field::Huge(_) => return Err(invalid("'id' must be a string")),
                },
                "parameters" => {
                    let error = || invalid("'parameters' of the request must be an object");
                    let start = self.p.offset();
                    if self.object_or_null(error)? {
                        self.request_parameters(&mut timeout, &mut priority, &mut binary_default)?;
                        parameters = Some(start..self.p.offset());
                    }
                }
                "inputs" => {
                    if inputs.is_some() {
                        return Err(invalid("the request has 'inputs' twice"));
                    }
                    inputs = Some(self.inputs()?);
                }
                "outputs" => outputs = self.outputs()?,
                _ => {
                    self.skip()?;
                }
            }
        }
        self.p.end().map_err(json_error)?;
        let binary_data_output = binary_default.unwrap_or(false);

        let pending = match inputs {
            Some(list) if !list.is_empty() => list,
            _ => return Err(invalid("the request needs a non-empty 'inputs' list")),
        };
        // Binary data follows the header in the inputs' order.
        let mut offset = header_end;
        let mut decoded = crate::PerTensor::with_capacity(pending.len());
        for input in pending {
            let data = match input.data {
                PendingData::Owned(bytes) => Data::Owned(bytes),
                PendingData::Binary(size) => {
                    let left = body_end - offset;
                    let size = usize::try_from(size)
                        .ok()
                        .filter(|&s| s <= left)
                        .ok_or_else(|| {
                            invalid(format!(
                            "input '{}': binary_data_size {size} runs past the end of the body \
                             ({left} binary bytes left)",
                            input.name
                        ))
                        })?;
                    let range = offset..offset + size;
                    offset += size;
                    // Lengths against shapes: `check_binary`, once all are known.
                    Data::Body(range)
                }
            };
            decoded.push(Input {
                name: input.name,
                dtype: input.dtype,
                shape: input.shape,
                data,
            });
        }
        if offset != body_end {
            return Err(invalid(format!(
                "the inputs' binary_data_size add up to {} bytes, but {} binary bytes follow \
                 the JSON header",
                offset - header_end,
                body_end - header_end
            )));
        }
        let outputs: Option<crate::PerTensor<RequestedOutput>> = outputs.map(|list| {
            list.into_iter()
                .map(|o| RequestedOutput {
                    index: o.index,
                    // Its bytes go to its region: none follow the header.
                    binary: o.shared.is_none() && o.binary.unwrap_or(binary_data_output),
                    shared: o.shared,
                    classes: o.classes,
                })
                .collect()
        });
        // An output of known size larger than its range: refused now,
        // before the model runs, not when its response is written.
        if let Some(list) = &outputs {
            let in_regions = list
                .iter()
                .filter_map(|o| o.shared.as_ref().map(|range| (o.index, range)));
            let first_shape = decoded.first().map(|i| &i.shape[..]);
            self.codec.check_output_regions(first_shape, in_regions)?;
        }
        let shared_memory = self.shared_memory
            || outputs
                .as_ref()
                .is_some_and(|list| list.iter().any(|o| o.shared.is_some()));
        Ok(InferRequest {
            id,
            timeout,
            priority,
            parameters,
            binary_data_output,
            inputs: decoded,
            outputs,
            shared_memory,
        })
    }

    fn request_parameters(
        &mut self,
        timeout: &mut Option<f64>,
        priority: &mut Option<u32>,
        binary_default: &mut Option<bool>,
    ) -> Result<(), V2Error> {
        let mut first = true;
        while let Some(key) = self.next_key(&mut first)? {
            match &*key {
                "timeout" => *timeout = self.timeout()?,
                "priority" => *priority = self.priority()?,
                "binary_data_output" => match self.p.peek_kind().map_err(json_error)? {
                    Kind::Bool => *binary_default = Some(self.p.boolean().map_err(json_error)?),
                    _ => {
                        self.skip()?;
                        return Err(invalid(
                            "parameter 'binary_data_output' must be true or false",
                        ));
                    }
                },
                _ => {
                    self.skip()?;
                }
            }
        }
        Ok(())
    }

    /// The `priority` parameter: an integer >= 0 (0: the default level).
    fn priority(&mut self) -> Result<Option<u32>, V2Error> {
        let start = self.p.offset();
        let level = match self.p.peek_kind().map_err(json_error)? {
            Kind::Null => {
                self.p.null();
                return Ok(None);
            }
            Kind::Number => {
                let n = self.p.number().map_err(json_error)?.to_f64();
                (n >= 0.0 && n.fract() == 0.0 && n <= f64::from(u32::MAX)).then_some(n as u32)
            }
            _ => {
                self.skip()?;
                None
            }
        };
        level.map(|p| (p > 0).then_some(p)).ok_or_else(|| {
            let text = self.text(start..self.p.offset());
            invalid(format!(
                "parameter 'priority' must be an integer >= 0, got {}",
                short(text.trim())
            ))
        })
    }

    /// The `timeout` parameter (microseconds, as Triton) in seconds.
    fn timeout(&mut self) -> Result<Option<f64>, V2Error> {
        let kind = self.p.peek_kind().map_err(json_error)?;
        if kind == Kind::Null {
            self.p.null();
            return Ok(None);
        }
        let start = self.p.offset();
        let micros = match kind {
            Kind::Number => Some(self.p.number().map_err(json_error)?.to_f64()),
            _ => {
                self.skip()?;
                None
            }
        };
        match micros {
            Some(us) if us >= 0.0 => {
                // 0 means none, as in Triton; one too long to represent is
                // none too, by the batcher's own rule (`Batcher::submit`).
                let seconds = us / 1e6;
                Ok((seconds > 0.0).then_some(seconds))
            }
            _ => {
                let text = self.text(start..self.p.offset());
                Err(invalid(format!(
                    "parameter 'timeout' must be microseconds >= 0, got {}",
                    short(text.trim())
                )))
            }
        }
    }

    fn inputs(&mut self) -> Result<crate::PerTensor<Pending>, V2Error> {
        if self.p.peek_kind().map_err(json_error)? != Kind::Array {
            self.skip()?;
            return Err(invalid("the request needs a non-empty 'inputs' list"));
        }
        self.p.begin_array().map_err(json_error)?;
        let mut inputs = crate::PerTensor::<Pending>::new();
        let mut first = true;
        while self.p.next_element(&mut first).map_err(json_error)? {
            if self.p.peek_kind().map_err(json_error)? != Kind::Object {
                self.skip()?;
                return Err(invalid("every entry of 'inputs' must be an object"));
            }
            let input = self.input()?;
            if inputs.iter().any(|i| i.name == input.name) {
                return Err(invalid(format!("input '{}' is given twice", input.name)));
            }
            inputs.push(input);
        }
        Ok(inputs)
    }

    /// Name, datatype and shape, checked in that order (and the elements
    /// against the limit): what decoding `data` needs.
    fn header(
        &self,
        name: &Field<'a, Cow<'a, str>>,
        datatype: &Field<'a, Cow<'a, str>>,
        shape: &Field<'a, Shape>,
    ) -> Result<(String, DType, Shape, usize), V2Error> {
        let name = match name {
            Field::Got(n) if !n.is_empty() => n.to_string(),
            Field::Got(_) => return Err(invalid("every tensor needs a non-empty 'name', got ''")),
            other => {
                return Err(invalid(format!(
                    "every tensor needs a non-empty 'name', got {}",
                    other.shown()
                )))
            }
        };
        let dtype = match datatype {
            Field::Got(d) => input_dtype(&name, d)?,
            other => {
                return Err(invalid(format!(
                    "input '{shown}': 'datatype' must be a string, got {}",
                    other.shown(),
                    shown = Clipped(name.as_ref())
                )))
            }
        };
        let shape = match shape {
            Field::Got(s) => s.clone(),
            Field::Huge(text) => {
                return Err(V2Error::TooManyElements {
                    input: name,
                    shape: short(text),
                    limit: self.codec.limits().max_elements,
                })
            }
            other => {
                return Err(invalid(format!(
                    "input '{shown}': 'shape' must be a list of non-negative integers, got {}",
                    other.shown(),
                    shown = Clipped(name.as_ref())
                )))
            }
        };
        let left = self
            .codec
            .limits()
            .max_elements
            .saturating_sub(self.elements);
        let (count, _) = checked_size(&name, dtype, &shape, left).map_err(|e| match e {
            V2Error::TooManyElements { input, shape, .. } => V2Error::TooManyElements {
                input,
                shape,
                limit: self.codec.limits().max_elements,
            },
            e => e,
        })?;
        Ok((name, dtype, shape, count))
    }

    fn input(&mut self) -> Result<Pending, V2Error> {
        self.p.begin_object().map_err(json_error)?;
        let mut name = Field::Missing;
        let mut datatype = Field::Missing;
        let mut shape = Field::Missing;
        let mut params = InputParams::default();
        let mut data = DataField::Missing;
        let mut first = true;
        while let Some(key) = self.next_key(&mut first)? {
            match &*key {
                "name" => name = self.string_field()?,
                "datatype" => datatype = self.string_field()?,
                "shape" => shape = self.shape()?,
                "parameters" => {
                    // Named only in an error: no text made for a good request.
                    let what = || match &name {
                        Field::Got(n) => format!("input '{}'", Clipped(n.as_ref())),
                        _ => "an input".into(),
                    };
                    let error = || invalid(format!("'parameters' of {} must be an object", what()));
                    if self.object_or_null(error)? {
                        params = self.input_parameters(what)?.or(params);
                    }
                }
                "data" => {
                    if self.p.peek_kind().map_err(json_error)? != Kind::Array {
                        self.skip()?;
                        data = DataField::Bad;
                    } else if let Ok((n, dtype, s, count)) = self.header(&name, &datatype, &shape) {
                        (self.check)(&n, dtype, &s)?;
                        data = DataField::Decoded(self.data(&n, dtype, &s, count)?);
                    } else {
                        let at = self.p.offset();
                        self.skip()?;
                        data = DataField::Later(at);
                    }
                }
                _ => {
                    self.skip()?;
                }
            }
        }
        let (name, dtype, shape, count) = self.header(&name, &datatype, &shape)?;
        if !matches!(data, DataField::Decoded(_)) {
            (self.check)(&name, dtype, &shape)?; // checked already if decoded
        }
        let binary_size = params.binary_size;
        if let Some(regions) = self.codec.regions() {
            exactly_one_source(
                !matches!(data, DataField::Missing),
                binary_size.is_some(),
                params.region.is_some(),
            )?;
            if let Some(region) = &params.region {
                let range = regions
                    .range(
                        region,
                        params.offset.unwrap_or(0),
                        params.byte_size.unwrap_or(0),
                    )
                    .map_err(|e| invalid(e.to_string()))?;
                let bytes = super::region_input(&name, dtype, &shape, &range)?;
                self.elements += count;
                self.shared_memory = true;
                return Ok(Pending {
                    data: PendingData::Owned(bytes),
                    name,
                    dtype,
                    shape,
                });
            }
        }
        let data = match (binary_size, data) {
            (Some(_), DataField::Missing) => None,
            (Some(_), _) => {
                return Err(invalid(format!(
                    "input '{shown}' has both 'data' and 'binary_data_size'",
                    shown = Clipped(name.as_ref())
                )))
            }
            (None, DataField::Missing) => {
                return Err(invalid(format!(
                    "input '{shown}' has neither 'data' nor 'binary_data_size'",
                    shown = Clipped(name.as_ref())
                )))
            }
            (None, DataField::Bad) => {
                return Err(invalid(format!(
                    "input '{shown}': 'data' must be a JSON array",
                    shown = Clipped(name.as_ref())
                )))
            }
            (None, DataField::Decoded(bytes)) => Some(bytes),
            (None, DataField::Later(at)) => {
                let mut later = Parser::at(self.src, at);
                std::mem::swap(&mut self.p, &mut later);
                let bytes = self.data(&name, dtype, &shape, count);
                std::mem::swap(&mut self.p, &mut later);
                Some(bytes?)
            }
        };
        self.elements += count;
        Ok(Pending {
            data: match (data, binary_size) {
                (Some(bytes), _) => PendingData::Owned(bytes),
                (None, size) => PendingData::Binary(size.unwrap_or(0)),
            },
            name,
            dtype,
            shape,
        })
    }

    /// `binary_data_size` and, with regions, the shared-memory parameters
    /// from an input's parameters (others are ignored).
    fn input_parameters(&mut self, what: impl Fn() -> String) -> Result<InputParams<'a>, V2Error> {
        let mut params = InputParams::default();
        let regions = self.codec.regions().is_some();
        let mut first = true;
        while let Some(key) = self.next_key(&mut first)? {
            match &*key {
                SHARED_MEMORY_REGION if !regions => {
                    self.skip()?;
                    return Err(invalid(super::shared_memory_refused(&what())));
                }
                SHARED_MEMORY_REGION => {
                    match self.region_name()? {
                        Field::Got(region) => params.region = Some(region),
                        bad => return Err(unparsed(&key, &what(), STRING, &bad.shown())),
                    }
                    continue;
                }
                SHARED_MEMORY_OFFSET | SHARED_MEMORY_BYTE_SIZE if regions => {
                    let value = match self.uint_field()? {
                        Field::Got(v) => v,
                        bad => return Err(unparsed(&key, &what(), UINT, &bad.shown())),
                    };
                    match &*key {
                        SHARED_MEMORY_OFFSET => params.offset = Some(value),
                        _ => params.byte_size = Some(value),
                    }
                    continue;
                }
                "binary_data_size" => {}
                _ => {
                    self.skip()?;
                    continue;
                }
            }
            let kind = self.p.peek_kind().map_err(json_error)?;
            if kind == Kind::Null {
                self.p.null();
                params.binary_size = None;
                continue;
            }
            match self.uint_field()? {
                Field::Got(v) => params.binary_size = Some(v),
                _ => {
                    return Err(invalid(format!(
                        "{}: binary_data_size must be an int >= 0",
                        what()
                    )))
                }
            }
        }
        Ok(params)
    }

    /// A tensor's `shared_memory_region`: a string.
    fn region_name(&mut self) -> Result<Field<'a, Cow<'a, str>>, V2Error> {
        if self.p.peek_kind().map_err(json_error)? == Kind::String {
            return Ok(Field::Got(self.p.string().map_err(json_error)?));
        }
        Ok(Field::Bad(self.skip()?))
    }

    /// An integer >= 0 (`binary_data_size`, `shared_memory_offset`,
    /// `shared_memory_byte_size`), or the text sent.
    fn uint_field(&mut self) -> Result<Field<'a, u64>, V2Error> {
        let start = self.p.offset();
        let value = match self.p.peek_kind().map_err(json_error)? {
            Kind::Number => {
                let n = self.p.number().map_err(json_error)?;
                n.integer.then(|| n.to_i128()).flatten()
            }
            _ => {
                self.skip()?;
                None
            }
        };
        Ok(match value.and_then(|v| u64::try_from(v).ok()) {
            Some(v) => Field::Got(v),
            None => Field::Bad(self.text(start..self.p.offset()).trim()),
        })
    }

    /// A `shape`: a list of non-negative integers, or the text sent.
    fn shape(&mut self) -> Result<Field<'a, Shape>, V2Error> {
        let range = self.p.skip_value().map_err(json_error)?;
        let text = self.text(range.clone());
        let mut p = Parser::at(self.src, range.start);
        let mut dims = Shape::new();
        if p.peek_kind() != Ok(Kind::Array) {
            return Ok(Field::Bad(text));
        }
        let _ = p.begin_array();
        let mut first = true;
        while let Ok(true) = p.next_element(&mut first) {
            if p.peek_kind() != Ok(Kind::Number) {
                return Ok(Field::Bad(text));
            }
            let Ok(n) = p.number() else {
                return Ok(Field::Bad(text));
            };
            match n.integer.then(|| n.to_i128()).flatten() {
                // Past u64: too many elements, shown as sent (not as u64::MAX).
                Some(d) if d >= 0 => match u64::try_from(d) {
                    Ok(d) => dims.push(d),
                    Err(_) => return Ok(Field::Huge(text)),
                },
                _ => return Ok(Field::Bad(text)),
            }
        }
        Ok(Field::Got(dims))
    }

    /// Parses a `data` array (flat or nested, row-major) into `count`
    /// elements of `dtype`.
    fn data(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        count: usize,
    ) -> Result<Vec<u8>, V2Error> {
        // Every value takes at least one byte and a separator: a shape
        // needing more than the rest of the header holds is refused before
        // its buffer is allocated.
        let room = self.p.remaining() / 2 + 1;
        if count > room {
            return Err(invalid(format!(
                "input '{shown}': shape {shape} needs {count} values, more than the \
                 request's JSON holds",
                shown = Clipped(name),
                shape = shape_text(shape)
            )));
        }
        let mut elements = Elements::new(dtype, count, usize::MAX);
        self.p.begin_array().map_err(json_error)?;
        // Open arrays: whether each has had a member yet.
        let mut open: Vec<bool> = vec![true];
        while let Some(first) = open.last_mut() {
            if !self.p.next_element(first).map_err(json_error)? {
                open.pop();
                continue;
            }
            if dtype == DType::Float32 {
                if let Some(v) = self.p.f32_number() {
                    elements.push_f32(v);
                    self.p.f32_run(|v| elements.push_f32(v));
                    continue;
                }
            }
            if dtype.is_integer() {
                if let Some(v) = self.p.int_number() {
                    elements.push_integer(name, i128::from(v))?;
                    self.p
                        .int_run(|v| elements.push_integer(name, i128::from(v)))?;
                    continue;
                }
            }
            match self.p.peek_kind().map_err(json_error)? {
                // BYTES: each element a JSON string, taken as its UTF-8 bytes
                // (as Triton does); a string for any other type is refused below.
                Kind::String if dtype == DType::Bytes => {
                    let text = self.p.string().map_err(json_error)?;
                    elements.push_bytes(text.as_bytes())?;
                }
                Kind::Number => {
                    let n = self.p.number().map_err(json_error)?;
                    elements.push_number(name, n)?;
                }
                Kind::Bool => elements.push_bool(name, self.p.boolean().map_err(json_error)?)?,
                Kind::Array => {
                    self.p.begin_array().map_err(json_error)?;
                    open.push(true);
                }
                kind => {
                    let text = self.skip()?;
                    let what = if kind == Kind::String {
                        quote(text.trim_matches('"'))
                    } else {
                        text.to_owned()
                    };
                    return Err(
                        elements.not_a_number(name, &format!("{} {}", kind.describe(), what))
                    );
                }
            }
        }
        elements.finish(name, shape)
    }

    fn outputs(&mut self) -> Result<Option<crate::PerTensor<Selected>>, V2Error> {
        match self.p.peek_kind().map_err(json_error)? {
            Kind::Null => {
                self.p.null();
                return Ok(None);
            }
            Kind::Array => {}
            _ => {
                self.skip()?;
                return Err(invalid("'outputs' must be a list"));
            }
        }
        self.p.begin_array().map_err(json_error)?;
        let mut outputs = crate::PerTensor::<Selected>::new();
        let mut first = true;
        let entry_error =
            || invalid("every entry of 'outputs' must be an object with a string 'name'");
        while self.p.next_element(&mut first).map_err(json_error)? {
            if self.p.peek_kind().map_err(json_error)? != Kind::Object {
                self.skip()?;
                return Err(entry_error());
            }
            self.p.begin_object().map_err(json_error)?;
            let mut name: Field<'a, Cow<'a, str>> = Field::Missing;
            let mut binary: Option<Option<bool>> = None; // Some(None): binary_data bad
            let mut classification: Option<Option<u64>> = None; // Some(None): not a count
            let mut shared_memory = false;
            // With regions: its shared-memory parameters as read, or the
            // first one that did not parse.
            let mut region = OutputRegion::default();
            let mut params_bad = false;
            let mut entry_first = true;
            while let Some(key) = self.next_key(&mut entry_first)? {
                match &*key {
                    "name" => name = self.string_field()?,
                    "parameters" => match self.p.peek_kind().map_err(json_error)? {
                        Kind::Object => {
                            self.p.begin_object().map_err(json_error)?;
                            let mut pf = true;
                            while let Some(k) = self.next_key(&mut pf)? {
                                match &*k {
                                    "binary_data" => {
                                        binary =
                                            Some(match self.p.peek_kind().map_err(json_error)? {
                                                Kind::Bool => {
                                                    Some(self.p.boolean().map_err(json_error)?)
                                                }
                                                _ => {
                                                    self.skip()?;
                                                    None
                                                }
                                            })
                                    }
                                    "classification" => {
                                        classification = Some(match self.uint_field()? {
                                            Field::Got(count) => Some(count),
                                            _ => None,
                                        });
                                    }
                                    SHARED_MEMORY_REGION => {
                                        shared_memory = true;
                                        if self.codec.regions().is_none() {
                                            self.skip()?;
                                        } else {
                                            self.output_region(&k, &mut region)?;
                                        }
                                    }
                                    SHARED_MEMORY_OFFSET | SHARED_MEMORY_BYTE_SIZE
                                        if self.codec.regions().is_some() =>
                                    {
                                        self.output_region(&k, &mut region)?;
                                    }
                                    _ => {
                                        self.skip()?;
                                    }
                                }
                            }
                        }
                        Kind::Null => {
                            self.p.null();
                        }
                        _ => {
                            self.skip()?;
                            params_bad = true;
                        }
                    },
                    _ => {
                        self.skip()?;
                    }
                }
            }
            let Field::Got(name) = name else {
                return Err(entry_error());
            };
            let index = self.codec.output_index(&name)?;
            // Each entry would be sent in full: a name repeated thousands
            // of times in a small request would make a reply of gigabytes.
            if outputs.iter().any(|earlier| earlier.index == index) {
                return Err(invalid(format!(
                    "output '{shown}' is asked for twice",
                    shown = Clipped(name.as_ref())
                )));
            }
            if params_bad {
                return Err(invalid(format!(
                    "'parameters' of output '{shown}' must be an object",
                    shown = Clipped(name.as_ref())
                )));
            }
            let shared = match self.codec.regions() {
                Some(regions) if shared_memory => Some(self.resolve_output(
                    regions,
                    &name,
                    region,
                    classification.is_some(),
                    binary,
                )?),
                _ => None,
            };
            let classes = match classification {
                None => None,
                Some(None) => {
                    return Err(invalid(format!(
                        "output '{shown}': 'classification' must be an integer >= 0",
                        shown = Clipped(name.as_ref())
                    )))
                }
                // 0 asks for none, as Triton reads it: the output's values.
                Some(Some(0)) => None,
                Some(Some(count)) => {
                    if let Some(spec) = self.codec.outputs().get(index) {
                        super::classify::check_classifiable(&spec.name, spec.dtype)?;
                    }
                    // No entry has more classes than u32 counts.
                    Some(u32::try_from(count).unwrap_or(u32::MAX))
                }
            };
            if shared_memory && shared.is_none() {
                let tensor = format!("output '{}'", Clipped(name.as_ref()));
                return Err(invalid(super::shared_memory_refused(&tensor)));
            }
            let binary = match binary {
                None => None,
                Some(Some(b)) => Some(b),
                Some(None) => return Err(binary_not_bool(&name)),
            };
            outputs.push(Selected {
                index,
                binary,
                shared,
                classes,
            });
        }
        // None named, as none given: every output (as Triton and gRPC read it).
        Ok((!outputs.is_empty()).then_some(outputs))
    }

    /// Reads one shared-memory parameter (`key`) of an output into
    /// `region`; a value that does not parse is kept in `region.bad`,
    /// reported once the output's name is known.
    fn output_region(&mut self, key: &str, region: &mut OutputRegion<'a>) -> Result<(), V2Error> {
        let bad = match key {
            SHARED_MEMORY_REGION => match self.region_name()? {
                Field::Got(name) => {
                    region.name = Some(name);
                    None
                }
                bad => Some((SHARED_MEMORY_REGION, STRING, bad.shown())),
            },
            _ => match self.uint_field()? {
                Field::Got(v) if key == SHARED_MEMORY_OFFSET => {
                    region.offset = v;
                    None
                }
                Field::Got(v) => {
                    region.byte_size = v;
                    None
                }
                bad => Some((
                    if key == SHARED_MEMORY_OFFSET {
                        SHARED_MEMORY_OFFSET
                    } else {
                        SHARED_MEMORY_BYTE_SIZE
                    },
                    UINT,
                    bad.shown(),
                )),
            },
        };
        if region.bad.is_none() {
            region.bad = bad;
        }
        Ok(())
    }

    /// The range an output's bytes go to, resolved now (before the model
    /// runs), with Triton's checks.
    fn resolve_output(
        &self,
        regions: &SharedRegions,
        name: &str,
        region: OutputRegion<'a>,
        classification: bool,
        binary: Option<Option<bool>>,
    ) -> Result<RegionRange, V2Error> {
        if classification {
            return Err(invalid(
                "Output can't set both 'shared_memory_region' and 'classification'",
            ));
        }
        match binary {
            Some(Some(true)) => {
                return Err(invalid(
                    "Output can't set both 'shared_memory_region' and 'binary_data'",
                ))
            }
            Some(None) => return Err(binary_not_bool(name)),
            _ => {}
        }
        if let Some((field, expected, got)) = region.bad {
            let what = format!("output '{}'", Clipped(name));
            return Err(unparsed(field, &what, expected, &got));
        }
        let region_name = region.name.as_deref().unwrap_or_default();
        regions
            .range(region_name, region.offset, region.byte_size)
            .map_err(|e| invalid(e.to_string()))
    }
}

/// An output named by the request: its index, `binary_data` if given, and
/// the range its bytes go to if in shared memory.
struct Selected {
    index: usize,
    binary: Option<bool>,
    shared: Option<RegionRange>,
    classes: Option<u32>,
}

/// An output's shared-memory parameters as read.
#[derive(Default)]
struct OutputRegion<'a> {
    name: Option<Cow<'a, str>>,
    offset: u64,
    byte_size: u64,
    /// The first that did not parse: its field, what it must be, what it was.
    bad: Option<(&'static str, &'static str, String)>,
}

/// An input's parameters that say where its bytes are.
#[derive(Default)]
struct InputParams<'a> {
    binary_size: Option<u64>,
    region: Option<Cow<'a, str>>,
    offset: Option<u64>,
    byte_size: Option<u64>,
}

impl<'a> InputParams<'a> {
    /// These, with what `earlier` (another `parameters` of the same input) set and these do not.
    fn or(self, earlier: InputParams<'a>) -> InputParams<'a> {
        InputParams {
            binary_size: self.binary_size.or(earlier.binary_size),
            region: self.region.or(earlier.region),
            offset: self.offset.or(earlier.offset),
            byte_size: self.byte_size.or(earlier.byte_size),
        }
    }
}

fn binary_not_bool(name: &str) -> V2Error {
    invalid(format!(
        "output '{shown}': binary_data must be true or false",
        shown = Clipped(name)
    ))
}

const STRING: &str = "a string";
const UINT: &str = "an integer >= 0";

/// A shared-memory parameter of the wrong kind (Triton's words first);
/// `got`: as [`Field::shown`] shows it.
fn unparsed(field: &str, what: &str, expected: &str, got: &str) -> V2Error {
    invalid(format!(
        "Unable to parse '{field}' of {what}: expected {expected}, got {got}"
    ))
}

/// Triton's rule for an input's data: exactly one of `data`,
/// `binary_data_size` and `shared_memory_region` (its words).
fn exactly_one_source(data: bool, binary: bool, region: bool) -> Result<(), V2Error> {
    if usize::from(data) + usize::from(binary) + usize::from(region) == 1 {
        return Ok(());
    }
    let mut message = String::from(
        "Input must set only one of the following fields: 'data', 'binary_data_size' in \
         'parameters', 'shared_memory_region' in 'parameters'. But",
    );
    if !(data || binary || region) {
        message.push_str(" no field is set");
    } else {
        message.push_str(" set");
        for (set, field) in [
            (data, " 'data'"),
            (binary, " 'binary_data_size'"),
            (region, " 'shared_memory_region'"),
        ] {
            if set {
                message.push_str(field);
            }
        }
    }
    Err(invalid(message))
}

struct Pending {
    name: String,
    dtype: DType,
    shape: Shape,
    data: PendingData,
}

enum PendingData {
    Owned(Vec<u8>),
    Binary(u64),
}

impl InferRequest {
    /// Checks the binary inputs' bytes in `body`: lengths against shapes,
    /// BOOL bytes 0 or 1.
    pub(super) fn check_binary(&self, body: &[u8]) -> Result<(), V2Error> {
        for input in &self.inputs {
            if let Data::Body(range) = &input.data {
                let bytes = body.get(range.clone()).ok_or_else(|| {
                    invalid(format!(
                        "input '{}': binary data out of the body",
                        input.name
                    ))
                })?;
                check_raw(&input.name, input.dtype, &input.shape, bytes)?;
            }
        }
        Ok(())
    }
}
