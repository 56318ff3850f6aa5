//! Element types a tensor input may have, with their sizes and the
//! buffer-protocol format characters that denote them.

/// A tensor element type, named as torch names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    Bool,
    Int8,
    Int16,
    Int32,
    Int64,
    UInt8,
    UInt16,
    UInt32,
    UInt64,
    Float16,
    BFloat16,
    Float32,
    Float64,
    /// Triton's BYTES: each element a byte string of its own length. Its
    /// buffers hold elements serialized as Triton's binary extension does
    /// (a 4-byte little-endian length, then the bytes: [`crate::bytes`]),
    /// so sizes are counted by whoever reads them, never from `itemsize`.
    Bytes,
}

impl DType {
    pub const ALL: [DType; 13] = [
        DType::Bool,
        DType::Int8,
        DType::Int16,
        DType::Int32,
        DType::Int64,
        DType::UInt8,
        DType::UInt16,
        DType::UInt32,
        DType::UInt64,
        DType::Float16,
        DType::BFloat16,
        DType::Float32,
        DType::Float64,
    ];

    /// Parses torch / numpy spellings: `"float32"`, `"torch.float32"`, `"f4"`...
    pub fn parse(name: &str) -> Option<DType> {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        Some(match name {
            "bool" => DType::Bool,
            "int8" | "i1" => DType::Int8,
            "int16" | "short" | "i2" => DType::Int16,
            "int32" | "int" | "i4" => DType::Int32,
            "int64" | "long" | "i8" => DType::Int64,
            "uint8" | "u1" => DType::UInt8,
            "uint16" | "u2" => DType::UInt16,
            "uint32" | "u4" => DType::UInt32,
            "uint64" | "u8" => DType::UInt64,
            "float16" | "half" | "f2" => DType::Float16,
            "bfloat16" => DType::BFloat16,
            "float32" | "float" | "f4" => DType::Float32,
            "float64" | "double" | "f8" => DType::Float64,
            "bytes" | "object" | "bytes_" | "BYTES" => DType::Bytes,
            _ => return None,
        })
    }

