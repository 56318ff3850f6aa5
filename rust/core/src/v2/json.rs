//! A pull parser over one JSON document held in memory.
//!
//! The decoder asks for what it expects next (an object key, a string, a
//! number token) instead of building a tree, so a tensor's `data` array goes
//! from the body straight into its byte buffer. It accepts what Python's
//! `json` module accepts, the v2 front-ends' reference: RFC 8259 plus the
//! literals `NaN`, `Infinity` and `-Infinity`; strings must be valid UTF-8
//! without raw control characters. Nesting is limited to [`MAX_DEPTH`]
//! levels. Every method returns an error instead of panicking, whatever the
//! input; positions in errors are byte offsets into the document.

use std::borrow::Cow;

/// The deepest nesting of arrays and objects accepted.
pub const MAX_DEPTH: usize = 128;

/// A syntax error at a byte offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntaxError {
    pub message: &'static str,
    pub offset: usize,
}

/// The kind of the value that starts at the parser's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Object,
    Array,
    String,
    Number,
    Bool,
    Null,
}

impl Kind {
    pub fn describe(self) -> &'static str {
        match self {
            Kind::Object => "an object",
            Kind::Array => "an array",
            Kind::String => "a string",
            Kind::Number => "a number",
            Kind::Bool => "a boolean",
            Kind::Null => "null",
        }
    }
}

/// A number token, not yet converted: `text` is its JSON spelling (or
/// `NaN`, `Infinity`, `-Infinity`); `integer` when it has neither a fraction
/// nor an exponent.
#[derive(Debug, Clone, Copy)]
pub struct Number<'a> {
    /// Its spelling, ASCII (read as text only when needed: errors, the
    /// slow path).
    spelt: &'a [u8],
    pub integer: bool,
    /// The value, when the token is exactly `mantissa * 10^exp` with both
    /// small enough for one correctly rounded `f64` operation (Clinger's
    /// fast path: mantissa < 2^53, |exp| <= 22), as most numbers are.
    fast: Option<f64>,
    /// The value's magnitude as `mantissa * 10^exponent`, when every
    /// significant digit fits in `mantissa` (at most 19) and |exponent| <=
    /// 22: what [`Number::to_f32`] rounds without the correctly rounded
    /// `f64` (17-digit spellings of `f32` values, as Python clients send).
    near: Option<(u64, i64, bool)>,
}

/// 10^-0 ..= 10^-22, each the nearest `f64` (a multiplication by one is
/// cheaper than a division by 10^k, and as close for [`Number::to_f32`]).
const NEG_POW10: [f64; 23] = [
    1e0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10, 1e-11, 1e-12, 1e-13, 1e-14,
    1e-15, 1e-16, 1e-17, 1e-18, 1e-19, 1e-20, 1e-21, 1e-22,
];

/// 10^0 ..= 10^19: every power of ten a `u64` holds.
const POW10_U64: [u64; 20] = {
    let mut powers = [1u64; 20];
    let mut i = 1;
    while i < 20 {
        powers[i] = powers[i - 1] * 10;
        i += 1;
    }
    powers
};

/// The eight bytes of `src` from `at`, when there are that many.
fn word(src: &[u8], at: usize) -> Option<[u8; 8]> {
    src.get(at..at.checked_add(8)?)?.try_into().ok()
}

/// The digits that begin `bytes` (eight of them), up to the first byte
/// that is not one: `(their value, how many)`, in a few word operations:
/// each byte's digit, the run's length from where the first non-digit is,
/// then pairs, quads and the eight combined by multiplications that keep
/// them in separate lanes.
pub(super) fn leading_digits(bytes: [u8; 8]) -> (u64, usize) {
    let word = u64::from_le_bytes(bytes);
    // A byte is a digit iff it is >= b'0' and adding 0x46 does not reach
    // 0x80. A borrow or carry only runs upwards, from a byte that is not a
    // digit: the bytes below the first such one are read right.
    let below = word.wrapping_sub(0x3030_3030_3030_3030);
    let above = word.wrapping_add(0x4646_4646_4646_4646);
    let not_digits = (below | above) & 0x8080_8080_8080_8080;
    let count = (not_digits.trailing_zeros() / 8) as usize;
    if count == 0 {
        return (0, 0);
    }
    // The run's digits moved to the last places, zeros before them (the
    // first byte is the lowest): what follows the run is shifted out.
    let digits = below << (8 * (8 - count));
    let pairs = digits.wrapping_mul(10).wrapping_add(digits >> 8);
    const LANES: u64 = 0x0000_00ff_0000_00ff;
    let high = (pairs & LANES).wrapping_mul(0x000f_4240_0000_0064); // * 1_000_000, * 100
    let low = ((pairs >> 16) & LANES).wrapping_mul(0x0000_2710_0000_0001); // * 10_000, * 1
    (u64::from((high.wrapping_add(low) >> 32) as u32), count)
}

