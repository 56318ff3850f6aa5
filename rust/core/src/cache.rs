//! The response cache (Triton's `response_cache`): the result of a request,
//! kept under a digest of its inputs, so that a later request with the same
//! inputs is answered without running the model.
//!
//! A batcher with a cache ([`crate::Batcher::with_response_cache`]) looks
//! each request up as its batch is released, after its worker won `take()`
//! (so its bytes are readable): a hit leaves the batch and is answered by
//! the worker's owner from the cached value ([`crate::Worker::take_cached`]),
//! never collated nor run; a miss runs, and its batch carries its key
//! ([`crate::Batch::cache_keys`]) for the owner to [`ResponseCache::insert`]
//! its result once the batch succeeded. While every worker runs a slow
//! batch, requests are looked up as they are submitted instead (as Triton
//! looks hits up before its queue; see [`crate::HIT_WAIT_FOR_BUSY`]): a hit
//! is taken and handed to the thread waiting in
//! [`crate::Batcher::wait_found`], never queued (a miss there is looked up
//! again at release: digested twice, only while the batches are slow).
//! Every way in goes through the batcher, so every way in has it.
//!
//! One cache may serve several models (as Triton's one cache serves every
//! model that enables it): each batcher keys its entries under its own
//! namespace ([`ResponseCache::namespace`]). Its size is bounded in bytes
//! (values as their owner sizes them, plus a fixed cost per entry: keys
//! are digests, see [`CacheKey`]); the least recently used
//! entries go first, and an entry larger than the whole cache is never kept.
//!
//! Values are opaque here (the binding keeps bytes, or Python objects):
//! whoever inserts one reads it back. The one invariant: no value is
//! dropped while the cache's lock is held. What `insert`, `forget` and
//! `clear` take out is handed back to the caller, who drops it once the
//! lock is let go, so the lock is never held by a thread that waits for
//! anything (a Python value's drop may wait for the GIL, and a thread
//! holding the GIL may be waiting for this lock).

use std::collections::hash_map::RandomState;
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use foldhash::fast::RandomState as MapHasher;
use lru::LruCache;

use crate::Request;

/// Bytes counted per entry beyond its value: its key, the map's slot and
/// node, and the value's shared handle (measured: 300,000 entries of one
/// 64-byte output took 207 bytes each of resident memory, counted 232
/// with the binding's own per-column cost).
const ENTRY_OVERHEAD: usize = 128 + std::mem::size_of::<CacheKey>();

/// What a request is looked up by: its batcher's namespace, and a 128-bit
/// digest of every field that shapes its result (rows, which inputs and
/// outputs, and what else the model is told: see [`KeyRules`]) and of each
/// input's length, extents and bytes. Lengths go before what they measure,
/// so two different requests never feed the digest alike. The digest is
/// keyed BLAKE3 under a key drawn at random once per process (as Triton
/// keys its cache by a hash, not by the inputs): a cache holds no copy of
/// any input, two different requests share a key only by a 128-bit
/// collision, and nobody without the process's key can craft one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheKey {
    namespace: u64,
    digest: [u64; 2],
}

/// What a model is told of a request besides its inputs, rows, the
/// optional inputs it left out and the outputs it asked for (all in every
/// key): what else its key must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyRules {
    /// Its priority level (a model that reads its requests is told it).
    pub priority: bool,
    /// Parameters the model is never shown (they only tell the server how
    /// to serve the request): left out of the key. The others count, in
    /// any key order; a request whose parameters are only these counts as
    /// one with none. (A request carries parameters only to a model that
    /// reads them.)
    pub unseen_parameters: Vec<String>,
}

/// The digest's key, drawn once per process (from the random keys the
/// standard library seeds its hash maps with).
fn digest_key() -> &'static [u8; 32] {
    static KEY: OnceLock<[u8; 32]> = OnceLock::new();
    KEY.get_or_init(|| {
        let random = RandomState::new();
        let mut key = [0u8; 32];
        for (i, word) in key.chunks_exact_mut(8).enumerate() {
            word.copy_from_slice(&random.hash_one(i as u64).to_le_bytes());
        }
        key
    })
}

