//! The metadata documents gRPC's `ServerMetadata` and `ModelMetadata`
//! answer with, as the Python side describes its models (one source for
//! both front-ends), and the models gRPC knows before they are served.

/// What `ServerMetadata` answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerMetadata {
    pub name: String,
    pub version: String,
    pub extensions: Vec<String>,
}

/// One tensor of a model, as its metadata shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMetadata {
    pub name: String,
    /// The v2 datatype ("FP32").
    pub datatype: String,
    /// With the batch dimension, -1.
    pub shape: Vec<i64>,
}

/// What `ModelMetadata` answers for one model (its one version is
/// [`MODEL_VERSION`](ferrobatch_core::v2::MODEL_VERSION)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelMetadata {
    pub name: String,
    pub platform: String,
    pub inputs: Vec<TensorMetadata>,
    pub outputs: Vec<TensorMetadata>,
}

/// The server's metadata and every model the gRPC listener knows: a model
/// known but not served yet (warming up) is not ready, and its inference
/// answers UNAVAILABLE; a model not known is NOT_FOUND.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalog {
    pub server: ServerMetadata,
    pub models: Vec<ModelMetadata>,
}

impl Catalog {
    pub fn model(&self, name: &str) -> Option<&ModelMetadata> {
        self.models.iter().find(|m| m.name == name)
    }
}