/// 10^0 ..= 10^22: every one exact in an `f64`.
const POW10: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
];

/// A number's magnitude as `mantissa * 10^exponent`, as scanned: exact
/// while `significant` (its significant digits, `u32::MAX` past 19) is at
/// most 19.
#[derive(Debug, Clone, Copy)]
struct Scanned {
    mantissa: u64,
    significant: u32,
    exponent: i64,
    negative: bool,
    integer: bool,
}

impl Scanned {
    /// The value, when one correctly rounded `f64` operation gives it
    /// (Clinger's fast path: mantissa < 2^53, |exponent| <= 22).
    fn exact(self) -> Option<f64> {
        if self.significant > 15 || self.mantissa >= (1 << 53) || self.exponent.abs() > 22 {
            return None;
        }
        let m = self.mantissa as f64;
        let v = if self.exponent >= 0 {
            m * POW10[self.exponent as usize]
        } else {
            m / POW10[(-self.exponent) as usize]
        };
        Some(if self.negative { -v } else { v })
    }
}

/// `mantissa * 10^exponent` (|exponent| <= 22) rounded to `f32` as its
/// correctly rounded `f64` would round, when an approximation decides it
/// (see [`Number::to_f32`]); `None` near a rounding midpoint or past
/// `f32`'s normal range.
fn near_f32(mantissa: u64, exponent: i64, negative: bool) -> Option<f32> {
    let m = mantissa as f64;
    let approx = match usize::try_from(exponent) {
        Ok(e) => m * *POW10.get(e)?,
        Err(_) => m * *NEG_POW10.get(usize::try_from(exponent.unsigned_abs()).ok()?)?,
    };
    const LOW_BITS: u64 = (1 << 29) - 1;
    let low = approx.to_bits() & LOW_BITS;
    let nearest = approx as f32;
    (nearest.is_normal() && low.abs_diff(1 << 28) > 8).then_some(if negative {
        -nearest
    } else {
        nearest
    })
}

/// A number spelt plainly, `-?(0|[1-9][0-9]*)(\.[0-9]+)?` with at most 19
/// digits in all and no exponent (how Python, numpy and most writers spell
/// floats), starting at `start`: its `f32` as [`Number::to_f32`] gives it
/// and the offset past it, in one pass over its digits, eight at a time.
/// `None` for any other spelling, a value [`near_f32`] cannot decide, or
/// too few bytes left to read its digits a word at a time: the general
/// scan takes those.
fn plain_f32(src: &[u8], start: usize) -> Option<(f32, usize)> {
    let negative = src.get(start) == Some(&b'-');
    let mut pos = start + usize::from(negative);
    // The integer part: most often one digit before the point.
    let (mut mantissa, mut digits) = match (src.get(pos), src.get(pos + 1)) {
        (Some(&d @ b'0'..=b'9'), Some(b'.')) => (u64::from(d - b'0'), 1),
        _ => {
            let (whole, n) = leading_digits(word(src, pos)?);
            // No digit, a leading zero, or an integer part too long to be plain.
            if n == 0 || n == 8 || (n > 1 && src[pos] == b'0') {
                return None;
            }
            (whole, n)
        }
    };
    pos += digits;
    let mut exponent = 0i64;
    if src.get(pos) == Some(&b'.') {
        pos += 1;
        // The fraction, eight digits a word; a word's length does not wait
        // for the one before it (a long fraction is read in its first two).
        let (mut fraction, mut count) = leading_digits(word(src, pos)?);
        if count == 8 {
            let (second, more) = leading_digits(word(src, pos + 8)?);
            fraction = fraction * POW10_U64[more] + second;
            count += more;
            if more == 8 {
                let (third, last) = leading_digits(word(src, pos + 16)?);
                if last > 3 {
                    return None; // more than 19 digits
                }
                fraction = fraction * POW10_U64[last] + third;
                count += last;
            }
        }
        digits += count;
        if count == 0 || digits > 19 {
            return None;
        }
        // At most 19 digits in all: below 10^19, within a u64.
        mantissa = mantissa * POW10_U64[count] + fraction;
        pos += count;
        exponent = -(count as i64);
    }
    if matches!(src.get(pos), Some(b'e' | b'E')) {
        return None;
    }
    if mantissa == 0 {
        return Some((if negative { -0.0 } else { 0.0 }, pos));
    }
    near_f32(mantissa, exponent, negative).map(|v| (v, pos))
}

