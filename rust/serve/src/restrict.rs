//! Access-restricted APIs, as Triton's `--http-restricted-api` and
//! `--grpc-restricted-protocol` configure them: the one place that names the
//! categories, parses the groups, says which category an HTTP path or a gRPC
//! method is of, and words the refusal. Both native front-ends
//! ([`crate::http`], [`crate::grpc`]) and the Python ones (through the
//! binding) ask it.
//!
//! A group is `<apis>:<key>=<value>`: a comma-separated list of categories
//! ([`Api`], by Triton's names), split from the rest at the first `:`, the
//! key split from the value at the first `=` after it (the value may hold
//! `=` and `:`). A request to an API of a restricted category must carry the
//! group's header with exactly its value; gRPC's header is
//! `triton-grpc-protocol-<key>` (Triton prefixes it), lowercase as gRPC
//! metadata keys are.
//!
//! Invariants:
//! - a category is restricted by at most one group (a second is refused at
//!   parse), so a request has one header to show, or none;
//! - a header's name is compared ignoring ASCII case (it is stored
//!   lowercase), its value byte for byte;
//! - [`Restrictions`] with no group is empty, and an empty one refuses
//!   nothing: its check is one branch ([`Restrictions::is_empty`]);
//! - a path or method of no category ([`http_api`], [`grpc_api`]: `None`)
//!   is never refused;
//! - nothing here panics on any input: no indexing that can fail, no
//!   arithmetic.

use crate::http::model_route;

/// A category of APIs that a group may restrict (Triton's
/// `RestrictedCategory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    Health,
    Metadata,
    Inference,
    SharedMemory,
    ModelConfig,
    ModelRepository,
    Statistics,
    Trace,
    Logging,
}

impl Api {
    /// Every category, each at its own index (`api as usize`).
    pub const ALL: [Api; 9] = [
        Api::Health,
        Api::Metadata,
        Api::Inference,
        Api::SharedMemory,
        Api::ModelConfig,
        Api::ModelRepository,
        Api::Statistics,
        Api::Trace,
        Api::Logging,
    ];

    /// The category's name in a group, as Triton spells it.
    pub fn name(self) -> &'static str {
        match self {
            Api::Health => "health",
            Api::Metadata => "metadata",
            Api::Inference => "inference",
            Api::SharedMemory => "shared-memory",
            Api::ModelConfig => "model-config",
            Api::ModelRepository => "model-repository",
            Api::Statistics => "statistics",
            Api::Trace => "trace",
            Api::Logging => "logging",
        }
    }

    /// The category named `name` (exactly, as [`Api::name`] spells it).
    pub fn named(name: &str) -> Option<Api> {
        Api::ALL.into_iter().find(|api| api.name() == name)
    }
}

/// Which front-end's groups: their option, their words, and gRPC's prefix
/// of the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `--http-restricted-api`: "restricted api".
    Http,
    /// `--grpc-restricted-protocol`: "restricted protocol", the header
    /// `triton-grpc-protocol-<key>`.
    Grpc,
}

/// The prefix gRPC's restricted headers take (Triton's).
pub const GRPC_HEADER_PREFIX: &str = "triton-grpc-protocol-";

impl Protocol {
    fn option(self) -> &'static str {
        match self {
            Protocol::Http => "--http-restricted-api",
            Protocol::Grpc => "--grpc-restricted-protocol",
        }
    }

    fn feature(self) -> &'static str {
        match self {
            Protocol::Http => "api",
            Protocol::Grpc => "protocol",
        }
    }
}

/// What a restricted category asks of a request: one header, one value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restriction {
    /// The header's name, lowercase (gRPC's prefixed).
    header: String,
    value: String,
    /// The refusal's message, worded once.
    refusal: String,
}

impl Restriction {
    /// The header's name, lowercase (gRPC's `triton-grpc-protocol-<key>`).
    pub fn header(&self) -> &str {
        &self.header
    }

    /// The value the header must have, exactly.
    pub fn value(&self) -> &str {
        &self.value
    }

    /// The refusal's message: HTTP's `This API is restricted, expecting
    /// header '<key>'`, gRPC's `This protocol is restricted, expecting
    /// header 'triton-grpc-protocol-<key>'`.
    pub fn refusal(&self) -> &str {
        &self.refusal
    }

