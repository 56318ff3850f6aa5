//! Encoding one infer response, straight from the outputs' bytes.

use half::{bf16, f16};

use super::regions::{self, RegionRange};
use super::{checked_size, Codec, V2Error};
use crate::DType;

/// One output to send: its index in [`Codec::outputs`], shape, little-endian
/// row-major bytes, and whether it goes as binary data.
#[derive(Debug, Clone, Copy)]
pub struct Output<'a> {
    pub index: usize,
    pub shape: &'a [u64],
    pub data: &'a [u8],
    pub binary: bool,
    /// Its top classes ([`Codec::classify`]'s shape and bytes): sent as
    /// BYTES whatever the output's datatype.
    pub classified: bool,
}

impl Output<'_> {
    /// The datatype it is sent as (`spec`: its output's).
    fn dtype(&self, spec: &super::OutputSpec) -> DType {
        if self.classified {
            DType::Bytes
        } else {
            spec.dtype
        }
    }
}

/// An encoded response body. With binary outputs, `header_length` is the
/// length of its JSON header, to send as `Inference-Header-Content-Length`
/// (the body is then not JSON as a whole).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    pub body: Vec<u8>,
    pub header_length: Option<usize>,
}

/// `text` as a JSON string (serde_json's escaping).
pub fn write_json_string(out: &mut Vec<u8>, text: &str) {
    // Writing a &str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, text);
}

fn write_uint(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

/// How many bytes [`write_uint`] writes for `v`.
fn uint_len(v: u64) -> usize {
    v.checked_ilog10().map_or(1, |d| d as usize + 1)
}

/// How many bytes [`write_json_string`] writes for `text`: its quotes,
/// two for each `"`, `\\` and control character with a short escape, six
/// for the other control characters (`\u00XX`), one for any other byte.
fn json_string_len(text: &str) -> usize {
    let escapes: usize = text
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\x08' | b'\t' | b'\n' | b'\x0c' | b'\r' => 1,
            0..=0x1f => 5,
            _ => 0,
        })
        .sum();
    text.len().saturating_add(escapes).saturating_add(2)
}

/// Floats as Python's `json` spells the non-finite ones; finite ones
/// shortest-round-trip in their own precision.
macro_rules! write_float {
    ($out:expr, $v:expr) => {{
        let v = $v;
        if v.is_finite() {
            $out.extend_from_slice(zmij::Buffer::new().format_finite(v).as_bytes());
        } else if v.is_nan() {
            $out.extend_from_slice(b"NaN");
        } else if v > 0.0 {
            $out.extend_from_slice(b"Infinity");
        } else {
            $out.extend_from_slice(b"-Infinity");
        }
    }};
}

/// `data` (little-endian `dtype` elements) as the members of a JSON array.
fn write_values(out: &mut Vec<u8>, dtype: DType, data: &[u8]) {
    macro_rules! each {
        ($n:literal, |$b:ident| $write:expr) => {
            for (i, $b) in data.chunks_exact($n).enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                let $b: [u8; $n] = $b.try_into().unwrap_or([0; $n]);
                $write;
            }
        };
    }
    macro_rules! int {
        ($t:ty, $n:literal) => {
            each!($n, |b| out.extend_from_slice(
                itoa::Buffer::new()
                    .format(<$t>::from_le_bytes(b))
                    .as_bytes()
            ))
        };
    }
    match dtype {
        // Triton sends BYTES as JSON strings; bytes that are not UTF-8 are
        // sent with U+FFFD in their place (the binary extension keeps them).
        DType::Bytes => {
            for (i, element) in crate::bytes::elements(data).enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_json_string(out, &String::from_utf8_lossy(element));
            }
        }
        DType::Bool => each!(1, |b| out.extend_from_slice(if b[0] != 0 {
            b"true"
        } else {
            b"false"
        })),
        DType::Int8 => int!(i8, 1),
        DType::Int16 => int!(i16, 2),
        DType::Int32 => int!(i32, 4),
        DType::Int64 => int!(i64, 8),
        DType::UInt8 => int!(u8, 1),
        DType::UInt16 => int!(u16, 2),
        DType::UInt32 => int!(u32, 4),
        DType::UInt64 => int!(u64, 8),
        DType::Float16 => each!(2, |b| write_float!(out, f16::from_le_bytes(b).to_f32())),
        DType::BFloat16 => each!(2, |b| write_float!(out, bf16::from_le_bytes(b).to_f32())),
        DType::Float32 => each!(4, |b| write_float!(out, f32::from_le_bytes(b))),
        DType::Float64 => each!(8, |b| write_float!(out, f64::from_le_bytes(b))),
    }
}

/// The region output `i` goes to, if any (`regions` aligned with the
/// outputs; shorter or empty: the rest go in the response).
fn region_of(regions: &[Option<RegionRange>], i: usize) -> Option<&RegionRange> {
    regions.get(i).and_then(Option::as_ref)
}

