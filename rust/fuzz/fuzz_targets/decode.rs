//! The v2 decoder on arbitrary bodies: it must return (a request or an
//! error), never panic, and never allocate past its limits. The first byte
//! picks how `Inference-Header-Content-Length` is given. A header memo must
//! answer as a fresh decode does: the body twice, then with its last byte
//! changed and one byte shorter (a remembered header with other bytes after
//! it). `rust/fuzz/seeds/decode` holds valid requests to start from.
#![no_main]

use ferrobatch_core::v2::{Codec, Data, HeaderMemo, Limits, OutputSpec, V2Error};
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
    let mut memo = HeaderMemo::new();
    let mut accept = |_: &str, _: DType, _: &[u64]| Ok::<(), V2Error>(());
    // Its last byte changed (a BOOL 0 or 1 becomes 2 or 3), and one byte shorter.
    let mut changed = body.to_vec();
    if let Some(last) = changed.last_mut() {
        *last ^= 2;
    }
    let shorter = body.get(..body.len().saturating_sub(1)).unwrap_or_default();
    for body in [body, body, &changed[..], shorter] {
        let fresh = codec.decode(body, length.as_deref());
        let remembered = codec
            .decode_remembered(&mut memo, body, length.as_deref(), &mut accept)
            .map(|request| request.into_owned());
        assert_eq!(remembered, fresh);
    }
    if let Ok(request) = codec.decode(body, length.as_deref()) {
        let mut elements = 0usize;
        for input in &request.inputs {
            let count: u64 = input.shape.iter().product();
            elements += count as usize;
            let data = match &input.data {
                Data::Owned(v) => v.as_slice(),
                Data::Body(r) => &body[r.clone()],
            };
            if input.dtype == DType::Bytes {
                // Length-prefixed elements: exactly `count` of them.
                assert_eq!(
                    ferrobatch_core::bytes::elements(data).count(),
                    count as usize
                );
                assert_eq!(
                    ferrobatch_core::bytes::elements(data)
                        .map(|e| 4 + e.len())
                        .sum::<usize>(),
                    data.len()
                );
            } else {
                assert_eq!(data.len(), count as usize * input.dtype.itemsize());
            }
        }
        assert!(elements <= limits.max_elements);
    }
});
