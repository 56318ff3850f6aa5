//! What the v2 codec refuses, with the HTTP status each maps to.

use std::fmt;

/// A request (or response) the codec refuses. The messages say what was
/// wrong in the client's terms; [`V2Error::status`] is the HTTP status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum V2Error {
    /// The body is over the configured `max_body_size` (413).
    BodyTooLarge { size: usize, limit: usize },
    /// `Inference-Header-Content-Length` is not a number within the body.
    HeaderLength { got: String, body: usize },
    /// The JSON header is not valid JSON (or not UTF-8, or nested too deep).
    Json {
        message: &'static str,
        offset: usize,
    },
    /// The inputs declare more elements than `max_elements` allows; found
    /// from the shapes alone, before anything is allocated.
    TooManyElements {
        input: String,
        /// The shape as the client sent it, as messages show it ([`shape_text`]).
        shape: String,
        limit: usize,
    },
    /// Valid JSON that is not a valid inference request; the message names
    /// the field and what was expected.
    Invalid(String),
    /// Output tensors that do not match what the response declares (a bug
    /// of the caller, not of the client's request: 500).
    Output(String),
}

impl V2Error {
    /// The HTTP status: 413 for a body over the limit, 500 for [`V2Error::Output`],
    /// 400 for the rest.
    pub fn status(&self) -> u16 {
        match self {
            V2Error::BodyTooLarge { .. } => 413,
            V2Error::Output(_) => 500,
            _ => 400,
        }
    }
}

impl fmt::Display for V2Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            V2Error::BodyTooLarge { size, limit } => write!(
                f,
                "request body of {size} bytes is over the limit of {limit} bytes"
            ),
            V2Error::HeaderLength { got, body } => write!(
                f,
                "Inference-Header-Content-Length must be 0..{body} (the body's size), got {}",
                quote(got)
            ),
            V2Error::Json { message, offset } => {
                write!(
                    f,
                    "malformed JSON in the request: {message} (at byte {offset})"
                )
            }
            V2Error::TooManyElements {
                input,
                shape,
                limit,
            } => write!(
                f,
                "input '{}': shape {shape} is over the limit of {limit} elements per request",
                Clipped(input),
            ),
            V2Error::Invalid(message) | V2Error::Output(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for V2Error {}

/// `text` in single quotes, cut to 80 characters (error messages quote what
/// a client sent, which may be huge).
pub fn quote(text: &str) -> String {
    format!("'{}'", short(text))
}

/// `text` cut to 80 characters, with "..." when cut ([`Clipped`]).
pub fn short(text: &str) -> String {
    Clipped(text).to_string()
}

/// Characters of a client's string that a message shows at most.
const SHOWN: usize = 80;

/// A client's string as every message (HTTP error, gRPC status) echoes it
/// (a name, a version, a method, a number as sent): cut to 80 characters,
/// with "..." when cut, so that no echo makes a message huge (gRPC sends
/// its message as a header, refused past 16 KB). Formats without
/// allocating: `format!("input '{}'", Clipped(name))`.
#[derive(Debug, Clone, Copy)]
pub struct Clipped<'a>(pub &'a str);

impl fmt::Display for Clipped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.0;
        match text.char_indices().nth(SHOWN) {
            None => f.write_str(text),
            Some(_) => {
                let cut = text
                    .char_indices()
                    .nth(SHOWN - 3)
                    .map_or(text.len(), |(i, _)| i);
                f.write_str(&text[..cut])?;
                f.write_str("...")
            }
        }
    }
}

/// A shape in a message: its dimensions, cut as [`Clipped`] cuts text.
pub fn shape_text(shape: &[impl fmt::Debug]) -> String {
    short(&format!("{shape:?}"))
}