impl CacheKey {
    /// The key of `request` under `namespace`.
    ///
    /// # Safety
    /// Nobody may resolve `request` meanwhile: the caller has won
    /// `request.take()`, or submits it and has not queued it yet. The key
    /// reads the request's input bytes (see [`crate::InputBytes::new`]).
    pub unsafe fn of(namespace: u64, request: &Request, rules: &KeyRules) -> CacheKey {
        let mut digest = blake3::Hasher::new_keyed(digest_key());
        let word = |w: u64| w.to_le_bytes();
        digest.update(&word(u64::from(request.rows)));
        digest.update(&word(request.absent));
        digest.update(&word(request.requested_outputs));
        digest.update(&word(if rules.priority {
            u64::from(request.lane)
        } else {
            0
        }));
        let parameters = request
            .parameters
            .as_deref()
            .and_then(|text| model_parameters(text, &rules.unseen_parameters));
        match parameters {
            None => digest.update(&word(u64::MAX)),
            Some(text) => digest
                .update(&word(text.len() as u64))
                .update(text.as_bytes()),
        };
        for input in request.inputs() {
            digest.update(&word(input.len() as u64));
            for &extent in input.extents() {
                digest.update(&word(extent as u64));
            }
            // SAFETY: nobody resolves the request meanwhile (the caller's
            // contract), so its submitter keeps these bytes alive.
            digest.update(unsafe { input.as_slice() });
        }
        let hash = digest.finalize();
        let bytes = hash.as_bytes();
        let half = |at: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(word)
        };
        CacheKey {
            namespace,
            digest: [half(0), half(8)],
        }
    }
}

/// The parameters the model is shown, in one spelling: the request's JSON
/// object without `unseen`, its keys decoded and sorted, each value as its
/// text was written (a number is never read: two numbers that a parser
/// would round alike still differ here, as they may for the model); `None`
/// when none is left. Text that is not an object is kept as it is.
fn model_parameters(text: &str, unseen: &[String]) -> Option<String> {
    use serde_json::value::RawValue;
    // A key given twice keeps its last value, as Python's json does.
    let Ok(mut object) = serde_json::from_str::<BTreeMap<String, &RawValue>>(text) else {
        return Some(text.to_owned());
    };
    for name in unseen {
        object.remove(name);
    }
    if object.is_empty() {
        return None;
    }
    let mut canonical = String::with_capacity(text.len());
    canonical.push('{');
    for (i, (name, value)) in object.iter().enumerate() {
        if i > 0 {
            canonical.push(',');
        }
        // A decoded key written back as JSON: one spelling per name.
        canonical.push_str(&serde_json::to_string(name).unwrap_or_default());
        canonical.push(':');
        canonical.push_str(value.get().trim());
    }
    canonical.push('}');
    Some(canonical)
}

/// What [`ResponseCache::insert`] did: whether it kept the value, and the
/// values it took out (evicted, replaced, or the value itself when not
/// kept), to drop once the cache's lock is let go.
#[must_use = "drop the values taken out once the cache's lock is let go"]
pub struct Inserted<V: ?Sized> {
    pub kept: bool,
    pub taken_out: Vec<Arc<V>>,
}

/// A kept value and the bytes it is counted as (key and overhead included).
struct Entry<V: ?Sized> {
    value: Arc<V>,
    nbytes: usize,
}

struct Entries<V: ?Sized> {
    lru: LruCache<CacheKey, Entry<V>, MapHasher>,
    bytes: usize,
}

/// Counters of a cache since it was made.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheCounts {
    pub entries: usize,
    pub bytes: usize,
    pub max_bytes: usize,
    /// Entries dropped to make room for newer ones.
    pub evictions: u64,
    /// Values not kept: larger than the whole cache.
    pub too_large: u64,
}

/// A bounded, least-recently-used map from request keys to results (see
/// the module). `V` is what the binding keeps per result.
pub struct ResponseCache<V: ?Sized> {
    max_bytes: usize,
    entries: Mutex<Entries<V>>,
    next_namespace: AtomicU64,
    evictions: AtomicU64,
    too_large: AtomicU64,
}

