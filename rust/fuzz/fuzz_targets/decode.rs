//! The v2 decoder on arbitrary bodies: it must return (a request or an
//! error), never panic, and never allocate past its limits. The first byte
//! picks how `Inference-Header-Content-Length` is given.
#![no_main]

use ferrobatch_core::v2::{Codec, Data, Limits, OutputSpec};
use ferrobatch_core::DType;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Some((&mode, body)) = input.split_first() else {
        return;
    };
    let limits = Limits {
        max_body_size: 1 << 16,
        max_elements: 1 << 12,
    };
    let outputs = vec![
        OutputSpec {
            name: "y".into(),
            dtype: DType::Float32,
        },
        OutputSpec {
            name: "z".into(),
            dtype: DType::BFloat16,
        },
    ];
    let codec = Codec::new("m", outputs, limits);
    let length = match mode % 4 {
        0 => None,
        1 => Some((usize::from(mode) * 7 % (body.len() + 1)).to_string()),
        2 => Some(body.len().to_string()),
        _ => Some("x".to_string()),
    };
    if let Ok(request) = codec.decode(body, length.as_deref()) {
        let mut elements = 0usize;
        for input in &request.inputs {
            let count: u64 = input.shape.iter().product();
            elements += count as usize;
            let len = match &input.data {
                Data::Owned(v) => v.len(),
                Data::Body(r) => r.len(),
            };
            assert_eq!(len, count as usize * input.dtype.itemsize());
        }
        assert!(elements <= limits.max_elements);
    }
});