    /// Whether a request whose header has the value `given` (None: it has
    /// not the header) may go on.
    pub fn admits(&self, given: Option<&[u8]>) -> bool {
        given == Some(self.value.as_bytes())
    }
}

/// The restricted categories of one front-end, and what each asks.
/// Default: none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restrictions {
    /// Indexed by `api as usize`; `None` when no category is restricted
    /// (then the check is one branch).
    by_api: Option<Box<[Option<Restriction>; Api::ALL.len()]>>,
}

impl Restrictions {
    /// Parses `groups`, each `<apis>:<key>=<value>` (see the module's
    /// docs), in Triton's words when one is wrong: an unknown category, one
    /// in two groups, or a group not of that form (apis, key and value
    /// nonempty).
    pub fn parse<S: AsRef<str>>(groups: &[S], protocol: Protocol) -> Result<Restrictions, String> {
        let mut by_api: [Option<Restriction>; Api::ALL.len()] = Default::default();
        for group in groups {
            let group = group.as_ref();
            let malformed = || {
                format!(
                    "{} option format is '<apis>:<key>=<value>', got '{group}'",
                    protocol.option()
                )
            };
            let (apis, setting) = group.split_once(':').ok_or_else(malformed)?;
            let (key, value) = setting.split_once('=').ok_or_else(malformed)?;
            if apis.is_empty() || key.is_empty() || value.is_empty() {
                return Err(malformed());
            }
            let (header, refusal) = match protocol {
                Protocol::Http => (
                    key.to_ascii_lowercase(),
                    format!("This API is restricted, expecting header '{key}'"),
                ),
                Protocol::Grpc => {
                    let header = format!("{GRPC_HEADER_PREFIX}{key}").to_ascii_lowercase();
                    let refusal =
                        format!("This protocol is restricted, expecting header '{header}'");
                    (header, refusal)
                }
            };
            let restriction = Restriction {
                header,
                value: value.to_owned(),
                refusal,
            };
            for name in apis.split(',') {
                let feature = protocol.feature();
                let Some(api) = Api::named(name) else {
                    return Err(format!("unknown restricted {feature} '{name}'"));
                };
                let Some(slot) = by_api.get_mut(api as usize) else {
                    continue; // every category has its slot
                };
                if slot.is_some() {
                    return Err(format!(
                        "restricted {feature} '{name}' can not be specified in multiple config groups"
                    ));
                }
                *slot = Some(restriction.clone());
            }
        }
        let any = by_api.iter().any(Option::is_some);
        Ok(Restrictions {
            by_api: any.then(|| Box::new(by_api)),
        })
    }

    /// Whether no category is restricted (then nothing is refused).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.by_api.is_none()
    }

    /// What a request to `api` must carry, if it is restricted.
    pub fn get(&self, api: Api) -> Option<&Restriction> {
        self.by_api.as_ref()?.get(api as usize)?.as_ref()
    }

    /// The categories restricted, each with what it asks, in [`Api::ALL`]'s
    /// order.
    pub fn iter(&self) -> impl Iterator<Item = (Api, &Restriction)> {
        Api::ALL
            .into_iter()
            .filter_map(|api| Some((api, self.get(api)?)))
    }

    /// The refusal's message for a request to `api` (None: of no category)
    /// whose header `name` (lowercase) has the value `header(name)` (None:
    /// it has not that header); None when it may go on.
    pub fn refusal<V: AsRef<[u8]>>(
        &self,
        api: Option<Api>,
        header: impl FnOnce(&str) -> Option<V>,
    ) -> Option<&str> {
        let restriction = self.get(api?)?;
        let given = header(restriction.header());
        if restriction.admits(given.as_ref().map(AsRef::as_ref)) {
            None
        } else {
            Some(restriction.refusal())
        }
    }

    /// [`Restrictions::refusal`] of a native front-end's request with
    /// `headers`, of the category `api` says (asked only when something is
    /// restricted: with nothing restricted, one branch).
    #[inline]
    pub fn refused(
        &self,
        api: impl FnOnce() -> Option<Api>,
        headers: &hyper::HeaderMap,
    ) -> Option<&str> {
        if self.is_empty() {
            return None;
        }
        self.refusal(api(), |name| {
            headers.get(name).map(hyper::header::HeaderValue::as_bytes)
        })
    }
}