/// An integer spelt plainly, `-?(0|[1-9][0-9]*)` with at most 15 digits
/// (no fraction, no exponent), starting at `start`: its value and the
/// offset past it, its digits read eight at a time. `None` for any other
/// spelling, or too few bytes left to read a word: the general scan takes
/// those (token ids and indices, what INT data holds, are short).
fn plain_int(src: &[u8], start: usize) -> Option<(i64, usize)> {
    let negative = src.get(start) == Some(&b'-');
    let mut pos = start + usize::from(negative);
    let (mut value, mut count) = leading_digits(word(src, pos)?);
    if count == 0 || (count > 1 && src[pos] == b'0') {
        return None;
    }
    if count == 8 {
        let (more, extra) = leading_digits(word(src, pos + 8)?);
        if extra == 8 {
            return None;
        }
        value = value * POW10_U64[extra] + more;
        count += extra;
    }
    pos += count;
    if matches!(src.get(pos), Some(b'.' | b'e' | b'E')) {
        return None;
    }
    // At most 15 digits: below 10^15, within an i64 either way.
    let value = value as i64;
    Some((if negative { -value } else { value }, pos))
}

impl<'a> Number<'a> {
    /// Its JSON spelling (or `NaN`, `Infinity`, `-Infinity`).
    pub fn text(self) -> &'a str {
        std::str::from_utf8(self.spelt).unwrap_or("")
    }

    /// The nearest `f64` (correctly rounded, as Python's `float()`).
    pub fn to_f64(self) -> f64 {
        if let Some(v) = self.fast {
            return v;
        }
        match self.text() {
            "NaN" => f64::NAN,
            "Infinity" => f64::INFINITY,
            "-Infinity" => f64::NEG_INFINITY,
            // A validated JSON number is a valid Rust float literal.
            text => text.parse().unwrap_or(f64::NAN),
        }
    }

    /// `self.to_f64() as f32`: the `f32` nearest to the nearest `f64`, as
    /// numpy casts Python's floats, most often without the correctly
    /// rounded `f64`.
    ///
    /// `mantissa * 10^exponent` in `f64` (the mantissa's conversion, the
    /// power of ten (10^-k is not exact) and one multiplication, each
    /// correctly rounded) is within 3 * 2^-53 of the exact value,
    /// relatively, and so within 2^-51 (4 units in its last place) of its
    /// nearest `f64`. An `f64` in `f32`'s normal range rounds to `f32` by
    /// its 29 low mantissa bits, the midpoint between two `f32`s being
    /// 2^28 there. When the approximation's are more than 8 units from
    /// it, the nearest `f64` lies on the same side of the same midpoint
    /// and rounds to the same `f32`. Otherwise (a value near a midpoint,
    /// about one in 2^24 of random digits; past `f32`'s normal range) the
    /// correctly rounded `f64` decides.
    pub fn to_f32(self) -> f32 {
        if let Some(v) = self.fast {
            return v as f32;
        }
        if let Some((mantissa, exponent, negative)) = self.near {
            if let Some(v) = near_f32(mantissa, exponent, negative) {
                return v;
            }
        }
        self.to_f64() as f32
    }

    /// The value as an `i128` when it is an integer that fits (JSON integers
    /// beyond that range, fractions and non-finite values give `None`).
    /// Integral spellings such as `3.0` or `1e3` count as integers.
    pub fn to_i128(self) -> Option<i128> {
        if self.integer {
            let text = self.text();
            let (negative, digits) = match text.strip_prefix('-') {
                Some(rest) => (true, rest),
                None => (false, text),
            };
            if digits.len() > 38 {
                return None;
            }
            let mut value: i128 = 0;
            for b in digits.bytes() {
                value = value.checked_mul(10)?.checked_add(i128::from(b - b'0'))?;
            }
            return Some(if negative { -value } else { value });
        }
        let value = self.to_f64();
        // Exactly representable integers only: 2**64 is the largest needed.
        if value.is_finite() && value.fract() == 0.0 && value.abs() <= 1.9e19 {
            Some(value as i128)
        } else {
            None
        }
    }
}

