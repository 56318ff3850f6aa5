//! The cells of a varying model's request (`ferrobatch_core::shm::varying`)
//! as a hostile process could write them: the server's reading of a
//! request's inputs and a client's reading of its outputs must refuse
//! anything malformed, never panic, and place every input inside the region.

#![no_main]

use ferrobatch_core::shm::varying;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&count, region)) = data.split_first() else {
        return;
    };
    let count = usize::from(count % 8);
    if let Ok(used) = varying::used_len(region, count, region.len()) {
        assert!(used <= region.len());
    }
    if let Ok(places) = varying::read_inputs(region, count) {
        assert_eq!(places.len(), count);
        for place in places {
            assert!(place.range.start <= place.range.end && place.range.end <= region.len());
        }
    }
    for rows in [0, 1, 3] {
        if let Ok(outputs) = varying::read_outputs(region, count, rows) {
            assert!(outputs.iter().all(|o| o.shapes.len() == rows));
        }
    }
});
