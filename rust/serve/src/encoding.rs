//! HTTP content codings, as Triton has them: an infer request's body may be
//! gzip or deflate (zlib) coded, inflated here within a bound; a response
//! is coded when the request's `Accept-Encoding` names gzip (preferred) or
//! deflate.
//!
//! Inflating never allocates more than the bound: the output grows in
//! steps capped by what is left of it, and one more byte of output past it
//! is a 413, not an allocation.

use std::io::{Read, Write};

use flate2::write::{GzEncoder, ZlibEncoder};
use flate2::{Compression, Decompress, FlushDecompress, Status};
use hyper::header::HeaderValue;

use crate::replies::Failure;

/// A content coding ferrobatch undoes and applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    /// HTTP's deflate: a zlib stream (RFC 1950), as Triton and its clients use.
    Deflate,
}

impl Coding {
    pub fn name(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Deflate => "deflate",
        }
    }

    fn named(token: &[u8]) -> Option<Coding> {
        if token.eq_ignore_ascii_case(b"gzip") || token.eq_ignore_ascii_case(b"x-gzip") {
            Some(Coding::Gzip)
        } else if token.eq_ignore_ascii_case(b"deflate") {
            Some(Coding::Deflate)
        } else {
            None
        }
    }
}

/// A request's `Content-Encoding`: `Ok(None)` for none or identity,
/// `Ok(Some(_))` for one this module undoes, `Err(())` for anything else
/// (a list of codings included).
#[allow(clippy::result_unit_err)]
pub fn content_coding(value: Option<&HeaderValue>) -> Result<Option<Coding>, ()> {
    content_coding_of(value.map(HeaderValue::as_bytes))
}

/// [`content_coding`] of a header's bytes (the Python front-ends' way in).
#[allow(clippy::result_unit_err)]
pub fn content_coding_of(value: Option<&[u8]>) -> Result<Option<Coding>, ()> {
    let Some(value) = value else { return Ok(None) };
    let token = value.trim_ascii();
    if token.is_empty() || token.eq_ignore_ascii_case(b"identity") {
        return Ok(None);
    }
    Coding::named(token).map(Some).ok_or(())
}

/// The coding for a response to a request with `Accept-Encoding: value`:
/// gzip when it is accepted, else deflate, else none. A coding with `q=0`
/// is not accepted.
pub fn accepted(value: Option<&HeaderValue>) -> Option<Coding> {
    accepted_of(value.map(HeaderValue::as_bytes))
}

/// [`accepted`] of a header's bytes (the Python front-ends' way in).
pub fn accepted_of(value: Option<&[u8]>) -> Option<Coding> {
    let value = value?;
    let mut deflate = false;
    for item in value.split(|&b| b == b',') {
        let mut parts = item.split(|&b| b == b';');
        let Some(coding) = parts.next().and_then(|t| Coding::named(t.trim_ascii())) else {
            continue;
        };
        let refused = parts.any(|p| {
            let p = p.trim_ascii();
            let Some(q) = p.strip_prefix(b"q=").or_else(|| p.strip_prefix(b"Q=")) else {
                return false;
            };
            std::str::from_utf8(q)
                .ok()
                .and_then(|q| q.trim().parse::<f32>().ok())
                .is_some_and(|q| q <= 0.0)
        });
        match (coding, refused) {
            (Coding::Gzip, false) => return Some(Coding::Gzip),
            (Coding::Deflate, false) => deflate = true,
            _ => {}
        }
    }
    deflate.then_some(Coding::Deflate)
}

/// Step by which the inflated body grows (at most what is left of the limit).
const STEP: usize = 64 << 10;

/// Undoes `coding` on `body`: at most `limit` bytes of output (413 beyond,
/// found without producing more), 400 for a corrupt or truncated stream or
/// data after a deflate stream's end.
pub fn inflate(body: &[u8], coding: Coding, limit: usize) -> Result<Vec<u8>, Failure> {
    let corrupt = |why: &dyn std::fmt::Display| {
        Failure::new(
            400,
            format!("the request body is not valid {}: {why}", coding.name()),
        )
    };
    let mut source = Source::new(body, coding);
    let mut out: Vec<u8> = Vec::new();
    let mut filled = 0usize;
    loop {
        if filled == out.len() {
            let left = limit.saturating_sub(filled);
            if left == 0 {
                // Full: one byte more is over the limit.
                let mut probe = [0u8; 1];
                return match source.read(&mut probe).map_err(|e| corrupt(&e))? {
                    0 => {
                        out.truncate(filled);
                        Ok(out)
                    }
                    _ => Err(Failure::new(
                        413,
                        format!(
                            "the {} request body expands past the limit of {limit} bytes \
                             (max_decompressed_size)",
                            coding.name()
                        ),
                    )),
                };
            }
            let step = filled.max(STEP).min(left);
            out.try_reserve_exact(step)
                .map_err(|_| Failure::new(503, "no memory left to inflate the request body"))?;
            out.resize(filled.saturating_add(step), 0);
        }
        let read = source.read(&mut out[filled..]).map_err(|e| corrupt(&e))?;
        if read == 0 {
            out.truncate(filled);
            return Ok(out);
        }
        filled = filled.saturating_add(read);
    }
}

/// The decoder of one coding over a body in memory.
enum Source<'a> {
    Gzip(flate2::bufread::MultiGzDecoder<&'a [u8]>),
    Deflate {
        input: &'a [u8],
        state: Decompress,
        done: bool,
    },
}