pub struct Parser<'a> {
    src: &'a [u8],
    pos: usize,
    depth: usize,
}

type Result<T> = std::result::Result<T, SyntaxError>;

impl<'a> Parser<'a> {
    pub fn new(src: &'a [u8]) -> Self {
        Parser {
            src,
            pos: 0,
            depth: 0,
        }
    }

    /// A parser positioned at `offset` of `src` (a value found earlier).
    pub fn at(src: &'a [u8], offset: usize) -> Self {
        Parser {
            src,
            pos: offset.min(src.len()),
            depth: 0,
        }
    }

    pub fn offset(&self) -> usize {
        self.pos
    }

    /// Bytes of the document after the current position.
    pub fn remaining(&self) -> usize {
        self.src.len() - self.pos
    }

    fn error<T>(&self, message: &'static str) -> Result<T> {
        Err(SyntaxError {
            message,
            offset: self.pos,
        })
    }

    fn skip_ws(&mut self) {
        while let Some(&b) = self.src.get(self.pos) {
            if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                self.pos += 1;
            } else {
                break;
            }
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.src.get(self.pos).copied()
    }

    /// The kind of the next value, without consuming it.
    pub fn peek_kind(&mut self) -> Result<Kind> {
        Ok(match self.peek() {
            Some(b'{') => Kind::Object,
            Some(b'[') => Kind::Array,
            Some(b'"') => Kind::String,
            Some(b't' | b'f') => Kind::Bool,
            Some(b'n') => Kind::Null,
            Some(b'-' | b'0'..=b'9' | b'N' | b'I') => Kind::Number,
            Some(_) => return self.error("expected a value"),
            None => return self.error("unexpected end of the document"),
        })
    }

    /// Fails unless only whitespace is left.
    pub fn end(&mut self) -> Result<()> {
        match self.peek() {
            None => Ok(()),
            Some(_) => self.error("extra data after the document"),
        }
    }

    fn eat_literal(&mut self, literal: &'static [u8]) -> bool {
        if self.src[self.pos..].starts_with(literal) {
            self.pos += literal.len();
            true
        } else {
            false
        }
    }

    fn enter(&mut self) -> Result<()> {
        if self.depth >= MAX_DEPTH {
            return self.error("nested too deep");
        }
        self.depth += 1;
        self.pos += 1;
        Ok(())
    }

    /// Consumes `{`.
    pub fn begin_object(&mut self) -> Result<()> {
        match self.peek() {
            Some(b'{') => self.enter(),
            _ => self.error("expected '{'"),
        }
    }