    /// The canonical (torch) name, e.g. `"float32"`.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::Int8 => "int8",
            DType::Int16 => "int16",
            DType::Int32 => "int32",
            DType::Int64 => "int64",
            DType::UInt8 => "uint8",
            DType::UInt16 => "uint16",
            DType::UInt32 => "uint32",
            DType::UInt64 => "uint64",
            DType::Float16 => "float16",
            DType::BFloat16 => "bfloat16",
            DType::Float32 => "float32",
            DType::Float64 => "float64",
            DType::Bytes => "bytes",
        }
    }

    /// A signed or unsigned integer type (not BOOL).
    pub fn is_integer(self) -> bool {
        matches!(
            self,
            DType::Int8
                | DType::Int16
                | DType::Int32
                | DType::Int64
                | DType::UInt8
                | DType::UInt16
                | DType::UInt32
                | DType::UInt64
        )
    }

    /// The Open Inference Protocol v2 datatype name, e.g. `"FP32"`.
    pub fn v2_name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::Int8 => "INT8",
            DType::Int16 => "INT16",
            DType::Int32 => "INT32",
            DType::Int64 => "INT64",
            DType::UInt8 => "UINT8",
            DType::UInt16 => "UINT16",
            DType::UInt32 => "UINT32",
            DType::UInt64 => "UINT64",
            DType::Float16 => "FP16",
            DType::BFloat16 => "BF16",
            DType::Float32 => "FP32",
            DType::Float64 => "FP64",
            DType::Bytes => "BYTES",
        }
    }

    /// The field of the v2 gRPC `InferTensorContents` that carries this
    /// type's elements typed (`"fp32_contents"`); `None` for FP16 and BF16,
    /// which travel as raw bytes only.
    pub fn v2_contents(self) -> Option<&'static str> {
        Some(match self {
            DType::Bool => "bool_contents",
            DType::Int8 | DType::Int16 | DType::Int32 => "int_contents",
            DType::Int64 => "int64_contents",
            DType::UInt8 | DType::UInt16 | DType::UInt32 => "uint_contents",
            DType::UInt64 => "uint64_contents",
            DType::Float32 => "fp32_contents",
            DType::Float64 => "fp64_contents",
            DType::Bytes => "bytes_contents",
            DType::Float16 | DType::BFloat16 => return None,
        })
    }

    /// The type of a v2 datatype name (`"FP32"`, `"BYTES"`); `None` for
    /// unknown names.
    pub fn from_v2(name: &str) -> Option<DType> {
        if name == "BYTES" {
            return Some(DType::Bytes);
        }
        DType::ALL.into_iter().find(|d| d.v2_name() == name)
    }

    /// Bytes per element; for `Bytes`, the least an element takes
    /// serialized (its 4-byte length), a bound and not a size.
    pub fn itemsize(self) -> usize {
        match self {
            DType::Bytes => 4,
            DType::Bool | DType::Int8 | DType::UInt8 => 1,
            DType::Int16 | DType::UInt16 | DType::Float16 | DType::BFloat16 => 2,
            DType::Int32 | DType::UInt32 | DType::Float32 => 4,
            DType::Int64 | DType::UInt64 | DType::Float64 => 8,
        }
    }

    /// Whether a buffer-protocol (PEP 3118) format string denotes this type.
    /// Native byte order only; bfloat16 has no standard format character.
    pub fn matches_buffer_format(self, format: &str) -> bool {
        let code = format.trim_start_matches(['@', '=', '<', '|']);
        // '<' is native on every platform we build for (little-endian).
        let mut chars = code.chars();
        let (Some(c), None) = (chars.next(), chars.next()) else {
            return false;
        };
        let size_of = |c: char| -> Option<usize> {
            Some(match c {
                '?' | 'b' | 'B' => 1,
                'h' | 'H' | 'e' => 2,
                'i' | 'I' | 'f' => 4,
                'q' | 'Q' | 'd' => 8,
                'l' | 'L' => std::mem::size_of::<std::ffi::c_long>(),
                _ => return None,
            })
        };
        let Some(size) = size_of(c) else { return false };
        size == self.itemsize()
            && match self {
                DType::Bool => c == '?',
                DType::Int8 | DType::Int16 | DType::Int32 | DType::Int64 => "bhilq".contains(c),
                DType::UInt8 | DType::UInt16 | DType::UInt32 | DType::UInt64 => "BHILQ".contains(c),
                DType::Float16 => c == 'e',
                DType::Float32 => c == 'f',
                DType::Float64 => c == 'd',
                DType::BFloat16 | DType::Bytes => false,
            }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_torch_and_numpy_spellings() {
        assert_eq!(DType::parse("torch.float32"), Some(DType::Float32));
        assert_eq!(DType::parse("f8"), Some(DType::Float64));
        assert_eq!(DType::parse("complex64"), None);
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()), Some(d));
        }
    }

    #[test]
    fn buffer_formats_match_size_and_kind() {
        assert!(DType::Float32.matches_buffer_format("f"));
        assert!(DType::Float32.matches_buffer_format("<f"));
        assert!(!DType::Float32.matches_buffer_format("d"));
        assert!(DType::Int64.matches_buffer_format("q"));
        assert!(!DType::Int64.matches_buffer_format("Q"));
        assert!(DType::UInt8.matches_buffer_format("B"));
        assert!(!DType::Bool.matches_buffer_format("B"));
        assert!(!DType::BFloat16.matches_buffer_format("e"));
        assert!(!DType::Float32.matches_buffer_format("ff"));
    }

    #[test]
    fn v2_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_v2(d.v2_name()), Some(d));
        }
        assert_eq!(DType::from_v2("BYTES"), Some(DType::Bytes));
        assert_eq!(DType::from_v2("fp32"), None);
    }
}
