//! Writing tensor elements, one value at a time, into a little-endian buffer.

use crate::v2::{shape_text, Clipped};
use half::{bf16, f16};

use super::error::{short, V2Error};
use super::json::Number;
use crate::DType;

/// The elements of one tensor being decoded: values are converted to
/// `dtype` and appended as little-endian bytes. Values beyond the expected
/// count are counted but not written, so the buffer never grows past the
/// size the shape declared (checked against the limits before).
#[derive(Debug)]
pub struct Elements {
    dtype: DType,
    expected: usize,
    count: usize,
    out: Vec<u8>,
}

/// Why a value does not fit a datatype.
enum Refusal {
    NotBool,
    /// A number for BYTES (which takes strings only).
    NotBytes,
    OutOfRange,
    NotInteger,
}

impl Elements {
    /// Room for `expected` elements of `dtype`, reserving at most
    /// `reserve_limit` bytes up front (the rest grows as values arrive).
    pub fn new(dtype: DType, expected: usize, reserve_limit: usize) -> Elements {
        let nbytes = expected.saturating_mul(dtype.itemsize());
        Elements {
            dtype,
            expected,
            count: 0,
            out: Vec::with_capacity(nbytes.min(reserve_limit)),
        }
    }

    /// Values pushed so far (written or not).
    pub fn count(&self) -> usize {
        self.count
    }

    /// The buffer, once exactly the expected count was pushed; otherwise the
    /// error naming the shape and the count.
    pub fn finish(self, name: &str, shape: &[u64]) -> Result<Vec<u8>, V2Error> {
        if self.count != self.expected {
            return Err(V2Error::Invalid(format!(
                "input '{shown}': shape {shape} needs {} values, got {}",
                self.expected,
                self.count,
                shown = Clipped(name),
                shape = shape_text(shape)
            )));
        }
        Ok(self.out)
    }

    fn write(&mut self, bytes: &[u8]) {
        if self.count < self.expected {
            self.out.extend_from_slice(bytes);
        }
        self.count += 1;
    }

    /// One FP32 value (the caller checked the dtype).
    pub fn push_f32(&mut self, value: f32) {
        self.write(&value.to_le_bytes());
    }

    /// One BYTES element (the caller checked the dtype is `Bytes` and the
    /// element's size against its limits); written serialized.
    pub fn push_bytes(&mut self, element: &[u8]) -> Result<(), V2Error> {
        if self.count < self.expected {
            crate::bytes::push(&mut self.out, element)
                .map_err(|e| V2Error::Invalid(e.to_string()))?;
        }
        self.count += 1;
        Ok(())
    }

    /// A JSON boolean: BOOL, or 0/1 for numeric types (as numpy converts).
    /// BYTES data must be strings: a boolean is refused, as a number is.
    pub fn push_bool(&mut self, name: &str, value: bool) -> Result<(), V2Error> {
        let v = u8::from(value);
        match self.dtype {
            DType::Bool | DType::Int8 | DType::UInt8 => self.write(&[v]),
            DType::Bytes => {
                let text = if value { "true" } else { "false" };
                return Err(self.refusal(name, Refusal::NotBytes, text));
            }
            _ => self.push_int(i128::from(v)).unwrap_or(()),
        }
        Ok(())
    }

    /// A JSON number token; `name` is the input's, for the error.
    pub fn push_number(&mut self, name: &str, number: Number<'_>) -> Result<(), V2Error> {
        let result = match self.dtype {
            DType::Bool => Err(Refusal::NotBool),
            DType::Bytes => Err(Refusal::NotBytes),
            DType::Float32 => {
                self.push_f32(number.to_f32());
                Ok(())
            }
            DType::Float16 | DType::BFloat16 | DType::Float64 => {
                self.push_f64(number.to_f64());
                Ok(())
            }
            _ => match number.to_i128() {
                Some(v) => self.push_int(v),
                None if number.integer => Err(Refusal::OutOfRange),
                None => Err(Refusal::NotInteger),
            },
        };
        result.map_err(|refusal| self.refusal(name, refusal, number.text()))
    }