impl<'a> Source<'a> {
    fn new(body: &'a [u8], coding: Coding) -> Source<'a> {
        match coding {
            Coding::Gzip => Source::Gzip(flate2::bufread::MultiGzDecoder::new(body)),
            Coding::Deflate => Source::Deflate {
                input: body,
                state: Decompress::new(true),
                done: false,
            },
        }
    }

    /// Up to `out.len()` bytes of output; 0 once the stream has ended
    /// (an error if it ends early or has data after its end).
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        use std::io::{Error, ErrorKind};
        match self {
            // The gzip reader checks each member's CRC and length, and that
            // what follows a member is another member.
            Source::Gzip(decoder) => decoder.read(out),
            Source::Deflate { input, state, done } => loop {
                if *done {
                    return Ok(0);
                }
                let (before_in, before_out) = (state.total_in(), state.total_out());
                let status = state
                    .decompress(input, out, FlushDecompress::None)
                    .map_err(|e| Error::new(ErrorKind::InvalidData, e))?;
                let used = usize::try_from(state.total_in().saturating_sub(before_in))
                    .unwrap_or(usize::MAX)
                    .min(input.len());
                let made = usize::try_from(state.total_out().saturating_sub(before_out))
                    .unwrap_or(usize::MAX)
                    .min(out.len());
                *input = &input[used..];
                if status == Status::StreamEnd {
                    *done = true;
                    if !input.is_empty() {
                        return Err(Error::new(ErrorKind::InvalidData, "data after its end"));
                    }
                }
                if made > 0 || out.is_empty() {
                    return Ok(made);
                }
                if !*done && used == 0 {
                    return Err(Error::new(ErrorKind::UnexpectedEof, "truncated"));
                }
            },
        }
    }
}

/// `body` coded as `coding` (fast compression, as a server under load
/// wants); None if the encoder failed (send it uncoded).
pub fn compress(body: &[u8], coding: Coding) -> Option<Vec<u8>> {
    let out = Vec::with_capacity(body.len() / 2 + 64);
    match coding {
        Coding::Gzip => {
            let mut encoder = GzEncoder::new(out, Compression::fast());
            encoder.write_all(body).ok()?;
            encoder.finish().ok()
        }
        Coding::Deflate => {
            let mut encoder = ZlibEncoder::new(out, Compression::fast());
            encoder.write_all(body).ok()?;
            encoder.finish().ok()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        compress(data, Coding::Gzip).unwrap()
    }

    #[test]
    fn round_trips_both_codings_and_multi_member_gzip() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        for coding in [Coding::Gzip, Coding::Deflate] {
            let coded = compress(&data, coding).unwrap();
            assert_eq!(inflate(&coded, coding, data.len()).unwrap(), data);
        }
        let mut two = gzip(b"ab");
        two.extend(gzip(b"cd"));
        assert_eq!(inflate(&two, Coding::Gzip, 4).unwrap(), b"abcd");
    }

    #[test]
    fn output_past_the_limit_is_413_and_never_allocated() {
        let bomb = compress(&vec![0u8; 10 << 20], Coding::Deflate).unwrap();
        let refused = inflate(&bomb, Coding::Deflate, 1 << 20).unwrap_err();
        assert_eq!(refused.status, 413);
        let refused = inflate(&gzip(&vec![0u8; 10 << 20]), Coding::Gzip, 100).unwrap_err();
        assert_eq!(refused.status, 413);
        // Exactly at the limit is fine.
        assert_eq!(inflate(&gzip(b"12345"), Coding::Gzip, 5).unwrap(), b"12345");
        assert_eq!(
            inflate(&compress(b"", Coding::Deflate).unwrap(), Coding::Deflate, 0).unwrap(),
            b""
        );
    }

    #[test]
    fn corrupt_truncated_or_trailing_streams_are_400() {
        let coded = compress(&[7u8; 1000], Coding::Deflate).unwrap();
        let truncated = &coded[..coded.len() - 3];
        assert_eq!(
            inflate(truncated, Coding::Deflate, 1 << 20)
                .unwrap_err()
                .status,
            400
        );
        let mut trailing = coded.clone();
        trailing.extend_from_slice(b"junk");
        assert_eq!(
            inflate(&trailing, Coding::Deflate, 1 << 20)
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            inflate(b"not deflate", Coding::Deflate, 10)
                .unwrap_err()
                .status,
            400
        );
        let coded = gzip(&[7u8; 1000]);
        assert_eq!(
            inflate(&coded[..coded.len() - 3], Coding::Gzip, 1 << 20)
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            inflate(b"not gzip at all", Coding::Gzip, 10)
                .unwrap_err()
                .status,
            400
        );
    }

    #[test]
    fn accept_encoding_prefers_gzip_and_honours_q_zero() {
        let accepted = |v: &str| accepted(Some(&HeaderValue::from_str(v).unwrap()));
        assert_eq!(accepted("gzip"), Some(Coding::Gzip));
        assert_eq!(accepted("deflate, gzip;q=0.5"), Some(Coding::Gzip));
        assert_eq!(accepted("deflate"), Some(Coding::Deflate));
        assert_eq!(accepted("gzip;q=0, deflate"), Some(Coding::Deflate));
        assert_eq!(accepted("identity, br"), None);
        assert_eq!(super::accepted(None), None);
    }
}