    /// The next key of the object being read (its value follows), or `None`
    /// at its closing `}`. `first` is true before the first key.
    pub fn next_key(&mut self, first: &mut bool) -> Result<Option<Cow<'a, str>>> {
        match self.peek() {
            Some(b'}') => {
                self.pos += 1;
                self.depth -= 1;
                return Ok(None);
            }
            Some(b',') if !*first => self.pos += 1,
            _ if *first => {}
            _ => return self.error("expected ',' or '}'"),
        }
        *first = false;
        if self.peek() != Some(b'"') {
            return self.error("expected a string key");
        }
        let key = self.string()?;
        if self.peek() != Some(b':') {
            return self.error("expected ':'");
        }
        self.pos += 1;
        Ok(Some(key))
    }

    /// Consumes `[`.
    pub fn begin_array(&mut self) -> Result<()> {
        match self.peek() {
            Some(b'[') => self.enter(),
            _ => self.error("expected '['"),
        }
    }

    /// True when another element of the array being read follows, false at
    /// its closing `]`. `first` is true before the first element.
    pub fn next_element(&mut self, first: &mut bool) -> Result<bool> {
        match self.peek() {
            Some(b']') => {
                self.pos += 1;
                self.depth -= 1;
                Ok(false)
            }
            Some(b',') if !*first => {
                self.pos += 1;
                Ok(true)
            }
            Some(_) if *first => {
                *first = false;
                Ok(true)
            }
            None => self.error("unexpected end of the document"),
            Some(_) => self.error("expected ',' or ']'"),
        }
    }

    /// A string value (escapes undone; borrowed when it has none).
    pub fn string(&mut self) -> Result<Cow<'a, str>> {
        if self.peek() != Some(b'"') {
            return self.error("expected a string");
        }
        self.pos += 1;
        let start = self.pos;
        // Fast path: no escapes.
        loop {
            match self.src.get(self.pos) {
                None => return self.error("unterminated string"),
                Some(b'"') => {
                    let raw = &self.src[start..self.pos];
                    self.pos += 1;
                    return match std::str::from_utf8(raw) {
                        Ok(text) => Ok(Cow::Borrowed(text)),
                        Err(e) => Err(SyntaxError {
                            message: "invalid UTF-8 in a string",
                            offset: start + e.valid_up_to(),
                        }),
                    };
                }
                Some(b'\\') => break,
                Some(&b) if b < 0x20 => return self.error("control character in a string"),
                Some(_) => self.pos += 1,
            }
        }
        let mut out: Vec<u8> = self.src[start..self.pos].to_vec();
        loop {
            match self.src.get(self.pos) {
                None => return self.error("unterminated string"),
                Some(b'"') => {
                    self.pos += 1;
                    return String::from_utf8(out)
                        .map(Cow::Owned)
                        .map_err(|_| SyntaxError {
                            message: "invalid UTF-8 in a string",
                            offset: start,
                        });
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let Some(&escape) = self.src.get(self.pos) else {
                        return self.error("unterminated string");
                    };
                    self.pos += 1;
                    let byte = match escape {
                        b'"' => b'"',
                        b'\\' => b'\\',
                        b'/' => b'/',
                        b'b' => 8,
                        b'f' => 12,
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'u' => {
                            let c = self.unicode_escape()?;
                            let mut buf = [0u8; 4];
                            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                            continue;
                        }
                        _ => {
                            self.pos -= 1;
                            return self.error("invalid escape in a string");
                        }
                    };
                    out.push(byte);
                }
                Some(&b) if b < 0x20 => return self.error("control character in a string"),
                Some(&b) => {
                    out.push(b);
                    self.pos += 1;
                }
            }
        }
    }

    fn hex4(&mut self) -> Result<u32> {
        let Some(digits) = self.src.get(self.pos..self.pos + 4) else {
            return self.error("invalid \\u escape");
        };
        let mut value = 0u32;
        for &d in digits {
            let Some(v) = (d as char).to_digit(16) else {
                return self.error("invalid \\u escape");
            };
            value = value * 16 + v;
        }
        self.pos += 4;
        Ok(value)
    }

    /// After `\u`: one code point, joining a surrogate pair; a lone
    /// surrogate becomes U+FFFD (Python keeps it, but a Rust string cannot).
    fn unicode_escape(&mut self) -> Result<char> {
        let first = self.hex4()?;
        if (0xD800..0xDC00).contains(&first) && self.src[self.pos..].starts_with(b"\\u") {
            let save = self.pos;
            self.pos += 2;
            let second = self.hex4()?;
            if (0xDC00..0xE000).contains(&second) {
                let code = 0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00);
                return Ok(char::from_u32(code).unwrap_or('\u{FFFD}'));
            }
            self.pos = save;
        }
        Ok(char::from_u32(first).unwrap_or('\u{FFFD}'))
    }

    /// A number token (validated, not converted).
    pub fn number(&mut self) -> Result<Number<'a>> {
        self.skip_ws();
        let start = self.pos;
        let literals: &[&'static [u8]] = match self.src.get(start) {
            Some(b'N' | b'I' | b'-') => &[b"NaN", b"Infinity", b"-Infinity"],
            _ => &[],
        };
        for &literal in literals {
            if self.eat_literal(literal) {
                return Ok(Number {
                    spelt: &self.src[start..self.pos],
                    integer: false,
                    fast: None,
                    near: None,
                });
            }
        }
        let scanned = self.scan_number()?;
        let fast = scanned.exact();
        let near = (fast.is_none() && scanned.significant <= 19 && scanned.exponent.abs() <= 22)
            .then_some((scanned.mantissa, scanned.exponent, scanned.negative));
        Ok(Number {
            spelt: &self.src[start..self.pos],
            integer: scanned.integer,
            fast,
            near,
        })
    }

    /// The next value as [`Number::to_f32`] gives it, when it is a finite
    /// number whose `f32` needs no correctly rounded `f64` (as almost every
    /// number does); otherwise `None`, with nothing consumed, for
    /// [`Parser::peek_kind`] and [`Parser::number`] to take it. A fused
    /// scan and conversion for FP32 data, the most common payload.
    pub fn f32_number(&mut self) -> Option<f32> {
        self.skip_ws();
        let start = self.pos;
        if let Some((value, end)) = plain_f32(self.src, start) {
            self.pos = end;
            return Some(value);
        }
        let scanned = match self.src.get(start) {
            Some(b'-' | b'0'..=b'9') => self.scan_number().ok(),
            _ => None,
        };
        let value = scanned.and_then(|s| match s.exact() {
            Some(v) => Some(v as f32),
            None if s.significant <= 19 && s.exponent.abs() <= 22 => {
                near_f32(s.mantissa, s.exponent, s.negative)
            }
            None => None,
        });
        if value.is_none() {
            self.pos = start;
        }
        value
    }

    /// After an array element: the elements that follow it in the same
    /// array while each is a plainly spelt number (see `plain_f32`),
    /// each given to `push` as its `f32`; stops before the separator of the
    /// first that is not (or at the array's end), so that
    /// [`Parser::next_element`] goes on from there. The loop FP32 `data`
    /// spends its time in: one comma and the number's digits per element.
    pub fn f32_run(&mut self, mut push: impl FnMut(f32)) {
        let pushed: std::result::Result<(), std::convert::Infallible> =
            self.plain_run(plain_f32, |v| {
                push(v);
                Ok(())
            });
        let Ok(()) = pushed;
    }

    /// The next value when it is a plainly spelt integer (see
    /// `plain_int`); otherwise `None`, with nothing consumed.
    pub fn int_number(&mut self) -> Option<i64> {
        self.skip_ws();
        let (value, end) = plain_int(self.src, self.pos)?;
        self.pos = end;
        Some(value)
    }

    /// [`Parser::f32_run`] for plainly spelt integers; stops at the first
    /// error `push` returns.
    pub fn int_run<E>(
        &mut self,
        push: impl FnMut(i64) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        self.plain_run(plain_int, push)
    }

    /// The elements after the one just read, while `read` takes each.
    fn plain_run<T, E>(
        &mut self,
        read: impl Fn(&[u8], usize) -> Option<(T, usize)>,
        mut push: impl FnMut(T) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        loop {
            let mut at = self.pos;
            if self.src.get(at) != Some(&b',') {
                return Ok(());
            }
            at += 1;
            while matches!(self.src.get(at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
                at += 1;
            }
            let Some((value, end)) = read(self.src, at) else {
                return Ok(());
            };
            self.pos = end;
            push(value)?;
        }
    }

    /// Reads a run of digits, gathering them into `mantissa` while it has at
    /// most 19 significant digits (`significant` is `u32::MAX` past that);
    /// returns how many digits were read.
    fn digits(&mut self, mantissa: &mut u64, significant: &mut u32) -> usize {
        let from = self.pos;
        loop {
            // Past the leading zeros, up to eight digits at a time while
            // they fit (`0.4967141449451446`: one digit, then eight, then
            // the last seven).
            if *mantissa != 0 && *significant <= 11 {
                if let Some(bytes) = word(self.src, self.pos) {
                    let (value, count) = leading_digits(bytes);
                    *mantissa = *mantissa * POW10_U64[count] + value;
                    *significant += count as u32;
                    self.pos += count;
                    if count < 8 {
                        break;
                    }
                    continue;
                }
            }
            let Some(&d @ b'0'..=b'9') = self.src.get(self.pos) else {
                break;
            };
            if *significant < 19 {
                *mantissa = *mantissa * 10 + u64::from(d - b'0');
                if *mantissa != 0 {
                    *significant += 1;
                }
            } else {
                *significant = u32::MAX;
            }
            self.pos += 1;
        }
        self.pos - from
    }

    /// Skips the text of the number next (at least one character a number
    /// or its literals `NaN`, `Infinity`, `-Infinity` may hold), without
    /// reading or validating it: for a caller that passes the text on to a
    /// reader that reads it strictly ([`Parser::number`]), so that `1.2.3`
    /// is refused there, once. Its range in the document.
    pub fn skip_number_text(&mut self) -> Result<std::ops::Range<usize>> {
        self.skip_ws();
        let start = self.pos;
        let rest = self.src.get(start..).unwrap_or_default();
        let length = rest
            .iter()
            .position(|b| !(b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'-')))
            .unwrap_or(rest.len());
        if length == 0 {
            return self.error("expected a number");
        }
        self.pos = start + length; // within the document: no overflow
        Ok(start..self.pos)
    }

    /// Reads a JSON number's spelling (not a literal), validating it; its
    /// digits are read once, and while few enough gathered into a mantissa.
    fn scan_number(&mut self) -> Result<Scanned> {
        let mut mantissa: u64 = 0;
        let mut significant: u32 = 0;
        let negative = self.src.get(self.pos) == Some(&b'-');
        if negative {
            self.pos += 1;
        }
        match self.src.get(self.pos) {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                self.digits(&mut mantissa, &mut significant);
            }
            _ => return self.error("expected a number"),
        }
        let mut integer = true;
        let mut exponent: i64 = 0;
        if self.src.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            integer = false;
            let n = self.digits(&mut mantissa, &mut significant);
            if n == 0 {
                return self.error("expected digits after '.'");
            }
            exponent -= n as i64;
        }
        if matches!(self.src.get(self.pos), Some(b'e' | b'E')) {
            self.pos += 1;
            integer = false;
            let sign = match self.src.get(self.pos) {
                Some(b'-') => {
                    self.pos += 1;
                    -1
                }
                Some(b'+') => {
                    self.pos += 1;
                    1
                }
                _ => 1,
            };
            let from = self.pos;
            let mut e: i64 = 0;
            while let Some(&d @ b'0'..=b'9') = self.src.get(self.pos) {
                e = (e * 10 + i64::from(d - b'0')).min(1 << 40);
                self.pos += 1;
            }
            if self.pos == from {
                return self.error("expected digits in the exponent");
            }
            exponent += sign * e;
        }
        Ok(Scanned {
            mantissa,
            significant,
            exponent,
            negative,
            integer,
        })
    }

    /// `true` or `false`.
    pub fn boolean(&mut self) -> Result<bool> {
        self.skip_ws();
        if self.eat_literal(b"true") {
            Ok(true)
        } else if self.eat_literal(b"false") {
            Ok(false)
        } else {
            self.error("expected true or false")
        }
    }

    /// Consumes `null` if it is next.
    pub fn null(&mut self) -> bool {
        self.skip_ws();
        self.eat_literal(b"null")
    }

    /// Skips one value (validating it); returns the byte range it spans.
    pub fn skip_value(&mut self) -> Result<std::ops::Range<usize>> {
        self.skip_ws();
        let start = self.pos;
        // Iterative: the depth limit, not the stack, bounds the nesting.
        // Each open container: (is an object, no member read yet); inline
        // for the usual nesting, so skipping a value allocates nothing.
        let mut open: smallvec::SmallVec<[(bool, bool); 16]> = smallvec::SmallVec::new();
        loop {
            match self.peek_kind()? {
                kind @ (Kind::Object | Kind::Array) => {
                    self.enter()?;
                    open.push((kind == Kind::Object, true));
                }
                Kind::String => {
                    self.string()?;
                }
                Kind::Number => {
                    self.number()?;
                }
                Kind::Bool => {
                    self.boolean()?;
                }
                Kind::Null => {
                    if !self.null() {
                        return self.error("expected a value");
                    }
                }
            }
            // Close what ends here; stop once the outermost value is done.
            loop {
                let Some((is_object, first)) = open.last_mut() else {
                    return Ok(start..self.pos);
                };
                let more = if *is_object {
                    self.next_key(first)?.is_some()
                } else {
                    self.next_element(first)?
                };
                if more {
                    break;
                }
                open.pop();
            }
        }
    }
}