    /// A value of another kind than number or boolean (a string, null, an
    /// object): the error for input `name`, `what` describing the value.
    pub fn not_a_number(&self, name: &str, what: &str) -> V2Error {
        if self.dtype == DType::Bool {
            return self.refusal(name, Refusal::NotBool, what);
        }
        if self.dtype == DType::Bytes {
            return self.refusal(name, Refusal::NotBytes, what);
        }
        V2Error::Invalid(format!(
            "input '{shown}': data is not valid {}: expected numbers, got {}",
            self.dtype.v2_name(),
            short(what),
            shown = Clipped(name)
        ))
    }

    fn refusal(&self, name: &str, refusal: Refusal, text: &str) -> V2Error {
        let datatype = self.dtype.v2_name();
        V2Error::Invalid(match refusal {
            Refusal::NotBool => format!(
                "input '{shown}': BOOL data must be true or false",
                shown = Clipped(name)
            ),
            Refusal::NotBytes => format!(
                "input '{shown}': BYTES data must be strings, got {}",
                short(text),
                shown = Clipped(name)
            ),
            Refusal::OutOfRange => format!(
                "input '{shown}': data is not valid {datatype}: {} is out of range",
                short(text),
                shown = Clipped(name)
            ),
            Refusal::NotInteger => format!(
                "input '{shown}': data is not valid {datatype}: {} is not an integer",
                short(text),
                shown = Clipped(name)
            ),
        })
    }

    /// A float value for a float type (rounded to nearest, as numpy and
    /// torch cast; BF16 through FP32 as torch does). Integer types take
    /// integral values only; BOOL takes none.
    pub fn push_float(&mut self, name: &str, v: f64) -> Result<(), V2Error> {
        match self.dtype {
            DType::Float16 | DType::BFloat16 | DType::Float32 | DType::Float64 => {
                self.push_f64(v);
                Ok(())
            }
            DType::Bool => Err(self.refusal(name, Refusal::NotBool, "")),
            DType::Bytes => Err(self.refusal(name, Refusal::NotBytes, &v.to_string())),
            _ if v.is_finite() && v.fract() == 0.0 && v.abs() < 1.9e19 => {
                self.push_integer(name, v as i128)
            }
            _ => Err(self.refusal(name, Refusal::NotInteger, &v.to_string())),
        }
    }

    /// `v` for a float type (callers check the type).
    fn push_f64(&mut self, v: f64) {
        match self.dtype {
            DType::Float64 => self.write(&v.to_le_bytes()),
            DType::Float32 => self.write(&(v as f32).to_le_bytes()),
            DType::Float16 => self.write(&f16::from_f64(v).to_le_bytes()),
            _ => self.write(&bf16::from_f32(v as f32).to_le_bytes()),
        }
    }

    /// An integer value: exact for integer types (refused out of range),
    /// rounded for float types.
    fn push_int(&mut self, v: i128) -> Result<(), Refusal> {
        macro_rules! exact {
            ($t:ty) => {{
                let x = <$t>::try_from(v).map_err(|_| Refusal::OutOfRange)?;
                self.write(&x.to_le_bytes());
            }};
        }
        match self.dtype {
            DType::Bool => return Err(Refusal::NotBool),
            DType::Bytes => return Err(Refusal::NotBytes),
            DType::Int8 => exact!(i8),
            DType::Int16 => exact!(i16),
            DType::Int32 => exact!(i32),
            DType::Int64 => exact!(i64),
            DType::UInt8 => exact!(u8),
            DType::UInt16 => exact!(u16),
            DType::UInt32 => exact!(u32),
            DType::UInt64 => exact!(u64),
            DType::Float16 | DType::BFloat16 | DType::Float32 | DType::Float64 => {
                self.push_f64(v as f64)
            }
        }
        Ok(())
    }

    /// An integer from a typed source (gRPC contents): exact or refused.
    pub fn push_integer(&mut self, name: &str, v: i128) -> Result<(), V2Error> {
        self.push_int(v)
            .map_err(|r| self.refusal(name, r, &v.to_string()))
    }
}
