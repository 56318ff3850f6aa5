//! The JSON headers of binary requests, remembered.
//!
//! A client of the binary extension sends the same JSON header with every
//! request of one shape (tritonclient and PyTriton's clients build it from the
//! inputs' names, datatypes and shapes), and reading it was about a quarter of
//! the instructions the native front-end spends on such a request. A header's
//! decoded form depends only on its bytes, the body's length, the codec and
//! the caller's input check, and the last two are fixed for a model. So:
//!
//! - a header decoded once, with a body of the same length, decodes the same
//!   again, and is answered from the memo without being read;
//! - only headers that decoded without error are remembered (a refusal is
//!   found again, and counted, by the caller);
//! - a header that names a shared-memory region is never remembered: the
//!   region's bytes (and whether it is registered) change between requests
//!   of the same header, so it is read on every request;
//! - the binary bytes after the header are checked on every request (lengths
//!   against shapes, BOOL bytes), as a fresh decode checks them.
//!
//! A memo belongs to one caller at a time (`&mut`): the native front-end
//! keeps one per runtime thread and model, so no lock is taken; the Python
//! front-end's codec (`_core.V2Codec`) keeps one behind a `try_lock`.

use std::borrow::Cow;

use super::decode::{HeaderCheck, InferRequest};
use super::{Codec, V2Error};

/// Headers a memo keeps; each new one replaces the oldest.
pub const REMEMBERED_HEADERS: usize = 4;

/// The longest header remembered, in bytes: a few inputs' names, datatypes
/// and shapes. Longer headers (JSON data inline) are decoded each time.
pub const MAX_REMEMBERED_HEADER: usize = 2048;

/// Recently decoded binary-request headers and what they decoded to.
#[derive(Debug, Default)]
pub struct HeaderMemo {
    entries: Vec<Remembered>,
    /// The entry the next new header replaces, once all are in use.
    oldest: usize,
}

#[derive(Debug)]
struct Remembered {
    header: Box<[u8]>,
    body_len: usize,
    request: InferRequest,
}

impl HeaderMemo {
    pub fn new() -> HeaderMemo {
        HeaderMemo::default()
    }

    /// Headers remembered now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn find(&self, header: &[u8], body_len: usize) -> Option<usize> {
        self.entries
            .iter()
            .position(|e| e.body_len == body_len && *e.header == *header)
    }

    fn remember(&mut self, header: &[u8], body_len: usize, request: &InferRequest) {
        let entry = Remembered {
            header: header.into(),
            body_len,
            request: request.clone(),
        };
        if self.entries.len() < REMEMBERED_HEADERS {
            self.entries.push(entry);
        } else if let Some(slot) = self.entries.get_mut(self.oldest) {
            *slot = entry;
            self.oldest = (self.oldest + 1) % REMEMBERED_HEADERS;
        }
    }
}

impl Codec {
    /// [`Codec::decode_checked`], answering a binary request whose header
    /// `memo` holds (same bytes, same body length) without reading it.
    ///
    /// `memo` must be used with this codec and the same `check` only: what
    /// it holds was decoded and checked by them. A remembered request is
    /// lent, not copied: the caller copies only what it must own (a copy of
    /// the whole, its input names' `String`s, was 2 % of the native
    /// front-end's instructions per binary request).
    pub fn decode_remembered<'m>(
        &self,
        memo: &'m mut HeaderMemo,
        body: &[u8],
        header_length: Option<&str>,
        check: HeaderCheck<'_>,
    ) -> Result<Cow<'m, InferRequest>, V2Error> {
        let header_end = self.header_end(body, header_length)?;
        let header = match body.get(..header_end) {
            Some(header) if header_length.is_some() && header.len() <= MAX_REMEMBERED_HEADER => {
                header
            }
            _ => return self.decode_header(body, header_end, check).map(Cow::Owned),
        };
        if let Some(found) = memo.find(header, body.len()) {
            return match memo.entries.get(found) {
                Some(entry) => {
                    entry.request.check_binary(body)?;
                    Ok(Cow::Borrowed(&entry.request))
                }
                // Not reached (`found` indexes `entries`): decode it afresh.
                None => self.decode_header(body, header_end, check).map(Cow::Owned),
            };
        }
        let request = self.decode_header(body, header_end, check)?;
        if !request.shared_memory {
            memo.remember(header, body.len(), &request);
        }
        Ok(Cow::Owned(request))
    }
}