/// The category of an HTTP request to `path` (whatever its method; a query
/// is ignored), or None: not a route of a category, never restricted.
pub fn http_api(path: &str) -> Option<Api> {
    let path = path.split_once('?').map_or(path, |(path, _)| path);
    let rest = path.strip_prefix("/v2")?;
    let under = |prefix: &str| {
        rest.strip_prefix(prefix)
            .is_some_and(|tail| tail.is_empty() || tail.starts_with('/'))
    };
    match rest {
        "" => return Some(Api::Metadata),
        "/health/live" | "/health/ready" => return Some(Api::Health),
        // Not the metadata of a model named "stats".
        "/models/stats" => return Some(Api::Statistics),
        "/trace/setting" => return Some(Api::Trace),
        "/logging" => return Some(Api::Logging),
        _ => {}
    }
    if under("/repository") {
        return Some(Api::ModelRepository);
    }
    if under("/systemsharedmemory") || under("/cudasharedmemory") {
        return Some(Api::SharedMemory);
    }
    model_api(path)
}

/// The category of `/v2/models/{m}[/versions/{v}][/{what}]`.
fn model_api(path: &str) -> Option<Api> {
    if let Some((_, _, what)) = model_route(path) {
        return match what {
            // The model's own path, with a trailing slash.
            "" => Some(Api::Metadata),
            "ready" => Some(Api::Health),
            "infer" | "generate" | "generate_stream" => Some(Api::Inference),
            "config" => Some(Api::ModelConfig),
            "stats" => Some(Api::Statistics),
            _ => None,
        };
    }
    // What `model_route` does not split: the model's own path, and its
    // trace setting (a tail with a slash).
    let (model, api) = match path.strip_suffix("/trace/setting") {
        Some(model) => (model, Api::Trace),
        None => (path, Api::Metadata),
    };
    let rest = model.strip_prefix("/v2/models/")?;
    let is_model = match rest.split_once('/') {
        None => true,
        Some((_, versioned)) => versioned
            .strip_prefix("versions/")
            .is_some_and(|version| !version.is_empty() && !version.contains('/')),
    };
    is_model.then_some(api)
}