impl<V: ?Sized> std::fmt::Debug for ResponseCache<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseCache")
            .field("counts", &self.counts())
            .finish()
    }
}

/// What a batcher's cache keeps per result: whatever its binding chooses,
/// downcast where read.
pub type CachedValue = dyn std::any::Any + Send + Sync;

/// The cache batchers share ([`crate::Batcher::with_response_cache`]).
pub type SharedCache = ResponseCache<CachedValue>;

impl<V: ?Sized> ResponseCache<V> {
    /// A cache holding at most `max_bytes` (0 keeps nothing).
    pub fn new(max_bytes: usize) -> ResponseCache<V> {
        ResponseCache {
            max_bytes,
            entries: Mutex::new(Entries {
                // Capped by bytes, not by count; keys are digests already.
                lru: LruCache::unbounded_with_hasher(MapHasher::default()),
                bytes: 0,
            }),
            next_namespace: AtomicU64::new(1),
            evictions: AtomicU64::new(0),
            too_large: AtomicU64::new(0),
        }
    }

    /// A namespace no other user of this cache has: a batcher's keys.
    pub fn namespace(&self) -> u64 {
        self.next_namespace.fetch_add(1, Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries<V>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The value kept for `key`, now the most recently used.
    pub fn get(&self, key: &CacheKey) -> Option<Arc<V>> {
        self.lock().lru.get(key).map(|e| e.value.clone())
    }

    /// Keeps `value` (counted as `nbytes`, plus its entry) for `key`, making
    /// room by taking out the least recently used entries. Not kept when it
    /// is larger than the whole cache (nothing is taken out then).
    ///
    /// What it took out (and `value`, when not kept) comes back, to be
    /// dropped by the caller once the cache's lock is let go: a value may
    /// be a Python object, whose drop can wait for the GIL, and a thread
    /// holding the GIL may be waiting for this lock.
    pub fn insert(&self, key: CacheKey, value: Arc<V>, nbytes: usize) -> Inserted<V> {
        let nbytes = nbytes.saturating_add(ENTRY_OVERHEAD);
        if nbytes > self.max_bytes {
            self.too_large.fetch_add(1, Ordering::Relaxed);
            return Inserted {
                kept: false,
                taken_out: vec![value],
            };
        }
        let mut taken_out = Vec::new();
        let mut entries = self.lock();
        if let Some(old) = entries.lru.pop(&key) {
            entries.bytes -= old.nbytes;
            taken_out.push(old.value);
        }
        while entries.bytes + nbytes > self.max_bytes {
            let Some((_, old)) = entries.lru.pop_lru() else {
                break;
            };
            entries.bytes -= old.nbytes;
            taken_out.push(old.value);
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
        entries.bytes += nbytes;
        entries.lru.push(key, Entry { value, nbytes });
        drop(entries);
        Inserted {
            kept: true,
            taken_out,
        }
    }

    /// Takes out every entry of `namespace` (its model's weights changed);
    /// their values come back, to drop outside the lock (see `insert`).
    #[must_use = "drop the values once the cache's lock is let go"]
    pub fn forget(&self, namespace: u64) -> Vec<Arc<V>> {
        let mut entries = self.lock();
        let stale: Vec<CacheKey> = entries
            .lru
            .iter()
            .filter(|(key, _)| key.namespace == namespace)
            .map(|(key, _)| *key)
            .collect();
        let mut taken_out = Vec::with_capacity(stale.len());
        for key in stale {
            if let Some(old) = entries.lru.pop(&key) {
                entries.bytes -= old.nbytes;
                taken_out.push(old.value);
            }
        }
        taken_out
    }

    /// Takes out every entry; their values come back (see `forget`).
    #[must_use = "drop the values once the cache's lock is let go"]
    pub fn clear(&self) -> Vec<Arc<V>> {
        let mut entries = self.lock();
        entries.bytes = 0;
        let mut taken_out = Vec::with_capacity(entries.lru.len());
        while let Some((_, old)) = entries.lru.pop_lru() {
            taken_out.push(old.value);
        }
        taken_out
    }

    pub fn counts(&self) -> CacheCounts {
        let entries = self.lock();
        CacheCounts {
            entries: entries.lru.len(),
            bytes: entries.bytes,
            max_bytes: self.max_bytes,
            evictions: self.evictions.load(Ordering::Relaxed),
            too_large: self.too_large.load(Ordering::Relaxed),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{InputBytes, Sink};

    fn request(rows: u32, bytes: &[u8]) -> Request {
        // SAFETY: `bytes` outlives the request in every test here.
        let input = unsafe { InputBytes::new(bytes.as_ptr(), bytes.len()) };
        Request::new(1, Sink::Thread, rows, vec![input], None)
    }

    fn key(namespace: u64, r: &Request) -> CacheKey {
        key_by(namespace, r, &KeyRules::default())
    }

    fn key_by(namespace: u64, r: &Request, rules: &KeyRules) -> CacheKey {
        assert!(r.take());
        // SAFETY: taken just above, and its bytes outlive it.
        unsafe { CacheKey::of(namespace, r, rules) }
    }

    #[test]
    fn the_same_inputs_find_what_was_kept_and_other_inputs_do_not() {
        let cache: ResponseCache<u32> = ResponseCache::new(1 << 20);
        let ns = cache.namespace();
        let data = [1u8, 2, 3, 4];
        assert!(
            cache
                .insert(key(ns, &request(1, &data)), Arc::new(7), 4)
                .kept
        );
        assert_eq!(cache.get(&key(ns, &request(1, &data))).as_deref(), Some(&7));
        // Other bytes, other rows, another namespace, parameters: all miss.
        assert!(cache.get(&key(ns, &request(1, &[1, 2, 3, 5]))).is_none());
        assert!(cache.get(&key(ns, &request(2, &data))).is_none());
        assert!(cache
            .get(&key(cache.namespace(), &request(1, &data)))
            .is_none());
        let with_params = request(1, &data).with_parameters(Some("{\"a\":1}".into()));
        assert!(cache.get(&key(ns, &with_params)).is_none());
        let absent = request(1, &data).with_absent(1);
        assert!(cache.get(&key(ns, &absent)).is_none());
    }

    #[test]
    fn parameters_and_priority_count_as_the_model_is_told_them() {
        let data = [1u8];
        let serving: Vec<String> = ["timeout", "priority", "binary_data_output"]
            .map(String::from)
            .into();
        let triton = KeyRules {
            priority: false,
            unseen_parameters: serving,
        };
        let with = |text: Option<&str>, rules: &KeyRules| {
            key_by(
                1,
                &request(1, &data).with_parameters(text.map(Into::into)),
                rules,
            )
        };
        let plain = KeyRules::default();
        for rules in [&plain, &triton] {
            let none = with(None, rules);
            assert_eq!(with(Some("{}"), rules), none);
            // The same object spelt otherwise: one key.
            let ab = with(Some(r#"{"a": 1, "b": "x"}"#), rules);
            assert_eq!(with(Some(r#"{ "b":"x","a":1 }"#), rules), ab);
            assert_ne!(ab, none);
            assert_ne!(with(Some(r#"{"a": 2, "b": "x"}"#), rules), ab);
            // Numbers a parser would round alike: still two keys.
            for (one, two) in [
                ("18446744073709551616", "18446744073709551617"),
                ("0.012053200609833413", "0.012053200609833411"),
                ("1e400", "1e401"),
            ] {
                let one = with(Some(&format!(r#"{{"t": {one}}}"#)), rules);
                assert_ne!(one, with(Some(&format!(r#"{{"t": {two}}}"#)), rules));
            }
            // An escaped key is the same name.
            assert_eq!(with(Some(r#"{"\u0061": 1, "b": "x"}"#), rules), ab);
        }
        // Unseen parameters count only where the model is shown them.
        let serving_only = Some(r#"{"timeout": 5, "binary_data_output": true, "priority": 1}"#);
        assert_eq!(with(serving_only, &triton), with(None, &triton));
        assert_ne!(with(serving_only, &plain), with(None, &plain));
        // The priority level counts only for a model told it.
        let at = |lane: u8, rules: &KeyRules| key_by(1, &request(1, &data).in_lane(lane), rules);
        let told = KeyRules {
            priority: true,
            ..KeyRules::default()
        };
        assert_ne!(at(0, &told), at(1, &told));
        assert_eq!(at(0, &plain), at(1, &plain));
    }

    #[test]
    fn inputs_split_differently_make_different_keys() {
        // [1, 2] + [3] and [1] + [2, 3] hold the same bytes in a row.
        let (a, b, c, d) = ([1u8, 2], [3u8], [1u8], [2u8, 3]);
        // SAFETY: the arrays outlive the requests.
        let two = |x: &[u8], y: &[u8]| unsafe {
            Request::new(
                1,
                Sink::Thread,
                1,
                vec![
                    InputBytes::new(x.as_ptr(), x.len()),
                    InputBytes::new(y.as_ptr(), y.len()),
                ],
                None,
            )
        };
        assert_ne!(key(1, &two(&a, &b)), key(1, &two(&c, &d)));
        assert_eq!(key(1, &two(&a, &b)), key(1, &two(&a, &b)));
    }

    #[test]
    fn the_least_recently_used_go_first_and_the_bytes_stay_bounded() {
        let datas: Vec<[u8; 1]> = (0..5u8).map(|i| [i]).collect();
        let keys: Vec<CacheKey> = datas.iter().map(|d| key(1, &request(1, d))).collect();
        let unit = 100 + ENTRY_OVERHEAD;
        let cache: ResponseCache<u32> = ResponseCache::new(3 * unit);
        for (i, k) in keys.iter().take(3).enumerate() {
            assert!(cache.insert(*k, Arc::new(i as u32), 100).kept);
        }
        assert_eq!(cache.counts().entries, 3);
        assert_eq!(cache.counts().bytes, 3 * unit);
        assert!(cache.get(&keys[0]).is_some()); // 0 is now the most recent
        let inserted = cache.insert(keys[3], Arc::new(3), 100);
        assert!(inserted.kept);
        assert_eq!(
            inserted.taken_out.iter().map(|v| **v).collect::<Vec<_>>(),
            vec![1],
            "evicted, handed back"
        );
        assert!(
            cache.get(&keys[1]).is_none(),
            "the least recently used went"
        );
        assert!(cache.get(&keys[0]).is_some());
        let counts = cache.counts();
        assert!(counts.bytes <= counts.max_bytes);
        assert_eq!(counts.evictions, 1);
        // Larger than the whole cache: refused, nothing dropped.
        assert!(!cache.insert(keys[4], Arc::new(4), 3 * unit).kept);
        assert_eq!(cache.counts().entries, 3);
        assert_eq!(cache.counts().too_large, 1);
    }

    #[test]
    fn forgetting_a_namespace_keeps_the_others() {
        let cache: ResponseCache<u32> = ResponseCache::new(1 << 20);
        let (a, b) = (cache.namespace(), cache.namespace());
        let data = [9u8; 8];
        assert!(
            cache
                .insert(key(a, &request(1, &data)), Arc::new(1), 8)
                .kept
        );
        assert!(
            cache
                .insert(key(b, &request(1, &data)), Arc::new(2), 8)
                .kept
        );
        assert_eq!(
            cache.forget(a).iter().map(|v| **v).collect::<Vec<_>>(),
            vec![1]
        );
        assert!(cache.get(&key(a, &request(1, &data))).is_none());
        assert_eq!(cache.get(&key(b, &request(1, &data))).as_deref(), Some(&2));
        let one = cache.counts().bytes;
        let replaced = cache.insert(key(b, &request(1, &data)), Arc::new(3), 8);
        assert_eq!(
            replaced.taken_out.iter().map(|v| **v).collect::<Vec<_>>(),
            vec![2]
        );
        assert_eq!(
            cache.counts().bytes,
            one,
            "a key kept again replaces its entry"
        );
        assert_eq!(cache.clear().len(), 1);
        assert_eq!(cache.counts().entries, 0);
        assert_eq!(cache.counts().bytes, 0);
    }
}