impl Codec {
    /// `{"name":...,"datatype":...,"shape":[`: the opening of output `o`'s
    /// entry (made for a classified one, kept for the others).
    fn output_prefix(&self, o: &Output<'_>) -> std::borrow::Cow<'_, [u8]> {
        match (o.classified, self.outputs().get(o.index)) {
            (true, Some(spec)) => {
                let mut prefix = b"{\"name\":".to_vec();
                write_json_string(&mut prefix, &spec.name);
                prefix.extend_from_slice(b",\"datatype\":\"BYTES\",\"shape\":[");
                prefix.into()
            }
            _ => self.output_prefixes[o.index].as_slice().into(),
        }
    }

    /// Output `o` checked as every answer checks it: a known index, and
    /// bytes its shape holds (well-formed elements for BYTES). Its spec, the
    /// datatype it is sent as and its element count.
    fn checked(&self, o: &Output<'_>) -> Result<(&super::OutputSpec, DType, usize), V2Error> {
        let spec = self.outputs().get(o.index).ok_or_else(|| {
            V2Error::Output(format!(
                "output index {} is not one of the model's",
                o.index
            ))
        })?;
        let dtype = o.dtype(spec);
        let (count, nbytes) = checked_size(&spec.name, dtype, o.shape, usize::MAX)
            .map_err(|e| V2Error::Output(e.to_string()))?;
        if dtype == DType::Bytes {
            let limits = crate::bytes::BytesLimits {
                max_element: usize::MAX,
                max_request: usize::MAX,
            };
            crate::bytes::check(o.data, count, limits)
                .map_err(|e| V2Error::Output(format!("output '{}': {e}", spec.name)))?;
        } else if o.data.len() != nbytes {
            return Err(V2Error::Output(format!(
                "output '{}': shape {:?} needs {nbytes} bytes of {}, got {}",
                spec.name,
                o.shape,
                dtype.v2_name(),
                o.data.len()
            )));
        }
        Ok((spec, dtype, count))
    }

    /// Triton's generate answer carrying `outputs` (each in JSON whatever
    /// its `binary`), written straight from their bytes, in one pass (the
    /// rules: [`super::generate`]): `model_name`, `model_version`, the
    /// request's `id`, then each output by name, its one element or its
    /// elements as a flat array, as [`Codec::encode`] spells them (an
    /// output named as one of the keys before it is left out:
    /// [`super::generate::RESERVED`]). Fails as [`Codec::encode`] does.
    pub fn encode_generate(
        &self,
        id: Option<&str>,
        outputs: &[Output<'_>],
    ) -> Result<Vec<u8>, V2Error> {
        // About what a number's text takes per byte of it; a guess only.
        let estimate =
            outputs
                .iter()
                .fold(self.response_prefix.len().saturating_add(64), |n, o| {
                    n.saturating_add(o.data.len().saturating_mul(3))
                        .saturating_add(32)
                });
        let mut out = Vec::with_capacity(estimate);
        out.extend_from_slice(&self.response_prefix);
        if let Some(id) = id {
            out.extend_from_slice(b",\"id\":");
            write_json_string(&mut out, id);
        }
        for o in outputs {
            let (spec, dtype, count) = self.checked(o)?;
            if super::generate::RESERVED.contains(&spec.name.as_str()) {
                continue;
            }
            out.push(b',');
            write_json_string(&mut out, &spec.name);
            out.push(b':');
            if count == 1 {
                write_values(&mut out, dtype, o.data);
            } else {
                out.push(b'[');
                write_values(&mut out, dtype, o.data);
                out.push(b']');
            }
        }
        out.push(b'}');
        Ok(out)
    }

    /// A response carrying `outputs`, echoing the request's `id`.
    ///
    /// Fails (a 500: the caller's bug, not the client's) when an output's
    /// index is unknown or its byte length is not its shape's.
    pub fn encode(&self, id: Option<&str>, outputs: &[Output<'_>]) -> Result<Encoded, V2Error> {
        self.encode_with_regions(id, outputs, &[])
    }

    /// [`Codec::encode`], output `i` written into `regions[i]` when that is
    /// a range (Triton's system shared-memory extension: the request's
    /// [`super::InferRequest::output_regions`]) and answered with its name,
    /// datatype and shape only. An output too large for its range fails
    /// with a 400 ([`V2Error::Invalid`]: the client's range), before any
    /// output is written.
    pub fn encode_with_regions(
        &self,
        id: Option<&str>,
        outputs: &[Output<'_>],
        regions: &[Option<RegionRange>],
    ) -> Result<Encoded, V2Error> {
        // Room for the binary outputs from the start: reserving it after the
        // header would move the header (a reallocation per response).
        let (mut body, binary_bytes) = self.header(id, outputs, regions, true, 0)?;
        let binary = |(i, o): &(usize, &Output<'_>)| o.binary && region_of(regions, *i).is_none();
        if !outputs.iter().enumerate().any(|o| binary(&o)) {
            return Ok(Encoded {
                body,
                header_length: None,
            });
        }
        let header_length = body.len();
        body.reserve_exact(binary_bytes);
        for (_, o) in outputs.iter().enumerate().filter(binary) {
            body.extend_from_slice(o.data);
        }
        Ok(Encoded {
            body,
            header_length: Some(header_length),
        })
    }

    /// The JSON part of a response (all of it when no output is binary),
    /// with room reserved for `extra` more bytes, and the number of binary
    /// bytes that follow it: the binary outputs' `data`, in order. For
    /// callers that write those bytes themselves, straight into their own
    /// buffer; [`Codec::encode`] otherwise.
    pub fn encode_header(
        &self,
        id: Option<&str>,
        outputs: &[Output<'_>],
        extra: usize,
    ) -> Result<(Vec<u8>, usize), V2Error> {
        self.header(id, outputs, &[], false, extra)
    }

    /// [`Codec::encode_header`] with outputs in shared memory, as
    /// [`Codec::encode_with_regions`] writes them (an output in a region
    /// is never among the binary bytes that follow).
    pub fn encode_header_with_regions(
        &self,
        id: Option<&str>,
        outputs: &[Output<'_>],
        regions: &[Option<RegionRange>],
        extra: usize,
    ) -> Result<(Vec<u8>, usize), V2Error> {
        self.header(id, outputs, regions, false, extra)
    }

    /// [`Codec::encode_header_with_regions`], its buffer also holding room
    /// for the binary outputs when `with_binary`.
    fn header(
        &self,
        id: Option<&str>,
        outputs: &[Output<'_>],
        regions: &[Option<RegionRange>],
        with_binary: bool,
        extra: usize,
    ) -> Result<(Vec<u8>, usize), V2Error> {
        let mut header_estimate: usize = 128 + id.map_or(0, str::len);
        // The header's exact length while every output is binary (each one
        // written as below): a body whose capacity is its length becomes a
        // `Bytes` with no allocation of its own.
        const ID: &str = ",\"id\":";
        const OUTPUTS: &str = ",\"outputs\":[";
        const BINARY: &str = "],\"parameters\":{\"binary_data_size\":";
        let mut exact = Some(
            self.response_prefix
                .len()
                .saturating_add(id.map_or(0, |id| ID.len().saturating_add(json_string_len(id))))
                .saturating_add(OUTPUTS.len())
                .saturating_add(outputs.len().saturating_sub(1))
                .saturating_add(2),
        );
        let mut binary_bytes: usize = 0;
        for (i, o) in outputs.iter().enumerate() {
            let (_, _, count) = self.checked(o)?;
            let prefix = self.output_prefix(o).len() + 24 * o.shape.len() + 48;
            header_estimate = header_estimate.saturating_add(prefix);
            if region_of(regions, i).is_some() {
                exact = None;
            } else if o.binary {
                binary_bytes = binary_bytes.saturating_add(o.data.len());
                let dims: usize = o.shape.iter().map(|&d| uint_len(d)).sum();
                exact = exact.map(|n| {
                    n.saturating_add(self.output_prefix(o).len())
                        .saturating_add(dims)
                        .saturating_add(o.shape.len().saturating_sub(1))
                        .saturating_add(BINARY.len())
                        .saturating_add(uint_len(o.data.len() as u64))
                        .saturating_add(2)
                });
            } else {
                header_estimate = header_estimate
                    .saturating_add(count.saturating_mul(12))
                    .saturating_add(o.data.len());
                exact = None;
            }
        }
        if !regions.is_empty() {
            let writes: Vec<(&str, &[u8], &RegionRange)> = outputs
                .iter()
                .zip(regions)
                .filter_map(|(o, range)| {
                    let name = self.outputs().get(o.index).map_or("", |s| s.name.as_str());
                    Some((name, o.data, range.as_ref()?))
                })
                .collect();
            regions::write_all(&writes).map_err(|e| V2Error::Invalid(e.to_string()))?;
        }
        let room = if with_binary { binary_bytes } else { 0 };
        let header = exact.unwrap_or(header_estimate);
        let mut out = Vec::with_capacity(header.saturating_add(extra).saturating_add(room));
        out.extend_from_slice(&self.response_prefix);
        if let Some(id) = id {
            out.extend_from_slice(ID.as_bytes());
            write_json_string(&mut out, id);
        }
        out.extend_from_slice(OUTPUTS.as_bytes());
        for (i, o) in outputs.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(&self.output_prefix(o));
            for (j, &d) in o.shape.iter().enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                write_uint(&mut out, d);
            }
            if region_of(regions, i).is_some() {
                // As Triton answers it: the output's bytes are in its region.
                out.extend_from_slice(b"]}");
            } else if o.binary {
                out.extend_from_slice(BINARY.as_bytes());
                write_uint(&mut out, o.data.len() as u64);
                out.extend_from_slice(b"}}");
            } else {
                out.extend_from_slice(b"],\"data\":[");
                write_values(&mut out, o.dtype(&self.outputs()[o.index]), o.data);
                out.extend_from_slice(b"]}");
            }
        }
        out.extend_from_slice(b"]}");
        Ok((out, binary_bytes))
    }
}