/// The category of a gRPC call to `path`
/// (`/inference.GRPCInferenceService/<Method>`), or None: not an RPC of a
/// category, never restricted.
pub fn grpc_api(path: &str) -> Option<Api> {
    let method = path.strip_prefix("/inference.GRPCInferenceService/")?;
    Some(match method {
        "ServerLive" | "ServerReady" | "ModelReady" => Api::Health,
        "ServerMetadata" | "ModelMetadata" => Api::Metadata,
        "ModelInfer" | "ModelStreamInfer" => Api::Inference,
        "SystemSharedMemoryStatus"
        | "SystemSharedMemoryRegister"
        | "SystemSharedMemoryUnregister"
        | "CudaSharedMemoryStatus"
        | "CudaSharedMemoryRegister"
        | "CudaSharedMemoryUnregister" => Api::SharedMemory,
        "ModelConfig" => Api::ModelConfig,
        "ModelStatistics" => Api::Statistics,
        "RepositoryIndex" | "RepositoryModelLoad" | "RepositoryModelUnload" => Api::ModelRepository,
        "TraceSetting" => Api::Trace,
        "LogSettings" => Api::Logging,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(groups: &[&str], protocol: Protocol) -> Result<Restrictions, String> {
        Restrictions::parse(groups, protocol)
    }

    /// The header and value `api` asks for, if restricted.
    fn asked(restrictions: &Restrictions, api: Api) -> Option<(&str, &str)> {
        restrictions.get(api).map(|r| (r.header(), r.value()))
    }

    #[test]
    fn no_group_restricts_nothing() {
        let none = parse(&[], Protocol::Http).unwrap();
        assert!(none.is_empty());
        assert_eq!(none, Restrictions::default());
        for api in Api::ALL {
            assert_eq!(none.get(api), None);
            assert_eq!(none.refusal(Some(api), |_| None::<&[u8]>), None);
        }
    }

    #[test]
    fn each_category_is_named_as_triton_names_it() {
        for (index, api) in Api::ALL.into_iter().enumerate() {
            assert_eq!(api as usize, index);
            assert_eq!(Api::named(api.name()), Some(api));
        }
        assert_eq!(Api::named("Health"), None);
        assert_eq!(Api::named("shared_memory"), None);
    }

    #[test]
    fn a_group_restricts_its_categories_to_its_header_and_value() {
        let http = parse(
            &["statistics,model-repository:Triton-Access-Token=abc"],
            Protocol::Http,
        )
        .unwrap();
        assert!(!http.is_empty());
        let token = Some(("triton-access-token", "abc"));
        assert_eq!(asked(&http, Api::Statistics), token);
        assert_eq!(asked(&http, Api::ModelRepository), token);
        assert_eq!(asked(&http, Api::Inference), None);
        let restriction = http.get(Api::Statistics).unwrap();
        assert_eq!(
            restriction.refusal(),
            "This API is restricted, expecting header 'Triton-Access-Token'"
        );
        let listed: Vec<Api> = http.iter().map(|(api, _)| api).collect();
        assert_eq!(listed, [Api::ModelRepository, Api::Statistics]);

        let grpc = parse(&["statistics:Triton-Access-Token=abc"], Protocol::Grpc).unwrap();
        assert_eq!(
            asked(&grpc, Api::Statistics),
            Some(("triton-grpc-protocol-triton-access-token", "abc"))
        );
        assert_eq!(
            grpc.get(Api::Statistics).unwrap().refusal(),
            "This protocol is restricted, expecting header \
             'triton-grpc-protocol-triton-access-token'"
        );
    }

    #[test]
    fn several_groups_restrict_their_categories_each() {
        let http = parse(
            &[
                "health:probe=1",
                "inference,model-config:token=secret",
                "shared-memory,trace,logging,metadata:admin=yes",
            ],
            Protocol::Http,
        )
        .unwrap();
        assert_eq!(asked(&http, Api::Health), Some(("probe", "1")));
        assert_eq!(asked(&http, Api::Inference), Some(("token", "secret")));
        assert_eq!(asked(&http, Api::ModelConfig), Some(("token", "secret")));
        for api in [Api::SharedMemory, Api::Trace, Api::Logging, Api::Metadata] {
            assert_eq!(asked(&http, api), Some(("admin", "yes")), "{api:?}");
        }
        assert_eq!(asked(&http, Api::Statistics), None);
        assert_eq!(asked(&http, Api::ModelRepository), None);
    }

    #[test]
    fn a_value_keeps_every_equals_sign_and_colon_after_the_first_ones() {
        let http = parse(&["inference:key=a=b:c=="], Protocol::Http).unwrap();
        assert_eq!(asked(&http, Api::Inference), Some(("key", "a=b:c==")));
        let grpc = parse(&["inference:key=:x"], Protocol::Grpc).unwrap();
        assert_eq!(
            asked(&grpc, Api::Inference),
            Some(("triton-grpc-protocol-key", ":x"))
        );
    }

    #[test]
    fn an_unknown_category_is_refused_in_the_options_words() {
        let cases = [
            (
                Protocol::Http,
                "stats:k=v",
                "unknown restricted api 'stats'",
            ),
            (
                Protocol::Grpc,
                "Health:k=v",
                "unknown restricted protocol 'Health'",
            ),
            (
                Protocol::Http,
                "health, metadata:k=v",
                "unknown restricted api ' metadata'",
            ),
            (
                Protocol::Http,
                "health,,metadata:k=v",
                "unknown restricted api ''",
            ),
            (
                Protocol::Grpc,
                "health,:k=v",
                "unknown restricted protocol ''",
            ),
        ];
        for (protocol, group, message) in cases {
            assert_eq!(
                parse(&[group], protocol),
                Err(message.to_owned()),
                "{group}"
            );
        }
    }

    #[test]
    fn a_category_in_two_groups_is_refused() {
        let twice = parse(&["health,statistics:a=1", "statistics:b=2"], Protocol::Http);
        assert_eq!(
            twice,
            Err(
                "restricted api 'statistics' can not be specified in multiple config groups".into()
            )
        );
        let twice = parse(&["trace:a=1", "logging,trace:a=1"], Protocol::Grpc);
        assert_eq!(
            twice,
            Err(
                "restricted protocol 'trace' can not be specified in multiple config groups".into()
            )
        );
        // In one group, as Triton counts it: a second time is a second group's.
        let twice = parse(&["health,health:a=1"], Protocol::Http);
        assert_eq!(
            twice,
            Err("restricted api 'health' can not be specified in multiple config groups".into())
        );
    }

    #[test]
    fn a_group_not_of_the_form_apis_key_value_is_refused_naming_the_option() {
        for group in [
            "",
            "health",
            "health:",
            "health:key",
            "health:=value",
            "health:key=",
            ":key=value",
            "health=key:value",
            "health=value",
        ] {
            for (protocol, option) in [
                (Protocol::Http, "--http-restricted-api"),
                (Protocol::Grpc, "--grpc-restricted-protocol"),
            ] {
                let message =
                    format!("{option} option format is '<apis>:<key>=<value>', got '{group}'");
                assert_eq!(parse(&[group], protocol), Err(message), "{group:?}");
            }
        }
    }

    #[test]
    fn every_http_route_is_of_its_category() {
        use Api::*;
        let cases = [
            ("/v2/health/live", Some(Health)),
            ("/v2/health/ready", Some(Health)),
            ("/v2/models/m/ready", Some(Health)),
            ("/v2/models/m/versions/1/ready", Some(Health)),
            ("/v2", Some(Metadata)),
            ("/v2/models/m", Some(Metadata)),
            ("/v2/models/m/versions/1", Some(Metadata)),
            ("/v2/models/m/", Some(Metadata)),
            ("/v2/models/m/infer", Some(Inference)),
            ("/v2/models/m/versions/1/infer", Some(Inference)),
            ("/v2/models/m/generate", Some(Inference)),
            ("/v2/models/m/versions/1/generate", Some(Inference)),
            ("/v2/models/m/generate_stream", Some(Inference)),
            ("/v2/models/m/versions/1/generate_stream", Some(Inference)),
            ("/v2/models/m/config", Some(ModelConfig)),
            ("/v2/models/m/versions/1/config", Some(ModelConfig)),
            ("/v2/models/stats", Some(Statistics)),
            ("/v2/models/m/stats", Some(Statistics)),
            ("/v2/models/m/versions/1/stats", Some(Statistics)),
            ("/v2/repository", Some(ModelRepository)),
            ("/v2/repository/index", Some(ModelRepository)),
            ("/v2/repository/models/m/load", Some(ModelRepository)),
            ("/v2/repository/models/m/unload", Some(ModelRepository)),
            ("/v2/systemsharedmemory", Some(SharedMemory)),
            ("/v2/systemsharedmemory/status", Some(SharedMemory)),
            (
                "/v2/systemsharedmemory/region/r/register",
                Some(SharedMemory),
            ),
            ("/v2/cudasharedmemory/status", Some(SharedMemory)),
            (
                "/v2/cudasharedmemory/region/r/unregister",
                Some(SharedMemory),
            ),
            ("/v2/trace/setting", Some(Trace)),
            ("/v2/models/m/trace/setting", Some(Trace)),
            ("/v2/models/m/versions/1/trace/setting", Some(Trace)),
            ("/v2/logging", Some(Logging)),
            // A query is not the path.
            ("/v2/models/stats?x=1", Some(Statistics)),
            ("/v2/health/ready?verbose", Some(Health)),
            ("/v2/models/m/infer?", Some(Inference)),
            // A model named after a route is still that model's.
            ("/v2/models/infer/ready", Some(Health)),
            ("/v2/models/stats/stats", Some(Statistics)),
            ("/v2/models/stats/infer", Some(Inference)),
            // No category.
            ("/metrics", None),
            ("/", None),
            ("", None),
            ("/v2/", None),
            ("/v2/models", None),
            ("/v2/health", None),
            ("/v2/health/live/x", None),
            ("/v2/repositoryx", None),
            ("/v2/systemsharedmemoryx/status", None),
            ("/v2/logging/x", None),
            ("/v2/trace/setting/x", None),
            ("/v2/models/m/other", None),
            ("/v2/models/m/trace", None),
            ("/v2/models/m/infer/x", None),
            ("/v2/models/m/versions//infer", None),
            ("/v2/models/m/x/trace/setting", None),
            ("/v2/models/m/versions/1/2/trace/setting", None),
            ("/v3/models/m/infer", None),
            ("/v2x", None),
        ];
        for (path, expected) in cases {
            assert_eq!(http_api(path), expected, "{path}");
        }
    }

    #[test]
    fn every_grpc_method_is_of_its_category() {
        use Api::*;
        let cases = [
            ("ServerLive", Some(Health)),
            ("ServerReady", Some(Health)),
            ("ModelReady", Some(Health)),
            ("ServerMetadata", Some(Metadata)),
            ("ModelMetadata", Some(Metadata)),
            ("ModelInfer", Some(Inference)),
            ("ModelStreamInfer", Some(Inference)),
            ("SystemSharedMemoryStatus", Some(SharedMemory)),
            ("SystemSharedMemoryRegister", Some(SharedMemory)),
            ("SystemSharedMemoryUnregister", Some(SharedMemory)),
            ("CudaSharedMemoryStatus", Some(SharedMemory)),
            ("CudaSharedMemoryRegister", Some(SharedMemory)),
            ("CudaSharedMemoryUnregister", Some(SharedMemory)),
            ("ModelConfig", Some(ModelConfig)),
            ("ModelStatistics", Some(Statistics)),
            ("RepositoryIndex", Some(ModelRepository)),
            ("RepositoryModelLoad", Some(ModelRepository)),
            ("RepositoryModelUnload", Some(ModelRepository)),
            ("TraceSetting", Some(Trace)),
            ("LogSettings", Some(Logging)),
            ("ModelInferX", None),
            ("modelinfer", None),
            ("", None),
        ];
        for (method, expected) in cases {
            let path = format!("/inference.GRPCInferenceService/{method}");
            assert_eq!(grpc_api(&path), expected, "{path}");
        }
        for path in [
            "/grpc.health.v1.Health/Check",
            "/inference.Other/ModelInfer",
            "ModelInfer",
            "",
        ] {
            assert_eq!(grpc_api(path), None, "{path}");
        }
    }

    #[test]
    fn a_restricted_call_needs_its_header_with_exactly_its_value() {
        let http = parse(&["statistics:Triton-Access-Token=abc"], Protocol::Http).unwrap();
        let mut headers = hyper::HeaderMap::new();
        let refusal = "This API is restricted, expecting header 'Triton-Access-Token'";
        let check = |headers: &hyper::HeaderMap, path: &str| {
            http.refused(|| http_api(path), headers).map(str::to_owned)
        };
        assert_eq!(
            check(&headers, "/v2/models/stats").as_deref(),
            Some(refusal)
        );
        assert_eq!(check(&headers, "/v2/models/m/infer"), None);
        assert_eq!(check(&headers, "/metrics"), None);
        for wrong in ["ABC", "abc ", "ab", ""] {
            headers.insert("triton-access-token", wrong.parse().unwrap());
            assert_eq!(
                check(&headers, "/v2/models/stats").as_deref(),
                Some(refusal),
                "{wrong:?}"
            );
        }
        headers.insert("triton-access-token", "abc".parse().unwrap());
        assert_eq!(check(&headers, "/v2/models/stats"), None);
        headers.clear();
        // Sent in any case: HTTP's header names are case-insensitive.
        headers.insert(
            hyper::header::HeaderName::from_bytes(b"TRITON-ACCESS-TOKEN").unwrap(),
            "abc".parse().unwrap(),
        );
        assert_eq!(check(&headers, "/v2/models/stats"), None);

        // A lookup that ignores case itself is asked the lowercase name.
        let asked = std::cell::RefCell::new(Vec::new());
        let given = http.refusal(Some(Api::Statistics), |name| {
            asked.borrow_mut().push(name.to_owned());
            Some(b"abc".to_vec())
        });
        assert_eq!(given, None);
        assert_eq!(asked.into_inner(), ["triton-access-token"]);

        let grpc = parse(&["inference:Token=a=b"], Protocol::Grpc).unwrap();
        let metadata = |value: &'static str| {
            move |name: &str| (name == "triton-grpc-protocol-token").then_some(value)
        };
        let infer = grpc_api("/inference.GRPCInferenceService/ModelInfer");
        assert_eq!(grpc.refusal(infer, metadata("a=b")), None);
        assert_eq!(
            grpc.refusal(infer, metadata("a")),
            Some("This protocol is restricted, expecting header 'triton-grpc-protocol-token'")
        );
        assert_eq!(grpc.refusal(None, metadata("a")), None);
    }

    #[test]
    fn a_key_no_header_can_be_named_by_is_never_shown() {
        // Taken as Triton takes it; no request can carry it, none panics.
        let http = parse(&["health:bad key=v"], Protocol::Http).unwrap();
        let mut headers = hyper::HeaderMap::new();
        headers.insert("bad", "v".parse().unwrap());
        let refusal = http.refusal(Some(Api::Health), |name| {
            headers.get(name).map(hyper::header::HeaderValue::as_bytes)
        });
        assert_eq!(
            refusal,
            Some("This API is restricted, expecting header 'bad key'")
        );
    }
}
